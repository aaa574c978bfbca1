"""The eager engine's XNNPACK target: a decoder quantized as ExecuTorch ships one to phones (8da4w
Linears, int4 / int8 embeddings), every run an ExecuTorch program measured in its runtime.

Ground truth is an independent program: torchao's ``quantize_`` -> ``torch.export`` -> XNNPACK's
dynamically quantized partitioner -> ExecuTorch's runtime, written here from their APIs alone.
Needs the ``[executorch]`` extra; the decoder is the byte-level one trained on Python's help topics.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import text_decoder_report
from hf_models import tiny_llama

pytest.importorskip("executorch", reason="the [executorch] extra is not installed")

from executorch.backends.xnnpack.partition.xnnpack_partitioner import (  # noqa: E402
    XnnpackDynamicallyQuantizedPartitioner,
)
from executorch.backends.xnnpack.utils.configs import get_xnnpack_edge_compile_config  # noqa: E402
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower  # noqa: E402
from executorch.exir._serialize._program import deserialize_pte_binary  # noqa: E402
from executorch.exir.schema import Tensor as ProgramTensor  # noqa: E402
from executorch.runtime import Runtime  # noqa: E402
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # noqa: E402
from torchao.quantization.granularity import PerGroup  # noqa: E402

from qreport_widgets import analyze  # noqa: E402
from qreport_widgets.core.metrics import perplexity, sqnr_db  # noqa: E402
from qreport_widgets.engines.contract import Variant  # noqa: E402
from qreport_widgets.engines.executorch import DeployedProgram  # noqa: E402
from qreport_widgets.engines.settings import ModuleSettings  # noqa: E402
from qreport_widgets.errors import DecodeSpeedError, InvalidSettingsError  # noqa: E402


def as_from_pretrained(model):
    """The same decoder with its configuration as ``from_pretrained`` leaves it: ``use_cache=True``, so
    its forward returns a cache object beside the logits (the trained one was built without)."""
    config = copy.deepcopy(model.config)
    config.use_cache = True
    loaded = type(model)(config).eval()
    loaded.load_state_dict(model.state_dict())
    return loaded


@pytest.fixture(scope="module")
def phone_decoder(text_decoder):
    """The trained decoder for XNNPACK, as ``from_pretrained`` would give it (``use_cache=True``), every
    Linear 8da4w in groups of 32, its perplexity the metric; evaluation batches of 8 sequences against
    calibration batches of 4 (what the program's memory is planned for)."""
    model, data = text_decoder
    evaluation = [(torch.cat([a[0], b[0]]),) for a, b in zip(data.evaluation[::2], data.evaluation[1::2], strict=True)]
    report = analyze(
        as_from_pretrained(model),
        data.calibration[0],
        data.calibration,
        eval_data=evaluation,
        engine="eager",
        target="xnnpack",
        format="int8-dynamic-int4-weight",
        group_size=32,
        metric="perplexity",
        progress=False,
    )
    return model, data, evaluation, report


def independent_program(model, example, evaluation):
    """8da4w g32 on every Linear by torchao's quantize_, exported at the example's batch (ExecuTorch's LLM
    export fixes its shapes too; larger batches run in pieces of it), lowered as that export lowers decoders,
    and run by ExecuTorch's runtime: (perplexity, .pte bytes)."""
    quantized = copy.deepcopy(model)
    quantize_(quantized, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    exported = torch.export.export(quantized, example)
    # with the edge compile config ExecuTorch gives for programs XNNPACK takes (its IR not validated again)
    program = to_edge_transform_and_lower(
        exported, partitioner=[XnnpackDynamicallyQuantizedPartitioner()], compile_config=get_xnnpack_edge_compile_config()
    ).to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))
    pte = bytes(program.buffer)
    loaded = Runtime.get().load_program(pte)  # kept while its method executes: it holds the program's memory
    method = loaded.load_method("forward")
    rows = example[0].shape[0]

    def logits(ids):
        return torch.cat([method.execute([piece])[0] for piece in ids.split(rows)])

    return perplexity(logits, evaluation), len(pte)


def one_block_session():
    """A one-block Llama as ``from_pretrained`` gives it, analysed for XNNPACK (8da4w in groups of 32),
    evaluated on 8 sequences (the program is planned for 4)."""
    model, batches = tiny_llama(layers=1)
    evaluation = [(torch.cat([batches[0][0], batches[1][0]]),)]
    options = {"engine": "eager", "target": "xnnpack", "format": "int8-dynamic-int4-weight", "group_size": 32, "progress": False}
    report = analyze(as_from_pretrained(model), batches[0], batches, eval_data=evaluation, metric="perplexity", **options)
    return model, batches, evaluation, report.session


