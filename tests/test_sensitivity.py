"""The simulator against real convert_fx runs, and session.sensitivity() against the real keep-one-float sweep.

Models: the two digits models (trained in the fixture, weights cached in pytest's tmp dir) and the
MobileNetV3 layout of tests/zoo.py, each from the x86 default mapping.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import zoo
from conftest import assert_unchanged, fingerprint

from qreport_widgets import ModuleSettings, QuantizationSession
from qreport_widgets.core.metrics import is_float_output
from qreport_widgets.demo.digits import trained_digits_model

MODELS = ("digits cnn", "digits mixer", "mobilenet_v3")
AGREEMENT_DB = 0.5  # simulated and real output SQNR agree within this (per module kept float)


def build(name: str, cache) -> tuple[torch.nn.Module, QuantizationSession]:
    if name.startswith("digits"):
        model, data = trained_digits_model(name.split()[1], cache)
        return model, QuantizationSession(
            model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy
        )
    torch.manual_seed(0)
    model = zoo.MobileNetV3().eval()
    batches = zoo.image_batches(6)
    return model, QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:])


@pytest.fixture(scope="module")
def measured(digits_cache):
    cache = digits_cache
    found = {}
    for name in MODELS:
        model, session = build(name, cache)
        before = fingerprint(model)
        quiet = lambda done, total: None  # noqa: E731
        sensitivity = session.sensitivity(progress=quiet)
        baseline = session.baseline(progress=quiet)
        real = {}
        for module in ranked(session):
            result = session.apply({module.fqn: ModuleSettings(keep_float=True)}, progress=quiet)
            assert result.ok, result.error
            real[module.fqn] = result.output_sqnr_db - baseline.output_sqnr_db
        found[name] = (model, before, session, sensitivity, baseline, pd.Series(real))
    return found


def ranked(session: QuantizationSession) -> list:
    """The modules sensitivity ranks: those with weights (the simulation runs no real kernel here)."""
    return [m for m in session.modules if m.weighted]


@pytest.mark.parametrize("name", MODELS)
def test_simulated_runs_agree_with_real_convert_fx_runs(measured, name):
    _, _, session, sensitivity, baseline, real = measured[name]
    simulated_baseline, _ = session.simulate(())
    assert abs(simulated_baseline - baseline.output_sqnr_db) <= 0.5
    simulated = sensitivity["simulated_output_sqnr_db"]
    real_sqnr = real + baseline.output_sqnr_db
    assert set(simulated.index) == set(real_sqnr.index)
    worst = (simulated - real_sqnr.reindex(simulated.index)).abs().max()
    assert worst <= AGREEMENT_DB, f"{name}: simulated and real output SQNR differ by up to {worst:.3f} dB"


@pytest.mark.parametrize("name", MODELS)
def test_sensitivity_ranks_modules_as_the_real_sweep_does(measured, name):
    _, _, _, sensitivity, _, real = measured[name]
    estimate = sensitivity["output_sqnr_gain_db"]
    truth = real.reindex(estimate.index)
    # modules whose real gains differ by more than the simulation's tolerance are ordered as the
    # real sweep orders them (quantized kernels round differently per CPU, so closer gains may swap)
    apart = [(a, b) for a in truth.index for b in truth.index if truth[a] - truth[b] > AGREEMENT_DB]
    swapped = [(a, b) for a, b in apart if estimate[a] <= estimate[b]]
    assert not swapped, f"{name}: ranked against the real sweep: {swapped}"
    assert len(set(estimate.nlargest(3).index) & set(truth.nlargest(3).index)) >= 2


def test_the_table_is_sorted_most_harmful_first_with_every_column(measured):
    model, before, session, sensitivity, _, _ = measured["digits cnn"]
    assert list(sensitivity.columns) == ["output_sqnr_gain_db", "metric_gain", "local_sqnr_db", "simulated_output_sqnr_db"]
    assert sensitivity.index.name == "module" and list(sensitivity.index) != []
    assert sensitivity["output_sqnr_gain_db"].is_monotonic_decreasing
    assert set(sensitivity.index) == {m.fqn for m in ranked(session)}  # names the Tune rows use
    assert sensitivity["local_sqnr_db"].map(math.isfinite).all()
    assert_unchanged(model, before)


def test_local_error_of_the_first_layer_is_its_accumulated_error(measured):
    """The first layer's input is the model input, so its own error and the accumulated one coincide;
    deeper layers' local error leaves out what earlier layers added."""
    _, _, session, sensitivity, baseline, _ = measured["digits cnn"]
    first = session.modules[0].fqn
    assert sensitivity.at[first, "local_sqnr_db"] == pytest.approx(baseline.per_layer_sqnr_db[first], abs=0.01)


