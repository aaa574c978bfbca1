"""Insert and remove ModelReportObservers: one per distinct (tensor, channel axis), shared by detectors.

In a GraphModule an observer is a ``call_module`` node after its tensor. A graph that is a map of a
model run eagerly (its nodes carry ``meta["site"]``: a module's output or input) gets hooks on
those modules instead; the model runs its own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core.devices import model_device
from ..core.features import Stat
from .detectors.base import ObservationRequest
from .graph import OBSERVER_CONTAINER, ModelGraph
from .observer import PERCENTILE_SAMPLE, ModelReportObserver

_PER_CHANNEL = frozenset({Stat.CHANNEL_MINMAX, Stat.PERCENTILE})


@dataclass
class Placement:
    """One observer to insert: the tensor it watches and the union of what was asked of it."""

    name: str
    node: torch.fx.Node
    ch_axis: int
    stats: set[Stat] = field(default_factory=set)
    percentiles: list[float] = field(default_factory=list)
    histogram_bins: int = 0
    factory: Callable[[int], nn.Module] | None = None

    def build(self, percentile_sample: int | None = PERCENTILE_SAMPLE, device: torch.device | None = None) -> nn.Module:
        if self.factory is not None:
            return self.factory(self.ch_axis).to(device)
        percentiles = self.percentiles or [0.9]
        return ModelReportObserver(
            self.ch_axis,
            percentiles[0],
            stats=self.stats,
            percentiles=percentiles[1:],
            histogram_bins=self.histogram_bins,
            percentile_sample=percentile_sample,
            device=device,
        )


OUTPUT, INPUT = "output", "input"


@dataclass(frozen=True)
class Site:
    """Where an eagerly run model's tensor is watched: a module's output, or its first tensor input."""

    module: str
    side: str  # OUTPUT or INPUT


class ObserverContainer(nn.Module):
    """Holds the inserted observers; ``index`` maps (unit, side, requested axis) to an observer name."""

    def __init__(self) -> None:
        super().__init__()
        self.index: dict[tuple[str, str, int | None], str] = {}
        self.handles: list[RemovableHandle] = []  # hooks of an eagerly run model
        self.feeds: dict[Site, Callable[[Any], None]] = {}  # what those hooks call with their site's tensor


def plan(graph: ModelGraph, requests: Iterable[ObservationRequest]) -> tuple[list[Placement], dict]:
    """Merge requests on the same tensor. Range-only requests join any observer of that tensor."""
    placements: dict[tuple[str, int], Placement] = {}
    index: dict[tuple[str, str, int | None], str] = {}
    pending_range_only: list[tuple[ObservationRequest, torch.fx.Node, int]] = []
    for request in requests:
        located = graph.point(graph.units[request.unit], request.side, request.ch_axis)
        if located is None:
            continue
        node, axis = located
        if request.observer_factory is not None:
            if not request.tag.isidentifier():
                raise ValueError(f"an observer tag must be an identifier, got {request.tag!r}")
            name = f"{node.name}_{request.tag}"
            placements.setdefault((name, axis), Placement(name, node, axis, factory=request.observer_factory))
            index[(request.unit, request.side.value, request.tag)] = name
            continue
        if not request.stats & _PER_CHANNEL and Stat.HISTOGRAM not in request.stats:
            pending_range_only.append((request, node, axis))
            continue
        placement = _placement(placements, node, axis)
        _merge(placement, request)
        index[(request.unit, request.side.value, request.ch_axis)] = placement.name
    by_name = {p.name: p for p in placements.values()}
    for request, node, axis in pending_range_only:
        key = (request.unit, request.side.value, request.ch_axis)
        placement = by_name.get(index.get(key, ""))
        placement = placement or next((p for (n, _), p in placements.items() if n == node.name and p.factory is None), None)
        placement = placement or _placement(placements, node, axis)
        by_name[placement.name] = placement
        _merge(placement, request)
        index[key] = placement.name
    return list(placements.values()), index


def _placement(placements: dict[tuple[str, int], Placement], node: torch.fx.Node, axis: int) -> Placement:
    key = (node.name, axis)
    if key not in placements:
        suffix = "" if not any(n == node.name for n, _ in placements) else f"_axis{axis}".replace("-", "m")
        placements[key] = Placement(f"{node.name}{suffix}", node, axis)
    return placements[key]


def _merge(placement: Placement, request: ObservationRequest) -> None:
    placement.stats |= request.stats
    if request.percentile is not None and request.percentile not in placement.percentiles:
        placement.percentiles.append(request.percentile)
    placement.histogram_bins = max(placement.histogram_bins, request.histogram_bins)


def insert(
    model: nn.Module, placements: list[Placement], index: dict, percentile_sample: int | None = PERCENTILE_SAMPLE
) -> ObserverContainer:
    """Add the observers to ``model`` (in place) as call_module nodes right after their tensors, or
    as hooks on the modules of an eagerly run model's sites; ``percentile_sample``: see
    :class:`ModelReportObserver` (None: exact percentiles)."""
    container = ObserverContainer()
    container.index = index
    device = model_device(model)  # made where the model computes: no batch moves a statistic
    model.add_module(OBSERVER_CONTAINER, container)
    if not isinstance(model, torch.fx.GraphModule):
        watch: dict[Site, list[nn.Module]] = {}
        for placement in placements:
            container.add_module(placement.name, placement.build(percentile_sample, device))
            watch.setdefault(placement.node.meta["site"], []).append(container.get_submodule(placement.name))
        container.handles, container.feeds = attach(model, watch)
        return container
    last_placeholder = None
    for node in model.graph.nodes:
        if node.op == "placeholder":
            last_placeholder = node
    for placement in placements:
        container.add_module(placement.name, placement.build(percentile_sample, device))
        anchor = last_placeholder if placement.node.op == "placeholder" else placement.node
        with model.graph.inserting_after(anchor):
            model.graph.call_module(f"{OBSERVER_CONTAINER}.{placement.name}", (placement.node,))
    model.recompile()
    return container


def remove(model: nn.Module) -> None:
    """Take every inserted observer node (or hook) and module out of ``model``."""
    if not isinstance(model, torch.fx.GraphModule):
        container = getattr(model, OBSERVER_CONTAINER, None)
        for handle in getattr(container, "handles", ()):
            handle.remove()
        if container is not None:
            delattr(model, OBSERVER_CONTAINER)
        return
    prefix = f"{OBSERVER_CONTAINER}."
    for node in list(model.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith(prefix):
            model.graph.erase_node(node)
    if hasattr(model, OBSERVER_CONTAINER):
        delattr(model, OBSERVER_CONTAINER)
    model.recompile()


def attach(
    model: nn.Module, watch: dict[Site, list[nn.Module]]
) -> tuple[list[RemovableHandle], dict[Site, Callable[[Any], None]]]:
    """Hook each site's observers on its module (its output, or its first tensor input); they see
    floating-point tensors only. Also returns, per site, what its hook calls with the site's tensor."""
    modules = dict(model.named_modules())
    handles, feeds = [], {}
    for site, observers in watch.items():
        module = modules[site.module]
        feed = feeds[site] = _feed(observers)
        if site.side == OUTPUT:

            def after(_module: nn.Module, _args: tuple, output: Any, feed: Callable = feed) -> None:
                feed(output)

            handles.append(module.register_forward_hook(after))
        else:

            def before(_module: nn.Module, args: tuple, kwargs: dict, feed: Callable = feed) -> None:
                feed(first_tensor(args, kwargs))

            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
    return handles, feeds


def _feed(observers: list[nn.Module]) -> Callable[[Any], None]:
    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            for observer in observers:
                observer(value.detach())

    return feed


def first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first tensor among a call's positional, then keyword arguments."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None