def test_the_baseline_is_the_program_executorch_ships_its_perplexity_and_size_an_independent_programs():
    """On a one-block Llama as ``from_pretrained`` gives it (the independent program costs a lowering
    a block: the trained decoder's baseline is checked against its float model in the GPTQ test)."""
    model, batches, evaluation, session = one_block_session()
    baseline = session.baseline()
    assert baseline.ok, baseline.error
    program = baseline.quantized_model
    assert isinstance(program, DeployedProgram)
    assert program.batch_limit == 4  # batches of 8 ran in two executions each
    assert baseline.size_bytes == baseline.deployed_bytes == len(program.pte)
    assert any("measured in ExecuTorch's runtime" in note for note in baseline.notes)
    assert any(note.startswith("XNNPACK runs ") for note in baseline.notes)

    # the program returns the logits the session measures, whatever the config says, and leaves it as it was
    assert session.float_model.config.use_cache and program.reference.config.use_cache
    expected_perplexity, expected_bytes = independent_program(model, batches[0], evaluation)
    assert baseline.eval_metric == pytest.approx(expected_perplexity, rel=1e-3)
    # the same outputs from fewer bytes: ExecuTorch's constant propagation stores the attention mask broadcast to
    # the batch (4 x 1 x 16 x 16 bools) where ours computes it, and a few hundred bytes less a delegated Linear
    mask = 4 * 16 * 16
    assert (expected_bytes - mask) * 0.99 <= baseline.size_bytes <= expected_bytes - mask

    # the eager model is the simulation: the truth check compares it with the program
    truth = session.truth_check()
    assert truth.real_db == baseline.output_sqnr_db and abs(truth.gap_db) < 0.2
    # per-layer SQNR of the eager model the program was lowered from
    assert set(baseline.per_layer_sqnr_db.index) >= {m.fqn for m in session.modules if m.type_name == "Linear"}


@pytest.mark.slow  # a third lowering (half a minute); session.decode_speed and the runs table: test_llamacpp_target.py
def test_decode_speed_is_the_program_exported_again_with_a_kv_cache_generating_what_its_eager_model_does():
    _, _, evaluation, session = one_block_session()
    assert session.baseline().ok
    decodes_what_its_eager_model_generates(session, evaluation)


def decodes_what_its_eager_model_generates(session, evaluation):
    """``decode_speed``: the latest run's program with a static KV cache, fed the first evaluation
    sequence's 16 tokens, then generating 8; the runs table gains its decode time."""
    latest = session.keep(-1)  # the latest run (earlier runs' programs are released as later ones are recorded)
    speed = session.decode_speed(prompt_tokens=16, new_tokens=8)
    assert speed.prompt_tokens == 16 and speed.new_tokens == 8 and len(speed.generated) == 8
    assert 0 < speed.decode_ms < latest.latency_ms and 0 < speed.prefill_ms
    assert "ms a generated token" in speed.words
    # the runs table: prefill per token of every run, decode per token where it was measured
    runs = session.compare()[0]
    runs = runs[runs["run"] != "float model"]  # the reference row: no latency of its own
    tokens = evaluation[0][0].numel()
    assert runs["prefill (ms / token)"].tolist() == pytest.approx((runs["latency (ms, 1 thread)"] / tokens).tolist())
    assert runs["decode (ms / token)"].iloc[-1] == speed.decode_ms and runs["decode (ms / token)"].iloc[:-1].isna().all()

    # greedy generation by the eager quantized model the program was lowered from, whole sequences each
    # step: the same tokens, up to a near tie (an untrained model's top two logits can lie 0.002 apart)
    # that the kernels' rounding may break the other way, after which the two continue from different text
    tokens = evaluation[0][0][0, :16].tolist()
    with torch.no_grad():
        for generated in speed.generated:
            logits = latest.quantized_model.reference(torch.tensor([tokens])).logits[0, -1]
            first, second = logits.topk(2).values.tolist()
            tokens.append(int(logits.argmax()))
            if generated != tokens[-1]:
                assert first - second < 0.01, f"the program generated {speed.generated}, its eager model {tokens[16:]}"
                break


def constant_sizes(pte: bytes) -> list[tuple[int, ...]]:
    """The sizes of the constant tensors a program stores outside its delegates."""
    program = deserialize_pte_binary(pte)
    program = getattr(program, "program", program)
    values = (value.val for value in program.execution_plan[0].values)
    return [tuple(v.sizes) for v in values if isinstance(v, ProgramTensor) and v.data_buffer_idx > 0]


