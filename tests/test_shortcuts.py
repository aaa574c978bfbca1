"""Every shortcut gives the answer computed afresh (``core/shortcuts.py``, docs/RELIABILITY.md): user code
under ``torch.inference_mode`` or ``torch.no_grad`` reaches the memos that read a tensor's version, and
the check mode computes each shortcut's answer again and raises where they differ, naming it."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama

import qreport_widgets as qw
from qreport_widgets.core import shortcuts
from qreport_widgets.core.calibration import call_with
from qreport_widgets.core.kept import SameInput
from qreport_widgets.core.metrics import output_tensor, perplexity
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.settings import ModuleSettings

DYNAMIC_INT4 = "int8-dynamic-int4-weight"  # the simulation quantizes each Linear's input as the kernel does


def _settings(session) -> dict[str, ModuleSettings]:
    """Every Linear of the tiny decoder's blocks in 8da4w g32, by GPTQ, AWQ or the learned rounding in turn."""
    names = [m.fqn for m in session.modules if m.current.format == DYNAMIC_INT4 and m.algorithm_allowed("learned")]
    algorithms = ("gptq", "awq", "learned")
    chosen = {fqn: algorithms[i % 3] for i, fqn in enumerate(names)}
    # AWQ's scale folds into the op before a Linear: every reader of that input asks it alike (q / k / v, gate / up)
    for fqn in names:
        if fqn.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) and "awq" in [
            chosen[f] for f in names if f.rsplit(".", 1)[0] == fqn.rsplit(".", 1)[0]
        ]:
            chosen[fqn] = "gptq"
    return {fqn: ModuleSettings(format=DYNAMIC_INT4, group_size=32, algorithm=a) for fqn, a in chosen.items()}


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_a_calibration_and_a_metric_under_inference_mode_or_no_grad_give_what_plain_batches_give(mode):
    model, batches = tiny_llama()
    calibration, held = batches[:4], batches[4:]

    def calibrate(m):
        with mode():
            for batch in calibration:
                m(*batch)

    def eval_fn(m):
        with mode():
            return perplexity(m, held)

    def session_of(data, fn):
        given = {"eval_fn": fn, "metric": qw.Metric("perplexity", higher_is_better=False)} if fn is not None else {}
        report = qw.analyze(model, batches[0], data, eval_data=held, engine="eager", format=DYNAMIC_INT4, progress=False, **given)
        return report.session

    users, plain = session_of(calibrate, eval_fn), session_of(calibration, None)
    settings = _settings(plain)
    runs = [session.apply(settings) for session in (users, plain)]
    assert all(run.ok for run in runs), [run.error for run in runs]
    for batch in held:  # GPTQ, AWQ and the learned rounding read the same inputs either way
        outputs = [output_tensor(call_with(run.quantized_model, batch)) for run in runs]
        assert torch.equal(*outputs)
    assert runs[0].eval_metric == pytest.approx(perplexity(runs[1].quantized_model, held), rel=1e-6)
    # the simulation, its inputs quantized as the kernel does, its metric read by the user's function
    variant = Variant(settings=tuple((fqn, s) for fqn, s in settings.items() if s.algorithm != "learned"))
    (sqnr, value), (plain_sqnr, _) = (session.simulate_each([variant])[0] for session in (users, plain))
    assert sqnr == plain_sqnr and value is not None


def test_an_input_made_under_inference_mode_is_worked_out_for_each_reader(shortcuts_as_taken):
    memo, calls = SameInput(), []

    def work(x):
        calls.append(1)
        return x * 2

    with torch.inference_mode():
        x = torch.ones(3)
        assert torch.equal(memo.of(x, lambda: work(x)), torch.full((3,), 2.0))
        x.add_(1)  # an inference tensor's write moves no version
        assert torch.equal(memo.of(x, lambda: work(x)), torch.full((3,), 4.0))
    assert len(calls) == 2
    y = torch.ones(3)
    memo.of(y, lambda: work(y))
    memo.of(y, lambda: work(y))
    assert len(calls) == 3  # a plain tensor's answer is kept while it is unchanged


