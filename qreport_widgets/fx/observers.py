"""An activation observer for torch.ao's FX quantization that clips the extremes: a percentile range.

The x86 default (HistogramObserver) searches for the range with the least quantization error,
MinMaxObserver keeps every value. ``PercentileObserver`` takes, per batch, the ``percentile``-th
largest and smallest values and keeps the widest of those: a few extreme values no longer stretch
the range for all the others. A per-module choice in the Tune tab (``ModuleSettings.observer``).
"""

from __future__ import annotations

import torch
from torch.ao.quantization.observer import MinMaxObserver

_MAX_SAMPLE = 1 << 22  # torch.quantile's input limit is 2**24 elements; a strided sample above this


class PercentileObserver(MinMaxObserver):
    """MinMaxObserver on the ``percentile`` range of each batch (``percentile`` in (50, 100])."""

    def __init__(self, percentile: float = 99.99, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 50.0 < percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {percentile}")
        self.percentile = percentile

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        x = x_orig.detach().flatten().to(self.min_val.dtype)
        if x.numel() > _MAX_SAMPLE:
            x = x[:: x.numel() // _MAX_SAMPLE + 1]
        q = torch.tensor([1.0 - self.percentile / 100.0, self.percentile / 100.0], dtype=x.dtype)
        low, high = torch.quantile(x, q)
        self.min_val.copy_(torch.minimum(low, self.min_val))
        self.max_val.copy_(torch.maximum(high, self.max_val))
        return x_orig

    def extra_repr(self) -> str:
        return f"percentile={self.percentile}, {super().extra_repr()}"
