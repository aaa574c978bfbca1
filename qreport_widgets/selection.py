"""Exact per-row order statistics, cheaper than a full ``kthvalue`` pass on large CPU rows.

``kth_largest_rows(y, m)`` returns, for every row of a contiguous (rows x n) tensor, exactly the
value ``y.kthvalue(n - m + 1, dim=1)`` would. On accelerators that is what it calls (no host
synchronisation). On the CPU, where looking at a count costs nothing, large inputs go through a
bracket: a per-row lower bound that at least ``m`` values clear, one compare pass that keeps only
the values above it (a few times ``m`` per row), and the selection runs on those.

The bound comes from the previous batch when the caller passes the returned ``hint`` back (the
(2m)-th largest value it saw, so a stationary activation keeps about 2m values per row), and
from a strided sample otherwise. Rows where the bound turns out too tight fall back to a full
selection, so the answer is always exact; only the cost depends on how good the bound was.
"""

from __future__ import annotations

import math
import threading

import torch

# below these sizes a plain selection is already cheap
BRACKET_MIN_ROW = 256
BRACKET_MIN_VALUES = 1 << 17
# a prime stride does not line up with image rows or head sizes, so the sample is not biased
# towards the same columns of every row
_SAMPLE_STRIDE = 11


def kth_largest_rows(y: torch.Tensor, m: int, hint: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``m``-th largest value of every row of the 2-D tensor ``y`` (``m`` counts from 1).

    Returns the values and a hint for the next call on data like this (None when there is none).
    Rows holding NaN have an unspecified result (their maximum is NaN, and so is any ratio to it).
    """
    n = y.shape[1]
    if not 1 <= m <= n:
        raise ValueError(f"m must lie in [1, {n}], got {m}")
    if y.device.type != "cpu" or n < BRACKET_MIN_ROW or y.numel() < BRACKET_MIN_VALUES or m * 8 > n:
        return _select(y, m), None
    if hint is None or hint.shape != (y.shape[0],):
        hint = _sample_bound(y, m)
    elif bool(hint.isnan().any()):
        hint = torch.where(hint.isnan(), _sample_bound(y, m), hint)
    return _bracketed(y, m, hint)


_local = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: str) -> torch.Tensor:
    """A reusable per-thread work buffer: large temporaries come back from the allocator as fresh
    pages every batch (page faults cost as much as the work), so the hot path borrows them here.
    Peak extra memory stays one tensor per slot, sized by the largest observed activation.
    """
    buffers = _local.__dict__.setdefault("buffers", {})
    key = (slot, dtype, device)
    count = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = buffers[key] = torch.empty(count, dtype=dtype, device=device)
    return buffer[:count].view(shape)


def _select(y: torch.Tensor, m: int) -> torch.Tensor:
    n = y.shape[1]
    if m <= max(1, n // 16):  # a short upper tail: partial top-k beats a full selection
        return y.topk(m, dim=1, sorted=False).values.amin(dim=1)
    return y.kthvalue(n - m + 1, dim=1).values


def _sample_bound(y: torch.Tensor, m: int) -> torch.Tensor:
    sample = y[:, ::_SAMPLE_STRIDE]
    expected = m * sample.shape[1] / y.shape[1]
    # about four standard deviations of slack on the sample's count above the bound
    rank = min(sample.shape[1], int(expected + 4.0 * math.sqrt(expected) + 4))
    return sample.topk(rank, dim=1, sorted=False).values.amin(dim=1)


def _bracketed(y: torch.Tensor, m: int, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = y.shape
    keep = torch.ge(y, bound.unsqueeze(1), out=scratch(tuple(y.shape), torch.bool, y.device, "keep"))
    flat = keep.view(-1).nonzero().squeeze(1)
    row_of = flat // n
    counts = torch.bincount(row_of, minlength=rows)
    good = counts >= m
    result = torch.empty(rows, dtype=y.dtype)
    hint = torch.full((rows,), math.nan, dtype=y.dtype)
    if bool(good.any()):
        cap = int(counts.max())
        slot = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[row_of]
        packed = torch.full((rows, cap), -math.inf, dtype=y.dtype)
        packed[row_of, slot] = y.view(-1)[flat]
        depth = min(2 * m, cap)
        top = packed.topk(depth, dim=1, sorted=False).values  # padding sorts below every survivor
        result = top.kthvalue(depth - m + 1, dim=1).values
        # next bound: the (2m)-th largest, or this bound where fewer values survived
        hint = torch.where(counts >= depth, top.amin(dim=1), bound)
    if not bool(good.all()):
        bad = (~good).nonzero().squeeze(1)
        result[bad] = _select(y[bad], m)
        hint[bad] = math.nan  # the next call draws a fresh bound for these rows
    return result, hint
