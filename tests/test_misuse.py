"""Misuse raises a specific exception whose message says what to do next."""

from __future__ import annotations

import math
import numbers

import numpy as np
import pytest
import torch
from conftest import assert_unchanged, fingerprint, prepared, run
from hypothesis import given, settings
from hypothesis import strategies as st
from models import ConvNet, Mlp, conv_batches, mlp_batches
from torch import nn

import qreport_widgets as qw


def make_report(detectors=None):
    model, batches = Mlp().eval(), mlp_batches()
    return qw.ModelReport(prepared(model, batches[0]), detectors or [qw.DynamicStaticDetector()]), batches


def test_generate_before_prepare():
    report, _ = make_report()
    with pytest.raises(qw.NotPreparedError, match="prepare_detailed_calibration"):
        report.generate_model_report(False)


def test_generate_before_calibration():
    report, _ = make_report()
    report.prepare_detailed_calibration()
    with pytest.raises(qw.NotCalibratedError, match="run your calibration data"):
        report.generate_model_report(False)


def test_prepare_twice():
    report, _ = make_report()
    report.prepare_detailed_calibration()
    with pytest.raises(qw.AlreadyPreparedError, match="generate_model_report"):
        report.prepare_detailed_calibration()


def test_second_report_on_an_instrumented_model():
    report, _ = make_report()
    model = report.prepare_detailed_calibration()
    with pytest.raises(qw.AlreadyPreparedError, match="another ModelReport"):
        qw.ModelReport(model, [qw.OutlierDetector()]).prepare_detailed_calibration()


def test_generate_after_removing_observers_keeps_the_last_report():
    report, batches = make_report()
    run(report.prepare_detailed_calibration(), batches)
    first = report.generate_model_report(remove_inserted_observers=True)
    assert not hasattr(report.model, "model_report_observers")
    assert "model_report_observers" not in report.model.code
    with pytest.raises(qw.ObserversRemovedError, match="still available"):
        report.generate_model_report(False)
    assert set(report.results()) == set(first)
    assert report.generate_qconfig_mapping().module_name_qconfigs


def test_duplicate_detector_types():
    with pytest.raises(qw.DetectorConfigError, match="once"):
        make_report([qw.OutlierDetector(), qw.OutlierDetector(ratio_threshold=5)])


def test_no_detectors_and_non_detectors():
    with pytest.raises(qw.DetectorConfigError, match="at least one"):
        qw.ModelReport(prepared(Mlp(), mlp_batches()[0]), [])
    with pytest.raises(qw.DetectorConfigError, match="DetectorBase"):
        qw.ModelReport(prepared(Mlp(), mlp_batches()[0]), ["outlier"])


def test_model_that_is_not_a_graph_module():
    with pytest.raises(TypeError, match="prepare_fx"):
        qw.ModelReport(Mlp(), [qw.OutlierDetector()])


def test_per_channel_detector_on_a_model_without_qconfigs():
    traced = torch.fx.symbolic_trace(ConvNet())
    report = qw.ModelReport(traced, [qw.PerChannelDetector("x86")])
    run(report.prepare_detailed_calibration(), conv_batches())
    with pytest.raises(qw.DetectorConfigError, match="prepare_fx"):
        report.generate_model_report(False)


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: qw.OutlierDetector(ratio_threshold=0.5), "ratio_threshold"),
        (lambda: qw.OutlierDetector(reference_percentile=1.5), "reference_percentile"),
        (lambda: qw.OutlierDetector(fraction_batches_used_threshold=-0.1), "fraction_batches_used_threshold"),
        (lambda: qw.OutlierDetector(ch_axis="last"), "ch_axis"),
        (lambda: qw.InputWeightEqualizationDetector(1.5), "ratio_threshold"),
        (lambda: qw.InputWeightEqualizationDetector(0.5, ch_axis=12), "ch_axis"),
        (lambda: qw.DynamicStaticDetector(tolerance=0), "tolerance"),
        (lambda: qw.PerChannelDetector("tpu"), "backend"),
        (lambda: qw.ModelReportObserver(comp_percentile=1.0), "percentiles"),
    ],
)
def test_detector_arguments_out_of_range(make, argument):
    with pytest.raises(ValueError, match=argument):
        make()


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return x


