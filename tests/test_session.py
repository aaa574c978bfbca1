"""QuantizationSession and the Tune tab: real prepare_fx -> calibrate -> convert_fx runs."""

from __future__ import annotations

import datetime
import html
import math

import numpy as np
import pytest
import torch
from conftest import assert_unchanged, fingerprint

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.core.progress import Stopped
from qreport_widgets.engines.fx.qconfig import mapping_as_code
from qreport_widgets.engines.settings import InvalidSettingsError, ModuleSettings, validate
from qreport_widgets.tune.session import QuantizationSession


@pytest.fixture(scope="module")
def analyzed():
    model = demo.build_demo_model()
    batches = demo.demo_batches(6)
    before = fingerprint(model)
    report = qw.analyze(model, batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)
    return model, before, report


def test_baseline_and_suggestions_are_measured(analyzed):
    _, _, report = analyzed
    session = report.session
    baseline = session.baseline()
    assert baseline.ok and baseline is session.baseline()  # cached
    suggested = session.run(report.suggested_qconfig_mapping(), report.suggested_equalization_mapping(), label="suggested")
    assert suggested.ok, suggested.error
    assert suggested.output_sqnr_db > baseline.output_sqnr_db + 3  # dynamic meta_fc and equalized head
    assert suggested.per_layer_sqnr_db["meta_fc"] > baseline.per_layer_sqnr_db["meta_fc"] + 10
    assert {"meta_fc", "head", "stem.conv"} <= set(suggested.per_layer_sqnr_db.index)
    assert baseline.size_bytes > 0 and baseline.latency_ms > 0 and "held out" in baseline.eval_batches
    runs, layers = session.compare()
    assert list(runs["run"])[:2] == ["baseline", "suggested"] and "suggested" in layers.columns
    conversions = suggested.conversions.set_index("module")
    assert conversions.loc["meta_fc", "converted type"] == "dynamic quantized Linear" and conversions.loc["meta_fc", "quantized"]
    # equalizing head keeps the LayerNorm before it in float: torch puts the float scale there
    assert not conversions.loc["neck", "quantized"] and suggested.quantized_layers == baseline.quantized_layers - 1


def test_suggested_mapping_keeps_the_starting_mapping(analyzed):
    _, _, report = analyzed
    mapping = report.suggested_qconfig_mapping()
    assert mapping.global_qconfig is not None  # the starting mapping's global entry stays
    upstream_style = report.generate_qconfig_mapping()
    assert upstream_style.global_qconfig is None
    result = report.session.run(mapping, label="no equalization")
    baseline = report.session.baseline()
    assert result.quantized_layers == baseline.quantized_layers


def test_invalid_settings_are_refused(analyzed):
    _, _, report = analyzed
    modules = {m.fqn: m for m in report.session.modules}
    with pytest.raises(InvalidSettingsError, match="dynamic quantization needs a Linear"):
        validate(modules["stem.conv"], ModuleSettings(dynamic=True))
    with pytest.raises(InvalidSettingsError, match="static"):
        validate(modules["head"], ModuleSettings(dynamic=True, equalize=True))


def test_failed_run_keeps_history(analyzed):
    _, _, report = analyzed
    session = report.session
    before = list(session.history)
    session.calibration_data.append((torch.randn(2, 5), torch.randn(2, 3)))  # a batch of the wrong shape
    try:
        result = session.run(report.suggested_qconfig_mapping(), label="broken")
    finally:
        session.calibration_data.pop()
    assert not result.ok and "batch 5 failed" in result.error and session.history == before


def test_progress_takes_what_analyze_takes_true_false_or_a_callback(capsys):
    """``progress=False`` shows nothing, as ``analyze(progress=False)`` does; True a bar; a callback its counts."""
    batches = demo.demo_batches(4)
    report = qw.analyze(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)
    session = report.session
    verified = report.verified_suggestions(progress=False)
    assert verified is report.verified_suggestions(progress=True)  # computed once per session
    assert "verifying" not in capsys.readouterr().err
    counts = []
    assert session.apply({}, label="counted", progress=lambda done, total: counts.append((done, total))).ok
    assert counts[-1] == (len(session.calibration_data), len(session.calibration_data))  # a step a calibration batch
    assert session.apply({}, label="quiet", progress=False).ok
    assert "calibrating" not in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"progress= takes True, False or a callback \(done, total\), got str"):
        session.pareto(progress="yes")

    def stop(done, total):  # a widget's Cancel: the run stops, and is not recorded as a failed run
        raise Stopped

    before = list(session.history)
    with pytest.raises(Stopped):
        session.apply({}, label="stopped", progress=stop)
    assert session.history == before


