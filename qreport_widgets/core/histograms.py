"""Histogram observers' range search done once per histogram.

A histogram observer (torch's FX one, torchao's PT2E one: the x86 default for activations) chooses
its range by a search over its histogram each time it is converted. The simulations convert a copy
of the same calibrated observers once per variant (a sensitivity, a front, a verification), so the
same search ran again for every module asked about: 92% of the searches in the PT2E engine's tests
were repeats, 40% of their time. ``searches_kept()`` keeps each search's result by what it reads (the
histogram, its range, its bins and the target's), so a repeat is a lookup and the result the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections import OrderedDict
from collections.abc import Iterator

import torch

from .kept import results_kept
from .shortcuts import Shortcut

SEARCH = Shortcut.HISTOGRAM_SEARCHES

# results kept (two scalars each, a few hundred bytes with their keys); the oldest dropped beyond it
KEPT = 8192
_FOUND: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


# torchao's PT2E observers, looked up only once imported: no observer of theirs exists before, and
# importing torchao for an FX session's first conversion cost seconds (more on a busy machine)
_PT2E_OBSERVERS = "torchao.quantization.pt2e.observer"


def _observer_classes() -> list[type]:
    from torch.ao.quantization.observer import HistogramObserver

    classes: list[type] = [HistogramObserver]
    pt2e = sys.modules.get(_PT2E_OBSERVERS)
    if pt2e is not None and isinstance(getattr(pt2e, "HistogramObserver", None), type):
        classes.append(pt2e.HistogramObserver)
    return classes


@contextlib.contextmanager
def searches_kept() -> Iterator[None]:
    """While this lasts (re-entrant), a histogram observer's range search with the same histogram,
    range and bins as one done before in the process returns that search's result."""
    with contextlib.ExitStack() as stack:
        for cls in _observer_classes():
            if "_non_linear_param_search" in cls.__dict__:
                kept = results_kept(cls, "_non_linear_param_search", _key, _FOUND, copied=_cloned, limit=KEPT, shortcut=SEARCH)
                stack.enter_context(kept)
        yield


def _cloned(found: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = found
    return low.detach().clone(), high.detach().clone()


def _key(observer: torch.nn.Module) -> tuple:
    digest = hashlib.sha1()
    for tensor in (observer.histogram, observer.min_val, observer.max_val):
        value = tensor.detach().cpu().contiguous()
        digest.update(str((value.dtype, tuple(value.shape))).encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return (type(observer), observer.bins, observer.dst_nbins, str(observer.min_val.device), digest.hexdigest())