def test_untraceable_model_names_the_limitation_and_the_options():
    with pytest.raises(qw.UntraceableModelError) as caught:
        qw.analyze(Branchy(), (torch.randn(2, 4),), [(torch.randn(2, 4),)], progress=False)
    message = str(caught.value)
    assert "Branchy" in message and "concrete_args" in message and "non_traceable" in message
    assert "test_misuse.py" in message  # the offending line


class Gate(nn.Module):
    def forward(self, x):
        return x if x.amax() > 0 else -x  # data-dependent control flow inside a submodule


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.gate(self.fc(x)))


def test_untraceable_submodule_is_named_and_the_suggested_fix_works():
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

    batches = [(torch.randn(3, 4),) for _ in range(4)]
    with pytest.raises(qw.UntraceableModelError, match=r"in submodule gate \(Gate\.forward\)"):
        qw.analyze(Gated(), batches[0], batches, progress=False)
    config = PrepareCustomConfig().set_non_traceable_module_classes([Gate])
    report = qw.analyze(Gated(), batches[0], batches, prepare_custom_config=config, progress=False)
    assert {"fc", "out"} <= set(report.frame().module_names)
    result = report.session.baseline()  # later runs prepare with the same config
    assert result.ok, result.error


def test_calibration_errors_name_the_batch_and_leave_the_model_alone():
    model = Mlp().eval()
    before = fingerprint(model)
    good = mlp_batches()
    with pytest.raises(qw.CalibrationError, match="batch 2"):
        qw.analyze(model, good[0], [*good[:2], (torch.randn(3, 7),)], progress=False)
    with pytest.raises(qw.CalibrationError, match="calibrating with observers: batch 1 failed.*dtype"):
        qw.analyze(model, good[0], [good[0], (torch.ones(6, 12, dtype=torch.int64),)], progress=False)

    def failing():
        yield good[0]
        raise OSError("disk gone")

    with pytest.raises(qw.CalibrationError, match="batch 1.*disk gone"):
        qw.analyze(model, good[0], failing(), progress=False)
    with pytest.raises(qw.NotCalibratedError, match="no batch"):
        qw.analyze(model, good[0], [], progress=False)
    assert_unchanged(model, before)
    assert not hasattr(model, "model_report_observers") and not isinstance(model, torch.fx.GraphModule)


ARGUMENTS = {  # argument: (build, accepted interval as (low, high, low_open, high_open))
    "ratio_threshold": (lambda v: qw.OutlierDetector(ratio_threshold=v), (1.0, math.inf, False, True)),
    "reference_percentile": (lambda v: qw.OutlierDetector(reference_percentile=v), (0.0, 1.0, True, True)),
    "fraction_batches_used_threshold": (
        lambda v: qw.OutlierDetector(fraction_batches_used_threshold=v),
        (0.0, 1.0, False, False),
    ),
    "tolerance": (lambda v: qw.DynamicStaticDetector(tolerance=v), (0.0, 1.0, True, False)),
    "equalization ratio_threshold": (lambda v: qw.InputWeightEqualizationDetector(v), (0.0, 1.0, True, True)),
}


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(ARGUMENTS)),
    value=st.one_of(st.floats(), st.integers(-5, 5), st.booleans(), st.none(), st.text(max_size=3), st.just(np.float32(0.5))),
)
def test_any_detector_argument_is_accepted_in_range_or_refused_by_name(name, value):
    build, (low, high, low_open, high_open) = ARGUMENTS[name]
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    inside = number and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if inside:
        build(value)
    else:
        with pytest.raises(ValueError, match=name.split()[-1]):
            build(value)


def test_a_dataloader_of_images_and_labels_gets_a_hint_about_the_labels():
    images = torch.randn(16, 3, 32, 32)
    labels = torch.randint(0, 10, (16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=8)
    model = ConvNet().eval()
    with pytest.raises(qw.CalibrationError, match=r"looks like \(inputs, labels\).*images,\) for images, _labels in loader"):
        qw.analyze(model, (images[:8],), loader, progress=False)
    report = qw.analyze(model, (images[:8],), [(x,) for x, _labels in loader], progress=False)  # the fix works
    assert report.session is not None
