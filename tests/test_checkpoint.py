"""Runs saved as Hugging Face checkpoints in compressed-tensors' pack-quantized form: transformers
loads them (offline, CPU) to the run's logits, compressed-tensors unpacks the run's int4 / int8
values bit for bit, the bytes are the run's, and what the format cannot hold is refused with
nothing written."""

from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from hf_models import FAMILIES, VOCAB, _tokens, tiny_family
from torch import nn

import qreport_widgets as qw
from qreport_widgets.errors import CheckpointError

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

BATCHES = [(ids,) for ids in _tokens(2)]
# the families whose projections are Linears: GPT-2's are transformers' Conv1D, which the format does not
# pack; Qwen3-MoE's experts are 3-d parameters the session holds as one Linear an expert (refused, below)
LINEAR_FAMILIES = [family for family in FAMILIES if family not in ("GPT-2", "Qwen3-MoE")]


def session_of(model: nn.Module, **options) -> qw.QuantizationSession:
    given = {"format": "int4-weight-only", **options}
    return qw.analyze(model, BATCHES[0], BATCHES[:3], eval_data=BATCHES[3:], engine="eager", progress=False, **given).session


def mixed_settings(session, embedding: str | None = "int8-weight-only") -> dict[str, qw.ModuleSettings]:
    """Block Linears int4 in groups of 32 (GPTQ) and 64 (round to nearest) by turns, every fourth int8
    weight-only, the input embedding in format ``embedding`` (None: float), the rest float."""
    settings = {}
    linears = [m for m in session.modules if m.format_allowed("int4-weight-only") and ".layers." in m.fqn]
    for index, module in enumerate(linears):
        if index % 4 == 3:
            settings[module.fqn] = qw.ModuleSettings(format="int8-weight-only")
        elif index % 2:
            settings[module.fqn] = qw.ModuleSettings(format="int4-weight-only", group_size=64)
        else:
            algorithm = "gptq" if module.algorithm_allowed("gptq") else ""
            settings[module.fqn] = qw.ModuleSettings(format="int4-weight-only", group_size=32, algorithm=algorithm)
    for module in session.modules:
        if module.fqn not in settings:
            quantized = embedding and session.float_model.get_submodule(module.fqn) is session.float_model.get_input_embeddings()
            settings[module.fqn] = qw.ModuleSettings(format=embedding) if quantized else qw.ModuleSettings(keep_float=True)
    return settings


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).double().pow(2).mean()
    return math.inf if noise == 0 else float(10 * torch.log10(reference.double().pow(2).mean() / noise))


def data_bytes(path) -> int:
    """A safetensors file's tensor bytes: its size less its header."""
    with open(path, "rb") as file:
        header = int.from_bytes(file.read(8), "little")
    return os.path.getsize(path) - 8 - header


def check_saved(run, folder, grown: int = 0) -> dict:
    """Loads ``folder`` in transformers and compares it with ``run``: logits, values, scales, bytes
    (the run's, and ``grown`` more: an embedding written as its float weight)."""
    model = run.quantized_model
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        for (ids,) in BATCHES[3:]:
            assert sqnr_db(model(ids).logits, loaded(ids).logits) >= 100
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    forms = {group["format"] for group in config["config_groups"].values()}
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == (forms.pop() if len(forms) == 1 else "mixed-precision")
    packed = one_a_byte = 0
    with safe_open(folder / "model.safetensors", "pt") as file:
        for name in file.keys():
            fqn = name.removesuffix(".weight_scale")
            if not name.endswith(".weight_scale"):
                continue
            weight = model.get_submodule(fqn).weight
            if f"{fqn}.weight_packed" in file.keys():  # a Linear's values packed into int32 words
                bits = 8 if type(weight).__name__ == "Int8Tensor" else 4
                shape = torch.Size(file.get_tensor(f"{fqn}.weight_shape").tolist())
                values = unpack_from_int32(file.get_tensor(f"{fqn}.weight_packed"), bits, shape)
                packed += 1
            else:  # an Embedding's, one to a byte
                values = file.get_tensor(f"{fqn}.weight")
                assert values.dtype == torch.int8 and isinstance(model.get_submodule(fqn), nn.Embedding), fqn
                one_a_byte += 1
            assert torch.equal(values, weight.qdata.to(torch.int8)), fqn
            assert torch.equal(file.get_tensor(name).flatten(), weight.scale.flatten()), fqn
    assert data_bytes(folder / "model.safetensors") == pytest.approx(run.deployed_bytes + grown, rel=0.02)
    return {"config": config, "packed": packed, "one_a_byte": one_a_byte, "loaded": loaded}