def test_the_check_mode_computes_a_kept_answer_again_and_names_the_shortcut_that_differs(monkeypatch):
    monkeypatch.setenv(shortcuts.ENVIRONMENT, "1")
    memo = SameInput()
    x = torch.ones(3)
    before = shortcuts.CHECKED[shortcuts.Shortcut.SHARED_INPUT]
    memo.of(x, lambda: x * 2)
    assert torch.equal(memo.of(x, lambda: x * 2), torch.full((3,), 2.0))  # the same answer afresh: no error
    assert shortcuts.CHECKED[shortcuts.Shortcut.SHARED_INPUT] == before + 1
    with pytest.raises(shortcuts.ShortcutMismatchError, match="shared input"):
        memo.of(x, lambda: x * 3)  # a memo keyed on less than its answer depends on
    monkeypatch.setenv(shortcuts.ENVIRONMENT, "0")
    assert torch.equal(memo.of(x, lambda: x * 3), torch.full((3,), 2.0))  # off: the kept answer, unchecked


def test_a_metric_that_reads_the_whole_model_is_simulated_once_a_variant_and_checked_again_in_the_check_mode(
    monkeypatch, shortcuts_as_taken
):
    model, batches = tiny_llama()
    calls = []

    def eval_fn(m):
        calls.append(1)
        return perplexity(m, batches[4:])

    metric = qw.Metric("perplexity", higher_is_better=False)
    session = qw.analyze(
        model, batches[0], batches[:4], eval_data=batches[4:], eval_fn=eval_fn, metric=metric, engine="eager", progress=False
    ).session
    variant = Variant(frozenset({session.modules[0].fqn}))
    first = session.simulate_each([variant])
    counted = len(calls)
    assert session.simulate_each([variant]) == first and len(calls) == counted  # known: not simulated again
    monkeypatch.setenv(shortcuts.ENVIRONMENT, "1")
    before = shortcuts.CHECKED[shortcuts.Shortcut.KNOWN_VARIANTS]
    assert session.simulate_each([variant]) == first and len(calls) == counted + 1  # simulated again, the same
    assert shortcuts.CHECKED[shortcuts.Shortcut.KNOWN_VARIANTS] == before + 1


def _made_in_inference_mode(batches):
    with torch.inference_mode():
        return [tuple(t.clone() for t in batch) for batch in batches]


@pytest.mark.parametrize("engine", ["eager", "pt2e", "fx"])
def test_data_and_a_metric_made_under_inference_mode_work_on_every_engine(engine, digits_cache, shortcuts_as_taken):
    """Batches a data pipeline made under ``torch.inference_mode`` (tensors without a version counter,
    which ``torch.export`` and autograd refuse) and an ``eval_fn`` that runs the model under it: the
    analysis, the baseline and (where the simulation's memos read versions) a sensitivity run on every
    engine, and give what ordinary tensors give."""
    from qreport_widgets.demo.digits import trained_digits_model

    if engine == "fx":  # a model torch.fx traces
        model, data = trained_digits_model("cnn", digits_cache)
        batches, given = data.calibration[:4] + data.evaluation[:2], {}
    else:
        model, batches = tiny_llama()
        given = {"format": DYNAMIC_INT4} if engine == "eager" else {}
    made = _made_in_inference_mode(batches)
    assert made[0][0].is_inference()

    def eval_fn(m):
        with torch.inference_mode():
            return float(sum(output_tensor(call_with(m, b)).float().abs().mean() for b in made[4:]))

    metric = qw.Metric("mean output", higher_is_better=True)
    sessions = [
        qw.analyze(
            model, data[0], data[:4], eval_data=data[4:], engine=engine, progress=False, eval_fn=fn, metric=m, **given
        ).session
        for data, fn, m in ((made, eval_fn, metric), (batches, None, None))
    ]
    runs = [session.baseline() for session in sessions]
    assert all(run.ok for run in runs), [run.error for run in runs]
    assert runs[0].output_sqnr_db == pytest.approx(runs[1].output_sqnr_db, abs=1e-6) and runs[0].eval_metric is not None
    if engine == "eager":  # the input quantization shared by q / k / v, block replay
        found, expected = (session.sensitivity(progress=False) for session in sessions)
        # (the first with a metric that reads the whole model, summed another way: to round-off)
        assert found["simulated_output_sqnr_db"].tolist() == pytest.approx(
            expected["simulated_output_sqnr_db"].tolist(), rel=1e-9
        )
