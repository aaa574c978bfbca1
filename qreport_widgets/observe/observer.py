"""ModelReportObserver: streaming, mergeable statistics of one tensor.

One forward pass per batch, O(channels + bins) state, no host synchronisation on accelerators:
every update there is a tensor operation whose result stays on the tensor's device, so calibration
on a GPU never waits for the host. Branches depend only on shapes, on which statistics were
requested, and on whether the tensor is on the CPU, where reading a value costs nothing and saves
work (the histogram rebins only when its range grew; selections run in NumPy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import torch
from torch.ao.quantization.observer import ObserverBase

from ..core.features import Stat
from .selection import channel_view, kth_largest_per_channel, on_host, select

ALL_STATS = frozenset({Stat.RANGE, Stat.CHANNEL_MINMAX, Stat.PERCENTILE})
_NEEDS_CHANNELS = frozenset({Stat.CHANNEL_MINMAX, Stat.PERCENTILE})
HISTOGRAM_SAMPLE = 1 << 14  # at most this many values per batch enter the value histogram
# A channel holding more values than this in one batch has its percentiles estimated from this many
# of them, evenly spread (``percentile_sample``); None keeps them exact
PERCENTILE_SAMPLE = 4096
_STANDARD_ERRORS = 3.0  # the stated bound of an estimated percentile's rank
_MIN_EXPONENT = -126.0  # the histogram never zooms below float32's smallest normal range
_MAX_EXPONENT = 127.0


@functools.lru_cache(maxsize=4096)
def percentile_rank(q: float, n: int) -> int:
    """1-based rank of the ``q`` percentile of ``n`` values, "lower" interpolation.

    Computed in float32 like PyTorch's quantile with ``interpolation="lower"`` so both pick the same
    element; unlike that function it has no size limit, because the value is found by selection.
    """
    position = np.float32(q) * np.float32(n - 1)
    return int(np.floor(position)) + 1


def estimate_bounds(q: float, sample: int) -> tuple[float, float]:
    """The percentile ranks (in (0, 1)) between which the ``q`` percentile of an evenly spread sample
    of ``sample`` values lies, stated as three standard errors of a sample quantile's rank,
    sqrt(q (1 - q) / sample): 4,096 values put the 97.5th within the 96.8th-98.2th."""
    spread = _STANDARD_ERRORS * math.sqrt(q * (1.0 - q) / sample)
    return max(q - spread, 0.0), min(q + spread, 1.0)


@functools.lru_cache(maxsize=256)
def spread_positions(n: int, sample: int, sizes: tuple[int, ...]) -> torch.Tensor:
    """At least ``sample`` positions in ``range(n)``, evenly spread over all of it: a stride that shares
    no factor with ``sizes`` (the layout's other dimensions), so the sample does not come back to the
    same pixel column or token position in every row (a stride equal to a sequence length would
    read only its first token). Where no stride of 2 or more does (fewer than twice the sample, or
    every such stride shares a factor), all ``n`` positions: the channel is read whole, exactly. (A
    sample with two spacings mixed, tried there, reads one column parity per image at 8 x 32 x 32
    values and changed an outlier verdict on the zoo's DenseNet.) Cached: every batch of the same
    shape samples the same positions (callers only read the tensor)."""
    stride = max(n // sample, 1)
    while stride > 1 and any(math.gcd(stride, size) > 1 for size in sizes if size > 1):
        stride -= 1
    count = -(-n // stride) if stride > 1 else n
    offset = (n - 1 - (count - 1) * stride) // 2  # centred: the margins at both ends differ by at most one
    return torch.arange(count, dtype=torch.int64, device="cpu") * stride + offset


# the stride and each row's first column, or the positions' row and column indices
SpreadReading = tuple[int, tuple[int, ...]] | tuple[torch.Tensor, torch.Tensor] | None


@functools.lru_cache(maxsize=256)
def _spread_reading(before: int, after: int, sample: int, sizes: tuple[int, ...], device: torch.device) -> SpreadReading:
    """How ``spread_positions`` are read from a (before, channels, after) view: None where they are
    all of its values; else the stride and each row's first column, when every row holds at least 8
    of them (slicing each row and joining the slices reads the same values in the same order as
    indexing, 2-2.6x faster: 8 x 256 x 56 x 56 in 0.69 ms against 1.79); else their row and column
    indices, on ``device``. Computed once per shape and device, like the positions: no batch copies
    indices to an accelerator."""
    positions = spread_positions(before * after, sample, sizes)
    if len(positions) == before * after:
        return None
    stride, first = int(positions[1] - positions[0]), int(positions[0])
    if after >= 8 * stride:
        # the positions run from ``first`` to the end in steps of ``stride``: row r's first one is
        # the first at or after r * after
        return stride, tuple(first + max(0, -(-(r * after - first) // stride)) * stride - r * after for r in range(before))
    positions = positions.to(device)
    return torch.div(positions, after, rounding_mode="floor"), positions.remainder(after)


class ModelReportObserver(ObserverBase):
    r"""Collects the statistics the detectors need from the tensor passed to ``forward``.

    Args:
        ch_axis: channel axis of the observed tensor (negative counts from the end). A tensor with
            fewer dimensions than the axis needs is treated as a single channel.
        comp_percentile: reference percentile for the max / percentile ratio, in (0, 1).
        stats: which statistics to collect (see :class:`~qreport_widgets.core.features.Stat`);
            default: range, per-channel min / max and percentile ratio, as PyTorch's observer.
        percentiles: further reference percentiles tracked next to ``comp_percentile``.
        histogram_bins: bins of the running value histogram (even, > 0) when ``Stat.HISTOGRAM``
            is requested.
        percentile_sample: a channel holding more values than this in a batch has its percentiles
            estimated from about this many of them, evenly spread (:func:`estimate_bounds` states
            how far off the estimate's rank can be); None: exact percentiles, however large the batch.
        device: where the state is made (default: the CPU); it moves to the device of the first
            tensor observed elsewhere.

    The attributes read by PyTorch's detectors keep their names: ``epoch_activation_min``,
    ``epoch_activation_max``, ``average_batch_activation_range``, ``min_val``, ``max_val``,
    ``average_percentile_ratio``, ``percentile_batches_tracked``, ``constant_channels``,
    ``num_batches_tracked`` and ``get_batch_to_epoch_ratio()``.
    """

    epoch_activation_min: torch.Tensor
    epoch_activation_max: torch.Tensor
    batch_range_mean: torch.Tensor
    batch_range_m2: torch.Tensor
    min_val: torch.Tensor
    max_val: torch.Tensor
    constant_channels: torch.Tensor
    histogram: torch.Tensor
    histogram_exponent: torch.Tensor

    def __init__(
        self,
        ch_axis: int = 1,
        comp_percentile: float = 0.9,
        *,
        stats: Iterable[Stat | str] | None = None,
        percentiles: Iterable[float] = (),
        histogram_bins: int = 128,
        percentile_sample: int | None = PERCENTILE_SAMPLE,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(torch.qint8)
        device = torch.device("cpu") if device is None else torch.device(device)
        if percentile_sample is not None and (
            isinstance(percentile_sample, bool) or not isinstance(percentile_sample, int) or percentile_sample < 16
        ):
            raise ValueError(f"percentile_sample must be None (exact) or an int >= 16, got {percentile_sample!r}")
        if not isinstance(ch_axis, int) or isinstance(ch_axis, bool):
            raise ValueError(f"ch_axis must be an int, got {ch_axis!r}")
        self.stats = ALL_STATS if stats is None else frozenset(Stat(s) for s in stats)
        self.percentiles: tuple[float, ...] = tuple(dict.fromkeys(float(p) for p in (comp_percentile, *percentiles)))
        for p in self.percentiles:
            if not 0.0 < p < 1.0:
                raise ValueError(f"percentiles must lie in (0, 1), got {p}")
        if Stat.HISTOGRAM in self.stats and (histogram_bins <= 0 or histogram_bins % 2):
            raise ValueError(f"histogram_bins must be a positive even number, got {histogram_bins}")
        self.ch_axis = ch_axis
        self.comp_percentile_value = float(comp_percentile)
        self.histogram_bins = histogram_bins
        self.percentile_sample = percentile_sample
        self.num_batches_tracked = 0
        # (smallest sample, most values a channel held) over the batches whose percentiles were
        # estimated; None while every percentile was exact
        self.estimated_from: tuple[int, int] | None = None
        self.empty_batches = 0
        self.observed_ndim: int | None = None
        self._selection_hints: dict[int, torch.Tensor | None] = {}  # speeds up the next batch only

        self.register_buffer("epoch_activation_min", torch.tensor(math.inf, device=device))
        self.register_buffer("epoch_activation_max", torch.tensor(-math.inf, device=device))
        self.register_buffer("batch_range_mean", torch.tensor(0.0, device=device))
        self.register_buffer("batch_range_m2", torch.tensor(0.0, device=device))
        self.register_buffer("min_val", torch.empty(0, device=device))
        self.register_buffer("max_val", torch.empty(0, device=device))
        self.register_buffer("constant_channels", torch.empty(0, dtype=torch.int64, device=device))
        for i in range(len(self.percentiles)):
            self.register_buffer(f"_ratio_sum_{i}", torch.empty(0, device=device))
            self.register_buffer(f"_ratio_count_{i}", torch.empty(0, dtype=torch.int64, device=device))
        bins = histogram_bins if Stat.HISTOGRAM in self.stats else 0
        self.register_buffer("histogram", torch.zeros(bins, device=device))
        self.register_buffer("histogram_exponent", torch.tensor(_MIN_EXPONENT, device=device))

    # ------------------------------------------------------------------ forward (the hot path)
    def forward(self, x, *more):  # type: ignore[override]
        tensor = _first_tensor((x, *more))
        if tensor is None:
            return x
        t = tensor.detach()
        if t.dtype != torch.float32 and t.dtype != torch.float64:
            t = t.to(torch.float32)
        if t.numel() == 0:
            self.empty_batches += 1
            return x
        if t.device != self.epoch_activation_min.device:
            # made where the model was said to be, or the tensor moved (a model split across devices):
            # the state follows what it observes, so no update mixes devices
            self.to(t.device)
            self._selection_hints.clear()
        self.observed_ndim = t.dim()
        self.num_batches_tracked += 1

        if self.stats & _NEEDS_CHANNELS:
            cmin, cmax = self._channel_extremes(t)
            bmin, bmax = cmin.amin(), cmax.amax()
            self._update_range(bmin, bmax)
            self._update_channels(t, cmin, cmax)
        else:
            bmin, bmax = torch.aminmax(t)
            self._update_range(bmin, bmax)
        if Stat.HISTOGRAM in self.stats:
            self._update_histogram(t, bmin, bmax)
        return x

    def _axis(self, t: torch.Tensor) -> int | None:
        """The channel axis of ``t``; None when ``t`` has no such axis (one channel)."""
        return self.ch_axis % t.dim() if -t.dim() <= self.ch_axis < t.dim() else None

    def _channel_extremes(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel min and max, reduced in the tensor's own layout (no copy)."""
        axis = self._axis(t)
        if axis is None:
            low, high = torch.aminmax(t)
            return low.reshape(1), high.reshape(1)
        dims = tuple(d for d in range(t.dim()) if d != axis)
        if not dims:
            return t, t
        return t.amin(dim=dims), t.amax(dim=dims)

    def _update_range(self, bmin: torch.Tensor, bmax: torch.Tensor) -> None:
        # in-place updates: the hot path allocates little and skips nn.Module.__setattr__
        low, high = self.epoch_activation_min, self.epoch_activation_max
        torch.minimum(low, bmin.to(low.dtype), out=low)
        torch.maximum(high, bmax.to(high.dtype), out=high)
        batch_range = (bmax - bmin).to(self.batch_range_mean.dtype)
        delta = batch_range - self.batch_range_mean
        self.batch_range_mean.add_(delta / self.num_batches_tracked)
        self.batch_range_m2.add_(delta * (batch_range - self.batch_range_mean))

    def _update_channels(self, t: torch.Tensor, cmin: torch.Tensor, cmax: torch.Tensor) -> None:
        n_channels = cmin.shape[0]
        if self.min_val.numel() == 0:
            self._init_channel_state(n_channels, t.device)
        elif self.min_val.numel() != n_channels:
            raise ValueError(
                f"ModelReportObserver saw {n_channels} channels on axis {self.ch_axis} after "
                f"{self.min_val.numel()} in earlier batches; pass the channel axis that stays fixed"
            )
        torch.minimum(self.min_val, cmin.to(self.min_val.dtype), out=self.min_val)
        torch.maximum(self.max_val, cmax.to(self.max_val.dtype), out=self.max_val)
        if Stat.PERCENTILE not in self.stats:
            return
        self.constant_channels.add_(cmax == cmin)
        axis, n = self._axis(t), t.numel() // n_channels
        sample = self._spread_sample(t, axis) if self.percentile_sample is not None and n > self.percentile_sample else None
        if sample is not None:
            seen = self.estimated_from or (sample.shape[1], n)
            self.estimated_from = (min(seen[0], sample.shape[1]), max(seen[1], n))
        for i, q in enumerate(self.percentiles):
            if sample is None:
                rank = n - percentile_rank(q, n) + 1
                reference, self._selection_hints[i] = kth_largest_per_channel(t, axis, rank, self._selection_hints.get(i))
            else:
                count = sample.shape[1]
                reference = select(sample, count - percentile_rank(q, count) + 1)
            reference = reference + 0.0  # -0.0 -> +0.0
            counted = (reference != 0) | (cmax != 0)
            ratio = torch.where(counted, cmax / reference, torch.zeros_like(cmax))
            self._buffers[f"_ratio_sum_{i}"].add_(ratio.to(self.min_val.dtype))
            self._buffers[f"_ratio_count_{i}"].add_(counted)

    def _spread_sample(self, t: torch.Tensor, axis: int | None) -> torch.Tensor | None:
        """(channels, values): about ``percentile_sample`` values of every channel, evenly spread; None
        where the spread positions are all of them (every value is read)."""
        view = channel_view(t, axis)
        before, _, after = view.shape
        others = tuple(size for d, size in enumerate(t.shape) if d != axis)
        reading = _spread_reading(before, after, self.percentile_sample or 1, others, t.device)
        if reading is None:
            return None
        if isinstance(reading[0], int):
            stride, starts = reading
            return torch.cat([view[row, :, start::stride] for row, start in enumerate(starts)], dim=1)
        rows, columns = reading
        return view.permute(1, 0, 2)[:, rows, columns]

    def _init_channel_state(self, n_channels: int, device: torch.device) -> None:
        self.min_val = torch.full((n_channels,), math.inf, device=device)
        self.max_val = torch.full((n_channels,), -math.inf, device=device)
        self.constant_channels = torch.zeros(n_channels, dtype=torch.int64, device=device)
        for i in range(len(self.percentiles)):
            setattr(self, f"_ratio_sum_{i}", torch.zeros(n_channels, device=device))
            setattr(self, f"_ratio_count_{i}", torch.zeros(n_channels, dtype=torch.int64, device=device))

    def _update_histogram(self, t: torch.Tensor, bmin: torch.Tensor, bmax: torch.Tensor) -> None:
        scale: torch.Tensor | float
        if on_host(t):
            # reading the range costs nothing here, so the histogram is rebinned only when it grew
            # (a dozen small tensor operations a batch fewer)
            exponent = _covering_exponent(max(abs(bmin.item()), abs(bmax.item())))
            current = self.histogram_exponent.item()
            if exponent > current:
                self.histogram.copy_(_rebin(self.histogram, torch.tensor(2.0 ** (exponent - current), device=t.device)))
                self.histogram_exponent.fill_(exponent)
            scale = 2.0 ** max(exponent, current)
        else:
            absmax = torch.maximum(bmin.abs(), bmax.abs()).float()
            batch_exponent = torch.log2(absmax).ceil().nan_to_num(_MAX_EXPONENT, _MAX_EXPONENT, _MIN_EXPONENT)
            grown = torch.maximum(self.histogram_exponent, batch_exponent.clamp(_MIN_EXPONENT, _MAX_EXPONENT))
            self.histogram.copy_(_rebin(self.histogram, torch.exp2(grown - self.histogram_exponent)))
            self.histogram_exponent.copy_(grown)
            scale = torch.exp2(grown)
        values = t.reshape(-1)
        if values.numel() > HISTOGRAM_SAMPLE:
            # the histogram is a picture of the distribution: an evenly strided sample draws it as well
            values = values[:: (values.numel() // HISTOGRAM_SAMPLE) | 1]
        scaled = values.float() / scale
        self.histogram.add_(torch.histc(scaled, bins=self.histogram_bins, min=-1.0, max=1.0))

    # ------------------------------------------------------------------ derived values
    def percentile_ratio(self, q: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Average per-batch max / ``q``-percentile ratio per channel and the batches counted.

        Channels whose reference percentile and max were both 0 in a batch skip that batch; a
        channel never counted has ratio 0 (PyTorch's convention).
        """
        i = self.percentiles.index(self.comp_percentile_value if q is None else float(q))
        total = getattr(self, f"_ratio_sum_{i}")
        count = getattr(self, f"_ratio_count_{i}")
        average = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        return average, count

    @property
    def average_batch_activation_range(self) -> torch.Tensor:
        return self.batch_range_mean

    @property
    def batch_range_variance(self) -> torch.Tensor:
        if self.num_batches_tracked < 2:
            return torch.tensor(math.nan, device=self.batch_range_m2.device)
        return self.batch_range_m2 / (self.num_batches_tracked - 1)

    @property
    def average_percentile_ratio(self) -> torch.Tensor:
        return self.percentile_ratio()[0]

    @property
    def percentile_batches_tracked(self) -> torch.Tensor:
        return self.percentile_ratio()[1]

    @property
    def comp_percentile(self) -> torch.Tensor:
        return torch.tensor([self.comp_percentile_value], device=self.min_val.device)

    def histogram_edges(self) -> np.ndarray:
        """Bin edges of :attr:`histogram` in the units of the observed values."""
        scale = float(2.0 ** self.histogram_exponent.item())
        return np.linspace(-scale, scale, self.histogram_bins + 1)

    @torch.jit.export
    def get_batch_to_epoch_ratio(self) -> torch.Tensor:
        """Average batch range over the range of all batches; NaN when it is undefined.

        PyTorch raises for a zero or infinite range; a constant tensor is a fact to report, so
        here the ratio is NaN and the detectors flag the module instead.
        """
        epoch_range = self.epoch_activation_max - self.epoch_activation_min
        undefined = (epoch_range == 0) | ~torch.isfinite(epoch_range)
        return torch.where(undefined, torch.full_like(epoch_range, math.nan), self.batch_range_mean / epoch_range)

    # ------------------------------------------------------------------ merging and resetting
    def merge_(self, other: ModelReportObserver) -> ModelReportObserver:
        """Fold in the state of ``other`` (same settings), as if this observer had seen its batches."""
        if (other.ch_axis, other.percentiles, other.stats, other.histogram_bins, other.percentile_sample) != (
            self.ch_axis,
            self.percentiles,
            self.stats,
            self.histogram_bins,
            self.percentile_sample,
        ):
            raise ValueError("only observers with the same settings can be merged")
        n_a, n_b = self.num_batches_tracked, other.num_batches_tracked
        if n_b == 0:
            return self
        if n_a == 0:
            self.load_state_dict(other.state_dict())
            self._copy_counters(other)
            return self
        n = n_a + n_b
        delta = other.batch_range_mean - self.batch_range_mean
        self.batch_range_m2 = self.batch_range_m2 + other.batch_range_m2 + delta**2 * (n_a * n_b / n)
        self.batch_range_mean = self.batch_range_mean + delta * (n_b / n)
        self.epoch_activation_min = torch.minimum(self.epoch_activation_min, other.epoch_activation_min)
        self.epoch_activation_max = torch.maximum(self.epoch_activation_max, other.epoch_activation_max)
        if self.min_val.numel() and other.min_val.numel():
            self.min_val = torch.minimum(self.min_val, other.min_val)
            self.max_val = torch.maximum(self.max_val, other.max_val)
            self.constant_channels = self.constant_channels + other.constant_channels
            for i in range(len(self.percentiles)):
                for name in (f"_ratio_sum_{i}", f"_ratio_count_{i}"):
                    setattr(self, name, getattr(self, name) + getattr(other, name))
        if self.histogram.numel():
            exponent = torch.maximum(self.histogram_exponent, other.histogram_exponent)
            mine = _rebin(self.histogram, torch.exp2(exponent - self.histogram_exponent))
            theirs = _rebin(other.histogram, torch.exp2(exponent - other.histogram_exponent))
            self.histogram, self.histogram_exponent = mine + theirs, exponent
        self.num_batches_tracked = n
        self.empty_batches += other.empty_batches
        if other.estimated_from is not None:
            mine = self.estimated_from or other.estimated_from
            self.estimated_from = (min(mine[0], other.estimated_from[0]), max(mine[1], other.estimated_from[1]))
        return self

    def _copy_counters(self, other: ModelReportObserver) -> None:
        for name in ("num_batches_tracked", "empty_batches", "observed_ndim", "estimated_from"):
            setattr(self, name, getattr(other, name))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        # per-channel buffers are created lazily, so adopt the saved shapes before loading
        for name, value in list(self._buffers.items()):
            saved = state_dict.get(prefix + name)
            if saved is not None and value is not None and saved.shape != value.shape:
                self._buffers[name] = torch.empty_like(saved)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.jit.export
    def reset_batch_and_epoch_values(self) -> None:
        """Forget every batch seen so far, keeping the settings and the device."""
        device = self.epoch_activation_min.device
        fresh = ModelReportObserver(
            self.ch_axis,
            self.comp_percentile_value,
            stats=self.stats,
            percentiles=self.percentiles[1:],
            histogram_bins=self.histogram_bins,
            percentile_sample=self.percentile_sample,
            device=device,
        )
        for name, value in fresh._buffers.items():
            self._buffers[name] = value
        self._copy_counters(fresh)

    @torch.jit.export
    def calculate_qparams(self):  # type: ignore[override]
        raise NotImplementedError("ModelReportObserver only collects statistics; it has no qparams")

    def extra_repr(self) -> str:
        stats = ", ".join(sorted(s.value for s in self.stats))
        sample = "exact" if self.percentile_sample is None else f"estimated above {self.percentile_sample} values a channel"
        return f"ch_axis={self.ch_axis}, percentiles={self.percentiles} ({sample}), stats=[{stats}]"


def _first_tensor(values) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def _covering_exponent(absmax: float) -> float:
    """The smallest power-of-two exponent whose range [-2**e, 2**e] holds ``absmax``, within float32's
    normal exponents; NaN and infinity take the largest."""
    if math.isnan(absmax) or math.isinf(absmax):
        return _MAX_EXPONENT
    if absmax == 0.0:
        return _MIN_EXPONENT
    return float(min(max(math.ceil(math.log2(absmax)), _MIN_EXPONENT), _MAX_EXPONENT))


def _rebin(histogram: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Coarsen a histogram over [-R, R] to one over [-factor*R, factor*R], factor a power of two.

    Old bin edges are a superset of the new ones, so every old bin lands whole in one new bin and
    no count is split: histograms stay exactly mergeable.
    """
    bins = histogram.numel()
    if bins == 0:
        return histogram
    half = bins // 2
    centres = torch.arange(bins, device=histogram.device, dtype=torch.float32) + 0.5 - half
    target = (torch.floor(centres / factor) + half).clamp(0, bins - 1).to(torch.int64)
    return torch.zeros_like(histogram).scatter_add_(0, target, histogram)
