"""Run an FX graph node by node, keep what it computed, and recompute only the part a change touches.

Used by the simulator: keeping one module float changes that module and the quantize points around
it; every node before them, and every node that does not depend on them, computes what it computed
in the starting configuration. One run of the starting configuration per batch is kept, and each
variant recomputes its changed nodes and their descendants from it.

In-place ops are the catch: a kept value that a later node mutates is no longer what its readers
saw. Mutations are found from tensors' version counters. One that only the mutating node can see
(the mutated value has no other reader, as in ``relu(inplace=True)`` after a conv, or
``out += identity``) is handled by keeping a copy of the value before the mutation and handing a
copy to whoever recomputes from it. Any other mutation makes ``Replay.exact`` false, and the caller
runs whole forward passes instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves


class Replay:
    """A graph module's nodes in execution order, runnable whole or in part.

    Args:
        model: the graph module (its graph must not change while this is used).
    """

    def __init__(self, model: torch.fx.GraphModule) -> None:
        self.model = model
        self.nodes = list(model.graph.nodes)
        self._position = {node: i for i, node in enumerate(self.nodes)}
        self._interpreter = torch.fx.Interpreter(model, garbage_collect_values=False)
        self._placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self._signature = inspect.signature(model.forward)
        self._last_use = {}
        for node in self.nodes:
            for source in node.all_input_nodes:
                self._last_use[source] = node
        self._mutated: set[torch.fx.Node] = set()  # values a later node changes in place (seen so far)
        self.exact = all(p.op == "placeholder" and not str(p.target).startswith("*") for p in self._placeholders)

    def affected(self, seeds: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
        """``seeds`` and every node that depends on them, in execution order."""
        changed = set(seeds)
        for node in self.nodes:
            if node not in changed and any(source in changed for source in node.all_input_nodes):
                changed.add(node)
        return sorted(changed, key=self._position.__getitem__)

    def inputs_of(self, nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
        """The values ``nodes`` read from outside themselves (what a recomputation needs kept)."""
        inside = set(nodes)
        return {source for node in nodes for source in node.all_input_nodes if source not in inside}

    def run(self, batch: Any, keep: set[torch.fx.Node]) -> dict[torch.fx.Node, Any]:
        """Run every node on ``batch``; return the values of ``keep`` (and of the output node), each
        as it was when computed. May set ``exact`` to False (see the module's docstring)."""
        mutated_before = set(self._mutated)
        kept = self._run(batch, keep)
        if self.exact and self._mutated != mutated_before:  # found a mutation: keep copies from now on
            kept = self._run(batch, keep)
        return kept

    def rerun(self, kept: Mapping[torch.fx.Node, Any], nodes: list[torch.fx.Node]) -> Any:
        """The output with ``nodes`` (from ``affected``) recomputed and everything else read from ``kept``."""
        if not nodes or nodes[-1].op != "output":
            return kept[self.nodes[-1]]
        values: dict[torch.fx.Node, Any] = {}

        def read(source: torch.fx.Node) -> Any:
            if source not in values:  # a kept value that is changed in place is read as a copy
                value = kept[source]
                values[source] = _copy(value) if source in self._mutated else value
            return values[source]

        for node in nodes:
            values[node] = self._call(node, map_arg(node.args, read), map_arg(node.kwargs, read))
        return values[nodes[-1]]

    def _run(self, batch: Any, keep: set[torch.fx.Node]) -> dict[torch.fx.Node, Any]:
        live: dict[torch.fx.Node, Any] = dict(zip(self._placeholders, self._bind(batch), strict=True))
        kept: dict[torch.fx.Node, Any] = {}
        versions: dict[torch.fx.Node, list[int]] = {}
        output = self.nodes[-1]
        for node in self.nodes:
            if node.op != "placeholder":
                live[node] = self._call(node, map_arg(node.args, live.__getitem__), map_arg(node.kwargs, live.__getitem__))
            value = live[node]
            versions[node] = _versions(value)
            if node in keep or node is output:
                kept[node] = _copy(value) if node in self._mutated else value
            for source in node.all_input_nodes:
                if source in live and _versions(live[source]) != versions[source]:
                    self._note_mutation(source, node)
                    versions[source] = _versions(live[source])
                if self._last_use.get(source) is node:
                    del live[source]
        if any(_versions(value) != versions[node] for node, value in kept.items() if node not in self._mutated):
            self.exact = False  # changed by a node that does not read it: through a view
        return kept

    def _note_mutation(self, source: torch.fx.Node, by: torch.fx.Node) -> None:
        if len(source.users) == 1 and self._last_use.get(source) is by:
            self._mutated.add(source)  # only ``by`` reads it: a copy taken before ``by`` is exact
        else:
            self.exact = False

    def _bind(self, batch: Any) -> list[Any]:
        if isinstance(batch, tuple):
            bound = self._signature.bind(*batch)
        elif isinstance(batch, Mapping):
            bound = self._signature.bind(**batch)
        else:
            bound = self._signature.bind(batch)
        bound.apply_defaults()
        return list(bound.arguments.values())

    def _call(self, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
        """What the node computes from these arguments (torch.fx's interpreter runs each kind of node)."""
        if node.op == "placeholder":
            raise ValueError(f"cannot replay a placeholder ({node.name}) without its input")
        return getattr(self._interpreter, node.op)(node.target, args, kwargs)


def _versions(value: Any) -> list[int]:
    return [leaf._version for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (tuple, list):
        return type(value)(_copy(v) for v in value)
    return value
