"""DetectorBase and what detectors exchange with the observation step: requests in, typed records out."""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ...core.features import Side, Stat
from ...errors import QReportWarning, warn_user
from ..compat import from_upstream, to_upstream
from ..graph import OBSERVER_CONTAINER, ModelGraph, Unit
from ..observer import ModelReportObserver
from ..records import Column, DetectorResult, Suggestion

__all__ = [
    "Column",
    "DetectorBase",
    "DetectorResult",
    "ObservationRequest",
    "ObservedTensor",
    "QReportWarning",
    "ReportContext",
    "Suggestion",
    "check_axis",
    "check_range",
    "weighted_units",
]


@dataclass(frozen=True)
class ObservationRequest:
    """A detector's wish to see one tensor of one unit, with the statistics it will read."""

    unit: str
    side: Side
    stats: frozenset[Stat]
    percentile: float | None = None
    ch_axis: int | None = None  # None: the unit's default axis (Conv: 1, Linear: last)
    histogram_bins: int = 0
    # a detector's own observer: ``observer_factory(channel_axis)`` builds it, ``tag`` (an
    # identifier) names it; it gets the tensor alone and must return it unchanged
    observer_factory: Callable[[int], nn.Module] | None = None
    tag: str = ""


@dataclass(frozen=True)
class ObservedTensor:
    """Read-only numpy snapshot of one observer, as detectors consume it."""

    observer: ModelReportObserver
    ch_axis: int  # normalised to the observed rank, as PyTorch reports it

    @property
    def batches(self) -> int:
        return self.observer.num_batches_tracked

    def range_ratio(self) -> float:
        return float(self.observer.get_batch_to_epoch_ratio())

    def batch_range_std(self) -> float:
        return float(self.observer.batch_range_variance.sqrt())

    def channel_min(self) -> np.ndarray:
        return self.observer.min_val.detach().cpu().numpy().copy()

    def channel_max(self) -> np.ndarray:
        return self.observer.max_val.detach().cpu().numpy().copy()

    def percentile_ratio(self, q: float) -> tuple[np.ndarray, np.ndarray]:
        ratio, count = self.observer.percentile_ratio(q)
        return ratio.cpu().numpy().copy(), count.cpu().numpy().copy()

    def constant_counts(self) -> np.ndarray:
        return self.observer.constant_channels.cpu().numpy().copy()

    @property
    def estimated_from(self) -> tuple[int, int] | None:
        """(fewest values sampled, most values a channel held) when percentiles were estimated."""
        return self.observer.estimated_from

    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """Counts and bin edges of the observed values (empty when no histogram was kept)."""
        counts = self.observer.histogram.detach().cpu().numpy().copy()
        if counts.size == 0 or self.batches == 0:
            return np.zeros(0), np.zeros(0)
        return counts, self.observer.histogram_edges()


@dataclass
class ReportContext:
    """What a detector sees when it writes its report: the graph and the filled observers."""

    graph: ModelGraph
    index: dict[tuple[str, str, int | None], str] = field(default_factory=dict)
    pending: list[tuple[str, str]] | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ReportContext:
        container = getattr(model, OBSERVER_CONTAINER, None)
        if not isinstance(model, torch.fx.GraphModule):
            raise TypeError("generate_detector_report needs the GraphModule that ModelReport instrumented")
        return cls(ModelGraph.of(model), dict(getattr(container, "index", {})))

    def observed(self, unit: str, side: Side, ch_axis: int | None = None) -> ObservedTensor | None:
        """The observer that watched ``unit``'s ``side`` tensor, or None if none was inserted."""
        name = self.index.get((unit, side.value, ch_axis))
        if name is None:
            return None
        observer = getattr(self.graph.model, OBSERVER_CONTAINER).get_submodule(name)
        ndim = observer.observed_ndim or 0
        axis = observer.ch_axis % ndim if ndim and -ndim <= observer.ch_axis < ndim else observer.ch_axis
        return ObservedTensor(observer, axis)

    def observer(self, unit: str, side: Side, tag: str) -> nn.Module | None:
        """A detector's own observer (see ``ObservationRequest.observer_factory``), or None."""
        name = self.index.get((unit, side.value, tag))
        return None if name is None else getattr(self.graph.model, OBSERVER_CONTAINER).get_submodule(name)

    def warn(self, module_fqn: str, message: str) -> str:
        """Warn (QReportWarning) that ``module_fqn`` has ``message``; with ``pending`` set, the
        warning waits there so that ModelReport can group modules with the same problem."""
        text = f"{module_fqn}: {message}"
        if self.pending is not None:
            self.pending.append((module_fqn, message))
        else:
            warn_user(text)
        return text