def every_linear(session, algorithm: str):
    """The session's baseline, and every Linear 8da4w g32 with its int4 values chosen by ``algorithm``."""
    linears = [m.fqn for m in session.modules if m.type_name == "Linear"]
    chosen = {fqn: ModuleSettings(format="int8-dynamic-int4-weight", group_size=32, algorithm=algorithm) for fqn in linears}
    return session.baseline(), chosen


def test_gptq_in_the_8da4w_layout_beats_round_to_nearest_in_the_runtime(phone_decoder):
    _, _, _, report = phone_decoder
    session = report.session
    baseline, chosen = every_linear(session, "gptq")
    model, data, evaluation, _ = phone_decoder
    assert baseline.ok and baseline.quantized_model.batch_limit == 4  # evaluation batches of 8: two executions each
    assert perplexity(model, evaluation) < baseline.eval_metric < 1.02 * perplexity(model, evaluation)
    baseline_pte = baseline.quantized_model.pte
    # lowered at the batch it is planned for, its attention mask computed in the program, not stored at
    # that batch's size (4 x 1 x 128 x 128 bools, twice, were the constant propagation to fold it)
    assert baseline.quantized_model.input_shapes == ((4, 128),)
    assert (4, 1, 128, 128) not in constant_sizes(baseline_pte)
    run = session.apply(chosen, label="gptq")
    assert run.ok, run.error
    assert run.eval_metric < baseline.eval_metric and run.output_sqnr_db > baseline.output_sqnr_db + 3
    assert run.size_bytes == pytest.approx(baseline.size_bytes, rel=0.001)  # the same layout, other int4 values
    assert not run.module_notes or all("kept round to nearest" in note for note in run.module_notes.values())

    # the baseline's graph: GPTQ's int4 values and scales written into its program (the bytes a fresh
    # lowering gives: tests/test_program_reuse.py)
    program = run.quantized_model
    assert any("lowered before" in note for note in run.notes) and "lowered before" in program.reused
    assert len(program.pte) == len(baseline_pte) and program.pte != baseline_pte

    # as code: GPTQ's weights for 8da4w Linears, an int4 embedding, the lowering ExecuTorch's LLM export does
    chosen["model.embed_tokens"] = ModuleSettings(format="int4-weight-only", group_size=32)
    code = session.settings_as_code(chosen)
    assert "XnnpackDynamicallyQuantizedPartitioner" in code and "'int8-dynamic-int4-weight'" in code
    assert "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))" in code


@pytest.mark.slow  # a program more (about a minute); the folds' arithmetic: tests/test_weight_algorithms.py
def test_awq_folds_its_scales_into_the_ops_before_and_runs_in_the_program_as_simulated(phone_decoder):
    _, _, _, report = phone_decoder
    session = report.session
    baseline, chosen = every_linear(session, "awq")
    simulated, _ = session.simulate(Variant(settings=tuple(chosen.items())))
    run = session.apply(chosen, label="awq")
    assert run.ok, run.error
    # the scales are in the norms' and Linears' weights: the program is the baseline's size, and as simulated
    assert run.size_bytes == pytest.approx(baseline.size_bytes, rel=0.001)
    assert run.output_sqnr_db == pytest.approx(simulated, abs=0.1)
    assert run.output_sqnr_db > baseline.output_sqnr_db + 0.5  # its perplexity: within the decoder's 0.1% int4 gap


def test_formats_the_program_cannot_run_are_refused_naming_what_it_can(phone_decoder, text_decoder):
    _, _, _, report = phone_decoder
    session = report.session
    with pytest.raises(InvalidSettingsError, match="XNNPACK delegates a Linear with dynamically quantized int8"):
        session.apply({"lm_head": ModuleSettings(format="int4-weight-only")})
    # AWQ's scale of q_proj's input folds into the norm before it, which k_proj and v_proj also read
    with pytest.raises(InvalidSettingsError, match="ask AWQ with group size 32 of all of .*q_proj, .*k_proj, .*v_proj"):
        session.apply({"model.layers.0.self_attn.q_proj": ModuleSettings(format="int8-dynamic-int4-weight", algorithm="awq")})
    model, data = text_decoder
    with pytest.raises(ValueError, match="format must be 'int8-dynamic' or 'int8-dynamic-int4-weight'"):
        analyze(model, data.calibration[0], data.calibration, engine="eager", target="xnnpack", format="int4-weight-only")
    with pytest.raises(ValueError, match="target must be 'x86' or 'xnnpack'"):
        analyze(model, data.calibration[0], data.calibration, engine="eager", target="arm")
    assert math.isfinite(session.baseline().latency_ms)


