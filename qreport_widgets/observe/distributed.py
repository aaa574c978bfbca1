"""Calibration across the processes of a torch.distributed group.

Each rank calibrates on the batches it was given; then one collective (``all_gather_object``)
carries every rank's batch count, its failure if it had one, and its observers' state, and every
rank merges the states in rank order, so every rank ends with the same observers: those one
process would have after calibrating on all the batches.

- The report's own observers (``ModelReportObserver``) merge exactly with ``merge_``: ranges,
  per-channel min / max and histograms exactly, the batch-range averages and variances to float
  rounding.
- What a pass gathers besides observers (GPTQ's input Gram matrices, AWQ's input magnitudes:
  ``InputStatistics``) by adding the ranks' sums.
- A prepared model's own observers: the min / max family (``MinMaxObserver``,
  ``PerChannelMinMaxObserver``, the percentile observer, the equalization observers' inner ones)
  exactly; moving-average observers by averaging the ranks' ranges (their result depends on batch
  order even in one process); torch's ``HistogramObserver`` by spreading each rank's histogram
  over the union of the ranges and adding, as torch itself combines a histogram when the range
  grows (approximate: a bin's count is spread evenly over the bins it overlaps).

A rank that fails, or has no batch, or a different number of batches from the others, makes every
rank raise ``DistributedCalibrationError`` after the exchange: no rank is left waiting in a
collective the others never reach.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import DistributedCalibrationError
from .observer import ModelReportObserver


def group_of(process_group: Any = None) -> Any | None:
    """The group to calibrate across: ``process_group``, else the default group when torch.distributed
    is initialised; None when there is none or it has a single process (nothing to merge)."""
    import torch.distributed as dist

    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    if process_group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group= needs torch.distributed initialised (torch.distributed.init_process_group)")
    group = process_group if process_group is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


def calibrated_across(
    group: Any | None,
    model: nn.Module,
    calibrate_here: Callable[[], int],
    what: str,
    report_observers: bool = False,
    statistics: MutableMapping[str, Any] | None = None,
) -> int:
    """``calibrate_here()`` on this rank (its batch count), then the observers of ``model`` merged
    across ``group`` (the report's observers with ``report_observers``, else the model's own
    quantization observers), and ``statistics`` the pass gathered besides (name -> an object with
    ``merge_``, such as GPTQ's and AWQ's input statistics) replaced by every rank's merged in rank
    order. Without a group it is ``calibrate_here()``. Returns the batches seen by all ranks together."""
    if group is None:
        return calibrate_here()
    import torch.distributed as dist

    count, failure, local = 0, None, None
    try:
        count = calibrate_here()
    except Exception as error:  # said on every rank after the exchange, not left to hang the others
        failure, local = f"{type(error).__name__}: {error}", error
    states = {} if failure else _states(model, report_observers)
    found = {} if failure or statistics is None else dict(statistics)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (count, failure, states, found), group=group)
    _refuse_uneven(gathered, what, local)
    _merge(model, [states for _, _, states, _ in gathered], report_observers)
    if statistics is not None:
        for name in statistics:
            statistics[name] = _folded([found[name] for _, _, _, found in gathered])
    return sum(max(c, 0) for c, _, _, _ in gathered)


def _refuse_uneven(gathered: list[Any], what: str, local: Exception | None) -> None:
    failed = {r: failure for r, (_, failure, *_) in enumerate(gathered) if failure}
    if failed:
        said = "; ".join(f"rank {r}: {failure}" for r, failure in failed.items())
        raise DistributedCalibrationError(
            f"{what}: calibration failed on {len(failed)} of {len(gathered)} rank(s), so every rank stops here ({said}). "
            "A rank with no batch needs a share of the data: shard it with "
            "torch.utils.data.DistributedSampler(dataset, drop_last=True) or give each rank the same number of batches."
        ) from local
    counts = [count for count, *_ in gathered]
    if min(counts) >= 0 and len(set(counts)) > 1:  # -1: a calibration callable, whose batches are not counted
        listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise DistributedCalibrationError(
            f"{what}: the ranks calibrated on different numbers of batches ({listed}); every rank stops here. "
            "Give each rank the same number of batches (torch.utils.data.DistributedSampler(dataset, "
            "drop_last=True) over a DataLoader does): an uneven split usually means a rank read the wrong shard."
        )


def _states(model: nn.Module, report_observers: bool) -> dict[str, nn.Module]:
    """The observers to merge, copied to the CPU for the exchange."""
    return {name: copy.deepcopy(observer).cpu() for name, observer in _observers(model, report_observers)}


def _observers(model: nn.Module, report_observers: bool) -> Iterator[tuple[str, nn.Module]]:
    for name, module in model.named_modules():
        if isinstance(module, ModelReportObserver):
            if report_observers:
                yield name, module
        elif not report_observers and _has_range(module):
            yield name, module


def _has_range(module: nn.Module) -> bool:
    return isinstance(getattr(module, "min_val", None), torch.Tensor) and isinstance(
        getattr(module, "max_val", None), torch.Tensor
    )


def _merge(model: nn.Module, ranks: list[dict[str, nn.Module]], report_observers: bool) -> None:
    for name, observer in _observers(model, report_observers):
        each = [states[name] for states in ranks]
        if report_observers:
            merged = _folded(each)
            observer.load_state_dict(merged.state_dict())
            observer._copy_counters(merged)
        else:
            _merge_range(observer, each)


def _folded(each: list[Any]) -> Any:
    """The ranks' states (this process's own unpickled copies) merged in rank order with ``merge_``."""
    merged = each[0]
    for other in each[1:]:
        merged.merge_(other)
    return merged


def _merge_range(observer: nn.Module, each: list[nn.Module]) -> None:
    seen = [o for o in each if o.min_val.numel() and bool(torch.isfinite(o.min_val).all())]
    if not seen:
        return
    device = observer.min_val.device
    lows = torch.stack([o.min_val for o in seen])
    highs = torch.stack([o.max_val for o in seen])
    if hasattr(observer, "histogram") and isinstance(observer.histogram, torch.Tensor):
        low, high = lows.min(0).values, highs.max(0).values
        histogram = sum(_spread(o.histogram, o.min_val, o.max_val, low, high) for o in seen)
        observer.histogram = histogram.to(device=device, dtype=observer.histogram.dtype)
    elif "MovingAverage" in type(observer).__name__:  # order-dependent even in one process: the ranks' mean
        low, high = lows.mean(0), highs.mean(0)
    else:
        low, high = lows.min(0).values, highs.max(0).values
    observer.min_val = low.to(device=device, dtype=observer.min_val.dtype)
    observer.max_val = high.to(device=device, dtype=observer.max_val.dtype)


def _spread(
    histogram: torch.Tensor, low: torch.Tensor, high: torch.Tensor, new_low: torch.Tensor, new_high: torch.Tensor
) -> torch.Tensor:
    """``histogram`` over [low, high] redistributed over the same number of bins on [new_low,
    new_high] (which contains it), each bin's count spread evenly over its width."""
    counts = histogram.double().numpy()
    bins = len(counts)
    targets = np.linspace(float(new_low), float(new_high), bins + 1)
    if float(high) <= float(low):  # one value: all of it in the bin that holds it
        spread = np.zeros(bins)
        width = (float(new_high) - float(new_low)) or 1.0
        spread[min(int((float(low) - float(new_low)) / width * bins), bins - 1)] = counts.sum()
        return torch.from_numpy(spread)
    cumulative = np.concatenate([[0.0], np.cumsum(counts)])
    edges = np.linspace(float(low), float(high), bins + 1)
    return torch.from_numpy(np.diff(np.interp(targets, edges, cumulative)))
