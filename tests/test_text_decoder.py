"""The byte-level decoder trained on real text: it predicts the held-out text far better than byte
frequencies do, its perplexity is what Hugging Face's own loss says, and quantization moves it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import text_decoder_report

import qreport_widgets as qw
from qreport_widgets.core.metrics import perplexity
from qreport_widgets.demo.text import HELD_OUT, TOKENS, decoder_weights_name, text_bytes, trained_text_decoder
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.tune import runner


def test_the_held_out_text_is_never_trained_on(text_decoder):
    _, data = text_decoder
    ids = text_bytes()
    boundary = int(len(ids) * (1 - HELD_OUT))
    held = ids[boundary:]
    windows = [w for batch in data.calibration + data.evaluation for w in batch[0]]
    assert all(w.shape == (TOKENS,) for w in windows)
    starts = {bytes(w[:16].tolist()) for w in windows}
    assert len(starts) == len(windows)  # no window twice
    text = bytes(held.tolist())
    assert all(bytes(w.tolist()) in text for w in windows)


@pytest.mark.slow
def test_training_again_gives_the_kept_weights(text_decoder, tmp_path):
    """The recipe trained from scratch (a minute) predicts the held-out text as the kept weights do:
    the same weights bit for bit on the machine that trained them, the same perplexity elsewhere."""
    kept, data = text_decoder
    trained, _ = trained_text_decoder(cache_dir=tmp_path)
    assert (tmp_path / decoder_weights_name()).exists()
    assert data.perplexity(trained) == pytest.approx(data.perplexity(kept), rel=0.02)


def test_perplexity_is_huggingfaces_own_loss_and_beats_byte_frequencies(text_decoder):
    model, data = text_decoder
    with torch.no_grad():
        losses = [float(model(input_ids=ids, labels=ids).loss) for (ids,) in data.evaluation]
    assert math.isclose(data.perplexity(model), math.exp(sum(losses) / len(losses)), rel_tol=1e-5)
    # what knowing only how often each byte occurs in the training text gives on the same bytes
    ids = text_bytes()
    counts = torch.bincount(ids[: int(len(ids) * (1 - HELD_OUT))], minlength=256).double() + 1
    log_p = (counts / counts.sum()).log()
    targets = torch.cat([ids_[:, 1:].reshape(-1) for (ids_,) in data.evaluation])
    unigram = math.exp(float(-log_p[targets].mean()))
    assert unigram > 15
    assert data.perplexity(model) < unigram / 3


def test_int4_weights_cost_perplexity_and_int8_almost_none(text_decoder):
    model, data = text_decoder
    session = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="eager", progress=False
    ).session
    linears = [m.fqn for m in session.modules if m.type_name == "Linear"]
    float_ppl = data.perplexity(model)
    runs = {}
    for name, fmt, group in (("int4 g128", "int4-weight-only", 128), ("int8", "int8-weight-only", None)):
        run = session.apply({fqn: ModuleSettings(format=fmt, group_size=group) for fqn in linears})
        assert run.ok, run.error
        runs[name] = (run, data.perplexity(run.quantized_model))
    int4, int8 = runs["int4 g128"], runs["int8"]
    assert int4[1] > float_ppl and int4[1] > int8[1]
    assert abs(int8[1] - float_ppl) < 0.01 * float_ppl
    assert int4[0].output_sqnr_db < int8[0].output_sqnr_db
    assert perplexity(int8[0].quantized_model, data.evaluation) == int8[1]  # the latest run's model is kept


def test_perplexity_is_the_metric_and_targets_on_it_are_met_at_or_below(text_decoder):
    """metric="perplexity": every run's metric is the perplexity on the evaluation text, the runs
    table names it with its direction, and fit / reach meet a perplexity target from below."""
    model, data = text_decoder
    session = text_decoder_report(text_decoder).session
    assert session.metric == qw.Metric("perplexity", higher_is_better=False)
    baseline = session.baseline()
    float_ppl = data.perplexity(model)
    assert baseline.eval_metric == pytest.approx(data.perplexity(baseline.quantized_model), rel=1e-6)
    assert baseline.eval_metric > float_ppl
    runs, _ = session.compare()
    # the float model is the runs table's reference row, its perplexity next to its name
    assert list(runs.columns[:2]) == ["run", "perplexity (lower is better)"]
    assert runs["run"].iloc[0] == "float model" and math.isinf(runs["output SQNR (dB)"].iloc[0])
    assert runs["perplexity (lower is better)"].iloc[0] == pytest.approx(float_ppl, rel=1e-6) == session.float_metric()
    assert runs["perplexity (lower is better)"].iloc[1] == baseline.eval_metric
    # halfway between float and the int4 start: some modules must be kept float or finer
    target = float_ppl + (baseline.eval_metric - float_ppl) / 2
    plan = session.plan_reach(target_metric=target)
    assert plan.target == f"perplexity <= {target:g}" and plan.met and plan.float_count >= 1
    # the same target, relative to the float model: at most this fraction worse
    loss = (target - session.float_metric()) / session.float_metric()
    relative = session.plan_reach(max_metric_loss=loss)
    assert relative.target_metric == pytest.approx(target, rel=1e-9) and relative.float_modules == plan.float_modules
    with pytest.raises(ValueError, match="give one metric target"):
        session.plan_reach(target_metric=target, max_metric_loss=loss)
    with pytest.raises(ValueError, match="a fraction of the float model's metric"):
        session.plan_reach(max_metric_loss=2.0)
    reached = session.reach(max_metric_loss=loss)
    assert reached.ok and reached.eval_metric <= relative.target_metric, reached.notes
    assert any(f"perplexity <= {relative.target_metric:g}: met" in note for note in reached.notes), reached.notes
    assert "the target is the float model's perplexity" in reached.notes[-1] and session.history[-1] is reached
    fitted = session.fit(target_metric=target)
    assert fitted.ok and fitted.eval_metric <= target, fitted.notes
    assert fitted.eval_metric == pytest.approx(data.perplexity(fitted.quantized_model), rel=1e-6)


def test_a_metric_that_cannot_be_is_refused_with_the_way_out(text_decoder):
    model, data = text_decoder
    batches = data.calibration
    with pytest.raises(ValueError, match="either eval_fn= or metric='perplexity'"):
        qw.analyze(model, batches[0], batches, engine="eager", metric="perplexity", eval_fn=data.perplexity, progress=False)
    with pytest.raises(ValueError, match="not one the tool computes"):
        qw.analyze(model, batches[0], batches, engine="eager", metric="accuracy", progress=False)
    with pytest.raises(ValueError, match="pass eval_fn= too"):
        qw.analyze(model, batches[0], batches, engine="eager", metric=qw.Metric("loss", False), progress=False)
    with pytest.raises(ValueError, match="causal language model's logits"):
        perplexity(torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Flatten()), batches)
    with pytest.raises(ValueError, match="batches of token ids"):
        perplexity(model, [(torch.randn(2, 8),)])


def test_a_metric_read_off_the_outputs_costs_a_real_run_no_call_of_the_model(text_decoder, monkeypatch):
    """Perplexity (a ``Metric`` read off the outputs) comes from the real run's evaluation pass: the run
    calls the model as often as the same run without a metric, and its value is what ``eval_fn`` gives."""
    model, data = text_decoder
    evaluation = data.evaluation[:3]
    monkeypatch.setattr(runner, "LATENCY_CALLS", (len(evaluation), len(evaluation)))  # no timing-dependent calls
    calls = []
    forward = type(model).forward

    def counted(self, *args, **kwargs):
        calls.append(self)
        return forward(self, *args, **kwargs)

    def a_run(**metric):
        options = {"engine": "eager", "format": "int4-weight-only", "progress": False, **metric}
        session = qw.analyze(model, data.calibration[0], data.calibration[:2], eval_data=evaluation, **options).session
        session.baseline(), session.float_metric()  # the float model's outputs and metric: computed once, first
        calls.clear()
        with monkeypatch.context() as patched:
            patched.setattr(type(model), "forward", counted)
            run = session.apply({"model.layers.0.mlp.down_proj": ModuleSettings(keep_float=True)})
        assert run.ok, run.error
        return len(calls), run

    plain, _ = a_run()
    with_metric, run = a_run(metric="perplexity")
    assert with_metric == plain > len(evaluation)
    assert run.eval_metric == pytest.approx(perplexity(run.quantized_model, evaluation), rel=1e-6)
