"""Exact per-channel order statistics without a full selection pass over large CPU tensors.

``kth_largest_per_channel(t, axis, m)`` returns, for every channel of ``t`` along ``axis``, exactly
the ``m``-th largest of its values, i.e. what ``kthvalue`` gives on the channel-major copy. On
accelerators that is what runs (no host synchronisation). On the CPU, where reading a count costs
nothing, large tensors go through a bracket in their own layout (no channel-major copy):

1. a per-channel lower bound that at least ``m`` values clear: the previous batch's hint when the
   caller passes it back (a stationary activation then keeps about 2m values per channel), else a
   strided sample's high-order statistic with four standard deviations of slack;
2. one compare pass keeps only the values above the bound;
3. the selection runs on those few values per channel.

Channels where the bound was too tight fall back to a full selection, so the answer is always
exact; only the cost depends on the bound. Extra memory: one bool mask of the tensor's shape.

Channels-last data (a transformer's tokens x features) with a short upper tail goes through a
tournament instead (``_tournament``): the ``m`` largest of a column lie in the ``m`` blocks of rows
with the largest maxima, so a top-k over a few blocks' rows gives the same value at half the cost.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from ..core.cpu import numpy_has_avx512

# below these sizes a plain selection on a channel-major copy is already cheap: NumPy sorts a
# channel of 8,192 values faster than the bracket's compare and gather (128 x 6,272: 1.5 ms against
# 2.6, 2 threads); at 25,088 values a channel the two cost the same
BRACKET_MIN_ROW = 1 << 14
BRACKET_MIN_VALUES = 1 << 17
# nor on channels-last data (a transformer's tokens x features): with fewer values of a channel
# side by side than this, the bracket's gather costs more than the channel-major copy it saves
# (a decoder's 256 x 32,000 logits: 236 ms bracketed, 201 ms plain, one thread)
BRACKET_MIN_RUN = 16
# the longest row NumPy's sort selects on; longer rows take its partition (a selection), which is
# 1.2-3.6x faster there. AVX-512 makes the sort fast enough to win up to 768 values (256 x 512: 0.19
# ms against 0.33); with AVX2 alone it wins only up to 256 (256 x 512: 0.31 ms against 0.22)
_SORT_MAX_ROW = 768 if numpy_has_avx512() else 256
# a prime stride does not line up with image rows or head sizes, so the sample is not biased
# towards the same positions of every channel
_SAMPLE_STRIDE = 11

_local = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slot: str) -> torch.Tensor:
    """A reusable per-thread work buffer: large temporaries come back from the allocator as fresh
    pages every batch (the page faults cost as much as the work), so the hot path borrows them here.
    """
    buffers = _local.__dict__.setdefault("buffers", {})
    key = (slot, dtype, device)
    count = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < count:
        buffer = buffers[key] = torch.empty(count, dtype=dtype, device=device)
    return buffer[:count].view(shape)


def channel_view(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """``t`` as (before, channels, after) without copying; ``axis=None`` is one channel."""
    if axis is None:
        return t.reshape(1, 1, -1)
    return t.reshape(math.prod(t.shape[:axis]), t.shape[axis], -1)


def channel_major(view: torch.Tensor) -> torch.Tensor:
    """A contiguous (channels, values) copy of a (before, channels, after) view."""
    return view.transpose(0, 1).reshape(view.shape[1], -1)


def kth_largest_per_channel(
    t: torch.Tensor, axis: int | None, m: int, hint: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``m``-th largest value of every channel (``m`` counts from 1), and a hint for the next
    batch of data like this (None when there is none). Channels holding NaN have an unspecified
    result (their maximum is NaN, and so is any ratio to it).
    """
    view = channel_view(t, axis)
    channels = view.shape[1]
    n = view.shape[0] * view.shape[2]
    if not 1 <= m <= n:
        raise ValueError(f"m must lie in [1, {n}], got {m}")
    small = n < BRACKET_MIN_ROW or t.numel() < BRACKET_MIN_VALUES or m * 8 > n
    if not on_host(t) or small or view.shape[2] < BRACKET_MIN_RUN:
        if view.shape[2] == 1 and _short_tail(m, n):  # channels last: down the columns, no copy
            return _tournament(view.reshape(n, channels), m), None
        return select(channel_major(view), m), None
    if hint is None or hint.shape != (channels,):
        hint = _sample_bound(view, m)
    elif bool(hint.isnan().any()):
        hint = torch.where(hint.isnan(), _sample_bound(view, m), hint)
    return _bracketed(view, m, hint)


