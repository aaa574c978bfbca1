"""The detector notebook 04 writes, with its own observer, shows up in the report and the widget."""

from __future__ import annotations

from pathlib import Path

import nbformat
import numpy as np

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.observe.detectors import DetectorResult


def _notebook_code() -> dict:
    """The observer and detector exactly as notebooks/04_custom_detector.ipynb defines them."""
    notebook = nbformat.read(Path(__file__).resolve().parents[1] / "notebooks" / "04_custom_detector.ipynb", 4)
    namespace: dict = {}
    for cell in [c for c in notebook.cells if c.cell_type == "code"][:2]:
        exec(cell.source, namespace)
    return namespace


def test_custom_detector_features_reach_report_frame_and_widget():
    batches = demo.demo_batches(3)
    detector = _notebook_code()["SparsityDetector"]()
    report = qw.analyze(demo.build_demo_model(), batches[0], batches, detectors=[detector, qw.OutlierDetector()], progress=False)
    features = report.generate_model_report()["sparsity_detector"][1]
    # down.conv reads the ReLU output of stem.conv: about half of its values are exact zeros
    assert 0.2 < float(features["down.conv"]["input_activation_zero_fraction"].mean()) < 0.8
    assert float(features["stem.conv"]["input_activation_zero_fraction"].max()) == 0.0
    widget = report.widget()
    widget.controls.module.value = "down.conv"
    assert "input_activation_zero_fraction" in [v for _, v in widget.controls.feature.options]
    widget.controls.feature.value = "input_activation_zero_fraction"
    np.testing.assert_allclose(
        widget.views.line.drawn()[1], features["down.conv"]["input_activation_zero_fraction"].numpy(), rtol=1e-6
    )


def test_a_report_with_a_custom_detector_saves_and_loads(tmp_path):
    import pandas as pd

    batches = demo.demo_batches(3)
    detector = _notebook_code()["SparsityDetector"]()
    report = qw.analyze(demo.build_demo_model(), batches[0], batches, detectors=[detector], progress=False)
    loaded = qw.load_report(report.save(tmp_path / "sparsity.qreport"))
    pd.testing.assert_frame_equal(loaded.frame().channels, report.frame().channels, check_exact=True)
    pd.testing.assert_frame_equal(loaded.frame().modules, report.frame().modules, check_exact=True)
    assert list(loaded.detectors) == ["sparsity_detector"] and "sparsity_detector" in loaded.text_reports()


def test_a_detector_that_only_writes_torch_dictionaries_still_feeds_the_views(tmp_path):
    """Detectors written for PyTorch's API override upstream_dict(); their columns are read from it."""
    import dataclasses

    import pytest
    import torch

    code = _notebook_code()

    @dataclasses.dataclass(frozen=True)
    class PlainRecord:  # no columns() method
        module_fqn: str
        zero_fraction: np.ndarray

    class TorchStyle(code["SparsityDetector"]):
        name = "torch_style_detector"

        def analyze(self, context):
            records = super().analyze(context).records
            return DetectorResult(self.name, tuple(PlainRecord(r.module_fqn, r.zero_fraction) for r in records))

        def upstream_dict(self, record):
            return {"zero_fraction_torch": torch.from_numpy(record.zero_fraction), "flags": [True, False]}

    batches = demo.demo_batches(3)
    report = qw.analyze(demo.build_demo_model(), batches[0], batches, detectors=[TorchStyle()], progress=False)
    values = report.frame().channel_values("down.conv", "zero_fraction_torch")
    assert 0.2 < values.mean() < 0.8
    loaded = qw.load_report(report.save(tmp_path / "torch_style.qreport"))
    np.testing.assert_array_equal(loaded.frame().channel_values("down.conv", "zero_fraction_torch"), values)

    class Neither(TorchStyle):
        name = "neither_detector"
        upstream_dict = qw.DetectorBase.upstream_dict

    with pytest.raises(TypeError, match="PlainRecord has no columns"):
        qw.analyze(demo.build_demo_model(), batches[0], batches, detectors=[Neither()], progress=False)