def test_mapping_as_code_runs(analyzed):
    _, _, report = analyzed
    namespace: dict = {}
    exec(mapping_as_code(report.suggested_qconfig_mapping(), report.suggested_equalization_mapping()), namespace)
    built = namespace["qconfig_mapping"]
    assert set(built.module_name_qconfigs) == {m.fqn for m in report.tunable_modules() if m.weighted}  # ops: when changed
    assert list(namespace["equalization_mapping"].module_name_qconfigs) == ["head"]


def test_tuning_panel_apply_accept_reset_and_errors(analyzed):
    model, before, report = analyzed
    widget = report.widget()
    tuning = widget.tuning
    tuning.accept.click()  # each suggestion measured first: equalizing head gains under 0.1 dB
    assert tuning.rows["meta_fc"].settings.dynamic and not tuning.rows["head"].settings.equalize
    assert "input-weight equalization: +0.0" in tuning.rows["head"].why.value and "Accept all (measured)" in tuning.status.value
    assert tuning.rows["stem.conv"].activation.disabled  # dynamic is Linear-only
    tuning.apply.click()
    assert "output SQNR" in tuning.status.value and not tuning.error.value
    runs = len(report.session.history)
    assert "baseline" in tuning.history.value and tuning.layers.bars.y.shape[0] == runs
    y_scale = tuning.layers.bars.scales["y"]  # both ends set, or the browser draws grouped bars flat
    assert y_scale.min <= 0 and y_scale.max > np.nanmax(tuning.layers.bars.y) > 0
    assert not tuning.apply.disabled
    tuning.rows["head"].equalize.value = True
    tuning.rows["head"].activation.value = "dynamic"  # with equalize: refused before running
    tuning.apply.click()
    assert "static" in tuning.error.value and len(report.session.history) == runs
    tuning.reset.click()
    assert not tuning.rows["meta_fc"].settings.dynamic and not tuning.rows["head"].settings.equalize
    tuning.controller._lock.acquire()  # a click handled while a run is in progress (another kernel thread)
    tuning.apply.click()
    assert "1 click made while the run was in progress ignored" in tuning.status.value
    assert len(report.session.history) == runs
    tuning.controller._lock.release()
    tuning.apply.click()
    assert len(report.session.history) == runs + 1
    # the delta view: each run minus the baseline, per layer, and back
    _, layers = report.session.compare()
    tuning.layers.view.value = "change vs baseline"
    expected = layers.iloc[:, 1:].iloc[:, -3:].sub(layers.iloc[:, 0], axis=0)  # at most the last three runs
    np.testing.assert_allclose(tuning.layers.bars.y, expected.T.to_numpy(dtype=np.float32), rtol=1e-5, atol=1e-5)
    assert tuning.layers.bars.labels == [f"{c} - baseline" for c in expected.columns] and "change" in tuning.layers.figure.title
    assert tuning.layers.bars.scales["y"].min <= min(0.0, float(np.nanmin(tuning.layers.bars.y)))
    tuning.layers.view.value = "SQNR per run"
    assert tuning.layers.bars.y.shape[0] == min(4, layers.shape[1]) and tuning.layers.bars.labels[0] == "baseline"
    # each run named with its colour in HTML above the figure (it wraps), not in a box inside the plot
    assert not tuning.layers.bars.display_legend
    for label, color in zip(tuning.layers.bars.labels, tuning.layers.bars.colors, strict=True):
        assert f"background:{color}'></span>{html.escape(label)}</span>" in tuning.layers.legend.value
    # the caller's float model is bit-identical after analyze, the widget and three Applies
    assert_unchanged(model, before)


def test_report_without_session_disables_tuning():
    from conftest import prepared, run
    from models import ConvNet, conv_batches

    report = qw.ModelReport(prepared(ConvNet(), conv_batches()[0]), [qw.OutlierDetector()])
    run(report.prepare_detailed_calibration(), conv_batches())
    tuning = report.widget().tuning
    assert report.session is None and tuning.apply.disabled and "analyze(" in tuning.status.value
    assert not tuning.rows