@pytest.mark.parametrize(
    "family, embedding",
    [("Llama", "int8-weight-only"), ("Qwen3", "int4-weight-only"), ("Gemma 2", None), ("Gemma 2", "int8-weight-only")],
)
def test_a_mixed_run_loads_in_transformers_with_its_logits_values_and_bytes(family, embedding, tmp_path):
    """Linears packed by (bits, group); an int8 / int4 embedding one value to a byte (as the run's size
    counts it), said to be for transformers; a float head reading a float embedding (Gemma 2's)
    written once and tied again on load, one reading a quantized embedding written apart."""
    session = session_of(tiny_family(family))
    settings = mixed_settings(session, embedding)
    run = session.apply(settings, progress=False)
    assert run.ok, run.error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = run.save_pretrained(tmp_path / "checkpoint", tokenizer=None)
    said = [str(w.message) for w in caught if "model.embed_tokens" in str(w.message)]
    assert len(said) == bool(embedding) and all("one to a byte" in words and "vLLM" in words for words in said)
    saved = check_saved(run, folder)  # an int4 embedding's values a byte each in the run's size too
    assert saved["packed"] == 14 and saved["one_a_byte"] == bool(embedding)  # 7 Linears a block, 2 blocks
    assert "lm_head" in saved["config"]["ignore"]
    groups = {
        fqn: (g["weights"]["num_bits"], g["weights"].get("group_size"))
        for g in saved["config"]["config_groups"].values()
        for fqn in g["targets"]
    }
    expected = {}
    for fqn, choice in settings.items():
        if not choice.keep_float:
            inputs = session.float_model.get_submodule(fqn).weight.shape[1]
            group = choice.group_size if choice.format == "int4-weight-only" and choice.group_size < inputs else None
            expected[fqn] = (4 if choice.format == "int4-weight-only" else 8, group)  # one group a row: a channel
    assert groups == expected
    tied = tiny_family(family).config.tie_word_embeddings and embedding is None  # Gemma 2's head reads its embedding
    with safe_open(folder / "model.safetensors", "pt") as file:
        assert ("lm_head.weight" in file.keys()) is not tied
    assert saved["loaded"].config.tie_word_embeddings == tied


@pytest.mark.slow
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_every_family_with_linear_projections_saves_and_loads_to_the_runs_logits(family, tmp_path):
    session = session_of(tiny_family(family))
    run = session.apply(mixed_settings(session), progress=False)
    assert run.ok, run.error
    check_saved(run, run.save_pretrained(tmp_path / "checkpoint", tokenizer=None))


def test_an_embedding_whose_forward_takes_more_than_the_ids_is_written_dequantized_and_said_so(tmp_path):
    """OPT's learned positions take a mask and an offset: compressed-tensors' quantized forward would
    call them with one input, so their int8 values are written as their float weight."""
    session = session_of(tiny_family("OPT"))
    settings = mixed_settings(session)
    positions = "model.decoder.embed_positions"
    settings[positions] = qw.ModuleSettings(format="int8-weight-only")
    run = session.apply(settings, progress=False)
    assert run.ok, run.error
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = run.save_pretrained(tmp_path / "checkpoint", tokenizer=None)
    assert any(positions in str(w.message) and "dequantized" in str(w.message) for w in caught)
    module = session.float_model.get_submodule(positions)
    grown = module.weight.numel() * 4 - session.engine.module_bytes(module, settings[positions])
    saved = check_saved(run, folder, grown)
    assert saved["one_a_byte"] == 1  # the token embedding; the positions are a float tensor
    assert positions not in {fqn for g in saved["config"]["config_groups"].values() for fqn in g["targets"]}


