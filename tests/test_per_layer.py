"""Per-layer SQNR from Numeric Suite FX reads each layer's own output, even when an in-place op follows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qreport_widgets.tune.session import QuantizationSession


class InPlaceNet(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.Hardswish(inplace=inplace)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act2 = nn.ReLU(inplace=inplace)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act2(self.conv2(self.act1(self.conv1(x)))).flatten(1))


def per_layer(model: nn.Module, batches) -> dict[str, float]:
    session = QuantizationSession(model, batches[0], batches)
    result = session.baseline(progress=lambda done, total: None)
    assert result.ok, result.error
    return result.per_layer_sqnr_db.to_dict()


def test_in_place_activations_do_not_overwrite_the_logged_outputs():
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8),) for _ in range(4)]
    in_place = InPlaceNet(inplace=True)
    out_of_place = InPlaceNet(inplace=False)
    out_of_place.load_state_dict(copy.deepcopy(in_place.state_dict()))
    read, truth = per_layer(in_place, batches), per_layer(out_of_place, batches)
    assert set(read) == set(truth) and {"conv1", "conv2", "fc"} <= set(read)
    for layer, value in truth.items():
        assert read[layer] == pytest.approx(value, abs=1e-6), layer
    # Hardswish(inplace=True) used to overwrite conv1's logged float output: about 1 dB instead of ~27
    assert read["conv1"] > 15


class WithDropout(nn.Module):
    """A ViT block's tail: a projection, its dropout (an identity in eval), an activation, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.proj_drop = nn.Dropout(0.1)
        self.act = nn.GELU()
        self.head_drop = nn.Dropout(0.1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_drop(self.act(self.proj_drop(self.proj(x)))))


def test_dropout_is_no_layer_of_the_per_layer_sqnr():
    """A dropout passes its input through in eval: a row of its own would repeat the layer before it."""
    torch.manual_seed(0)
    layers = per_layer(WithDropout().eval(), [(torch.randn(8, 16),) for _ in range(4)])
    assert {"proj", "head"} <= set(layers) and not {"proj_drop", "head_drop"} & set(layers)
