"""An activation observer for torch.ao's FX quantization that clips the extremes: a percentile range.

The x86 default (HistogramObserver) searches for the range with the least quantization error,
MinMaxObserver keeps every value. ``PercentileObserver`` takes, per batch, the ``percentile``-th
largest and smallest values and keeps the widest of those: a few extreme values no longer stretch
the range for all the others. A per-module choice in the Tune tab (``ModuleSettings.observer``).
The percentiles are exact and have no size limit: found by selection (``selection.py``), as the
report's own observer finds its percentiles.
"""

from __future__ import annotations

import torch
from torch.ao.quantization.observer import MinMaxObserver

from ...observe.observer import percentile_rank
from ...observe.selection import kth_largest_per_channel


class PercentileObserver(MinMaxObserver):
    """MinMaxObserver on the ``percentile`` range of each batch (``percentile`` in (50, 100])."""

    def __init__(self, percentile: float = 99.99, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = percentile
        self._hints: dict[str, torch.Tensor | None] = {"high": None, "low": None}  # speed up the next batch

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().to(self.min_val.dtype)
        n = x.numel()
        m = n - percentile_rank(self.percentile / 100.0, n) + 1  # the percentile as the m-th largest
        high, self._hints["high"] = kth_largest_per_channel(x, None, m, self._hints["high"])
        low, self._hints["low"] = kth_largest_per_channel(x.neg(), None, m, self._hints["low"])
        self.min_val.copy_(torch.minimum(-low.reshape(()), self.min_val))
        self.max_val.copy_(torch.maximum(high.reshape(()), self.max_val))
        return x_orig

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, {super().extra_repr()}"
