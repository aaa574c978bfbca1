"""analyze() end to end on the demo model."""

from __future__ import annotations

from conftest import assert_unchanged, fingerprint

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.core.features import DetectorName, SuggestionKind


def test_analyze_never_mutates_the_float_model():
    model = demo.build_demo_model().train()  # a model straight from training, in train mode
    before = fingerprint(model)
    batches = demo.demo_batches(3)
    qw.analyze(model, batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)
    assert all(m.training for m in model.modules())  # analysis runs in eval mode on its own copy
    assert_unchanged(model, before)
    assert not any("model_report" in n for n, _ in model.named_modules())


def test_every_detector_finds_its_problem_in_the_demo():
    batches = demo.demo_batches()
    report = qw.analyze(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)
    found = {(s.module_fqn, s.kind) for s in report.suggestions()}
    assert ("meta_fc", SuggestionKind.DYNAMIC) in found
    assert ("head", SuggestionKind.EQUALIZATION) in found
    assert ("mlp.fc1", SuggestionKind.EQUALIZATION) not in found  # 3-D input: torch cannot equalize it
    notes = report.results()[DetectorName.EQUALIZATION.value].notes
    assert any(n.startswith("mlp.fc1") and "3-D input" in n for n in notes)
    assert ("stem.conv", SuggestionKind.OUTLIERS) in found
    assert {("stem.conv", SuggestionKind.PER_CHANNEL), ("head", SuggestionKind.PER_CHANNEL)} <= found
    outliers = report.results()[DetectorName.OUTLIER.value].by_module()["stem.conv"]
    assert outliers.outliers.tolist() == [True, False, False]  # only the spiky image channel
    mapping = report.generate_qconfig_mapping()
    assert mapping.module_name_qconfigs["meta_fc"].activation.p.func.__name__ == "PlaceholderObserver"
    assert list(report.generate_equalization_mapping().module_name_qconfigs) == ["head"]


def test_calibration_data_forms():
    model = demo.build_demo_model()
    batches = demo.demo_batches(2)
    as_dicts = [{"image": i, "meta": m} for i, m in batches]
    report = qw.analyze(model, batches[0], as_dicts, progress=False)
    assert report.analysis().batches == 2

    def loop(instrumented):
        for batch in batches:
            instrumented(*batch)

    report = qw.analyze(model, batches[0], loop, progress=False)
    assert report.results()


def test_demo_main_prints_report_and_mapping(capsys):
    demo.main()
    out = capsys.readouterr().out
    assert "meta_fc" in out and "PlaceholderObserver" in out and "Equalization suggested for: head" in out