def test_session_with_own_eval_data_and_metric():
    batches = demo.demo_batches(3)
    session = QuantizationSession(
        demo.build_demo_model(),
        batches[0],
        batches,
        eval_data=batches[:1],
        eval_fn=lambda m: 0.5,
        qconfig_mapping=demo.demo_qconfig_mapping(),
    )
    result = session.baseline()
    assert result.ok and result.eval_metric == 0.5 and result.eval_batches == "the eval_data you passed"
    assert "your metric" in session.compare()[0].columns
    assert math.isfinite(result.mean_batch_sqnr_db)


def test_clicks_made_during_a_run_are_dropped(analyzed, monkeypatch):
    from qreport_widgets.widgets import tuning as tuning_module

    _, _, report = analyzed
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    sent = iter([start, start + datetime.timedelta(milliseconds=10), start + datetime.timedelta(minutes=5)])
    monkeypatch.setattr(tuning_module, "_click_sent_at", lambda: next(sent))
    tuning = report.widget().tuning
    tuning.apply.click()
    runs = len(report.session.history)
    tuning.apply.click()  # clicked 10 ms after the first, while it ran: handled only after it, dropped
    assert len(report.session.history) == runs
    assert "output SQNR" in tuning.status.value and "1 click made while the run was in progress ignored" in tuning.status.value
    tuning.apply.click()  # clicked after the run had finished
    assert len(report.session.history) == runs + 1 and "output SQNR" in tuning.status.value


def test_failing_apply_keeps_the_previous_results_on_screen(analyzed):
    _, _, report = analyzed
    tuning = report.widget().tuning
    tuning.apply.click()
    history, bars, summary = tuning.history.value, tuning.layers.bars.y.copy(), tuning.summary.value
    runs = list(report.session.history)
    broken = len(report.session.calibration_data)
    report.session.calibration_data.append((torch.randn(2, 3), torch.randn(2, 3)))  # wrong shape
    try:
        tuning.apply.click()
    finally:
        report.session.calibration_data.pop()
    assert f"batch {broken} failed" in tuning.error.value and "previous results are kept" in tuning.status.value
    assert report.session.history == runs and tuning.history.value == history and tuning.summary.value == summary
    np.testing.assert_array_equal(tuning.layers.bars.y, bars)
    assert not tuning.apply.disabled and tuning.progress.layout.visibility == "hidden"


def test_run_survives_numeric_suite_failing_to_pair_the_graphs(analyzed, monkeypatch):
    from torch.ao.ns.fx.graph_matcher import GraphMatchingException

    from qreport_widgets.engines.fx import engine as fx

    def unmatched(*args, **kwargs):
        raise GraphMatchingException("subgraphs of different types")

    _, _, report = analyzed
    monkeypatch.setattr(fx, "per_layer_sqnr", unmatched)
    result = report.session.run(report.suggested_qconfig_mapping(), label="no per-layer")
    assert result.ok and math.isfinite(result.output_sqnr_db) and result.per_layer_sqnr_db.empty
    assert result.notes == ("per-layer SQNR unavailable: Numeric Suite could not match the two graphs (GraphMatchingException)",)


def test_a_generator_of_batches_is_kept_for_tuning():
    batches = demo.demo_batches(4)
    report = qw.analyze(
        demo.build_demo_model(), batches[0], (b for b in batches), qconfig_mapping=demo.demo_qconfig_mapping(), progress=False
    )
    assert report.calibration_batches() == 4
    tuning = report.widget().tuning
    tuning.apply.click()
    assert not tuning.error.value and [r.label for r in report.session.history] == ["baseline", "apply 1"]


def test_a_session_that_cannot_be_built_leaves_the_analysis_usable():
    batches = demo.demo_batches(3)

    def feed(model):  # a calibration callable, but no eval_data to measure quantized models on
        for batch in batches:
            model(*batch)

    report = qw.analyze(demo.build_demo_model(), batches[0], feed, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)
    widget = report.widget()
    widget.controls.module.value = "head"
    assert "unavailable" in widget.tuning.status.value and "pass eval_data" in widget.tuning.error.value
    assert widget.tuning.apply.disabled


