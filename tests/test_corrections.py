"""Each place where torch's _model_report goes wrong, shown failing there and working here."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from conftest import prepared, run
from models import ConvNet, TokenMlp, conv_batches
from torch import nn
from torch.ao.quantization.fx._model_report import detector as upstream_detector
from torch.ao.quantization.fx._model_report.model_report import ModelReport as UpstreamReport
from torch.ao.quantization.fx._model_report.model_report_observer import ModelReportObserver as UpstreamObserver
from torch.ao.quantization.quantize_fx import convert_fx

import qreport_widgets as qw
from qreport_widgets.core import features as F


def our_report(model, batches, detectors, mapping=None):
    report = qw.ModelReport(prepared(model, batches[0], mapping), detectors)
    run(report.prepare_detailed_calibration(), batches)
    return report


def token_batches(n=3, tokens=5, hidden=8):
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-1, 1, hidden)  # hidden channels differ in scale, tokens do not
    return [(torch.randn(4, tokens, hidden, generator=g) * scales,) for _ in range(n)]


def test_linear_on_3d_input_observes_hidden_channels():
    model, batches = TokenMlp(hidden=8, tokens=5).eval(), token_batches()
    report = our_report(model, batches, [qw.InputWeightEqualizationDetector(0.5), qw.OutlierDetector()])
    features = report.generate_model_report()
    equalization = features[F.DetectorName.EQUALIZATION.value][1]["fc1"]
    stacked = torch.cat([b[0] for b in batches]).reshape(-1, 8)
    np.testing.assert_allclose(equalization[F.INPUT_PER_CHANNEL_MAX].numpy(), stacked.amax(0).numpy(), rtol=1e-6)
    assert equalization[F.EQUALIZATION_CHANNEL_AXIS] == 2
    assert len(features[F.DetectorName.OUTLIER.value][1]["fc1"][F.OUTLIER_RATIOS]) == 8
    # GELU follows fc1, so it inherits the last axis too
    assert len(features[F.DetectorName.OUTLIER.value][1]["fc2"][F.OUTLIER_RATIOS]) == 16

    upstream = UpstreamReport(prepared(model, batches[0]), {upstream_detector.InputWeightEqualizationDetector(0.5)})
    run(upstream.prepare_detailed_calibration(), batches)
    with pytest.raises(AssertionError, match="divisible"):
        upstream.generate_model_report(False)  # 5 tokens taken as channels against 8 weight columns


def test_no_size_limit_where_torch_quantile_refuses():
    x = torch.randn(17, 3, 1024, 1024)
    with pytest.raises(RuntimeError, match="too large"):
        UpstreamObserver()(x)
    ours = qw.ModelReportObserver(1, 0.9)
    ours(x)
    assert ours.average_percentile_ratio.shape == (3,)
    assert torch.isfinite(ours.average_percentile_ratio).all()


def test_each_detector_keeps_its_own_percentile():
    model, batches = ConvNet().eval(), conv_batches()
    # torch: both detectors want an observer at the same name, so one silently replaces the other
    graph = prepared(model, batches[0])
    dynamic = upstream_detector.DynamicStaticDetector().determine_observer_insert_points(graph)
    outlier = upstream_detector.OutlierDetector().determine_observer_insert_points(graph)
    shared = set(dynamic) & set(outlier)
    assert shared and all(
        dynamic[k]["observer_to_insert"].comp_percentile != outlier[k]["observer_to_insert"].comp_percentile for k in shared
    )
    alone = our_report(model, batches, [qw.OutlierDetector()]).generate_model_report()
    for order in ([qw.DynamicStaticDetector(), qw.OutlierDetector()], [qw.OutlierDetector(), qw.DynamicStaticDetector()]):
        both = our_report(model, batches, order).generate_model_report()
        for module, features in alone[F.DetectorName.OUTLIER.value][1].items():
            mine = both[F.DetectorName.OUTLIER.value][1][module][F.OUTLIER_RATIOS]
            torch.testing.assert_close(mine, features[F.OUTLIER_RATIOS])


def test_report_generation_is_read_only_and_idempotent():
    model = ConvNet().eval()
    batches = [(torch.randn(4, 3, 12, 12) - 3.0,) for _ in range(4)]  # negative channels: ratios below 1
    detectors = lambda: [qw.DynamicStaticDetector(), qw.InputWeightEqualizationDetector(0.5), qw.OutlierDetector()]  # noqa: E731
    interleaved = our_report(model, batches[:2], detectors())
    state_before = {k: v.clone() for k, v in interleaved.model.state_dict().items()}
    first = interleaved.generate_model_report()
    second = interleaved.generate_model_report()
    for k, v in interleaved.model.state_dict().items():
        torch.testing.assert_close(v, state_before[k], equal_nan=True)
    for name in first:
        assert first[name][0] == second[name][0]
    run(interleaved.model, batches[2:])
    straight = our_report(model, batches, detectors())
    a, b = interleaved.generate_model_report(), straight.generate_model_report()
    for name in a:
        for module, features in a[name][1].items():
            for key, value in features.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(value, b[name][1][module][key], equal_nan=True)


class FusedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 2)
        self.fc_relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.fc_relu(self.fc(x))


def test_fused_modules_are_observed_as_prepare_fx_sees_them():
    model, batches = FusedNet().eval(), conv_batches(shape=(4, 3, 8, 8))
    report = our_report(model, batches, [qw.OutlierDetector(), qw.DynamicStaticDetector()])
    outlier = report.generate_model_report()[F.DetectorName.OUTLIER.value][1]
    assert set(outlier) == {"conv", "fc"}
    image_max = torch.cat([b[0] for b in batches]).amax((0, 2, 3))
    torch.testing.assert_close(outlier["conv"][F.INPUT_PER_CHANNEL_MAX], image_max)
    # torch observes conv.1 (the ReLU) and reports the conv's input as the ReLU's input
    upstream = UpstreamReport(prepared(model, batches[0]), {upstream_detector.OutlierDetector()})
    run(upstream.prepare_detailed_calibration(), batches)
    theirs = upstream.generate_model_report(False)["outlier_detector"][1]
    torch.testing.assert_close(theirs["conv.1"][F.INPUT_PER_CHANNEL_MAX], image_max)


def test_qconfig_mapping_names_fused_modules_so_they_get_quantized():
    model, batches = FusedNet().eval(), conv_batches(shape=(4, 3, 8, 8))
    mine = our_report(model, batches, [qw.PerChannelDetector("x86")]).generate_qconfig_mapping()
    upstream = UpstreamReport(prepared(model, batches[0]), {upstream_detector.PerChannelDetector("x86")})
    run(upstream.prepare_detailed_calibration(), batches)
    upstream.generate_model_report(False)
    theirs = upstream.generate_qconfig_mapping()
    assert "conv.0" in theirs.module_name_qconfigs and "conv" in mine.module_name_qconfigs

    def quantized_conv(mapping):
        p = prepared(model, batches[0], mapping)
        run(p, batches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted = convert_fx(p)
        return type(converted.conv).__module__.startswith("torch.ao.nn.intrinsic.quantized")

    assert quantized_conv(mine)
    assert not quantized_conv(theirs)


class AttentionNet(nn.Module):
    """MultiheadAttention (out_proj has no call_module node), an inlined norm and an unused head."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.unused_head = nn.Linear(8, 3)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        x = self.proj(x)
        a, _ = self.attn(x, x, x)
        a = nn.functional.layer_norm(a, (8,), self.norm.weight, self.norm.bias)
        return self.out(a)


