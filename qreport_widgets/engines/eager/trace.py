"""A model's leaf modules in the order one forward pass calls them, as a graph the detectors read,
without tracing: hooks watch which module's output each module reads.

The graph (``torch.fx.Graph``, never executed) has a ``call_module`` node per leaf module called on
the example inputs, in call order; a node's argument is the node of the module whose output it
reads, or, when its input comes from elsewhere (a residual add, a reshape, the attention
arithmetic, the model's own inputs), a node standing for that module's input alone. Each node
carries its *site* (``meta["site"]``: the module's output, or its input) so observers can be hooked
there. ``ObservedModules`` is what the report instruments: the float model's leaf modules under
their own names, and a forward that runs the float model itself. The pass may be recorded: what
every leaf module read and wrote, so the report's observers can be fed that batch without running it
again (``replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...core.calibration import call_with
from ...observe.graph import CHANNEL_FIRST, CHANNEL_LAST, ModelGraph
from ...observe.instrument import INPUT, OUTPUT, Site, first_tensor

PASSED_ON = "passed on"  # a module whose output is its input tensor itself


@dataclass
class Call:
    """One call of a leaf module in a recorded pass: its first tensor input and its output, with the
    version counters they had then (a tensor changed in place afterwards has a newer one)."""

    input: torch.Tensor | None
    input_version: int
    output: Any = None
    output_version: int = 0

    def seen(self, side: str) -> Any:
        return self.output if side == OUTPUT else self.input

    def unchanged(self, side: str) -> bool:
        value, version = (self.output, self.output_version) if side == OUTPUT else (self.input, self.input_version)
        return not isinstance(value, torch.Tensor) or value._version == version


class ObservedModules(nn.Module):
    """The float model's modules under their own names (so ``named_modules`` gives the float
    model's names) and its forward; ``graph`` is the dataflow of its leaf modules. Observers hooked
    on those modules see what the float model computes."""

    def __init__(self, model: nn.Module, graph: torch.fx.Graph, skipped: dict[str, str]) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "float_model", model)  # not a child: names stay the float model's
        self.graph = graph
        self.skipped = skipped  # leaf module -> why it has no node
        self.recorded: dict[str, list[Call]] | None = None  # the example pass, until replayed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.float_model(*args, **kwargs)


def leaf_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module without children, by name (the first name of a shared module)."""
    return {fqn: module for fqn, module in model.named_modules() if fqn and next(module.children(), None) is None}


def observed_modules(model: nn.Module, example_inputs: tuple[Any, ...] | dict[str, Any], record: bool = False) -> ObservedModules:
    """Run ``model`` once on ``example_inputs`` and record which leaf module reads which one's output;
    with ``record``, also every leaf module's input and output on that pass (held until ``replay``)."""
    leaves = leaf_modules(model)
    recorded: dict[str, list[Call]] = {}
    calls: list[tuple[str, int | None, torch.Tensor | None, torch.Tensor | None]] = []
    kept: list[torch.Tensor] = []  # outputs stay alive while tracing, so no id is reused
    producers: dict[int, str] = {}
    seen: set[str] = set()

    def before(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            first = first_tensor(args, kwargs)
            if record:
                recorded.setdefault(name, []).append(Call(first, first._version if first is not None else 0))
            if name not in seen:
                calls.append((name, producers.get(id(first)) if first is not None else None, first, None))

        return hook

    def after(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if record:
                call = recorded[name][-1]
                call.output, call.output_version = output, getattr(output, "_version", 0)
            if name in seen:
                return
            seen.add(name)
            index = max(i for i, call in enumerate(calls) if call[0] == name)
            if output is calls[index][2]:  # its input itself (dropout in eval mode): nothing new to observe
                calls[index] = (*calls[index][:3], PASSED_ON)
                return
            calls[index] = (*calls[index][:3], output if isinstance(output, torch.Tensor) else None)
            if isinstance(output, torch.Tensor):
                kept.append(output)
                producers[id(output)] = name

        return hook

    handles: list[RemovableHandle] = []
    try:
        for name, module in leaves.items():
            handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
            handles.append(module.register_forward_hook(after(name), with_kwargs=True))
        with torch.no_grad():
            call_with(model, example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    observed = ObservedModules(model, *_graph(leaves, calls))
    observed.recorded = recorded if record else None
    return observed


def replay(observed: ObservedModules, feeds: Mapping[Site, Callable[[Any], None]]) -> bool:
    """Feed each site what its module read or wrote in the recorded pass, as its hook would have; the
    recording is dropped either way. False, feeding nothing, when there is no recording or a watched
    tensor was changed in place after it was seen (an in-place ReLU on a conv's output, say)."""
    recorded, observed.recorded = observed.recorded, None
    if recorded is None:
        return False
    calls = [(feed, call, site.side) for site, feed in feeds.items() for call in recorded.get(site.module, ())]
    if not all(call.unchanged(side) for _, call, side in calls):
        return False
    for feed, call, side in calls:
        feed(call.seen(side))
    return True


def _graph(leaves: dict[str, nn.Module], calls: list) -> tuple[torch.fx.Graph, dict[str, str]]:
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}
    skipped: dict[str, str] = {}
    last_axis = 1  # the channel axis of the latest Conv / norm / Linear called: an outside input's best guess
    for name, producer, first, output in calls:
        if output is PASSED_ON:
            skipped[name] = "returns its input unchanged (dropout in eval mode, say): observed where that tensor is made"
            continue
        if output is None:
            skipped[name] = "its output is not one tensor: observed only where another module reads it"
            continue
        args: tuple = ()
        if producer in nodes:
            args = (nodes[producer],)
        elif first is not None and first.is_floating_point():
            own = graph.placeholder(_node_name(f"{name}_input"))
            own.meta["site"] = Site(name, INPUT)
            own.meta["channel_axis"] = last_axis
            args = (own,)
        node = graph.call_module(name, args)
        node.meta["site"] = Site(name, OUTPUT)
        nodes[name] = node
        module = leaves[name]
        if isinstance(module, CHANNEL_FIRST):
            last_axis = 1
        elif isinstance(module, CHANNEL_LAST):
            last_axis = -1
    for name in leaves:
        if name not in nodes and name not in skipped:
            skipped[name] = "never called on the example inputs"
    graph.output(tuple(nodes.values())[-1:] or None)
    return graph, skipped


def _node_name(text: str) -> str:
    return text.replace(".", "_")


def eager_graph(model: nn.Module, per_channel_weights: dict[str, bool] | None = None) -> ModelGraph:
    """The units of an ``ObservedModules``: its leaf modules with a node, the others skipped with
    why; ``per_channel_weights``: the modules the start quantizes, whether per channel (or finer)."""
    graph = ModelGraph.of(model)  # type: ignore[arg-type]  # reads .graph and named_modules only
    skipped = getattr(model, "skipped", {})
    graph.skipped = {fqn: skipped.get(fqn, why) for fqn, why in graph.skipped.items()}
    graph.per_channel_weights = per_channel_weights
    graph.kind = "modules"
    return graph


__all__ = ["ObservedModules", "eager_graph", "leaf_modules", "observed_modules", "replay"]