def test_three_saves_in_a_row_each_hold_their_own_runs_values(tmp_path):
    """Each save replaces the folder with its own run's values (overwrite=True), never an earlier one's."""
    session = session_of(tiny_family("Llama"))
    folder = tmp_path / "checkpoint"
    for group, algorithm in ((32, ""), (64, "gptq"), (32, "hqq")):
        settings = {
            m.fqn: qw.ModuleSettings(format="int4-weight-only", group_size=group, algorithm=algorithm)
            for m in session.modules
            if ".layers." in m.fqn
        }
        run = session.apply(settings, progress=False)
        run.save_pretrained(folder, tokenizer=None, overwrite=True)
        check_saved(run, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"]  # no partial folder left beside it


def test_the_tokenizer_given_is_saved_and_loads_to_the_same_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    session = session_of(tiny_family("Qwen3"))
    run = session.baseline()
    folder = run.save_pretrained(tmp_path / "checkpoint", tokenizer=tokenizer)
    text = "w1 w7 w200 nothing w3"
    assert AutoTokenizer.from_pretrained(folder)(text)["input_ids"] == tokenizer(text)["input_ids"]


def tied_llama() -> nn.Module:
    """The tiny Llama with its head reading its embedding's tensor, as SmolLM2's does."""
    config = tiny_family("Llama").config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return type(tiny_family("Llama"))(config).eval()


@pytest.mark.parametrize(
    "family, embedding", [("Llama", "int8-weight-only"), ("Gemma 2", None), ("tied Llama", "int8-weight-only")]
)
def test_the_torchao_form_loads_into_the_runs_own_torchao_tensors_dynamic_activations_too(family, embedding, tmp_path):
    """The folder transformers writes for a TorchAoConfig model: loaded back, every quantized module
    holds the run's torchao tensor (type, values, scales, activation rounding), so the logits are the
    run's; the run's model is left as it was."""
    model = tied_llama() if family == "tied Llama" else tiny_family(family)
    session = session_of(model)
    settings = mixed_settings(session, embedding)
    for fqn, choice in settings.items():  # every int4 module with int8 dynamic activations (8da4w)
        if choice.format == "int4-weight-only":
            settings[fqn] = qw.ModuleSettings(format="int8-dynamic-int4-weight", group_size=choice.group_size)
    run = session.apply(settings, progress=False)
    assert run.ok, run.error
    folder = run.save_pretrained(tmp_path / "checkpoint", tokenizer=None, quant_method="torchao")
    model = run.quantized_model
    assert "hf_quantizer" not in model.__dict__ and not hasattr(model.config, "quantization_config")
    assert model.config.tie_word_embeddings == session.float_model.config.tie_word_embeddings  # lent, given back
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "torchao"
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    held = 0
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(weight, "qdata"):
            again = loaded.get_submodule(fqn).weight
            assert type(again) is type(weight) and torch.equal(again.qdata, weight.qdata), fqn
            assert torch.equal(again.scale, weight.scale), fqn
            assert getattr(again, "activation_quantization", None) == getattr(weight, "activation_quantization", None), fqn
            held += 1
    assert held == 14 + bool(embedding)
    with torch.no_grad():
        for (ids,) in BATCHES[3:]:
            assert sqnr_db(model(ids).logits, loaded(ids).logits) >= 100
    tied = session.float_model.config.tie_word_embeddings and embedding is None  # else the run quantized them apart
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) is tied


def test_the_torchao_form_refuses_an_embedding_whose_unsaved_buffer_transformers_would_leave_unset(tmp_path):
    """Gemma's scaled embedding keeps its scale in a buffer it does not save, which transformers does
    not set again when it loads a torchao-quantized embedding: refused, naming the way out."""
    session = session_of(tiny_family("Gemma 2"))
    run = session.apply(mixed_settings(session, "int8-weight-only"), progress=False)
    words = r"model\.embed_tokens \(Gemma2TextScaledWordEmbedding\).*embed_scale.*compressed-tensors"
    with pytest.raises(CheckpointError, match=words):
        run.save_pretrained(tmp_path / "checkpoint", tokenizer=None, quant_method="torchao")
    assert list(tmp_path.iterdir()) == []


