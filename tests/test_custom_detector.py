"""A detector written outside the package, with its own observer, shows up everywhere."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.detectors import DetectorResult, ObservationRequest
from qreport_widgets.features import Side, Stat


class ZeroFraction(nn.Module):
    """Counts exact zeros per channel; returns its input untouched."""

    def __init__(self, ch_axis: int) -> None:
        super().__init__()
        self.ch_axis = ch_axis
        self.register_buffer("zeros", torch.zeros(0))
        self.register_buffer("total", torch.zeros(()))
        self.num_batches_tracked = 0

    def forward(self, x):
        axis = self.ch_axis % x.dim()
        dims = [d for d in range(x.dim()) if d != axis]
        zeros = (x == 0).sum(dim=dims).float()
        self.zeros = zeros if self.zeros.numel() == 0 else self.zeros + zeros
        self.total += x.numel() / x.shape[axis]
        self.num_batches_tracked += 1
        return x


@dataclass(frozen=True)
class SparsityRecord:
    module_fqn: str
    zero_fraction: np.ndarray


class SparsityDetector(qw.DetectorBase):
    name = "sparsity_detector"

    def requests(self, graph):
        return [
            ObservationRequest(fqn, Side.INPUT, frozenset({Stat.RANGE}), observer_factory=ZeroFraction, tag="zeros")
            for fqn in graph.units
        ]

    def analyze(self, context):
        records = []
        for fqn in context.graph.units:
            observer = context.observer(fqn, Side.INPUT, "zeros")
            if observer is not None and observer.num_batches_tracked:
                records.append(SparsityRecord(fqn, (observer.zeros / observer.total).numpy()))
        return DetectorResult(self.name, tuple(records))

    def upstream_dict(self, record):
        return {"input_activation_zero_fraction": torch.from_numpy(record.zero_fraction)}


def test_custom_detector_features_reach_report_frame_and_widget():
    batches = demo.demo_batches(3)
    report = qw.analyze(
        demo.build_demo_model(), batches[0], batches, detectors=[SparsityDetector(), qw.OutlierDetector()], progress=False
    )
    features = report.generate_model_report()["sparsity_detector"][1]
    # down.conv reads the ReLU output of stem.conv: about half of its values are exact zeros
    assert 0.2 < float(features["down.conv"]["input_activation_zero_fraction"].mean()) < 0.8
    assert float(features["stem.conv"]["input_activation_zero_fraction"].max()) == 0.0
    widget = report.widget()
    widget.controls.module.value = "down.conv"
    assert "input_activation_zero_fraction" in [v for _, v in widget.controls.feature.options]
    widget.controls.feature.value = "input_activation_zero_fraction"
    np.testing.assert_allclose(
        widget.views.line.line.y, features["down.conv"]["input_activation_zero_fraction"].numpy(), rtol=1e-6
    )