def test_an_embedding_with_a_padding_index_is_quantized_into_the_program_and_the_front_ranks_only_what_builds(
    monkeypatch, shortcuts_as_taken
):
    """A decoder whose config names a pad token (SmolLM2's: transformers passes it to the embedding as
    ``padding_idx``), its head tied as ``from_pretrained`` leaves it: each format the front offers the
    embedding lowers (the padding index, which shapes only gradients, once kept ExecuTorch from fusing
    the quantized lookup, and the program failed to serialise) and follows its eager model. Where a
    choice does not build (that fusion taken away again), the size front leaves it out and says why,
    and a fit's answer is a program."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qreport_widgets.engines import executorch
    from qreport_widgets.engines.eager import engine

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    assert model.model.embed_tokens.padding_idx == 2
    batches = [(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(i)),) for i in range(4)]
    session = analyze(
        model, batches[0], batches, engine="eager", target="xnnpack", format="int8-dynamic-int4-weight", algorithms=("rtn",),
        progress=False,
    ).session  # fmt: skip
    embedding = next(m for m in session.modules if m.fqn == "model.embed_tokens")
    offered = [c for c in session.engine.size_choices(embedding) if not c.keep_float]
    assert {c.format for c in offered} == {"int4-weight-only", "int8-weight-only"}
    run = session.apply({"model.embed_tokens": offered[0]})
    assert run.ok, run.error
    eager = run.quantized_model.reference(*batches[0]).logits
    assert sqnr_db(eager, run.quantized_model(*batches[0]).logits) > 30
    for choice in offered:  # each format builds (a few rows of the embedding lowered once a format)
        assert session.engine.unbuildable(session.float_model.get_submodule(embedding.fqn), choice) == ""
    monkeypatch.setattr(executorch, "_fusable_embeddings", lambda exported: exported)
    monkeypatch.setattr(engine, "_BUILDABLE", {})
    kept_float = ModuleSettings(keep_float=True)
    fitted = session.fit(max_size_bytes=session.baseline().deployed_bytes, progress=False)
    assert fitted.ok and fitted.settings.get("model.embed_tokens", kept_float).keep_float
    assert any("cannot build (RuntimeError: Missing out variants" in note for note in fitted.notes), fitted.notes


def test_decode_speed_elsewhere_says_where_it_is_measured(text_decoder):
    session = text_decoder_report(text_decoder).session  # x86: the quantized model runs in PyTorch
    with pytest.raises(DecodeSpeedError, match="engine='eager', target='xnnpack'"):
        session.decode_speed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    with pytest.raises(DecodeSpeedError, match="evaluation batches of token ids"):
        analyze(model, batches[0], batches, progress=False).session.decode_speed()


@pytest.mark.slow  # a session and two programs (about two minutes)
def test_the_truth_check_names_the_first_block_where_the_program_parts_from_its_simulation(text_decoder, monkeypatch):
    """Provoked: every program is lowered from a model whose third block's down_proj outputs half
    what the eager model's does (as a lowering that computed something else there would), while the
    simulation follows the eager model. The baseline then parts from its simulation; the truth check
    lowers the program again with each block's output tapped and names block 2."""
    import qreport_widgets.engines.executorch as executorch
    from qreport_widgets.engines.folds import rows_divided

    exported = executorch._exported

    def lowered_otherwise(model, example_inputs, **options):
        model = copy.deepcopy(model)
        inner = model.model if isinstance(model, executorch._ProgramOutputs) else model
        down = inner.get_submodule("model.layers.2.mlp.down_proj")
        down.weight = torch.nn.Parameter(rows_divided(down.weight.detach(), torch.full((down.out_features,), 2.0)), False)
        return exported(model, example_inputs, **options)

    monkeypatch.setattr(executorch, "_exported", lowered_otherwise)
    model, data = text_decoder
    report = analyze(
        model,
        data.calibration[0],
        data.calibration,
        eval_data=data.evaluation[:2],
        engine="eager",
        target="xnnpack",
        format="int8-dynamic-int4-weight",
        group_size=32,
        progress=False,
    )
    truth = report.session.truth_check()
    assert not truth.agrees and truth.gap_db > 3
    assert truth.gap_opens_at().startswith("the gap opens at model.layers.2:")
    blocks = truth.layers.loc[[f"model.layers.{i}" for i in range(4)]]
    assert (blocks["simulated_sqnr_db"] - blocks["real_sqnr_db"]).iloc[:2].abs().max() < 0.5  # before it, they agree
    assert any("the gap opens at model.layers.2" in note for note in truth.notes)
