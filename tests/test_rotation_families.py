"""The families table of docs/ENGINES.md (which rotations each decoder family takes), checked row by row on tiny models
transformers builds from each family's config: what ``rotation_problems`` says, and ``rotate`` with
its own check of the rotated model's logits against the original's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hf_models import FAMILIES, VOCAB, tiny_family

import qreport_widgets as qw
from qreport_widgets.engines.rotation import _decoder, _value_projections

ENGINES = Path(__file__).resolve().parents[1] / "docs" / "ENGINES.md"


def readme_rows() -> dict[str, tuple[bool, bool]]:
    """family -> (R1 applies, R2 applies), from the families table."""
    text = ENGINES.read_text()
    table = re.search(r"<!-- rotation families -->\n(.*?)<!-- end rotation families -->", text, re.S)
    assert table, "docs/ENGINES.md has no rotation families table"
    rows = {}
    for line in table.group(1).strip().splitlines()[2:]:
        families, residual, values, _ = (cell.strip() for cell in line.strip("|").split("|"))
        for family in families.split(", "):
            rows[family] = (residual == "yes", values == "yes")
    return rows


def test_the_readme_names_every_family_built_here():
    assert sorted(readme_rows()) == sorted(FAMILIES)


def _trained_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every norm's scale (and bias) moved off its initial 1 (and 0), as a trained
    model's are: folding a norm into its readers then changes them."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                for name in ("weight", "bias"):
                    tensor = getattr(module, name, None)
                    if isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
                        tensor.add_(0.3 * torch.randn(tensor.shape, generator=generator))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_takes_the_rotations_the_readme_says_and_refuses_the_others_naming_why(family):
    residual, values = readme_rows()[family]
    model = _trained_norms(tiny_family(family))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    problems = qw.rotation_problems(model)
    assert ("R1" not in problems) == residual and ("R2" not in problems) == values, problems
    asked = {"R1": qw.Rotation(values=False), "R2": qw.Rotation(residual=False)}
    for name, applies in (("R1", residual), ("R2", values)):
        if applies:
            rotated = qw.rotate(model, asked[name], (ids,))  # refused if its logits moved past float round-off
            assert rotated is not model
            if name == "R1":  # the stream turned: a Linear reading it takes the norm's scale and Q in its weight
                before, after = (_decoder(m).norms[0].readers[0].weight for m in (model, rotated))
                assert not torch.allclose(before, after, atol=1e-3)
            if name == "R2":  # each head's value rows turned, a fused projection's other rows as they were
                for before, after in zip(_value_projections(model), _value_projections(rotated), strict=True):
                    values_before, values_after = before.writer.weight[before.rows], after.writer.weight[after.rows]
                    assert not torch.allclose(values_before, values_after, atol=1e-4)
                    others = torch.ones(before.writer.weight.shape[0], dtype=torch.bool)
                    others[before.rows] = False
                    assert torch.equal(before.writer.weight[others], after.writer.weight[others])
        else:
            with pytest.raises(qw.InvalidSettingsError, match=f"{name} does not apply: .+"):
                qw.rotate(model, asked[name], (ids,))
    if residual and values:
        qw.rotate(model, qw.Rotation(), (ids,))


@pytest.mark.parametrize("family", ["StableLM", "Phi", "OPT", "GPT-NeoX", "GPT-2"])
def test_layer_norms_with_a_scale_and_bias_become_rms_norms_on_a_centred_stream_tied_or_not(family):
    from qreport_widgets.engines.rotation import UnitRMSNorm, _decoder

    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    rotation = qw.Rotation(down=True)  # R4 on the MLP's output projection too
    for tied in (False, True):
        model = tiny_family(family)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # a trained model's norms: scales and biases far from 1 and 0
            for module in model.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=generator))
                    module.bias.copy_(0.3 * torch.randn(module.bias.shape, generator=generator))
        if tied:
            model.config.tie_word_embeddings = True
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
        before = {k: v.clone() for k, v in model.state_dict().items()}
        rotated = qw.rotate(model, rotation, (ids,))  # its own check: the logits to float round-off
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the user's model untouched
        decoder = _decoder(rotated)
        assert decoder.layout == {"StableLM": "Llama"}.get(family, family)
        assert all(isinstance(read.norm, UnitRMSNorm) and bool((read.norm.weight == 1).all()) for read in decoder.norms)
        assert all(linear.bias is not None for read in decoder.norms for linear in read.readers)  # the norms' biases
        assert not any(isinstance(m, torch.nn.LayerNorm) for m in rotated.modules())


def test_a_mixture_of_experts_rotates_its_router_and_every_expert_and_refuses_r4_on_3d_experts():
    model = tiny_family("Qwen3-MoE")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    rotated = qw.rotate(model, qw.Rotation(values=False), (ids,))  # its logits checked: the same experts chosen
    mlp, turned = model.model.layers[0].mlp, rotated.model.layers[0].mlp
    for name in ("gate_up_proj", "down_proj"):
        assert not torch.allclose(getattr(mlp.experts, name), getattr(turned.experts, name), atol=1e-4), name
    assert not torch.allclose(mlp.gate.weight, turned.gate.weight, atol=1e-4)  # the router reads the stream too
    # each expert writes the rotated stream: an orthogonal turn of every column along the stream's axis
    assert torch.allclose(turned.experts.down_proj.norm(dim=-2), mlp.experts.down_proj.norm(dim=-2), atol=1e-5)
    with pytest.raises(qw.InvalidSettingsError, match="R4 multiplies .* a session's copy holds each expert as a Linear"):
        qw.rotate(model, qw.Rotation(down=True), (ids,))
