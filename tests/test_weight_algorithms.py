"""int4 weight algorithms (round to nearest, HQQ, GPTQ, AWQ) as per-module settings on the eager
engine, judged on the byte-level decoder trained on real text: each algorithm's own objective on
every Linear, the decoder's perplexity and logits, the simulation against the real run, the code a
user pastes, and the errors for what cannot take an algorithm."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import text_decoder_report
from hf_models import VOCAB, tiny_family, tiny_llama
from torch import nn

import qreport_widgets as qw
from qreport_widgets.core.calibration import call_with, data_fingerprint, gather_with
from qreport_widgets.core.metrics import output_tensor, perplexity, sqnr_db
from qreport_widgets.core.shortcuts import tensors_equal
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.eager import algorithms, quantize
from qreport_widgets.engines.eager.formats import ao_config, torchao_eager
from qreport_widgets.engines.eager.found import FoundWeights
from qreport_widgets.engines.folds import input_folds
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.errors import InvalidSettingsError
from qreport_widgets.tune.session import QuantizationSession

INT4 = "int4-weight-only"


def int4(group: int, algorithm: str = "") -> ModuleSettings:
    return ModuleSettings(format=INT4, group_size=group, algorithm=algorithm)


@pytest.fixture(scope="module")
def decoder_session(text_decoder):
    return text_decoder_report(text_decoder).session


def linear_names(session) -> list[str]:
    return [m.fqn for m in session.modules if m.type_name == "Linear"]


def test_gptq_and_awq_lower_every_linears_output_error_on_the_calibration_inputs(text_decoder):
    model, data = text_decoder
    names = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad(), algorithms.recording(model, names) as inputs:
        for batch in data.calibration:
            call_with(model, batch)
    awq_better = 0
    for fqn in names:
        weight, statistics = model.get_submodule(fqn).weight.detach(), inputs[fqn]
        assert statistics.tokens == 4 * 4 * 128

        def error(quantized, weight=weight, statistics=statistics):
            return algorithms.output_error(weight, quantized.dequantize(torch.float32), statistics.gram)

        rounded = error(algorithms.choose("rtn", weight, 128))
        # GPTQ's objective: the layer's output error on these inputs; it removes most of rounding's
        assert error(algorithms.gptq(weight, statistics, 128)) < 0.5 * rounded, fqn
        found = error(algorithms.awq(weight, statistics, 128))
        assert found <= rounded, fqn
        awq_better += found < rounded
    assert awq_better >= len(names) // 2


def _column_by_column(weight: torch.Tensor, gram: torch.Tensor, group: int, damping: float) -> torch.Tensor:
    """GPTQ's int4 values of one weight as a plain loop over its columns in rows x inputs layout
    (lazy updates every ``GPTQ_BLOCK`` columns): the arithmetic each weight must keep when solved
    beside others."""
    hessian = gram.clone()
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1.0
    order = torch.argsort(hessian.diagonal(), descending=True)
    hessian = hessian[order][:, order]
    hessian.diagonal().add_(damping * float(hessian.diagonal().mean()))
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian.double())), upper=True).float()
    work = weight.detach().float().clone()
    work[:, dead] = 0.0
    scales = algorithms.group_scales(work, group)
    work = work[:, order]
    values = torch.empty_like(work)
    step = algorithms.GPTQ_BLOCK
    for start in range(0, work.shape[1], step):
        stop = min(start + step, work.shape[1])
        block, errors = work[:, start:stop].clone(), torch.empty(work.shape[0], stop - start)
        for i in range(stop - start):
            scale = scales[:, int(order[start + i]) // group]
            q = torch.clamp(torch.round(block[:, i] / scale), algorithms.QMIN, algorithms.QMAX)
            values[:, start + i] = q
            error = (block[:, i] - q * scale) / inverse[start + i, start + i]
            block[:, i:].sub_(error[:, None] * inverse[start + i, start + i : stop][None, :])
            errors[:, i] = error
        work[:, stop:].sub_(errors @ inverse[start:stop, stop:])
    return values[:, torch.argsort(order)].to(torch.int8)


@pytest.mark.parametrize("features", [96, 577, 1536])  # one solve; uneven halves; SmolLM2's MLP input
def test_the_inverse_gram_factor_from_one_factorization_is_the_upper_cholesky_factor_of_the_inverse(features):
    generator = torch.Generator().manual_seed(features)
    inputs = torch.randn(2 * features, features, generator=generator, dtype=torch.float64)
    hessian = inputs.T @ inputs + 0.01 * features * torch.eye(features, dtype=torch.float64)
    factor = algorithms._inverse_factor(hessian)
    assert torch.equal(factor, factor.triu()) and bool((factor.diagonal() > 0).all())
    expected = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    assert float((factor - expected).abs().max() / expected.abs().max()) < 1e-12
    assert torch.allclose(factor.T @ factor @ hessian, torch.eye(features, dtype=torch.float64), atol=1e-9)


def test_gptq_of_many_weights_solved_together_gives_each_the_values_it_gets_alone(text_decoder, monkeypatch):
    model, data = text_decoder
    names = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad(), algorithms.recording(model, names) as inputs:
        for batch in data.calibration:
            call_with(model, batch)
    problems = {fqn: (model.get_submodule(fqn).weight, inputs[fqn], 128) for fqn in names}
    assert len({tuple(w.shape) for w, _, _ in problems.values()}) < len(names)  # weights of one shape, solved together
    factored = []
    factor = algorithms._activation_order
    monkeypatch.setattr(
        algorithms, "_activation_order", lambda gram, damping: factored.append((gram, damping)) or factor(gram, damping)
    )
    together = algorithms.gptq_many(problems)
    # q, k and v (gate and up) read one input: its Gram matrix factored once at a damping, not once a Linear
    assert len(factored) < 2 * len(names)
    for i, (gram, damping) in enumerate(factored):
        assert not any(d == damping and torch.equal(g, gram) for g, d in factored[i + 1 :])
    monkeypatch.setattr(algorithms, "GPTQ_BATCH_BYTES", 1)  # one weight at a time
    for fqn, (weight, statistics, group) in problems.items():
        alone = algorithms.gptq_many({fqn: problems[fqn]})[fqn]
        assert torch.equal(together[fqn].tensor.qdata, alone.tensor.qdata), fqn
        assert torch.equal(together[fqn].tensor.scale, alone.tensor.scale) and together[fqn].note == alone.note, fqn
        plain = _column_by_column(weight, statistics.gram, group, algorithms.GPTQ_DAMPINGS[0])
        if not alone.note:  # every Linear of the trained decoder takes the first damping
            assert torch.equal(alone.tensor.qdata, plain), fqn
    assert not any(q.note for q in together.values())


def test_linears_that_read_one_input_record_the_statistics_each_would_alone(text_decoder):
    model, data = text_decoder
    readers = [group for group in input_folds(model).values() if len(group.readers) > 1][0].readers
    with torch.no_grad(), algorithms.recording(model, readers) as together:
        for batch in data.calibration:
            call_with(model, batch)
    for fqn in readers:
        with torch.no_grad(), algorithms.recording(model, [fqn]) as alone:
            for batch in data.calibration:
                call_with(model, batch)
        mine, own = together[fqn], alone[fqn]
        assert torch.equal(mine.fit_sum, own.fit_sum) and torch.equal(mine.gram, own.gram), fqn
        assert (mine.tokens, mine.fitted_tokens, mine.units) == (own.tokens, own.fitted_tokens, own.units)
        weight = model.get_submodule(fqn).weight.detach()
        rounded = algorithms.QuantizedWeight(algorithms.round_to_nearest(weight, 128))
        assert mine.held_out_error(weight, rounded) == own.held_out_error(weight, rounded), fqn
    # each keeps its own sums: merging another rank's statistics into one changes no other
    first, second = (together[fqn] for fqn in readers[:2])
    before = second.fit_sum.clone()
    first.merge_(copy.deepcopy(first))
    assert torch.equal(second.fit_sum, before) and not torch.equal(first.fit_sum, before)


def test_a_calibration_pass_ends_each_batch_once_its_linears_have_read_their_inputs(text_decoder):
    model, data = text_decoder
    names = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    early = names[: len(names) // 2]  # the first blocks' Linears: everything after them need not run
    blocks_called = []
    handles = [m.register_forward_hook(lambda *_: blocks_called.append(1)) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad(), algorithms.recording(model, early) as ended:
            for batch in data.calibration:
                gather_with(model, batch)
        called_when_ended = len(blocks_called)
        blocks_called.clear()
        with torch.no_grad(), algorithms.recording(model, early) as whole:
            for batch in data.calibration:
                call_with(model, batch)  # not a calibration pass: every batch runs whole
    finally:
        for handle in handles:
            handle.remove()
    batches = len(data.calibration)
    # the first batch runs whole (it finds which Linear reads its input last), the others stop there
    assert called_when_ended == len(names) + (batches - 1) * (len(early) - 1)
    assert len(blocks_called) == batches * len(names)
    for fqn in early:
        assert torch.equal(ended[fqn].fit_sum, whole[fqn].fit_sum) and torch.equal(ended[fqn].gram, whole[fqn].gram), fqn
        assert ended[fqn].tokens == whole[fqn].tokens == batches * 4 * 128

    class Twice(nn.Module):  # a Linear called twice a batch: the batch runs whole
        def __init__(self) -> None:
            super().__init__()
            self.first, self.again = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.again(self.first(self.again(x)))

    twice = Twice()
    with torch.no_grad(), algorithms.recording(twice, ["first", "again"]) as inputs:
        for _ in range(3):
            gather_with(twice, torch.randn(2, 8))
    assert inputs["again"].tokens == 3 * 2 * 2 and inputs["first"].tokens == 3 * 2


def test_the_output_error_is_the_layers_squared_output_error_on_its_inputs():
    torch.manual_seed(0)
    layer = nn.Linear(64, 16, bias=False)
    x = torch.randn(3, 10, 64) * torch.linspace(0.1, 3, 64)
    with torch.no_grad(), algorithms.recording(nn.Sequential(layer), ["0"]) as inputs:
        layer(x)
    approximation = algorithms.choose("rtn", layer.weight.detach(), 32).dequantize()
    direct = float(((x @ layer.weight.detach().T - x @ approximation.T) ** 2).sum())
    assert algorithms.output_error(layer.weight.detach(), approximation, inputs["0"].gram) == pytest.approx(direct, rel=1e-4)


def test_whole_sequences_are_held_out_the_same_ones_in_any_order_and_too_few_tokens_keep_rounding_with_the_reason():
    torch.manual_seed(0)
    batches = [torch.randn(4, 10, 64) for _ in range(2)]
    statistics = algorithms.InputStatistics.empty(64)
    for batch in batches:
        statistics.add(batch)
    held = torch.cat(statistics.held_rows)
    sequences = torch.cat(batches)
    chosen = algorithms.held_out(sequences)
    assert 0 < int(chosen.sum()) < len(sequences) and statistics.tokens == 80
    assert torch.equal(held, sequences[chosen].reshape(-1, 64))  # whole sequences of 10 tokens
    torch.testing.assert_close(statistics.gram, statistics.fit + held.T @ held, rtol=1e-5, atol=1e-4)
    # the same sequences held out in another batch order and at other positions in their batches
    shuffled = algorithms.InputStatistics.empty(64)
    for batch in (sequences[[5, 0, 7, 2]], sequences[[6, 1, 4, 3]]):
        shuffled.add(batch)
    assert shuffled.fitted_tokens == statistics.fitted_tokens
    torch.testing.assert_close(shuffled.fit, statistics.fit, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(shuffled.gram, statistics.gram, rtol=1e-6, atol=1e-5)
    # the same batches gathered apart (two ranks) and merged, in either order: the same float32 sums
    for first, second in (batches, batches[::-1]):
        apart = [algorithms.InputStatistics.empty(64) for _ in range(2)]
        apart[0].add(first)
        apart[1].add(second)
        merged = apart[0].merge_(apart[1])
        assert torch.equal(merged.fit, statistics.fit) and torch.equal(merged.gram, statistics.gram)
        assert torch.equal(merged.mean_abs, statistics.mean_abs) and merged.tokens == statistics.tokens
    many = algorithms.held_out(torch.randn(4000, 10, 64))
    assert 0.22 < float(many.float().mean()) < 0.28  # about one in HELD_EVERY = 4
    # 96 tokens of 256 features: GPTQ's fit follows the tokens it saw and fails on the held-out ones
    layer = nn.Linear(256, 32)
    few = algorithms.InputStatistics.empty(256)
    few.add(torch.randn(8, 12, 256))
    found = algorithms.gptq(layer.weight.detach(), few, 128)
    assert "GPTQ kept round to nearest" in found.note and "96 tokens for 256 input features" in found.note
    assert torch.equal(found.tensor.qdata, algorithms.choose("rtn", layer.weight.detach(), 128).tensor.qdata)
    # enough tokens: GPTQ's own weights
    many = algorithms.InputStatistics.empty(256)
    mixing = torch.randn(64, 256)  # correlated input channels, as a model's activations are
    for _ in range(8):
        many.add(torch.randn(8, 64, 64) @ mixing + 0.1 * torch.randn(8, 64, 256))
    assert algorithms.gptq(layer.weight.detach(), many, 128).note == ""


def test_rtn_and_hqq_are_torchaos_own_and_every_algorithm_keeps_its_layout():
    torch.manual_seed(0)
    layer = nn.Linear(128, 32)
    for name in ("rtn", "hqq"):
        holder = nn.Sequential(copy.deepcopy(layer))
        torchao_eager().quantize_(
            holder, torchao_eager().FqnToConfig({"0": ao_config(INT4, 64, "" if name == "rtn" else name)}), filter_fn=None
        )
        ours = algorithms.choose(name, layer.weight.detach(), 64).tensor
        assert torch.equal(ours.qdata, holder[0].weight.qdata) and torch.equal(ours.scale, holder[0].weight.scale)
    statistics = algorithms.InputStatistics.empty(128)
    statistics.add(torch.randn(50, 128))
    for name in ("gptq", "awq"):
        found = algorithms.choose(name, layer.weight.detach(), 64, statistics).tensor
        assert type(found).__name__ == "IntxUnpackedToInt8Tensor" and found.block_size == (1, 64)
        assert int(found.qdata.min()) >= -8 and int(found.qdata.max()) <= 7 and not found.zero_point.any()


def test_on_the_trained_decoder_gptq_beats_rounding_and_hqq_in_real_runs(decoder_session, text_decoder):
    _, data = text_decoder
    session = decoder_session
    names = linear_names(session)
    runs = {}
    for algorithm in ("", "hqq", "gptq", "awq"):
        run = session.apply({fqn: int4(128, algorithm) for fqn in names})
        assert run.ok, run.error
        runs[algorithm or "rtn"] = run
    ppl = {name: run.eval_metric for name, run in runs.items()}
    sqnr = {name: run.output_sqnr_db for name, run in runs.items()}
    assert ppl["gptq"] == pytest.approx(data.perplexity(runs["gptq"].quantized_model))
    best = min(("gptq", "awq"), key=ppl.get)
    assert ppl[best] < ppl["rtn"] and ppl[best] < ppl["hqq"]
    assert max(sqnr["gptq"], sqnr["awq"]) >= sqnr["rtn"] + 5
    # the same layout: GPTQ costs no byte more than rounding; nor does AWQ, its scales folded into the norms and
    # Linears before (every Linear asked AWQ at one group size), none divided by a module of its own
    assert runs["gptq"].deployed_bytes == runs["rtn"].deployed_bytes == runs["awq"].deployed_bytes
    assert not any(hasattr(m, algorithms.INPUT_SCALE) for m in runs["awq"].quantized_model.modules())
    model, quantized = text_decoder[0], runs["awq"].quantized_model
    for norm in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"):
        assert not torch.equal(quantized.get_submodule(norm).weight, model.get_submodule(norm).weight), norm
    assert sqnr["awq"] > sqnr["rtn"] + 1
    assert any("gptq:" in note for note in runs["gptq"].notes)
    assert "algorithm=gptq" in runs["gptq"].changes(session.current_settings())


def test_the_simulation_uses_each_algorithms_own_weights(decoder_session):
    session = decoder_session
    names = linear_names(session)
    session.baseline()
    simulated = {}
    for algorithm in ("gptq", "awq"):
        settings = {fqn: int4(128, algorithm) for fqn in names}
        simulated[algorithm], _ = session.simulate(Variant(settings=tuple(settings.items())))
        real = session.apply(settings)
        assert simulated[algorithm] == pytest.approx(real.output_sqnr_db, abs=0.05), algorithm
    rounded, _ = session.simulate(())
    assert simulated["gptq"] > rounded + 5  # not the start's rounded weights


def test_size_choices_offer_every_algorithm_on_linears_and_the_size_counts_awqs_scales(decoder_session):
    session = decoder_session
    engine = session.engine
    head = next(m for m in session.modules if m.fqn == "lm_head")
    choices = engine.size_choices(head)
    assert {c.algorithm for c in choices if c.format == INT4} == {"", "hqq", "gptq", "awq"}
    module = session.float_model.get_submodule("lm_head")
    assert engine.module_bytes(module, int4(128, "awq")) == engine.module_bytes(module, int4(128)) + 4 * module.in_features
    assert engine.module_bytes(module, int4(128, "gptq")) == engine.module_bytes(module, int4(128))
    embedding = next(m for m in session.modules if m.type_name == "Embedding")
    assert {c.algorithm for c in engine.size_choices(embedding) if c.format == INT4} == {"", "hqq"}


def test_settings_as_code_with_gptq_builds_the_same_model():
    model, batches = tiny_llama()
    report = qw.analyze(model, batches[0], batches, eval_data=batches[:2], engine="eager", format=INT4, progress=False)
    session = report.session
    settings = {
        **session.current_settings(),
        "model.layers.0.mlp.down_proj": int4(64, "gptq"),
        "model.layers.1.self_attn.q_proj": int4(32, "awq"),
        "model.layers.1.mlp.up_proj": int4(32, "hqq"),
    }
    run = session.apply(settings)
    assert run.ok, run.error
    code = session.settings_as_code(settings)
    assert "quantize_weights" in code and "hqq_scale_only" in code
    namespace = {"model": copy.deepcopy(model), "calibration_batches": batches}
    exec(code, namespace)  # noqa: S102  (the code the Tune tab shows, run as a user would)
    for batch in batches:
        assert torch.equal(
            output_tensor(call_with(run.quantized_model, batch)), output_tensor(call_with(namespace["model"], batch))
        )


def test_what_cannot_take_an_algorithm_is_refused_with_the_reason(decoder_session):
    session = decoder_session
    with pytest.raises(InvalidSettingsError, match="for int4-weight-only, int8-dynamic-int4-weight, not int8-weight-only"):
        session.apply({"lm_head": ModuleSettings(format="int8-weight-only", algorithm="gptq")})
    with pytest.raises(InvalidSettingsError, match="an embedding looks rows up"):
        session.apply({"model.embed_tokens": int4(32, "gptq")})
    with pytest.raises(InvalidSettingsError, match="unknown weight algorithm 'smoothquant'"):
        session.apply({"lm_head": int4(32, "smoothquant")})
    with pytest.raises(InvalidSettingsError, match="group size 128 does not divide"):
        qw.quantize_weights(nn.Sequential(nn.Linear(96, 8)), {"0": ("gptq", 128)}, [torch.randn(2, 96)])
    assert ModuleSettings(format=INT4, algorithm="rtn") == ModuleSettings(format=INT4)
    assert ModuleSettings(format="float", algorithm="gptq").algorithm == ""


def test_an_algorithm_on_an_fx_module_says_which_engine_has_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    batches = [(torch.randn(8, 32),) for _ in range(3)]
    session = qw.analyze(model, batches[0], batches, progress=False).session
    with pytest.raises(InvalidSettingsError, match="engine='eager'"):
        session.apply({"0": ModuleSettings(algorithm="gptq")})


def test_a_run_says_where_gptq_kept_rounding_and_the_simulation_agrees():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    batches = [(torch.randn(4, 12, 256),) for _ in range(2)]  # 96 tokens for 256 input features
    session = qw.analyze(model, batches[0], batches, eval_data=batches, engine="eager", format=INT4, progress=False).session
    settings = {"0": int4(128, "gptq"), "2": int4(32, "gptq")}
    run = session.apply(settings)
    assert run.ok, run.error
    assert "GPTQ kept round to nearest" in run.module_notes["0"]
    assert any("modules asked GPTQ / AWQ kept round to nearest" in note for note in run.notes)
    rounded = session.apply({"0": int4(128), "2": int4(32, "gptq")})
    assert rounded.output_sqnr_db == pytest.approx(run.output_sqnr_db, abs=1e-6)
    simulated, _ = session.simulate(Variant(settings=tuple(settings.items())))
    assert simulated == pytest.approx(run.output_sqnr_db, abs=0.05)


def test_block_sensitivity_keeps_each_decoder_block_float_whole(decoder_session):
    from qreport_widgets.engines.settings import module_blocks

    session = decoder_session
    simulation = session.parts.diagnosis.simulation()  # the baseline and its check against the simulation first
    passes = []
    counting = simulation.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        table = session.block_sensitivity()  # perplexity and output SQNR from the same pass
    finally:
        counting.remove()
    batches = len(session.parts.runner.eval_data)
    assert len(passes) == (len(table) + 1) * batches  # the start and each block: one pass over the evaluation batches
    names = [m.fqn for m in session.modules if not m.current.keep_float]
    blocks = module_blocks(names)
    assert list(blocks) == ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3", "lm_head"]
    assert set(table.index) == set(blocks) and table.loc["model.layers.2", "modules"] == 7
    assert (table["output_sqnr_gain_db"] > 0).all() and "metric_gain" in table
    variant = Variant(frozenset(blocks["model.layers.1"]))
    whole, value = session.simulate(variant)
    assert table.loc["model.layers.1", "simulated_output_sqnr_db"] == pytest.approx(whole)
    simulation.configure(variant)  # the metric read from the outputs equals perplexity() of the simulated model
    assert value == pytest.approx(perplexity(simulation.model, session.parts.runner.eval_data), rel=1e-6)
    simulation.configure(())
    assert module_blocks(["layer1.0.conv1", "layer1.0.bn1", "layer1.1.conv1", "fc"]) == {
        "layer1.0": ["layer1.0.conv1", "layer1.0.bn1"],
        "layer1.1": ["layer1.1.conv1"],
        "fc": ["fc"],
    }


def test_the_algorithms_the_search_weighs_are_an_engine_option():
    model, batches = tiny_llama()
    session = qw.analyze(
        model, batches[0], batches, engine="eager", format=INT4, algorithms=("rtn", "hqq"), progress=False
    ).session
    module = next(m for m in session.modules if m.fqn.endswith("q_proj"))
    assert {c.algorithm for c in session.engine.size_choices(module) if c.format == INT4} == {"", "hqq"}
    assert module.algorithm_allowed("gptq")  # still a choice by hand
    with pytest.raises(ValueError, match="algorithms= is not for engine='fx'"):
        qw.analyze(model, batches[0], batches, algorithms=("gptq",), progress=False)
    with pytest.raises(ValueError, match="algorithms must name some of rtn, hqq, gptq, awq, learned"):
        qw.analyze(model, batches[0], batches, engine="eager", algorithms=("smoothquant",), progress=False)


def test_what_the_simulation_keeps_of_each_result_rebuilds_it_exactly():
    torch.manual_seed(0)
    weight = torch.randn(48, 128)
    mixing = torch.randn(24, 128)
    magnitudes = torch.ones(128)
    magnitudes[::16] = 20.0  # outlier channels, as a decoder's activations have
    correlated = algorithms.InputStatistics.empty(128)
    for _ in range(4):  # 32 sequences of 32 tokens, correlated channels: GPTQ and AWQ have something to use
        correlated.add((torch.randn(8, 32, 24) @ mixing + 0.05 * torch.randn(8, 32, 128)) * magnitudes)
    few = algorithms.InputStatistics.empty(128)
    few.add(torch.randn(4, 8, 128))  # 32 tokens for 128 features: rounding kept
    found = {
        "gptq": algorithms.gptq(weight, correlated, 64),
        "awq": algorithms.awq(weight, correlated, 64),
        "kept": algorithms.gptq(weight, few, 64),
    }
    assert found["gptq"].note == "" and found["awq"].input_scale is not None and found["kept"].note
    kinds = {name: type(q.compact()).__name__ for name, q in found.items()}
    assert kinds == {"gptq": "CompactWeight", "awq": "CompactWeight", "kept": "Recipe"}  # AWQ clips: not rounding
    for quantized in found.values():
        kept = quantized.compact()
        assert kept.nbytes < 0.6 * quantized.nbytes  # values two per byte instead of one; a recipe far less
        again = kept.expand(weight)
        assert torch.equal(again.tensor.qdata, quantized.tensor.qdata) and torch.equal(again.tensor.scale, quantized.tensor.scale)
        assert torch.equal(again.dequantize(), quantized.dequantize()) and again.note == quantized.note


def test_gram_matrices_are_gathered_in_one_pass_where_free_memory_holds_them_else_in_runs():
    features = {f"layers.{i}.{name}": width for i in range(3) for name, width in (("q", 64), ("down", 128))}
    held = sum(8 * width**2 for width in features.values())  # float64 sums
    assert algorithms.gram_runs(features, weight_bytes=0, free=4 * held) == [list(features)]
    runs = algorithms.gram_runs(features, weight_bytes=held / 0.15 / 3, free=0)  # a third of them a run
    assert [name for run in runs for name in run] == list(features) and len(runs) == 3
    assert algorithms.gram_runs(features, weight_bytes=0, free=0) == [[name] for name in features]  # one a run at least


def test_a_real_run_gathers_gptq_inputs_in_runs_of_modules_and_gets_the_same_model(monkeypatch):
    import qreport_widgets.tune.runner as runner

    model, batches = tiny_llama()
    session = qw.analyze(model, batches[0], batches, eval_data=batches[:2], engine="eager", format=INT4, progress=False).session
    settings = {fqn: int4(32, "gptq" if "mlp" in fqn else "awq") for fqn in linear_names(session)}
    passes = []
    calibrate = runner.calibrate
    monkeypatch.setattr(runner, "calibrate", lambda *args, **kwargs: passes.append(kwargs["desc"]) or calibrate(*args, **kwargs))
    session.baseline()
    monkeypatch.setattr(algorithms, "GRAM_SHARE", 10.0)  # every Gram matrix at once
    passes.clear()
    together = session.apply(settings)
    assert together.ok and passes == ["run 2: calibrating"]
    monkeypatch.setattr(algorithms, "GRAM_SHARE", 1e-9)  # one module a run, whatever memory is free
    monkeypatch.setattr(algorithms, "GRAM_FREE_SHARE", 0.0)
    monkeypatch.setattr(session.engine, "found_before", FoundWeights())  # the first run's GPTQ weights computed again
    passes.clear()
    apart = session.apply(settings)
    # one pass per module, but one for q/k/v: the Linears asked AWQ that read one input share its statistics
    shared = sum(1 for fqn in settings if fqn.endswith(("k_proj", "v_proj")))
    assert apart.ok and len(passes) == len(settings) - shared
    for batch in batches:
        assert torch.equal(
            output_tensor(call_with(together.quantized_model, batch)), output_tensor(call_with(apart.quantized_model, batch))
        )


def test_a_real_run_takes_the_gptq_weights_the_simulation_found_and_gets_the_model_it_computes_itself(
    monkeypatch, shortcuts_as_taken
):
    import qreport_widgets.tune.runner as runner

    model, batches = tiny_llama()
    session = qw.analyze(model, batches[0], batches, eval_data=batches[:2], engine="eager", format=INT4, progress=False).session
    settings = {fqn: int4(32, "gptq") for fqn in linear_names(session)}
    session.simulate(Variant(settings=tuple(settings.items())))  # the simulation finds every weight
    passes = []
    calibrate = runner.calibrate
    monkeypatch.setattr(runner, "calibrate", lambda *args, **kwargs: passes.append(kwargs["desc"]) or calibrate(*args, **kwargs))
    taken = session.apply(settings)
    assert taken.ok and passes == []  # no calibration pass: every weight was found before
    assert any(f"gptq: {len(settings)} modules' weights taken as found before" in note for note in taken.notes)
    monkeypatch.setattr(session.engine, "found_before", FoundWeights())  # nothing found before: the run computes them
    computed = session.apply(settings)
    assert computed.ok and passes and not any("taken as found before" in note for note in computed.notes)
    for batch in batches:
        assert torch.equal(
            output_tensor(call_with(taken.quantized_model, batch)), output_tensor(call_with(computed.quantized_model, batch))
        )


def test_gptq_weights_found_on_one_float_model_and_data_are_taken_for_those_alone_and_are_copies():
    store = FoundWeights()
    model, batches = tiny_llama()
    data = data_fingerprint(batches)
    same = copy.deepcopy(model)  # another object, the same weights: the same fingerprint
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.norm.weight[0] += 1e-3  # a weight no Linear holds: the inputs GPTQ reads change
    pair = ("model.layers.0.mlp.up_proj", (INT4, 32, "gptq"))
    found = algorithms.gptq(model.get_submodule(pair[0]).weight, _statistics(model, pair[0], batches), 32).compact()
    store.keep(FoundWeights.key(model, data), {pair: found})
    assert tensors_equal(store.taken(FoundWeights.key(same, data), [pair]), {pair: found})
    assert store.taken(FoundWeights.key(other, data), [pair]) == {}
    assert store.taken(FoundWeights.key(same, data_fingerprint(batches[:-1])), [pair]) == {}  # other calibration data
    assert FoundWeights.key(model, None) is None and store.taken(None, [pair]) == {}  # a callable's data: nothing kept
    # a weight assigned anew (``p.data = ...``, which moves no version counter) is another float model
    reassigned = copy.deepcopy(model)
    reassigned.model.norm.weight.data = reassigned.model.norm.weight.data * 1.01
    assert store.taken(FoundWeights.key(reassigned, data), [pair]) == {}
    # what is taken is a copy: a run writing into its weight leaves the store as it was
    taken = store.taken(FoundWeights.key(model, data), [pair])[pair]
    taken.packed.zero_()
    taken.scale.mul_(2)
    assert tensors_equal(store.taken(FoundWeights.key(model, data), [pair]), {pair: found})
    found.scale.mul_(3)  # and so is what was kept
    assert not tensors_equal(store.taken(FoundWeights.key(model, data), [pair]), {pair: found})
    rotated, third = copy.deepcopy(other), copy.deepcopy(model)
    with torch.no_grad():
        third.lm_head.weight.mul_(2)
    store.keep(FoundWeights.key(other, data), {pair: found})
    store.keep(FoundWeights.key(third, data), {pair: found})  # MODELS_KEPT keys: the first one asked is let go
    assert store.taken(FoundWeights.key(model, data), [pair]) == {}
    assert store.taken(FoundWeights.key(rotated, data), [pair]) != {}


def _statistics(model, fqn, batches):
    with torch.no_grad(), algorithms.recording(model, [fqn]) as statistics:
        for batch in batches:
            call_with(model, batch)
    return statistics[fqn]


def test_a_session_given_another_sessions_engine_with_other_calibration_data_computes_its_own_gptq_weights(shortcuts_as_taken):
    model, batches = tiny_llama()
    first = qw.analyze(model, batches[0], batches[:3], eval_data=batches[4:], engine="eager", format=INT4, progress=False)
    settings = {fqn: int4(32, "gptq") for fqn in linear_names(first.session)}
    assert first.session.apply(settings).ok
    shared = QuantizationSession(model, batches[0], batches[1:4], batches[4:], engine=first.session.engine)
    again = shared.apply(settings)
    alone = QuantizationSession(model, batches[0], batches[1:4], batches[4:], engine="eager").apply(settings)
    assert again.ok and not any("taken as found before" in note for note in again.notes)
    for batch in batches[4:]:
        assert torch.equal(
            output_tensor(call_with(again.quantized_model, batch)), output_tensor(call_with(alone.quantized_model, batch))
        )
    # the same data as the first session's: its weights are taken
    same = QuantizationSession(model, batches[0], batches[:3], batches[4:], engine=first.session.engine).apply(settings)
    assert any("taken as found before" in note for note in same.notes)


def test_a_report_with_algorithm_runs_saves_reloads_and_exports_them(tmp_path):
    model, batches = tiny_llama()
    report = qw.analyze(model, batches[0], batches, eval_data=batches[:2], engine="eager", format=INT4, progress=False)
    session = report.session
    settings = {**session.current_settings(), "model.layers.0.mlp.down_proj": int4(64, "gptq")}
    assert session.apply(settings, label="down_proj by GPTQ").ok
    saved = report.save(tmp_path / "decoder.qreport")
    loaded = qw.load_report(saved)
    assert list(loaded.features) == list(report.analysis().features)
    page = report.save_html(tmp_path / "decoder.html").read_text()
    assert "down_proj by GPTQ" in page and "algorithm=gptq" in page


def test_rows_worked_on_a_few_thousand_at_a_time_give_the_same_weights(monkeypatch):
    torch.manual_seed(0)
    weight = torch.randn(40, 64)
    statistics = algorithms.InputStatistics.empty(64)
    statistics.add(torch.randn(8, 16, 8) @ torch.randn(8, 64))
    scale = torch.rand(64) + 0.5
    whole = {
        "rtn": algorithms.round_to_nearest(weight, 32),
        "scaled": algorithms.round_to_nearest(weight, 32, scale),
        "gptq": algorithms.gptq_values(weight, statistics.gram, 32, 0.01),
    }
    monkeypatch.setattr(algorithms, "ROWS_AT_ONCE", 16)  # 40 rows: three runs of rows
    chunked = {
        "rtn": algorithms.round_to_nearest(weight, 32),
        "scaled": algorithms.round_to_nearest(weight, 32, scale),
        "gptq": algorithms.gptq_values(weight, statistics.gram, 32, 0.01),
    }
    for name, tensor in whole.items():
        assert torch.equal(tensor.qdata, chunked[name].qdata) and torch.equal(tensor.scale, chunked[name].scale), name
    torchaos = algorithms.round_to_nearest(weight * scale, 32)
    assert torch.equal(chunked["scaled"].qdata, torchaos.qdata)
    error = algorithms.output_error(weight, algorithms.QuantizedWeight(whole["gptq"]), statistics.gram)
    monkeypatch.setattr(algorithms, "ROWS_AT_ONCE", 4096)
    assert algorithms.output_error(weight, whole["gptq"].dequantize(), statistics.gram) == pytest.approx(error, rel=1e-5)


def test_the_size_panes_metric_button_names_perplexity(text_decoder):
    report = text_decoder_report(text_decoder)
    labels = [label for label, _ in report.widget().tuning.front.axis.options]
    assert labels == ["output SQNR", "perplexity"]


def test_reach_and_fit_by_block_keep_each_decoder_block_whole(text_decoder):
    session = text_decoder_report(text_decoder, algorithms=("rtn",)).session  # a front of formats and group sizes
    blocks = session.blocks()
    assert list(blocks)[:2] == ["model.embed_tokens", "model.layers.0"] and len(blocks["model.layers.3"]) == 7
    table = session.block_sensitivity(metric=False)
    start, _ = session.simulate(Variant())
    target = start + table["output_sqnr_gain_db"].iloc[0] + 1.0  # more than the most harmful block alone gives back

    def whole_blocks(settings) -> set[str]:
        kept = {fqn for fqn, s in settings.items() if s.keep_float}
        chosen = {block for block, members in blocks.items() if kept & set(members)}
        assert kept == {fqn for block in chosen for fqn in blocks[block]}, "a block kept float in part"
        return chosen

    plan = session.plan_reach(target, by_block=True)
    assert plan.met and whole_blocks(dict.fromkeys(plan.float_modules, ModuleSettings(keep_float=True)))
    assert set(plan.path.chosen) <= set(blocks)
    run = session.reach(target, by_block=True)
    assert run.ok and run.output_sqnr_db >= target and len(whole_blocks(run.settings)) >= 2
    assert "blocks float" in run.notes[-1]

    front = session.pareto(by_block=True)
    for settings in front["settings"]:
        for members in blocks.values():
            assert len({settings[fqn] for fqn in members if fqn in settings}) <= 1, "a block split between choices"
    budget = front["size_bytes"].iloc[len(front) // 2]
    fitted = session.fit(max_size_bytes=budget, by_block=True)
    assert fitted.ok and fitted.deployed_bytes <= budget
    assert "fits" in fitted.notes[-1]


@pytest.mark.parametrize("layout", [INT4, "int8-dynamic-int4-weight"])
def test_awqs_scales_folded_into_the_ops_before_compute_what_dividing_each_input_does(text_decoder, layout):
    """Every Linear of the trained decoder asked AWQ: its scales folded into the norms (q/k/v, gate/up,
    the head) and Linears (up -> down, v -> o) before, against each module dividing its own input by
    them; with 8da4w both quantize the divided input."""
    model, data = text_decoder
    names = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = {}
    for _ in algorithms.weights_in_runs(model, dict.fromkeys(names, ("awq", 32)), found):
        with torch.no_grad():
            for batch in data.calibration:
                call_with(model, batch)
    chosen = {fqn: found[fqn].expand(model.get_submodule(fqn).weight) for fqn in names}
    assert sum(q.input_scale is not None for q in chosen.values()) > len(names) // 2
    dynamic = names if layout != INT4 else []
    folded, divided = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        assert algorithms.assign_weights(folded, chosen, dynamic) == []  # every scale folded
        for fqn, quantized in chosen.items():
            quantized.assign(divided.get_submodule(fqn), fqn in dynamic)
    assert not any(hasattr(m, algorithms.INPUT_SCALE) for m in folded.modules())
    norm = "model.layers.0.input_layernorm"
    assert not torch.equal(folded.get_submodule(norm).weight, model.get_submodule(norm).weight)
    assert torch.equal(divided.get_submodule(norm).weight, model.get_submodule(norm).weight)
    for batch in data.evaluation[:2]:
        with torch.no_grad():
            expected, found_out = output_tensor(call_with(divided, batch)), output_tensor(call_with(folded, batch))
        # 8da4w: x / s from the norm and from a division differ in the last bit, and a token's int8 rounding flips
        assert sqnr_db(expected, found_out) > (60 if layout == INT4 else 50)


def test_awq_on_some_readers_of_an_input_divides_their_input_instead(text_decoder):
    model, data = text_decoder
    quantized = quantize.quantize_weights(
        copy.deepcopy(model), {"model.layers.0.self_attn.q_proj": ("awq", 32)}, data.calibration
    )
    q_proj = quantized.get_submodule("model.layers.0.self_attn.q_proj")
    assert hasattr(q_proj, algorithms.INPUT_SCALE)  # k_proj and v_proj read the norm's output unscaled
    norm = "model.layers.0.input_layernorm"
    assert torch.equal(quantized.get_submodule(norm).weight, model.get_submodule(norm).weight)
    problems = algorithms.unfolded_awq({"model.layers.0.self_attn.q_proj": ("awq", 32)}, input_folds(model))
    assert "k_proj, model.layers.0.self_attn.v_proj also read" in problems["model.layers.0.self_attn.q_proj"]


def test_fused_projections_fold_into_the_norm_they_read_and_take_awq_and_gptq():
    from hf_models import _tokens, tiny_family

    model = tiny_family("Phi-3")  # qkv_proj and gate_up_proj: one Linear reads each norm
    folds = input_folds(model)
    assert folds["model.layers.0.self_attn.qkv_proj"].into == "model.layers.0.input_layernorm"
    assert folds["model.layers.0.mlp.gate_up_proj"].into == "model.layers.0.post_attention_layernorm"
    assert folds["lm_head"].into == "model.norm"
    chosen = {"model.layers.0.self_attn.qkv_proj": ("awq", 32), "model.layers.1.mlp.gate_up_proj": ("gptq", 32)}
    quantized = qw.quantize_weights(copy.deepcopy(model), chosen, [(ids,) for ids in _tokens(5)])
    for fqn in chosen:
        assert int(quantized.get_submodule(fqn).weight.qdata.abs().max()) <= 8


@pytest.mark.parametrize("family", ["Gemma 3", "OLMo 2"])
def test_awq_takes_every_linear_of_gemma_and_olmo_2_and_folds_into_gemmas_1_plus_w_norms(family):
    """OLMo 2's bare stream gives q / k / v and gate / up no norm to fold an AWQ scale into, while
    up_proj still takes down_proj's: both inputs are searched, each its own. Gemma's `1 + w` norms
    take the scale as ``w -> (1 + w) / s - 1``."""
    from qreport_widgets.engines.folds import OFFSET_NORM, fold_scale

    model = tiny_family(family)
    folds = input_folds(model)
    down, up = "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"
    assert folds[down].into == up
    if family == "OLMo 2":
        assert up not in folds
        choices = {name: ("awq", 32) for name in (up, down)}
        assert set(algorithms.awq_shares(choices, folds)) == {up, down}  # two inputs: neither taken for the other
    else:  # the pre-feedforward norm takes gate / up's scale, divided through its 1 + w
        fold = folds[up]
        assert fold.kind == OFFSET_NORM and fold.into == "model.layers.0.pre_feedforward_layernorm"
        norm = model.get_submodule(fold.into)
        with torch.no_grad():
            norm.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
        scale = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5
        folded = copy.deepcopy(model)
        fold_scale(folded, fold, scale)
        with torch.no_grad():
            assert torch.allclose(folded.get_submodule(fold.into)(x), norm(x) / scale, rtol=1e-5, atol=1e-6)
        linears = {fqn: ("awq", 32) for fqn in folds if fqn.startswith("model.layers.0.") and "o_proj" not in fqn}
        assert algorithms.unfolded_awq(linears, folds) == {}  # every scale but o_proj's folds: XNNPACK takes them
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (2, 16), generator=generator),) for _ in range(3)]
    options = {"engine": "eager", "format": "int4-weight-only", "group_size": 32, "progress": False}
    session = qw.analyze(model, batches[0], batches, **options).session
    linears = [m.fqn for m in session.modules if m.type_name == "Linear"]
    run = session.apply({fqn: ModuleSettings(format="int4-weight-only", group_size=32, algorithm="awq") for fqn in linears})
    assert run.ok, run.error
