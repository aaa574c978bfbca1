"""GPT-2's projections are transformers' ``Conv1D`` (a Linear with its weight stored transposed): the
session's copy holds them as ``nn.Linear`` over the user's own weights, so every format and algorithm
quantizes them and the XNNPACK program delegates them; the user's model is untouched."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_unchanged, fingerprint
from hf_models import tiny_gpt2
from torch import nn

import qreport_widgets as qw
from qreport_widgets.core.linears import linears_in_place
from qreport_widgets.core.memory import WatchedCopy, shared_copy
from qreport_widgets.errors import FloatModelChangedError

PROJECTIONS = [f"transformer.h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]


def test_the_copy_holds_each_conv1d_as_the_linear_it_computes_over_the_same_weights():
    model, batches = tiny_gpt2()
    before = fingerprint(model)
    copy = shared_copy(model)
    assert linears_in_place(copy) == PROJECTIONS
    for name in PROJECTIONS:
        linear, conv = copy.get_submodule(name), model.get_submodule(name)
        assert type(linear) is nn.Linear and type(conv).__name__ == "Conv1D"
        assert linear.weight.shape == conv.weight.shape[::-1] and linear.weight.data_ptr() == conv.weight.data_ptr()
        assert linear.bias is conv.bias
    with torch.no_grad():
        assert torch.equal(model(*batches[0]).logits, copy(*batches[0]).logits)
    assert_unchanged(model, before)
    watched = WatchedCopy(model)  # an in-place change to the user's weight is still noticed through the view
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.0)
    with pytest.raises(FloatModelChangedError, match="transformer.h.1.mlp.c_fc.weight"):
        watched.check()


@pytest.mark.parametrize(
    ("target", "format"), [("x86", "int4-weight-only"), ("xnnpack", "int8-dynamic-int4-weight")], ids=["x86", "xnnpack"]
)
def test_every_gpt2_projection_is_quantized_with_gptq_and_the_program_delegates_them(target, format):
    if target == "xnnpack":
        pytest.importorskip("executorch", reason="the [executorch] extra is not installed")
    model, batches = tiny_gpt2()
    before = fingerprint(model)
    report = qw.analyze(
        model, batches[0], batches[:4], eval_data=batches[4:], engine="eager", format=format, target=target, metric="perplexity"
    )
    session = report.session
    tunable = {m.fqn: m.current.format for m in session.modules}
    assert all(tunable[name] == format for name in PROJECTIONS), tunable
    chosen = qw.ModuleSettings(format=format, group_size=32, algorithm="gptq")
    run = session.apply(dict.fromkeys(PROJECTIONS, chosen))
    assert run.ok, run.error
    assert any("8 projections stored transposed (transformers' Conv1D" in note for note in run.notes), run.notes
    assert run.eval_metric == pytest.approx(session.float_metric(), rel=0.05)
    projections = sum(model.get_submodule(name).weight.numel() for name in PROJECTIONS)
    assert run.deployed_bytes < 4 * projections  # float, the projections alone would take more
    if target == "x86":
        for name in PROJECTIONS:  # torchao's int4 tensor in place of each projection's weight
            weight = run.quantized_model.get_submodule(name).weight
            assert (
                type(weight).__name__ == "IntxUnpackedToInt8Tensor"
                and weight.shape == (model.get_submodule(name).weight.shape[::-1])
            )
    else:
        assert any("lowered with XNNPACK" in note for note in run.notes), run.notes
        assert run.output_sqnr_db > 15
    assert_unchanged(model, before)
