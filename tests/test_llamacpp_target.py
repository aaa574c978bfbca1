"""The eager engine's ``target="llama.cpp"``: every run written as a GGUF file and measured by llama.cpp
itself; the size front counts the file's bytes; refusals before any work."""

from __future__ import annotations

import copy

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
pytest.importorskip("torchao")

from conftest import text_decoder_report  # noqa: E402
from test_llamacpp import decoded, tiny  # noqa: E402

from qreport_widgets.core.metrics import perplexity  # noqa: E402
from qreport_widgets.engines.contract import Variant  # noqa: E402
from qreport_widgets.engines.settings import ModuleSettings  # noqa: E402
from qreport_widgets.errors import InvalidSettingsError  # noqa: E402
from qreport_widgets.targets.llamacpp import GgufWriteError, LlamaCppModel  # noqa: E402
from qreport_widgets.targets.llamacpp.program import GgufProgram  # noqa: E402

Q4 = {"format": "int8-dynamic-int4-weight", "group_size": 32, "target": "llama.cpp"}


@pytest.fixture(scope="module")
def llama_session(text_decoder):
    """The trained byte decoder's session on llama.cpp (every Linear Q4_0), round to nearest weighed."""
    model, data = text_decoder
    before = copy.deepcopy(model.state_dict())
    report = text_decoder_report(text_decoder, algorithms=("rtn",), **Q4)
    return model, data, report.session, before


def test_every_run_is_a_gguf_file_measured_in_llama_cpp_at_the_simulations_perplexity(llama_session, tmp_path):
    model, data, session, before = llama_session
    baseline = session.baseline()
    program = baseline.quantized_model
    assert isinstance(program, GgufProgram)
    assert program.formats() == {"Q4_0": 29, "F16": 1, "F32": 9}  # every Linear, the head too; the embedding float
    assert baseline.deployed_bytes == program.artifact_bytes == program.file.path.stat().st_size
    # llama.cpp multiplies with activations quantized per block of 32 (8da4w's per token): within 0.5%
    simulated = session.simulate()[1]
    assert baseline.eval_metric == pytest.approx(simulated, rel=0.005)
    assert baseline.eval_metric == pytest.approx(perplexity(program.reference, data.evaluation), rel=0.005)
    # round to nearest on llama.cpp's own Q4_0 grid: each group's extreme weight on -8, all 16 values used
    v_proj = program.reference.model.layers[2].self_attn.v_proj.weight
    assert bool((v_proj.qdata.reshape(-1, 32).amin(-1) == -8).all()) and bool((v_proj.scale < 0).any())
    # the file holds the reference's int values and (fp16) scales exactly: what was measured is what ships
    written = program.write(tmp_path / "baseline.gguf")
    assert written == baseline.deployed_bytes
    assert torch.equal(decoded(tmp_path / "baseline.gguf", "blk.2.attn_v.weight"), v_proj.dequantize())
    with pytest.raises(GgufWriteError, match="exists"):
        program.write(tmp_path / "baseline.gguf")
    assert LlamaCppModel(tmp_path / "baseline.gguf").perplexity(data.evaluation) == baseline.eval_metric
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the float model untouched


def test_which_block_hurts_is_read_inside_llama_cpp_and_the_simulation_models_its_kernels(llama_session):
    _, data, session, _ = llama_session
    baseline = session.baseline()
    in_llama = session.block_sqnr(baseline)
    assert list(in_llama.index) == [f"model.layers.{i}" for i in range(4)]
    # the simulation rounds each Linear's input to Q8_0 blocks, as llama.cpp's kernels do
    simulated, real = session.simulate()[0], baseline.output_sqnr_db
    assert abs(simulated - real) < 0.5
    truth = session.truth_check()
    assert abs(truth.gap_db) < 0.5


def test_q8_0_blocks_round_inputs_as_llama_cpps_q8_0_does():
    from gguf.quants import dequantize, quantize

    from qreport_widgets.engines.eager.formats import q8_0_blocks

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    x[3, :32] = 0.0  # a block of zeros stays zeros
    theirs = torch.from_numpy(dequantize(quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0))
    ours = q8_0_blocks(x)
    differ = ours != theirs.reshape(ours.shape)
    assert differ.float().mean() < 1e-3  # ties: gguf's reference rounds half away from zero, AVX to even
    assert torch.equal(ours[3, :32], torch.zeros(32))


def test_three_applies_in_a_row_are_three_files_each_measured_afresh(llama_session):
    _, data, session, _ = llama_session
    runs = [
        session.apply({"model.embed_tokens": ModuleSettings(format=name)}, label=name)
        for name in ("int8-weight-only", "int4-weight-only", "int8-weight-only")
    ]
    first, second, third = runs
    assert first.quantized_model.formats()["Q8_0"] == 1 and second.quantized_model.formats()["Q4_0"] == 30
    assert second.deployed_bytes < first.deployed_bytes == third.deployed_bytes
    assert first.eval_metric == third.eval_metric != second.eval_metric
    # more files than llama.cpp keeps open: the first opens again (its bytes checked) and computes the same
    for algorithm in ("hqq", "rtn"):
        session.apply({"model.embed_tokens": ModuleSettings(format="int4-weight-only", algorithm=algorithm)})
    assert first.quantized_model.llama().perplexity(data.evaluation) == first.eval_metric


