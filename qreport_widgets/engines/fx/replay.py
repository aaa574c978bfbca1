"""Run an FX graph node by node, and run variants of it from where they start to differ.

Used by the simulator: keeping one module float changes that module and the quantize points around
it; every node before them computes what it computed in the starting configuration. Per batch, one
run of the starting configuration goes through the graph in order; each variant, when that run
reaches the first node the variant changes, is computed from there to the output on the values the
starting run holds at that point, and those values are dropped as soon as nothing later reads them.
What is alive at once is what a plain forward pass holds, plus one variant's own values: not every
activation of the batch.

In-place ops are the catch: a variant that changes a value the starting run still holds would
change what later variants read. A first run of the graph finds which nodes change which values in
place (from tensors' version counters); a variant recomputes every such node after its start (its
effect may be read later), and reads a copy of any held value one of its nodes changes. What this
cannot follow (two held values that are views of one another, both changed) makes ``Replay.exact``
false, and the caller runs whole forward passes instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class Plan:
    """What one variant recomputes on each batch.

    Attributes:
        start: the position of the first node the variant computes differently (the graph's length
            when its output does not change).
        nodes: from ``start`` on, in execution order: the nodes the output depends on, and every node
            that changes a value in place (not the inputs: the starting run holds them).
        copies: values the starting run holds that ``nodes`` change in place (read as copies).
        free_after: node -> the values no later node of ``nodes`` reads.
    """

    start: int
    nodes: list[torch.fx.Node]
    copies: frozenset[torch.fx.Node] = frozenset()
    free_after: dict[torch.fx.Node, list[torch.fx.Node]] = field(default_factory=dict)


class Replay:
    """A graph module's nodes in execution order, runnable whole or from a variant's first change.

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
        self._last_use: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.nodes:
            for source in node.all_input_nodes:
                self._last_use[source] = node
        self._changes: dict[torch.fx.Node, set[torch.fx.Node]] | None = None  # in-place op -> the values it changes
        self.exact = all(p.op == "placeholder" and not str(p.target).startswith("*") for p in self._placeholders)

    def affected(self, seeds: Iterable[torch.fx.Node]) -> list[torch.fx.Node]:
        """``seeds`` and every node that depends on them, in execution order."""
        changed = set(seeds)
        for node in self.nodes:
            if node not in changed and any(source in changed for source in node.all_input_nodes):
                changed.add(node)
        return sorted(changed, key=self._position.__getitem__)

    def learn(self, batch: Any) -> None:
        """Find the in-place ops (one run on ``batch``); ``plan`` needs them. Runs once."""
        if self._changes is not None:
            return
        changes: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        live = dict(zip(self._placeholders, self._bind(batch), strict=True))
        versions = {node: _versions(value) for node, value in live.items()}
        storages = {node: _storages(value) for node, value in live.items()}  # of every value so far, dropped or not
        for node in self.nodes:
            if node.op != "placeholder":
                live[node] = self._call(node, map_arg(node.args, live.__getitem__), map_arg(node.kwargs, live.__getitem__))
                versions[node], storages[node] = _versions(live[node]), _storages(live[node])
            for held, value in live.items():  # through views too: a view shares its base's counter
                now = _versions(value)
                if held is not node and now != versions[held]:
                    versions[held] = now
                    # and every value that may share its memory: a view of it read by a later node
                    changes.setdefault(node, set()).update(n for n, s in storages.items() if n is not node and s & storages[held])
            for source in node.all_input_nodes:
                if self._last_use.get(source) is node:
                    del live[source]
        self._changes = changes

    def plan(self, seeds: Iterable[torch.fx.Node]) -> Plan:
        """What a variant that computes ``seeds`` differently recomputes (after ``learn``)."""
        if self._changes is None:
            raise RuntimeError("Replay.plan needs Replay.learn(batch) first")
        output = self.nodes[-1]
        affected = self.affected(seeds)
        if output not in affected:
            return Plan(len(self.nodes), [])
        start = self._position[affected[0]]
        needed = {output} | {node for node in self._changes if self._position[node] >= start}
        for node in reversed(self.nodes[start:]):
            if node in needed:
                needed.update(source for source in node.all_input_nodes if self._position[source] >= start)
        nodes = [node for node in self.nodes[start:] if node in needed and node.op != "placeholder"]  # inputs: held
        inside = set(nodes)
        held = {source for node in nodes for source in node.all_input_nodes if source not in inside}
        changed = set().union(*(self._changes.get(node, set()) for node in nodes))
        last: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in nodes:
            for source in node.all_input_nodes:
                last[source] = node
        free_after: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for source, node in last.items():
            free_after.setdefault(node, []).append(source)
        return Plan(start, nodes, frozenset(held & changed), free_after)

    def outputs(
        self,
        batch: Any,
        plans: Sequence[Plan],
        configure: Callable[[int | None], None],
        step: Callable[[], None] | None = None,
        keep: Callable[[Any], Any] | None = None,
    ) -> list[Any]:
        """Each plan's output on ``batch``, or what ``keep(output)`` makes of it as soon as it is
        computed. ``configure(i)`` sets plan ``i``'s variant, ``configure(None)`` the starting
        configuration; ``step()`` is called after each plan. May set ``exact`` to False (see the
        module's docstring): the outputs are then not to be used."""
        keep = keep if keep is not None else (lambda output: output)
        output = self.nodes[-1]
        found: list[Any] = [None] * len(plans)
        unchanged = []
        live: dict[torch.fx.Node, Any] = dict(zip(self._placeholders, self._bind(batch), strict=True))
        done = 0
        configure(None)
        for i in sorted(range(len(plans)), key=lambda i: plans[i].start):
            plan = plans[i]
            if not plan.nodes:
                unchanged.append(i)
                continue
            done = self._advance(live, done, plan.start)
            configure(i)
            try:
                found[i] = keep(self._rerun(live, plan))
            finally:
                configure(None)
            if step is not None:
                step()
        self._advance(live, done, len(self.nodes))
        for i in unchanged:
            found[i] = keep(live[output])
            if step is not None:
                step()
        return found

    def _advance(self, live: dict[torch.fx.Node, Any], done: int, to: int) -> int:
        """Run the starting configuration's nodes ``done`` to ``to``, dropping what nothing later reads."""
        output = self.nodes[-1]
        for node in self.nodes[done:to]:
            if node.op != "placeholder":
                live[node] = self._call(node, map_arg(node.args, live.__getitem__), map_arg(node.kwargs, live.__getitem__))
            for source in node.all_input_nodes:
                if self._last_use.get(source) is node:
                    del live[source]
            if not node.users and node is not output:
                del live[node]
        return max(done, to)

    def _rerun(self, live: Mapping[torch.fx.Node, Any], plan: Plan) -> Any:
        values: dict[torch.fx.Node, Any] = {}
        read_as_is: dict[torch.fx.Node, list[int]] = {}
        copied: set[int] = set()

        def read(source: torch.fx.Node) -> Any:
            if source not in values:
                value = live[source]
                if source in plan.copies:
                    storages = _storages(value)
                    if storages & copied:  # two held views of one another, changed: copies would part them
                        self.exact = False
                    copied.update(storages)
                    value = _copy(value)
                else:
                    read_as_is[source] = _versions(value)
                values[source] = value
            return values[source]

        for node in plan.nodes:
            values[node] = self._call(node, map_arg(node.args, read), map_arg(node.kwargs, read))
            for source in plan.free_after.get(node, ()):
                values.pop(source, None)
        if any(_versions(live[source]) != versions for source, versions in read_as_is.items()):
            self.exact = False  # changed in place where the first run saw no change
        return values[plan.nodes[-1]]

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


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _storages(value: Any) -> set[int]:
    return {leaf.untyped_storage().data_ptr() for leaf in _tensors(value) if leaf.layout == torch.strided}


def _versions(value: Any) -> list[int]:
    return [leaf._version for leaf in _tensors(value)]


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) in (tuple, list):
        return type(value)(_copy(v) for v in value)
    return value