def test_what_the_format_cannot_hold_is_refused_and_nothing_is_written(tmp_path):
    session = session_of(tiny_family("Llama"))
    target = tmp_path / "checkpoint"
    dynamic = session.apply({"model.layers.0.mlp.up_proj": qw.ModuleSettings(format="int8-dynamic-int4-weight")}, progress=False)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj is int8-dynamic-int4-weight.*int4-weight-only"):
        dynamic.save_pretrained(target, tokenizer=None)
    awq_o_proj = {"model.layers.0.self_attn.o_proj": qw.ModuleSettings(format="int4-weight-only", algorithm="awq")}
    awq = session.apply(awq_o_proj, progress=False)
    for form in ("compressed-tensors", "torchao"):
        with pytest.raises(CheckpointError, match=rf"model\.layers\.0\.self_attn\.o_proj: AWQ divides its input.*a {form} "):
            awq.save_pretrained(target, tokenizer=None, quant_method=form)
    with pytest.raises(CheckpointError, match="quant_method='gguf': a checkpoint is 'compressed-tensors' or 'torchao'"):
        awq.save_pretrained(target, tokenizer=None, quant_method="gguf")
    with pytest.raises(CheckpointError, match="tokenizer=None"):
        dynamic.save_pretrained(target)
    with pytest.raises(CheckpointError, match="tokenizer= takes a transformers tokenizer"):
        dynamic.save_pretrained(target, tokenizer="gpt2")
    assert list(tmp_path.iterdir()) == []
    target.mkdir()
    (target / "mine.txt").write_text("kept")
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        session.baseline().save_pretrained(target, tokenizer=None)
    assert [p.name for p in target.iterdir()] == ["mine.txt"]


def test_experts_held_one_linear_each_and_conv1d_projections_held_as_linears_are_refused_naming_why(tmp_path):
    moe = session_of(tiny_family("Qwen3-MoE")).baseline()
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj\.0\.weight .* the session's own layout"):
        moe.save_pretrained(tmp_path / "moe", tokenizer=None)
    gpt2 = session_of(tiny_family("GPT-2")).baseline()
    shapes = r"c_attn\.weight is \(192, 64\) in the run's model and \(64, 192\) in GPT2LMHeadModel"
    with pytest.raises(CheckpointError, match=shapes):
        gpt2.save_pretrained(tmp_path / "gpt2", tokenizer=None)
    assert list(tmp_path.iterdir()) == []


def test_runs_of_another_engine_or_of_a_file_target_are_refused_naming_what_to_do(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    fx = qw.QuantizationSession(model, batches[0], batches, eval_data=batches).baseline()
    with pytest.raises(CheckpointError, match="not the eager engine's"):
        fx.save_pretrained(tmp_path / "a", tokenizer=None)
    eager = qw.QuantizationSession(model, batches[0], batches, eval_data=batches, engine="eager").baseline()
    with pytest.raises(CheckpointError, match="not a transformers model"):
        eager.save_pretrained(tmp_path / "b", tokenizer=None)
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoints_page_snippet_runs_as_written(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    monkeypatch.chdir(tmp_path)  # it writes decoder-int4 here
    page = Path(__file__).resolve().parents[1] / "docs" / "CHECKPOINTS.md"
    (block,) = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    namespace: dict = {}
    exec(compile(block, "docs/CHECKPOINTS.md snippet", "exec"), namespace)
    run, loaded = namespace["run"], namespace["loaded"]
    (ids,) = namespace["batches"][-1]
    with torch.no_grad():
        assert sqnr_db(run.quantized_model(ids).logits, loaded(ids).logits) >= 100
    assert data_bytes(tmp_path / "decoder-int4" / "model.safetensors") == pytest.approx(run.deployed_bytes, rel=0.02)


def test_a_fit_weighing_the_formats_a_checkpoint_holds_saves_and_other_formats_are_refused_early(tmp_path):
    session = session_of(tiny_family("Llama"), formats=("int4-weight-only", "int8-weight-only"))
    module = next(m for m in session.modules if m.fqn.endswith("layers.0.mlp.down_proj"))
    weighed = {choice.format for choice in session.engine.size_choices(module)}
    assert weighed == {"float", "int4-weight-only", "int8-weight-only"}
    run = session.fit(max_size_bytes=session.baseline().deployed_bytes * 1.5, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = run.save_pretrained(tmp_path / "checkpoint", tokenizer=None)
    for fqn, module in run.quantized_model.named_modules():
        if isinstance(module, nn.Embedding) and not run.settings[fqn].keep_float:  # said: vLLM quantizes Linears alone
            assert any(fqn in str(w.message) and "vLLM" in str(w.message) for w in caught)
    saved = check_saved(run, folder)
    assert saved["one_a_byte"] == sum(not run.settings[fqn].keep_float for fqn in ("model.embed_tokens",))
    with pytest.raises(ValueError, match="formats must name some of"):
        session_of(tiny_family("Llama"), formats=("int3",))
