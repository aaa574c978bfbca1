"""Models that are legal PyTorch but unusual: each gets a report, a widget and a clear Apply outcome."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import qreport_widgets as qw


class Shared(nn.Module):
    """One Linear called twice (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.fc(torch.relu(self.fc(x))))


class OnlyActivations(nn.Module):
    """Nothing to tune: no Linear or Conv."""

    def forward(self, x):
        return torch.relu(x) * 2


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return {"logits": self.fc(x), "hidden": x}


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    note: str = "not a tensor"


class DataclassOutput(nn.Module):
    """Returns an output object, as transformer libraries do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return Output(self.fc(x))


class OddNames(nn.Module):
    """Submodule names with a dash and a space (legal in a ModuleDict)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"block-a": nn.Linear(8, 8), "block b": nn.Linear(8, 2)})

    def forward(self, x):
        return self.blocks["block b"](self.blocks["block-a"](x))


def batches(n=4, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g).to(dtype),) for _ in range(n)]


@pytest.mark.parametrize(
    "model, units",
    [
        (Shared(), ["fc", "out"]),
        (OnlyActivations(), []),
        (DictOutput(), ["fc"]),
        (DataclassOutput(), ["fc"]),
        (OddNames(), ["blocks.block-a", "blocks.block b"]),
    ],
    ids=["shared-weights", "nothing-to-tune", "dict-output", "dataclass-output", "odd-names"],
)
def test_unusual_models_get_a_report_a_widget_and_a_run(model, units):
    data = batches()
    report = qw.analyze(model.eval(), data[0], data, progress=False)
    assert [m.fqn for m in report.tunable_modules() if m.weighted] == units  # and ops, which can be kept float
    widget = report.widget()
    for _, module in widget.controls.module.options:
        widget.controls.module.value = module
    tuning = widget.tuning
    tuning.accept.click()
    tuning.apply.click()
    assert not tuning.error.value and "apply 1: output SQNR" in tuning.status.value


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_a_model_that_is_not_float32_is_analyzed_and_apply_says_what_to_do(dtype):
    data = batches(dtype=dtype)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype).eval()
    report = qw.analyze(model, data[0], data, progress=False)
    assert report.frame().modules.loc["0", "channels"] == 8
    tuning = report.widget().tuning
    tuning.apply.click()
    assert "works on float32 models: quantize model.float()" in tuning.error.value
    assert report.session.history == [] and not tuning.apply.disabled
