"""Data torch's own observers cannot take still gives a report; quantizing it gives a clear error."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import assert_unchanged, fingerprint
from models import Mixed

import qreport_widgets as qw
from qreport_widgets.core import features as F
from qreport_widgets.widgets.views import ALL_MODULES


def warned(messages: list[str], module: str, text: str) -> bool:
    """Whether a warning names ``module`` (alone or among others with the same problem) with ``text``."""
    return any(module in m.split(": ")[0].split(", ") and text in m for m in messages)


def analyze_recording(model, batches, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = qw.analyze(model, batches[0], batches, progress=False, **kwargs)
    return report, [str(w.message) for w in caught if issubclass(w.category, qw.QReportWarning)]


@pytest.fixture(scope="module")
def nan_report():
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(1, 3, 12, 12, generator=g),) for _ in range(6)]  # batch size 1 throughout
    batches[1][0][0, 0, 3, 3] = math.nan
    batches[2][0][0, 1, 2, 2] = math.inf
    batches[3][0][0, 1, 5, 5] = -math.inf
    for batch in batches:
        batch[0][0, 2] = 0.0  # an all-zero input channel
    model = Mixed().eval()
    before = fingerprint(model)
    report, messages = analyze_recording(model, batches)
    return model, before, report, messages


def test_nan_and_inf_batches_give_a_report_with_the_module_named(nan_report):
    _, _, report, messages = nan_report
    assert warned(messages, "conv", "input holds NaN or infinite values")
    assert warned(messages, "conv", "input range is zero or not finite")
    assert report.calibration_batches() == 6
    modules = report.frame().modules
    assert math.isnan(modules.at["conv", F.INPUT_COMP_STAT])
    assert modules.at["conv", F.INPUT_DATA_CLASSIFICATION] == F.UNDETERMINED
    outlier = report.results()[F.DetectorName.OUTLIER.value].by_module()["conv"]
    assert np.isnan(outlier.max_vals[0]) and np.isposinf(outlier.max_vals[1])
    assert outlier.constant_counts[2] == 6  # the zero channel was constant in every batch


def test_the_widget_draws_only_finite_values(nan_report):
    _, _, report, _ = nan_report
    widget = report.widget()
    controls = widget.controls
    for module in ("conv", "pool", "fc", ALL_MODULES):
        controls.module.value = module
        for _, feature in controls.feature.options:
            controls.feature.value = feature
            controls.view.value = "Line"
            assert np.isfinite(np.asarray(widget.views.line.drawn()[1], dtype=float)).all(), (module, feature)
            controls.view.value = "Histogram"
            for bars in (widget.views.histogram.bars, widget.views.values.bars):
                assert np.isfinite(np.asarray(bars.x, dtype=float)).all() and np.isfinite(np.asarray(bars.y, dtype=float)).all()
            controls.view.value = "Table"
            assert "<table" in widget.views.table.value


def test_quantizing_such_data_fails_with_the_reason_in_the_widget(nan_report):
    model, before, report, _ = nan_report
    tuning = report.widget().tuning
    tuning.apply.click()
    assert "batch 1 failed" in tuning.error.value and "NaN or inf" in tuning.error.value
    assert report.session.history == [] and not tuning.apply.disabled
    assert_unchanged(model, before)


def test_empty_batches_are_skipped_and_all_empty_is_an_error():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(0, 3, 12, 12),)] + [(torch.randn(2, 3, 12, 12, generator=g),) for _ in range(3)]
    report, _ = analyze_recording(Mixed().eval(), batches)
    assert report.calibration_batches() == 3
    with pytest.raises(qw.NotCalibratedError, match="not empty"):
        qw.analyze(Mixed().eval(), batches[0], [batches[0]] * 3, progress=False)


def test_integer_inputs_reach_the_report():
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(20, 6)
            self.fc = torch.nn.Linear(6, 3)

        def forward(self, ids, scale):
            return self.fc(self.embed(ids) * scale)

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 20, (4, 5), generator=g), torch.rand(4, 5, 1, generator=g) + 0.5) for _ in range(4)]
    report, _ = analyze_recording(Tokens().eval(), batches)
    modules = report.frame().modules
    assert modules.at["embed", "channels"] >= 1 and modules.at["fc", "channels"] == 6
    outlier = report.results()[F.DetectorName.OUTLIER.value].by_module()["embed"]
    ids = torch.cat([b[0] for b in batches])
    assert outlier.max_vals.max() == ids.max().item()  # token ids observed as numbers, not as floats' bits
    assert report.session.baseline().ok


def test_batches_on_another_device_are_named():
    model = Mixed().eval()
    good = (torch.randn(2, 3, 12, 12),)
    with pytest.raises(qw.CalibrationError, match=r"Batch 1 is on meta but the model is on cpu"):
        qw.analyze(model, good, [good, (torch.empty(2, 3, 12, 12, device="meta"),)], progress=False)


def test_modules_sharing_a_problem_share_one_warning():
    from qreport_widgets.report.model_report import _warn_grouped

    pending = [(f"layer{i}", "output range is zero") for i in range(10)] + [("head", "input holds NaN")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_grouped(pending)
    assert [str(w.message) for w in caught] == [
        "layer0, layer1, layer2, layer3, layer4, layer5, layer6, layer7 and 2 more modules: output range is zero",
        "head: input holds NaN",
    ]
