"""Histogram observers' range search kept by what it reads: the same qparams as searched each time."""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization.observer import HistogramObserver
from torchao.quantization.pt2e.observer import HistogramObserver as Pt2eHistogramObserver

from qreport_widgets.core import histograms


@pytest.mark.parametrize("kind", [HistogramObserver, Pt2eHistogramObserver], ids=["fx", "pt2e"])
def test_a_repeated_search_is_looked_up_and_gives_what_searching_gives(kind, monkeypatch):
    torch.manual_seed(0)
    observers = [kind(), kind(), kind()]
    for observer, scale in zip(observers, (1.0, 1.0, 3.0), strict=True):
        torch.manual_seed(1)  # the first two see the same batches: the same histogram
        for _ in range(3):
            observer(scale * torch.randn(64, 32) ** 3)
    expected = [observer.calculate_qparams() for observer in observers]
    searched = kind.__dict__["_non_linear_param_search"]
    calls = []

    def counted(observer):
        calls.append(observer)
        return searched(observer)

    monkeypatch.setattr(kind, "_non_linear_param_search", counted)
    monkeypatch.setattr(histograms, "_FOUND", type(histograms._FOUND)())
    with histograms.searches_kept(), histograms.searches_kept():  # re-entrant
        found = [observer.calculate_qparams() for observer in observers + observers]
    assert kind.__dict__["_non_linear_param_search"] is counted  # put back as it was
    assert len(calls) == 2  # the second observer and the repeats: looked up
    for (scale, zero), (kept_scale, kept_zero) in zip(expected + expected, found, strict=True):
        assert torch.equal(scale, kept_scale) and torch.equal(zero, kept_zero)
    assert not torch.equal(expected[0][0], expected[2][0])  # another histogram, another search

    observers[0](torch.full((4, 32), 100.0))  # more calibration: another histogram, searched again
    with histograms.searches_kept():
        kept = observers[0].calculate_qparams()
    assert torch.equal(kept[0], observers[0].calculate_qparams()[0])
    assert len(calls) == 4  # inside, and the plain call after


def test_an_fx_sessions_conversion_does_not_import_torchao():
    """torchao's observers are looked up only once torchao is imported: an FX session never pays
    for importing it (seconds, in a notebook's first Accept all)."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from torch.ao.quantization import get_default_qconfig_mapping\n"
        "from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx\n"
        "from qreport_widgets.core import histograms\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()\n"
        "x = torch.randn(4, 8)\n"
        "prepared = prepare_fx(model, get_default_qconfig_mapping('x86'), (x,))\n"
        "prepared(x)\n"
        "with histograms.searches_kept():\n"
        "    convert_fx(prepared)(x)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"
