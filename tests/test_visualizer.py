"""ReportFrame and ModelReportVisualizer: PyTorch's table layout, correct for unequal channel counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import prepared, run
from models import ConvNet, conv_batches
from torch import nn
from torch.ao.quantization.fx._model_report.model_report_visualizer import ModelReportVisualizer as UpstreamVisualizer

import qreport_widgets as qw
from qreport_widgets.core import features as F
from qreport_widgets.observe.visualizer import TABLE_CHANNEL_KEY as F_CHANNEL


class EqualWidth(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def report_for(model, batches):
    report = qw.ModelReport(prepared(model, batches[0]), qw.default_detectors())
    run(report.prepare_detailed_calibration(), batches)
    report.generate_model_report()
    return report


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6)
    return a == b


def test_tables_match_torch_on_equal_channel_counts():
    batches = [(torch.randn(5, 8),) for _ in range(3)]
    report = report_for(EqualWidth().eval(), batches)
    theirs = UpstreamVisualizer(report.features_by_module())
    mine = report.generate_visualizer()
    for feature_filter, module_filter in [("", ""), ("per_channel", ""), ("comp_stat", "fc2"), ("", "fc3")]:
        a = theirs.generate_filtered_tables(feature_filter, module_filter)
        b = mine.generate_filtered_tables(feature_filter, module_filter)
        for key in (mine.TABLE_TENSOR_KEY, mine.TABLE_CHANNEL_KEY):
            assert b[key][0] == a[key][0], (key, feature_filter, module_filter)
            assert len(b[key][1]) == len(a[key][1])
            for row_a, row_b in zip(a[key][1], b[key][1], strict=True):
                for x, y in zip(row_a, row_b, strict=True):
                    assert x == "Not Applicable" or same(x, y), (key, row_a[:3])
    assert mine.get_all_unique_module_fqns() == theirs.get_all_unique_module_fqns()
    assert mine.get_all_unique_feature_names(False) == theirs.get_all_unique_feature_names(False)


def test_unequal_channel_counts_get_one_row_per_real_channel():
    report = report_for(ConvNet().eval(), conv_batches())
    frame = report.frame()
    channels = frame.channels.groupby("module", sort=False).size()
    expected = {"conv1": 3, "pool": 8, "relu1": 8, "conv2": 8, "pool2": 8, "relu2": 8, "conv3": 8}
    assert channels.to_dict() == expected
    table = report.generate_visualizer().generate_filtered_tables(F.INPUT_PER_CHANNEL_MAX)[F_CHANNEL]
    assert len(table[1]) == sum(expected.values())
    with pytest.raises(IndexError):  # torch takes one channel count for every module
        UpstreamVisualizer(report.features_by_module()).generate_filtered_tables(F.INPUT_PER_CHANNEL_MAX)


def test_frame_values_and_feature_lists():
    batches = conv_batches()
    report = report_for(ConvNet().eval(), batches)
    frame = report.frame()
    stacked = torch.cat([b[0] for b in batches])
    np.testing.assert_allclose(frame.channel_values("conv1", F.INPUT_PER_CHANNEL_MAX), stacked.amax((0, 2, 3)).numpy(), rtol=1e-6)
    per_channel, per_tensor = frame.features_of("relu1")
    assert F.OUTLIER_RATIOS in per_channel and F.EQUALIZATION_COMP_METRICS not in per_channel
    assert F.INPUT_COMP_STAT not in per_tensor
    per_channel, per_tensor = frame.features_of("conv2")
    assert F.EQUALIZATION_COMP_METRICS in per_channel and F.INPUT_COMP_STAT in per_tensor
    assert frame.modules["module_type"].tolist()[:2] == ["Conv2d", "MaxPool2d"]
    assert set(frame.suggestions.columns) == {"module", "detector", "kind", "reason", "evidence"}
    assert "conv1" in frame.histograms
    tidy = report.to_dataframe()
    assert len(tidy) == len(frame.channels) and {"module_type", F.OUTLIER_RATIOS} <= set(tidy.columns)
    observers = report.get_observers_of_interest()
    assert observers["per_channel_detector"] == set() and observers["outlier_detector"]


def test_plot_and_histogram_return_bqplot_figures():
    import bqplot

    report = report_for(ConvNet().eval(), conv_batches())
    visualizer = report.generate_visualizer()
    one = visualizer.generate_plot_visualization(F.INPUT_PER_CHANNEL_MAX, "conv2")
    assert isinstance(one, bqplot.Figure)
    band, _, line, points, _ = one.marks  # band, thresholds, the line, points, flagged points
    assert isinstance(line, bqplot.Lines)  # joined, as PyTorch draws it
    expected = report.frame().channel_values("conv2", F.INPUT_PER_CHANNEL_MAX)
    np.testing.assert_allclose(line.y, expected, rtol=1e-6)
    np.testing.assert_array_equal(line.x, np.arange(expected.size))
    np.testing.assert_allclose(points.y, expected, rtol=1e-6)  # the points stay, to hover over
    many = visualizer.generate_plot_visualization(F.OUTLIER_RATIOS)
    grouped = report.frame().channels.groupby("module", sort=False)[F.OUTLIER_RATIOS]
    drawable = np.isfinite(grouped.mean()) & np.isfinite(grouped.max())  # an infinite ratio cannot be drawn
    band, _, line, points, flagged = many.marks
    np.testing.assert_allclose(line.y, grouped.mean()[drawable].to_numpy(), rtol=1e-6)  # the mean per module, joined
    assert points.y.size + flagged.y.size == drawable.sum() and band.y.shape == (2, drawable.sum())
    assert len(points.names) == points.y.size  # hover names the module
    tensor = visualizer.generate_plot_visualization(F.INPUT_GLOBAL_MAX)
    values = report.frame().modules[F.INPUT_GLOBAL_MAX].astype(float)
    np.testing.assert_allclose(tensor.marks[2].y, values.dropna().to_numpy(), rtol=1e-6)
    histogram = visualizer.generate_histogram_visualization(F.EQUALIZATION_COMP_METRICS, num_bins=7)
    assert histogram.marks[0].y.sum() == report.frame().channels[F.EQUALIZATION_COMP_METRICS].notna().sum()
    with pytest.raises(ValueError, match="matches"):
        visualizer.generate_plot_visualization("per_channel")


def test_generate_visualizer_before_report():
    report = qw.ModelReport(prepared(ConvNet(), conv_batches()[0]), [qw.OutlierDetector()])
    with pytest.raises(qw.ReportNotGeneratedError):
        report.generate_visualizer()