def test_apply_checks_settings_before_anything_runs(analyzed):
    _, _, report = analyzed
    session = report.session
    runs = len(session.history)
    with pytest.raises(InvalidSettingsError, match="stem.conv: dynamic quantization needs a Linear layer, not ConvReLU2d"):
        session.apply({"stem.conv": ModuleSettings(dynamic=True)})
    with pytest.raises(InvalidSettingsError, match="no tunable module named 'stem'"):
        session.apply({"stem": ModuleSettings()})
    with pytest.raises(InvalidSettingsError, match="head: expected ModuleSettings, got dict"):
        session.apply({"head": {"dynamic": True}})
    assert len(session.history) == runs


def test_apply_is_the_run_of_the_mapping_the_settings_translate_to(analyzed):
    _, _, report = analyzed
    session = report.session
    settings = report.suggested_settings()
    assert settings == session.suggested_settings(report.suggestions())
    applied = session.apply(settings, label="apply")
    by_hand = session.run(
        report.suggested_qconfig_mapping(settings), report.suggested_equalization_mapping(settings), label="by hand"
    )
    assert applied.ok and by_hand.ok
    assert applied.output_sqnr_db == by_hand.output_sqnr_db and applied.quantized_layers == by_hand.quantized_layers
    assert applied.settings == settings and by_hand.settings is None
    assert list(applied.equalization_mapping.module_name_qconfigs) == ["head"]
    # modules left out keep what the starting mapping gives them
    only_head = session.apply({"head": ModuleSettings(per_channel=True)}, label="head per-channel")
    assert only_head.ok and only_head.quantized_layers == session.baseline().quantized_layers
    code = session.settings_as_code(settings)
    assert "set_module_name('meta_fc'" in code and "equalization_mapping" in code


def test_a_session_built_by_hand_finds_its_tunable_modules():
    batches = demo.demo_batches(3)
    session = QuantizationSession(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping())
    names = [m.fqn for m in session.modules]
    assert names[:2] == ["stem.conv", "down.conv"] and "head" in names
    assert session.current_settings()["head"] == ModuleSettings()  # the demo mapping: per-tensor, static
    assert not session.modules[0].allows("dynamic") and session.modules[-1].allows("dynamic")
    result = session.apply({"head": ModuleSettings(keep_float=True)}, label="head float", progress=lambda done, total: None)
    assert result.ok and result.conversions.set_index("module").loc["head", "quantized"] == False  # noqa: E712


def test_the_widget_gets_an_analysis_and_a_session_through_their_protocols(analyzed, tmp_path):
    from qreport_widgets.widgets.protocols import ReportSource, TuningSession

    _, _, report = analyzed
    analysis = report.analysis()
    assert isinstance(analysis, ReportSource) and isinstance(report.session, TuningSession)
    assert isinstance(qw.load_report(report.save(tmp_path / "demo.qreport")), (ReportSource, qw.Analysis))
    widget = report.widget()
    assert widget.source is analysis and widget.tuning.session is report.session
    assert analysis is report.analysis()  # one value per generated report


def test_runs_state_their_change_honest_types_and_no_torch_warnings(analyzed, recwarn):
    import warnings as _warnings

    _, _, report = analyzed
    session = report.session
    tuning = report.widget().tuning
    with _warnings.catch_warnings(record=True) as seen:
        _warnings.simplefilter("always")
        tuning.rows["meta_fc"].keep_float.value = False
        tuning.rows["stem.conv"].weight.value = "per-tensor"
        tuning.apply.click()
    assert not [w for w in seen if "torch" in w.filename], [str(w.message) for w in seen][:3]
    assert "vs the baseline" in tuning.status.value and "best so far" in tuning.status.value
    result = session.history[-1]
    delta = result.output_sqnr_db - session.baseline().output_sqnr_db
    if delta < -0.05:
        assert "worse than the baseline" in tuning.status.value and "#b00" in tuning.status.value
    runs, _ = session.compare()
    assert runs.iloc[0]["changes"] == "the starting settings" and "latency spread (ms)" in runs.columns
    assert all(runs["latency (ms, 1 thread)"] > 0)
    conversions = session.baseline().conversions.set_index("module")
    assert conversions.loc["stem.conv", "converted type"].startswith("quantized ")  # not the float class's name
    from qreport_widgets.tune.run import RunResult  # a run's changes in words

    assert "stem.conv: per_channel" in RunResult(
        None, None, 0.0, None, 0, 0.0, 0.0, settings={"stem.conv": ModuleSettings(per_channel=True)}
    ).changes({"stem.conv": ModuleSettings()})