def test_progress_counts_every_simulated_step_and_the_table_is_what_whole_passes_give():
    model, data = trained_digits_model("mixer")
    session = QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    calls = []
    starting = session.simulate(())
    table = session.sensitivity(progress=lambda done, total: calls.append((done, total)))
    assert session.simulate(()) == starting  # the simulation is left in the starting configuration
    modules, batches = len(ranked(session)), len(data.evaluation)
    steps = modules * batches  # each module float, on each batch (the kernel check simulated the start)
    assert calls[-steps:] == [(i, steps) for i in range(1, steps + 1)] and len(table) == modules
    calls.clear()
    again = session.sensitivity(progress=lambda done, total: calls.append((done, total)))
    assert calls == [] and again.equals(table)  # nothing simulated twice while the simulation is unchanged
    assert "metric_gain" not in table.columns  # no eval_fn
    for name in table.index:  # replayed from one run per batch: the same numbers as whole passes
        assert table.at[name, "simulated_output_sqnr_db"] == pytest.approx(session.simulate([name])[0], abs=1e-9)


def greedy_real(session: QuantizationSession, real_gains: pd.Series, target_sqnr_db: float) -> tuple[int, float]:
    """The one-at-a-time walk in real runs: modules made float in the order of their real gain, a real run each."""
    order = list(real_gains.sort_values(ascending=False).index)
    quiet = lambda done, total: None  # noqa: E731
    for count in range(len(order) + 1):
        run = session.apply({name: ModuleSettings(keep_float=True) for name in order[:count]}, progress=quiet)
        if run.output_sqnr_db >= target_sqnr_db:
            return count, run.output_sqnr_db
    return len(order), run.output_sqnr_db


@pytest.mark.parametrize("target", [40.0, 45.0])
def test_reach_meets_a_target_with_fewer_float_modules_than_all(measured, target):
    _, _, session, _, baseline, real = measured["digits cnn"]
    assert baseline.output_sqnr_db < target
    result = session.reach(target, progress=lambda done, total: None)
    floats = [name for name, choice in result.settings.items() if choice.keep_float]
    assert result.ok and result.output_sqnr_db >= target
    assert 0 < len(floats) < len(session.modules) and "met with" in result.notes[-1]
    count, sqnr = greedy_real(session, real, target)
    # the in-context search keeps no more float than the real one-at-a-time order, and with as many
    # it ends no lower (at 45 dB: 3 against 3 or 4, by what the session simulated before)
    assert len(floats) <= count
    assert len(floats) < count or result.output_sqnr_db >= sqnr - 0.3


def test_the_tradeoff_curve_a_target_only_the_float_model_meets_and_an_unreachable_one(measured):
    _, _, session, sensitivity, _, _ = measured["digits cnn"]
    curve = session.tradeoff()
    assert list(curve.index) == list(range(len(ranked(session)) + 1))
    assert list(curve["added"][1:]) == list(sensitivity.index)  # most harmful first
    assert curve.at[0, "simulated_output_sqnr_db"] == pytest.approx(session.simulate(())[0])
    assert "simulated_metric" in curve.columns
    # every module float simulates the float model within round-off (137 dB), which meets 999 dB
    result = session.reach(999.0, progress=lambda done, total: None)
    assert result.ok and is_float_output(result.output_sqnr_db) and "met with 5 of 5" in result.notes[-1]
    result = session.reach(target_metric=1.01, progress=lambda done, total: None)  # accuracy above 1: no model
    said = " ".join(result.notes)
    assert result.ok and "out of reach" in said and "the most this engine reaches on this model is the float model" in said
    with pytest.raises(ValueError, match="needs target_sqnr_db"):
        session.reach()


def test_reach_by_metric_needs_an_eval_fn(measured):
    _, _, session, _, _, _ = measured["mobilenet_v3"]
    with pytest.raises(ValueError, match="needs the session's eval_fn"):
        session.reach(target_metric=0.9)