def tiny_session(family: str, tie_word_embeddings: bool = False, **options):
    """A tiny decoder of ``family`` (from its config) analysed for llama.cpp on one batch of random tokens."""
    import qreport_widgets as qw

    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    given = {"format": "int8-dynamic", "metric": "perplexity", **options}
    model = tiny(family, tie_word_embeddings=tie_word_embeddings)
    return qw.analyze(
        model, (ids,), [(ids,)], eval_data=[(ids,)], progress=False, engine="eager", target="llama.cpp", **given,
    ).session  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_decoder_of_each_family_runs_on_the_target(family):
    session = tiny_session(family)
    run = session.baseline()
    assert run.quantized_model.formats()["Q8_0"] == 15  # 7 Linears a block, the head; the embedding F16
    assert run.output_sqnr_db > 30
    assert run.eval_metric == pytest.approx(session.simulate()[1], rel=0.005)


def test_a_run_on_the_target_is_its_gguf_file_not_a_checkpoint(tmp_path):
    from qreport_widgets.errors import CheckpointError

    run = tiny_session("llama").baseline()
    with pytest.raises(CheckpointError, match=r"made for llama.cpp: its artifact is a file of that target's \(run\.quantized"):
        run.save_pretrained(tmp_path / "checkpoint", tokenizer=None)
    assert list(tmp_path.iterdir()) == []


def test_decode_speed_is_llama_cpps_own_generation_and_the_runs_table_shows_it():
    session = tiny_session("llama")
    run = session.baseline()
    speed = session.decode_speed(prompt_tokens=16, new_tokens=8)
    assert speed.prompt_tokens == 16 and speed.new_tokens == 8 and speed.decode_ms > 0 and speed.prefill_ms > 0
    assert speed.pte_bytes == run.deployed_bytes and "bytes of GGUF" in speed.words
    runs = session.compare()[0]
    assert runs["decode (ms / token)"].iloc[-1] == speed.decode_ms


def test_fit_under_the_baselines_bytes_finds_a_better_file_the_front_sized_exactly():
    # ranked by output SQNR: a random model's perplexity on random tokens says nothing of its quantization
    session = tiny_session("llama", format="int8-dynamic-int4-weight", group_size=32, algorithms=("rtn",), metric=None)
    baseline = session.baseline()
    fitted = session.fit(max_size_bytes=baseline.deployed_bytes, progress=False)
    assert isinstance(fitted.quantized_model, GgufProgram)
    assert fitted.deployed_bytes <= baseline.deployed_bytes
    assert fitted.output_sqnr_db > baseline.output_sqnr_db
    front = session.pareto(progress=False)
    assert fitted.deployed_bytes in set(front["size_bytes"])  # the front counts the file's tensors as written


def test_a_head_tied_to_the_embedding_reads_its_tensor_in_the_file_and_in_the_simulation():
    session = tiny_session("llama", format="int8-dynamic-int4-weight", group_size=32, tie_word_embeddings=True)
    head = next(m for m in session.modules if m.fqn == "lm_head")
    assert "the head's weight is the embedding's" in head.formats["int8-dynamic-int4-weight"]
    for embedding in ("float", "int4-weight-only", "int8-weight-only"):
        run = session.apply({"model.embed_tokens": ModuleSettings(format=embedding)}, label=embedding)
        assert run.ok, run.error
        assert "output.weight" not in run.quantized_model.file.formats  # llama.cpp multiplies by token_embd
        chosen = ModuleSettings(format=embedding, group_size=32 if embedding == "int4-weight-only" else 0)
        simulated = session.simulate(Variant(settings=frozenset({("model.embed_tokens", chosen)})))
        assert run.eval_metric == pytest.approx(simulated[1], rel=0.005), embedding
    baseline = session.baseline()
    fitted = session.fit(max_size_bytes=baseline.deployed_bytes, progress=False)  # the front sizes a tied head at 0 bytes
    assert fitted.deployed_bytes in set(session.pareto(progress=False)["size_bytes"])


def test_what_llama_cpp_cannot_run_is_refused_before_any_work(text_decoder):
    import transformers

    import qreport_widgets as qw

    with pytest.raises(ValueError, match="llama.cpp's kernels run a Linear with int8 dynamic activations"):
        text_decoder_report(text_decoder, format="int4-weight-only", target="llama.cpp")
    with pytest.raises(ValueError, match="a group of 64 or 128 would take the same bytes in a GGUF file"):
        text_decoder_report(text_decoder, format="int8-dynamic-int4-weight", group_size=128, target="llama.cpp")
    cnn = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    with pytest.raises(InvalidSettingsError, match="llama.cpp runs Hugging Face decoders"):
        qw.analyze(cnn, (torch.randn(2, 8),), [(torch.randn(2, 8),)], progress=False, engine="eager", target="llama.cpp")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    gpt2 = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 64, (1, 16))
    with pytest.raises(InvalidSettingsError, match="'gpt2' model cannot be written as GGUF yet"):
        qw.analyze(gpt2, (ids,), [(ids,)], progress=False, engine="eager", format="int8-dynamic", target="llama.cpp")
