"""llama.cpp as a target: GGUF files written tensor by tensor, read back by gguf's own reader, and
run by llama.cpp itself (the ``llamacpp`` extra: llama-cpp-python and gguf)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
pytest.importorskip("torchao")

from qreport_widgets.core.metrics import perplexity, sqnr_db  # noqa: E402
from qreport_widgets.engines.eager.algorithms import int4_tensor, round_to_nearest  # noqa: E402
from qreport_widgets.targets.llamacpp import (  # noqa: E402
    GgufFormat,
    GgufFormatError,
    GgufWriteError,
    packed_weight,
    write_gguf,
)
from qreport_widgets.targets.llamacpp.runtime import LlamaCppError, LlamaCppModel, llama_worker, quantize  # noqa: E402
from qreport_widgets.targets.worker import RuntimeFailedError  # noqa: E402


def on_fp16_grid(tensor: torch.Tensor) -> torch.Tensor:
    """The int4 tensor with its scales rounded to fp16 (what the file stores), its int values as they are."""
    return int4_tensor(tensor.qdata, tensor.scale.half().float(), tensor.block_size[1], torch.float32)


def decoded(path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a GGUF file as gguf's own reader decodes it (rows x inputs, float32)."""
    from gguf.quants import dequantize

    tensor = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32")).reshape(
        tuple(int(n) for n in reversed(tensor.shape))
    )