def select(y: torch.Tensor, m: int) -> torch.Tensor:
    """The ``m``-th largest of every row of a 2-D tensor: by NumPy's sort or partition on the CPU
    (the same order statistic, NaN sorting last in both), else by top-k or selection."""
    if _on_numpy(y):
        n = y.shape[1]
        rows = y.contiguous().numpy()
        ordered = np.sort(rows, axis=1) if n <= _SORT_MAX_ROW else np.partition(rows, n - m, axis=1)
        return torch.from_numpy(ordered[:, n - m].copy())
    if _short_tail(m, y.shape[1]):
        return y.topk(m, dim=1, sorted=False).values.amin(dim=1)
    return y.kthvalue(y.shape[1] - m + 1, dim=1).values


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lives in the host's memory (the CPU), where reading a value back costs nothing:
    there the selections and the observer's histogram take paths that read values; on an
    accelerator every step stays a tensor operation on the device."""
    return t.device.type == "cpu"


def _on_numpy(y: torch.Tensor) -> bool:
    """Whether NumPy selects on ``y``: a CPU float tensor. NumPy's vectorised sort (short rows) and
    partition (long rows) beat torch's top-k and kthvalue with or without AVX-512 (2 threads): 32 x
    256 values 13 us against 22-29 (AVX2: 18 against 22-28), 64 x 4,096 0.38 ms against 0.66-1.5
    (AVX2: 0.36 against 0.67-1.5); at 768 x 1,024 with m = 11 top-k keeps up (1.5 ms against 1.9;
    AVX2: 1.5 against 1.5)."""
    return on_host(y) and y.dtype in (torch.float32, torch.float64) and not y.requires_grad


def _tournament(y: torch.Tensor, m: int) -> torch.Tensor:
    """The ``m``-th largest of every column of ``y`` (rows x channels).

    Split the rows into blocks and keep, per column, the ``m`` blocks with the largest maxima: they
    hold the column's ``m`` largest values. (The ``m`` kept maxima are ``m`` values at or above the
    smallest of them, L, so the answer is at least L; every value above L lies in a kept block, and
    one equal to L only matters when the answer is L, which the kept blocks' maxima already reach.)
    A 256 x 768 activation, m = 7: 0.53 ms against 0.82 for a top-k over all rows (2 threads); on
    the CPU, with NumPy selecting the blocks and sorting their values, 0.25 ms, and a 1,024 x 3,072
    one with m = 27 4.3 ms (a channel-major copy alone costs 4.3 ms). Blocks of 8 rows cost less
    than blocks of 2, 4 or 16 on both.
    """
    rows, channels = y.shape
    per_block = next((b for b in (8, 4) if rows % b == 0 and rows // b > 2 * m), 0)
    if not per_block:
        return select(y.t(), m) if _on_numpy(y) else y.topk(m, dim=0, sorted=False).values.amin(dim=0)
    blocks = y.view(rows // per_block, per_block, channels)
    maxima = blocks.amax(dim=1)  # (blocks, channels)
    if not _on_numpy(y):
        kept = maxima.topk(m, dim=0, sorted=False).indices  # (m, channels)
        rows_kept = blocks.gather(0, kept.unsqueeze(1).expand(m, per_block, channels))
        return rows_kept.view(m * per_block, channels).topk(m, dim=0, sorted=False).values.amin(dim=0)
    count = maxima.shape[0]
    kept = np.argpartition(maxima.t().contiguous().numpy(), count - m, axis=1)[:, count - m :]  # (channels, m)
    # gathered channel-major, so the final selection reads contiguous rows
    index = torch.from_numpy(kept).unsqueeze(2).expand(channels, m, per_block)
    return select(blocks.permute(2, 0, 1).gather(1, index).view(channels, m * per_block), m)


def _short_tail(m: int, n: int) -> bool:
    """Whether the ``m`` largest of ``n`` are few enough that a partial top-k beats a full selection."""
    return m <= max(1, n // 16)


def _sample_bound(view: torch.Tensor, m: int) -> torch.Tensor:
    sampled = view[:, :, ::_SAMPLE_STRIDE] if view.shape[2] >= _SAMPLE_STRIDE else view[::_SAMPLE_STRIDE]
    sample = channel_major(sampled)
    expected = m * sample.shape[1] / (view.shape[0] * view.shape[2])
    rank = min(sample.shape[1], int(expected + 4.0 * math.sqrt(expected) + 4))
    return sample.topk(rank, dim=1, sorted=False).values.amin(dim=1)


def _bracketed(view: torch.Tensor, m: int, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    before, channels, after = view.shape
    keep = torch.ge(view, bound.view(1, -1, 1), out=scratch(tuple(view.shape), torch.bool, view.device, "keep"))
    flat = keep.view(-1).nonzero().squeeze(1)
    channel_of, slot, counts = _slots(flat, before, channels, after)
    good = counts >= m
    result = torch.empty(channels, dtype=view.dtype, device=view.device)
    hint = torch.full((channels,), math.nan, dtype=view.dtype, device=view.device)
    if bool(good.any()):
        depth = min(2 * m, int(counts.max()))
        packed = torch.full((channels, int(counts.max())), -math.inf, dtype=view.dtype, device=view.device)
        packed[channel_of, slot] = view.reshape(-1)[flat]
        top = packed.topk(depth, dim=1, sorted=False).values  # padding sorts below every survivor
        result = top.kthvalue(depth - m + 1, dim=1).values
        # next bound: the (2m)-th largest, or this bound where fewer values survived
        hint = torch.where(counts >= depth, top.amin(dim=1), bound)
    if not bool(good.all()):
        bad = (~good).nonzero().squeeze(1)
        result[bad] = select(channel_major(view[:, bad]), m)
        hint[bad] = math.nan  # the next call draws a fresh bound for these channels
    return result, hint


def _slots(flat: torch.Tensor, before: int, channels: int, after: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Channel, a distinct slot within the channel, and per-channel counts of kept positions.

    ``flat`` is in memory order, so the kept values of one (before, channel) block are contiguous:
    a value's slot is its rank in its block plus the kept counts of the same channel's earlier
    blocks (channels-last data never comes here: ``BRACKET_MIN_RUN``).
    """
    block = torch.div(flat, after, rounding_mode="floor")
    per_block = torch.bincount(block, minlength=before * channels)
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(per_block, 0) - per_block)[block]
    per_block = per_block.view(before, channels)
    earlier = (torch.cumsum(per_block, 0) - per_block).view(-1)
    slot = earlier[block] + rank
    return block.remainder_(channels), slot, per_block.sum(0)
