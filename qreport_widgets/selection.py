"""Exact per-row order statistics, cheaper than a full ``kthvalue`` pass on large CPU rows.

``kth_largest_rows(y, m)`` returns, for every row of a contiguous (rows x n) tensor, exactly the
value ``y.kthvalue(n - m + 1, dim=1)`` would. On accelerators that is what it calls (no host
synchronisation). On the CPU, where looking at a count costs nothing, long rows go through a
bracket: a strided sample gives a per-row lower bound that at least ``m`` values clear, one
compare pass keeps only the values above it (a few times ``m`` per row), and the selection runs on
those. Rows where the bound was too tight fall back to ``kthvalue``, so the answer is always exact.
"""

from __future__ import annotations

import math

import torch

# below these sizes a plain selection is already cheap
BRACKET_MIN_ROW = 2048
BRACKET_MIN_VALUES = 1 << 18
_SAMPLE_FRACTION = 8  # the sample keeps every 8th value of a row


def kth_largest_rows(y: torch.Tensor, m: int) -> torch.Tensor:
    """The ``m``-th largest value of every row of the 2-D tensor ``y`` (``m`` counts from 1)."""
    n = y.shape[1]
    if not 1 <= m <= n:
        raise ValueError(f"m must lie in [1, {n}], got {m}")
    if y.device.type != "cpu" or n < BRACKET_MIN_ROW or y.numel() < BRACKET_MIN_VALUES or m * 8 > n:
        return _select(y, m)
    return _bracketed(y, m)


def _select(y: torch.Tensor, m: int) -> torch.Tensor:
    n = y.shape[1]
    if m <= max(1, n // 16):  # a short upper tail: partial top-k beats a full selection
        return y.topk(m, dim=1, sorted=False).values.amin(dim=1)
    return y.kthvalue(n - m + 1, dim=1).values


def _bracketed(y: torch.Tensor, m: int) -> torch.Tensor:
    rows, n = y.shape
    sample = y[:, :: _SAMPLE_FRACTION]
    expected = m * sample.shape[1] / n
    # about four standard deviations of slack on the sample's count above the bound
    rank = min(sample.shape[1], int(expected + 4.0 * math.sqrt(expected) + 4))
    bound = sample.topk(rank, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    keep = y >= bound
    counts = keep.sum(dim=1, dtype=torch.int32).long()  # int32 keeps the bool reduction vectorised
    result = torch.empty(rows, dtype=y.dtype)
    good = counts >= m
    if bool(good.any()):
        flat = keep.view(-1).nonzero().squeeze(1)
        row_of = flat // n
        slot = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[row_of]
        packed = torch.full((rows, int(counts.max())), -math.inf, dtype=y.dtype)
        packed[row_of, slot] = y.view(-1)[flat]
        result = packed.topk(m, dim=1, sorted=False).values.amin(dim=1)
    if not bool(good.all()):
        bad = (~good).nonzero().squeeze(1)
        result[bad] = _select(y[bad], m)
    return result