def tiny(family: str = "llama", **overrides) -> torch.nn.Module:
    """A decoder of ``family`` built from its config, left at its defaults as from_pretrained leaves them."""
    import transformers

    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = configs[family](**{**sizes, "num_key_value_heads": 2, "max_position_embeddings": 256, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # trained-like norms: not all ones, so a misplaced norm shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


@pytest.fixture(scope="module")
def session_run(text_decoder):
    """The trained byte decoder's session (eager, int4 weight-only, groups of 32) and its baseline."""
    import qreport_widgets as qw

    model, data = text_decoder
    report = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False,
        engine="eager", format="int4-weight-only", group_size=32, metric="perplexity",
    )  # fmt: skip
    return model, data, report.session.baseline()


def test_q4_0_q8_0_and_q4_1_tensors_decode_with_ggufs_reader_to_the_values_written(tmp_path):
    from torchao.quantization.quant_primitives import MappingType
    from torchao.quantization.quantize_.workflows import IntxUnpackedToInt8Tensor

    model = tiny()
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    chosen = {
        "model.layers.0.self_attn.o_proj": on_fp16_grid(round_to_nearest(weights["model.layers.0.self_attn.o_proj"], 32)),
        # a group of 64 inputs: two blocks of 32 sharing its scale
        "model.layers.0.mlp.gate_proj": on_fp16_grid(round_to_nearest(weights["model.layers.0.mlp.gate_proj"], 64)),
        "model.layers.1.mlp.up_proj": IntxUnpackedToInt8Tensor.from_hp(
            weights["model.layers.1.mlp.up_proj"], (1, 32), torch.int4, mapping_type=MappingType.ASYMMETRIC
        ),
        "model.layers.1.mlp.down_proj": IntxUnpackedToInt8Tensor.from_hp(
            weights["model.layers.1.mlp.down_proj"], (1, 128), torch.int8
        ),
    }
    for name, tensor in chosen.items():
        model.get_submodule(name).weight = torch.nn.Parameter(tensor, requires_grad=False)
    written = write_gguf(model, tmp_path / "tiny.gguf")
    formats = {
        "blk.0.attn_output.weight": GgufFormat.Q4_0,
        "blk.0.ffn_gate.weight": GgufFormat.Q4_0,
        "blk.1.ffn_up.weight": GgufFormat.Q4_1,
        "blk.1.ffn_down.weight": GgufFormat.Q8_0,
        "blk.1.ffn_gate.weight": GgufFormat.F16,
    }
    assert {name: written.formats[name] for name in formats} == formats
    for gguf_name, module in zip(formats, [*chosen, "model.layers.1.mlp.gate_proj"], strict=True):
        read = decoded(written.path, gguf_name)
        weight = model.get_submodule(module).weight
        if gguf_name == "blk.1.ffn_up.weight":  # Q4_1: the codes and scales exact, the minimum rounded to fp16
            assert read.sub(weight.dequantize()).abs().max() <= weight.scale.abs().max() * 23 / 2048
            assert packed_weight(weight).scales_exact is False
        elif gguf_name == "blk.1.ffn_down.weight":  # int8 per row: its scale rounded to fp16, the values as they are
            assert torch.equal(read, (weight.qdata.float() * weight.scale.half().float()))
        elif gguf_name == "blk.1.ffn_gate.weight":
            assert torch.equal(read, weight.detach().half().float())
        else:
            assert torch.equal(read, weight.dequantize())  # bit for bit: the session's values
    assert torch.equal(decoded(written.path, "blk.0.attn_norm.weight"), model.model.layers[0].input_layernorm.weight.detach())


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_family_written_in_f32_computes_the_models_logits_in_llama_cpp(family, tmp_path):
    model = tiny(family)
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    written = write_gguf(model, tmp_path / f"{family}.gguf", float_format="F32")
    logits = LlamaCppModel(written.path, context=64).logits(ids)
    with torch.no_grad():
        expected = model(ids).logits
    # llama.cpp keeps its attention cache in F16 (its default): that, not the layout, bounds the match
    assert sqnr_db(expected, logits) > 60, family
    assert written.bytes == os.path.getsize(written.path)
    # each block's output as llama.cpp computes it (read through its evaluation callback) is the model's
    blocks = LlamaCppModel(written.path, context=64).block_outputs(ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[1:]
    assert len(blocks) == len(model.model.layers)
    assert all(sqnr_db(h, b) > 60 for h, b in zip(hidden[:-1], blocks[:-1], strict=True)), family


def test_a_session_run_in_q4_0_runs_in_llama_cpp_at_the_sessions_perplexity(session_run, tmp_path):
    model, data, baseline = session_run
    written = write_gguf(baseline.quantized_model, tmp_path / "decoder.gguf", float_format="F32")
    assert written.count(GgufFormat.Q4_0) == 29  # every Linear, the head included; the embedding float
    llama = LlamaCppModel(written.path, context=128)
    # llama.cpp multiplies Q4_0 weights with activations quantized to Q8_0 per block of 32 and keeps its
    # attention cache in F16: measured 5.23357 against the session's 5.23364
    assert llama.perplexity(data.evaluation) == pytest.approx(baseline.eval_metric, rel=0.005)
    assert baseline.eval_metric > perplexity(model, data.evaluation)


def test_the_byte_vocabulary_and_a_copied_tokenizer_give_text_its_bytes(tmp_path):
    model = tiny()
    first = write_gguf(model, tmp_path / "bytes.gguf")
    text = "def f(x):\n    return x ** 2  # é\n"
    llama = LlamaCppModel(first.path)
    assert llama.tokenize(text) == list(text.encode("utf-8"))
    assert llama.detokenize(list(text.encode("utf-8"))) == text.encode("utf-8")
    copied = write_gguf(model, tmp_path / "copied.gguf", tokenizer_from=first.path)
    assert LlamaCppModel(copied.path).tokenize(text) == list(text.encode("utf-8"))
    with pytest.raises(GgufWriteError, match="has 256 tokens, the model 320"):
        write_gguf(tiny(vocab_size=320), tmp_path / "other.gguf", tokenizer_from=first.path)
    assert not (tmp_path / "other.gguf").exists()


def test_what_cannot_be_written_is_refused_and_nothing_is_left_behind(tmp_path):
    import transformers

    model = tiny()
    path = tmp_path / "model.gguf"
    path.write_bytes(b"kept")
    with pytest.raises(GgufWriteError, match="exists; pass overwrite=True"):
        write_gguf(model, path)
    assert path.read_bytes() == b"kept"
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=256))
    with pytest.raises(GgufWriteError, match="'gpt2' model cannot be written as GGUF yet: the families written are llama"):
        write_gguf(gpt2, tmp_path / "gpt2.gguf")
    grouped = tiny()
    down = grouped.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(round_to_nearest(down.weight.detach(), 16), requires_grad=False)
    with pytest.raises(GgufFormatError, match=r"groups of \(1, 16\) has no llama.cpp format.*group size of 32, 64 or 128"):
        write_gguf(grouped, tmp_path / "grouped.gguf")
    with pytest.raises(GgufWriteError, match="formats names modules the model's weights do not come from: model.nothing"):
        write_gguf(model, tmp_path / "named.gguf", formats={"model.nothing": "Q4_0"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # no file, no partial one


def test_a_file_llama_cpp_refuses_is_a_clear_error_naming_the_tensor(tmp_path):
    model = tiny()
    written = write_gguf(model, tmp_path / "model.gguf")
    broken = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(str(broken), "llama")
    reader = gguf.GGUFReader(str(written.path))
    for key, found in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            kind = found.types[0]
            sub = found.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, found.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        data = decoded(written.path, tensor.name).numpy()
        if tensor.name == "blk.0.attn_q.weight":
            data = data[:, :32]  # half its inputs
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LlamaCppError, match=r"could not load .*broken.gguf.*blk\.0\.attn_q\.weight"):
        LlamaCppModel(broken)


def test_llama_cpps_own_quantization_and_ours_write_the_same_layout(tmp_path):
    model = tiny()
    source = write_gguf(model, tmp_path / "f32.gguf", float_format="F32")
    theirs = quantize(source.path, tmp_path / "theirs.gguf", "Q4_0", pure=True, output_type="F16", embedding_type="F16")
    linears = {name: "Q4_0" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in name}
    ours = write_gguf(model, tmp_path / "ours.gguf", formats=linears)
    assert ours.bytes == os.path.getsize(theirs)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        assert next(t for t in gguf.GGUFReader(str(theirs)).tensors if t.name == name).tensor_type.name == "Q4_0"
    with pytest.raises(LlamaCppError, match="exists; pass overwrite=True"):
        quantize(source.path, theirs, "Q4_0")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    found = {}
    for path in (theirs, ours.path):  # both round to nearest on blocks of 32, the extreme weight on -8
        found[path] = sqnr_db(expected, LlamaCppModel(path, context=64).logits(ids))
        assert 15 < found[path] < 40
    # ours chooses the values on the scale as the file stores it (fp16), llama.cpp on its float32 original
    assert found[ours.path] == pytest.approx(found[theirs], abs=0.5)
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        difference = decoded(ours.path, name) - decoded(theirs, name)
        assert (difference != 0).float().mean() < 0.02  # a value in fifty at most lands on the other side


def test_a_crash_of_llama_cpp_ends_its_worker_and_the_file_opens_again(tmp_path):
    model = tiny()
    written = write_gguf(model, tmp_path / "model.gguf", float_format="F32")
    llama = LlamaCppModel(written.path, context=64)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(3))
    before = llama.logits(ids)
    worker = llama_worker()
    pid, starts = worker.pid, worker.starts
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeFailedError, match="llama.cpp crashed while computing logits of 16 tokens with .*model.gguf"):
        llama.logits(ids)
    assert torch.equal(llama.logits(ids), before)  # a new worker opened the same bytes again
    assert worker.starts == starts + 1
    written.path.write_bytes(b"GGUF changed")
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(RuntimeFailedError):
        llama.logits(ids)
    with pytest.raises(LlamaCppError, match="changed since it was opened"):
        llama.logits(ids)