def test_the_tune_tab_ranks_modules_proposes_a_float_set_and_apply_confirms_it(digits_cache):
    import qreport_widgets as qw

    model, data = trained_digits_model("cnn", digits_cache)
    report = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy, progress=False
    )
    tuning = report.widget().tuning
    pane = tuning.sensitivity
    pane.compute.click()
    assert list(pane.bars.x)[0] == "fc2" and "Most harmful one at a time: <b>fc2</b>" in pane.status.value
    assert pane.bars.y.max() > 1 and pane.bars.scales["y"].max > pane.bars.y.max()  # bars drawn to scale
    assert pane.curve.x.size == len(ranked(report.session)) + 1 and pane.bars_figure in pane.children[-1].children
    pane.order.value = "most harmful first"
    assert [row.fqn for row in tuning.rows_box.children] == list(report.session.sensitivity().index)
    pane.order.value = "forward order"
    assert [row.fqn for row in tuning.rows_box.children] == list(tuning.rows)
    pane.target.value = 40.0
    pane.reach.click()
    assert [fqn for fqn, row in tuning.rows.items() if row.keep_float.value] == ["fc2"]
    assert "Apply to confirm" in pane.status.value and "set_module_name('fc2', None)" in tuning.code.value
    tuning.apply.click()
    assert report.session.history[-1].output_sqnr_db >= 40.0
    pane.target.value = 999.0  # only the float model meets it: every module float, within float round-off
    pane.reach.click()
    assert "5 module(s) float reach the float model's output in simulation" in pane.status.value
    assert all(row.keep_float.value for row in tuning.rows.values()) and not pane.compute.disabled


def test_a_failing_sensitivity_is_shown_in_the_pane(monkeypatch, digits_cache):
    import qreport_widgets as qw

    model, data = trained_digits_model("mixer", digits_cache)
    report = qw.analyze(model, data.calibration[0], data.calibration, progress=False)

    def broken(progress=None):
        raise RuntimeError("simulation failed")

    monkeypatch.setattr(report.session, "sensitivity", broken)
    pane = report.widget().tuning.sensitivity
    pane.compute.click()
    assert "RuntimeError: simulation failed" in pane.status.value
    assert not pane.compute.disabled and pane.progress.layout.visibility == "hidden"


def test_cancel_stops_a_running_sensitivity_and_a_later_one_completes(digits_cache):
    import qreport_widgets as qw

    model, data = trained_digits_model("mixer", digits_cache)
    report = qw.analyze(model, data.calibration[0], data.calibration, progress=False)
    pane = report.widget().tuning.sensitivity

    def clicked_during_the_run(_change):
        pane.cancel.click()  # as JupyterLab delivers it: on another thread, while the run goes on

    pane.controller.observe(clicked_during_the_run, "progress")
    pane.compute.click()
    assert "cancelled" in pane.status.value and pane.table is None and pane.cancel.layout.display == "none"
    pane.controller.unobserve(clicked_during_the_run, "progress")
    pane.compute.click()
    assert pane.table is not None and len(pane.table) == len(ranked(report.session))


def test_reach_tries_fewer_modules_only_where_the_simulation_is_within_its_error():
    from qreport_widgets.tune.diagnosis import SIMULATION_ERROR_DB
    from qreport_widgets.tune.search import SearchPath

    measured = {
        frozenset(): (18.0, None),
        frozenset("a"): (20.0 - SIMULATION_ERROR_DB / 2, None),  # 0.3 dB short: may still meet it for real
        frozenset("b"): (18.5, None),  # 1.5 dB short: will not
        frozenset("ab"): (20.3, None),
        frozenset("abc"): (20.1, None),
    }
    path = SearchPath(18.0, None, [], ("a", "b"), 20.3, None, True, measured)
    near = path.smaller(lambda sqnr, _metric: sqnr >= 20.0 - SIMULATION_ERROR_DB)
    assert near == [frozenset("a")]  # smaller than the chosen set only, within the error only


def test_a_vit_layout_whose_reshapes_reuse_their_input_qparams_is_simulated():
    """A transformer's reshapes and transposes read a float module's output with an observer that
    reuses its input's qparams: no other qparams to calibrate there, and keeping each module float
    is simulated as a real run measures it."""
    from qreport_widgets.demo.architectures import VitTiny

    torch.manual_seed(0)
    model = VitTiny(dim=64, depth=2, heads=2).eval()
    batches = [torch.randn(2, 3, 224, 224) for _ in range(3)]
    session = QuantizationSession(model, batches[0], batches)
    table = session.sensitivity(progress=lambda done, total: None, metric=False)
    assert len(table) >= 8 and table["simulated_output_sqnr_db"].notna().all()
    best = table.index[0]
    real = session.apply({best: ModuleSettings(keep_float=True)}, record=False, progress=lambda done, total: None)
    assert abs(real.output_sqnr_db - table.loc[best, "simulated_output_sqnr_db"]) <= 0.6