class DetectorBase(ABC):
    """Base of every detector.

    A detector says which tensors it needs (:meth:`requests`) and turns the filled observers into
    typed per-module records (:meth:`analyze`). The PyTorch-shaped methods
    (``generate_detector_report``, ``determine_observer_insert_points``) are derived from those two.
    """

    name: ClassVar[str] = ""
    affects_qconfig: ClassVar[bool] = False  # its records name the modules generate_qconfig_mapping() covers

    def get_detector_name(self) -> str:
        return self.name

    @abstractmethod
    def requests(self, graph: ModelGraph) -> list[ObservationRequest]:
        """Tensors to observe during calibration, with the statistics this detector reads."""

    @abstractmethod
    def analyze(self, context: ReportContext) -> DetectorResult:
        """Typed records from the observers; must not change any observer (reports are idempotent)."""

    def describe(self, result: DetectorResult) -> str:
        """Human-readable report text."""
        lines = [f"{self.name}:"] + [f"  {s.module_fqn}: {s.reason}" for s in result.suggestions]
        return "\n".join(lines + [f"  note: {n}" for n in result.notes]) + "\n"

    def columns(self, record: Any) -> Mapping[str, Column]:
        """The record's features by report key, in numpy: what tables, views and report files read.

        Records with a ``columns()`` method answer themselves; for a detector that only overrides
        :meth:`upstream_dict`, the columns are read from that dictionary.
        """
        own = getattr(record, "columns", None)
        if callable(own):
            return own()
        if type(self).upstream_dict is DetectorBase.upstream_dict:
            raise TypeError(
                f"{type(record).__name__} has no columns() method: give it one that returns its features "
                "(numpy arrays per channel, scalars per module), or override upstream_dict() in the detector"
            )
        return from_upstream(self.upstream_dict(record))

    def upstream_dict(self, record: Any) -> dict[str, Any]:
        """The record as PyTorch's dictionary for the module (tensors and lists, as torch reports)."""
        return to_upstream(self.columns(record))

    # ---- PyTorch-compatible surface ----------------------------------------------------------
    def generate_detector_report(self, model: nn.Module) -> tuple[str, dict[str, Any]]:
        result = self.analyze(ReportContext.of(model))
        return self.describe(result), {r.module_fqn: self.upstream_dict(r) for r in result.records}

    def determine_observer_insert_points(self, model: torch.fx.GraphModule) -> dict[str, dict[str, Any]]:
        graph = ModelGraph.of(model)
        points: dict[str, dict[str, Any]] = {}
        for request in self.requests(graph):
            unit = graph.units[request.unit]
            located = graph.point(unit, request.side, request.ch_axis)
            if located is None:
                continue
            node, axis = located
            points[f"{request.unit}.{request.side.value}"] = {
                "target_node": unit.node,
                "observer_to_insert": ModelReportObserver(axis, request.percentile or 0.9, stats=request.stats),
                "is_post_observer": request.side is Side.OUTPUT,
                "observer_args": (node,),
            }
        return points


def weighted_units(graph: ModelGraph, types: tuple[type, ...], exact: bool = False) -> list[Unit]:
    """Units whose weighted module (the first child of a fused unit) is one of ``types``."""
    if exact:
        return [u for u in graph.units.values() if type(u.base) in types]
    return [u for u in graph.units.values() if isinstance(u.base, types)]


def check_range(name: str, value: float, low: float, high: float, *, low_open: bool = True, high_open: bool = True) -> float:
    """``value`` if it lies in the interval, else a ValueError naming the argument and the interval."""
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in {interval}, got {value!r} ({type(value).__name__})")
    ok_low = value > low if low_open else value >= low
    ok_high = value < high if high_open else value <= high
    if not (ok_low and ok_high):
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")
    return float(value)


def check_axis(ch_axis: int | None) -> int | None:
    if ch_axis is not None and (isinstance(ch_axis, bool) or not isinstance(ch_axis, numbers.Integral) or not -8 <= ch_axis < 8):
        raise ValueError(f"ch_axis must be None (pick per module) or an int in [-8, 8), got {ch_axis!r}")
    return None if ch_axis is None else int(ch_axis)