def test_the_importance_matrix_is_each_columns_mean_square_and_llama_cpp_quantizes_with_it(tmp_path):
    from qreport_widgets.targets.llamacpp import importance_matrix, tensor_names

    model = tiny()
    batches = [(torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(s)),) for s in range(3)]
    found = importance_matrix(model, batches)
    names = tensor_names(model)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(found) == sorted(names[f"{n}.weight"] for n in linears)
    seen = []
    hook = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].reshape(-1, 128)))
    with torch.no_grad():
        for (ids,) in batches:
            model(ids)
    hook.remove()
    assert torch.allclose(found["blk.1.ffn_down.weight"], torch.cat(seen).square().mean(0), rtol=1e-5)
    source = write_gguf(model, tmp_path / "f32.gguf", float_format="F32")
    plain = quantize(source.path, tmp_path / "plain.gguf", "Q4_0", pure=True)
    weighted = quantize(source.path, tmp_path / "weighted.gguf", "Q4_0", pure=True, imatrix=found)
    assert plain.stat().st_size == weighted.stat().st_size
    # the importance matrix changes the values llama.cpp chooses for the Linears it covers, not the embedding's
    assert not torch.equal(decoded(plain, "blk.1.ffn_down.weight"), decoded(weighted, "blk.1.ffn_down.weight"))
    assert torch.equal(decoded(plain, "token_embd.weight"), decoded(weighted, "token_embd.weight"))


def test_relative_paths_name_the_callers_files_whatever_folder_the_worker_started_in(tmp_path, monkeypatch):
    model = tiny()
    first = write_gguf(model, tmp_path / "first.gguf", float_format="F32")
    LlamaCppModel(first.path)  # the worker runs, started in this process's folder of the moment
    here = tmp_path / "elsewhere"
    here.mkdir()
    monkeypatch.chdir(here)
    write_gguf(model, "model.gguf", float_format="F32")
    quantized = quantize("model.gguf", "q4.gguf", "Q4_0", pure=True)
    assert quantized == here / "q4.gguf" and quantized.is_file()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    assert torch.equal(LlamaCppModel("model.gguf").logits(ids), LlamaCppModel(first.path).logits(ids))


def test_a_bf16_model_is_written_as_it_is_and_left_unchanged(tmp_path):
    from conftest import assert_unchanged, fingerprint

    model = tiny().to(torch.bfloat16)
    before = fingerprint(model)
    written = write_gguf(model, tmp_path / "float.gguf", formats={"model.layers.1.mlp.up_proj": "Q8_0"})
    assert_unchanged(model, before)
    down = model.model.layers[0].mlp.down_proj
    down.weight = torch.nn.Parameter(round_to_nearest(down.weight.detach(), 32), requires_grad=False)
    values, scale = down.weight.qdata.clone(), down.weight.scale.clone()
    written = write_gguf(model, tmp_path / "bf16.gguf", formats={"model.layers.1.mlp.up_proj": "Q8_0"})
    assert torch.equal(down.weight.qdata, values) and torch.equal(down.weight.scale, scale)
    assert written.formats["blk.0.ffn_down.weight"] is GgufFormat.Q4_0
    assert written.formats["blk.1.ffn_up.weight"] is GgufFormat.Q8_0
    # a bf16 scale is on fp16's grid: the file holds the int values and scales exactly (their products in
    # float32, as llama.cpp computes them, where torchao's bf16 dequantize rounds them to bf16)
    assert torch.equal(decoded(written.path, "blk.0.ffn_down.weight"), values.float() * scale.float().repeat_interleave(32, 1))
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits.float()
    assert sqnr_db(expected, LlamaCppModel(written.path, context=32).logits(ids)) > 25  # bf16's own round-off bounds it