def test_tune_rows_at_scale_filter_bulk_and_refuse_on_the_row():
    from qreport_widgets.demo.architectures import mobilenet_v3_small

    model = mobilenet_v3_small(size=64)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 3, 64, 64, generator=generator),) for _ in range(3)]
    report = qw.analyze(model, batches[0], batches[:2], eval_data=batches[2:], progress=False)
    tuning = report.widget().tuning
    ops = sum(not m.weighted for m in report.session.modules)  # Hardswish, ReLU, pooling ...: shown when asked for
    assert ops > 20 and len(tuning.rows) == 54 + ops and len(tuning.rows_box.children) == 54
    assert f"54 of {54 + ops} shown" in tuning.shown.value and f"+ {ops} other ops" == tuning.all_ops.description
    tuning.filter.value = "FC2"  # name or type, case ignored: the squeeze-excitation expand convs
    shown = list(tuning.rows_box.children)
    assert shown and all("fc2" in row.fqn for row in shown) and f"{len(shown)} of {54 + ops} shown" in tuning.shown.value
    tuning.bulk["keep float"].click()
    tuning.filter.value = ""
    assert {row.fqn for row in tuning.rows.values() if row.keep_float.value} == {row.fqn for row in shown}
    tuning.filter.value = "Linear"
    assert [row.fqn for row in tuning.rows_box.children] == ["classifier.0", "classifier.2"]
    tuning.bulk["reset"].click()
    tuning.filter.value = ""
    assert sum(row.keep_float.value for row in tuning.rows.values()) == len(shown)
    tuning.only_suggested.value = True
    assert all(row.suggested for row in tuning.rows_box.children)
    tuning.only_suggested.value = False
    row = tuning.rows["classifier.0"]  # an invalid combination is refused on its row, before Apply
    row.equalize.value, row.activation.value = True, "dynamic"
    assert "color:#b00" in row.why.value and "static activation" in row.why.value
    row.activation.value = "static"
    assert "color:#b00" not in row.why.value


def test_a_second_widget_of_the_session_labels_its_applies_after_the_runs_there_and_restores_its_own(analyzed):
    _, _, report = analyzed
    first = report.widget().tuning
    first.apply.click()
    second = report.widget().tuning  # the cell run again: a new widget over the same session
    second.reset.click()
    second.rows["meta_fc"].activation.value = "dynamic"
    second.apply.click()
    labels = [run.label for run in report.session.history]
    assert len(labels) == len(set(labels)), labels
    second.reset.click()
    second.restore_from.value = labels[-1]
    second.restore.click()
    assert second.rows["meta_fc"].settings.dynamic


def test_a_run_can_be_restored_into_the_rows(analyzed):
    _, _, report = analyzed
    tuning = report.widget().tuning
    tuning.reset.click()
    tuning.rows["meta_fc"].activation.value = "dynamic"
    tuning.apply.click()
    label = report.session.history[-1].label
    assert label.startswith("apply ") and label in tuning.restore_from.options and not tuning.restore.disabled
    tuning.reset.click()
    assert not tuning.rows["meta_fc"].settings.dynamic
    tuning.restore_from.value = label
    tuning.restore.click()
    assert tuning.rows["meta_fc"].settings.dynamic and label in tuning.status.value
    tuning.restore_from.value = "baseline"
    tuning.restore.click()
    assert not tuning.rows["meta_fc"].settings.dynamic


def test_runs_given_one_label_are_each_named_once_in_the_history_and_the_per_layer_table(analyzed):
    _, _, report = analyzed
    session = report.session
    settings = {"meta_fc": ModuleSettings(dynamic=True)}
    first, second = (session.apply(settings, label="same label") for _ in range(2))
    assert (first.label, second.label) == ("same label", "same label (2)")
    _, layers = session.compare()
    assert {"same label", "same label (2)"} <= set(layers.columns) and layers.columns.is_unique