def test_modules_fx_traces_through_are_skipped_with_a_note():
    model = AttentionNet().eval()
    batches = [(torch.randn(2, 5, 8),) for _ in range(3)]
    with pytest.raises((ValueError, TypeError)):
        upstream = UpstreamReport(prepared(model, batches[0]), {upstream_detector.DynamicStaticDetector()})
        run(upstream.prepare_detailed_calibration(), batches)
        upstream.generate_model_report(False)
    report = our_report(model, batches, qw.default_detectors())
    results = report.generate_model_report()
    assert "attn" in results[F.DetectorName.OUTLIER.value][1]
    assert {"norm", "attn.out_proj"} <= set(report.graph.skipped)
    assert "unused_head" not in report.graph.units
    assert "attn" in report.graph.skipped["attn.out_proj"]


def test_degenerate_data_is_flagged_not_fatal():
    class Degenerate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.embed = nn.Embedding(10, 4)

        def forward(self, x, idx):
            return self.fc(x) + self.embed(idx).sum(1)

    model = Degenerate().eval()
    x = torch.randn(3, 4)
    x[:, 1] = 0.0  # all-zero channel
    x[:, 2] = 2.0  # constant channel
    batches = [(x, torch.randint(0, 10, (3, 2))), (torch.full((3, 4), 7.0), torch.zeros(3, 2, dtype=torch.long))]
    batches.append((torch.tensor([[math.nan, 1.0, math.inf, 0.0]] * 3), torch.ones(3, 2, dtype=torch.long)))
    report = our_report(model, batches, qw.default_detectors())
    with pytest.warns(qw.QReportWarning, match="fc"):
        features = report.generate_model_report()
    outlier = features[F.DetectorName.OUTLIER.value][1]
    assert outlier["fc"][F.CONSTANT_BATCH_COUNTS].tolist()[1] >= 1
    assert "embed" in outlier


def test_constant_tensor_gives_nan_statistic_instead_of_an_exception():
    model = TokenMlp().eval()
    batches = [(torch.ones(2, 5, 8),) for _ in range(2)]
    report = our_report(model, batches, [qw.DynamicStaticDetector()])
    with pytest.warns(qw.QReportWarning, match="fc1"):
        features = report.generate_model_report()[F.DetectorName.DYNAMIC_STATIC.value][1]
    assert math.isnan(features["fc1"][F.INPUT_COMP_STAT].item())
    assert features["fc1"][F.INPUT_DATA_CLASSIFICATION] == F.UNDETERMINED
    with pytest.raises(ValueError, match="Range for Epoch is 0"):
        observer = UpstreamObserver()
        observer(torch.ones(2, 5, 8))
        observer.get_batch_to_epoch_ratio()


def test_layer_no_batch_reached_is_reported_with_a_warning():
    model, batches = ConvNet().eval(), conv_batches()
    report = our_report(model, batches, [qw.DynamicStaticDetector(), qw.OutlierDetector()])
    container = report.model.model_report_observers
    container.get_submodule(container.index[("conv3", "input", None)]).reset_batch_and_epoch_values()
    with pytest.warns(qw.QReportWarning, match="conv3: no calibration batch") as caught:
        report.generate_model_report()
    # attributed to the line that called the report, not to a line inside the package
    assert {w.filename for w in caught if issubclass(w.category, qw.QReportWarning)} == {__file__}
