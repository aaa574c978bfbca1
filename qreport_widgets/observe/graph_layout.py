"""The model's dataflow laid out top to bottom, for the Graph tab and the HTML export.

A layered drawing: every node sits one layer below the lowest node that feeds it, an edge that
skips layers runs through waypoints of its own (so it bends around the nodes between instead of
crossing them), the order within a layer is improved by averaging the neighbours' positions a few
times over, and a node sits as close above or below its neighbours as the layer leaves room for.
A graph with more nodes than ``limit`` shows whole modules folded into one node each, from the
deepest module names up, until it fits; a folded module named in ``expanded`` shows its parts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .analysis import GraphSummary

NODE_LIMIT = 150  # above this many nodes, modules are folded
LABEL_CHARS = 16  # what a node's box holds
_SWEEPS = 6


@dataclass(frozen=True)
class LaidNode:
    """One node as drawn: a unit, a join (where units' outputs meet), a folded module, or a
    waypoint of an edge that skips layers (drawn as nothing)."""

    id: str  # unit name, join id (``<add_3>``), folded module name, or ``~n`` for a waypoint
    kind: str  # "unit", "join", "folded" or "waypoint"
    type: str  # the module's type, the join's op, or "12 modules" for a folded one
    members: tuple[str, ...]  # the units and joins it stands for (itself for a unit or join)
    x: float
    y: float  # layer, 0 at the top

    @property
    def label(self) -> str:
        if self.kind == "folded":
            return f"▸ {self.id} ({len(self.members)})"
        if self.kind == "join":
            return self.type
        parts = self.id.split(".")
        named = max((i for i, part in enumerate(parts) if not part.isdigit()), default=0)
        if named > 0 and parts[named - 1].isdigit():
            named -= 1
        return ".".join(parts[named:])  # "3.block.0", not "0"


@dataclass(frozen=True)
class GraphLayout:
    nodes: tuple[LaidNode, ...]
    edges: tuple[tuple[int, int], ...]  # indices into nodes, top to bottom
    note: str = ""  # how the edges were found, where that is not the graph itself

    def index(self, node_id: str) -> int | None:
        return next((i for i, node in enumerate(self.nodes) if node.id == node_id), None)

    @property
    def shown(self) -> list[LaidNode]:
        return [node for node in self.nodes if node.kind != "waypoint"]

    def labels(self) -> list[str]:
        """Each node's label, a module's made longer (more of its name) where two would read alike."""
        found = [node.label for node in self.nodes]
        for _ in range(max((n.id.count(".") for n in self.nodes), default=0)):
            counts = Counter(label for label, node in zip(found, self.nodes, strict=True) if node.kind == "unit")
            alike = [i for i, node in enumerate(self.nodes) if node.kind == "unit" and counts[found[i]] > 1]
            if not alike:
                break
            for i in alike:
                parts = self.nodes[i].id.split(".")
                found[i] = ".".join(parts[-(found[i].count(".") + 2) :])
        return [_short(label) if node.kind == "unit" else label for label, node in zip(found, self.nodes, strict=True)]

    @property
    def layers(self) -> int:
        return int(max((node.y for node in self.nodes), default=-1)) + 1


def lay_out(graph: GraphSummary, expanded: Collection[str] = (), limit: int = NODE_LIMIT) -> GraphLayout:
    """The layout of ``graph``'s units and joins, folded past ``limit`` nodes except ``expanded`` modules."""
    items, edges, note = _items_and_edges(graph)
    paths = {item: _path(item, graph) for item in items}
    depth = _folding_depth(paths, expanded, limit)
    shown = {item: _shown_as(paths[item], item, expanded, depth) for item in items}
    members: dict[str, list[str]] = {}
    for item in items:
        members.setdefault(shown[item], []).append(item)
    # a module folded around one node is just that node
    for group, inside in list(members.items()):
        if len(inside) == 1 and group != inside[0]:
            shown[inside[0]] = inside[0]
            members[inside[0]] = members.pop(group)
    order = {name: i for i, name in enumerate(members)}  # forward order of first members
    joined = sorted({(shown[a], shown[b]) for a, b in edges if shown[a] != shown[b]}, key=lambda e: (order[e[0]], order[e[1]]))
    forward = [(a, b) for a, b in joined if order[a] < order[b]]
    layer = dict.fromkeys(members, 0)
    for a, b in sorted(forward, key=lambda e: order[e[1]]):  # every edge into a node before any out of it
        layer[b] = max(layer[b], layer[a] + 1)
    nodes: list[tuple[str, int]] = [(name, layer[name]) for name in members]
    links: list[tuple[int, int]] = []
    index = {name: i for i, (name, _) in enumerate(nodes)}
    for a, b in joined:
        top, bottom = (a, b) if layer[a] < layer[b] else (b, a)
        previous = index[top]
        for level in range(layer[top] + 1, layer[bottom]):
            nodes.append((f"~{len(nodes)}", level))
            links.append((previous, len(nodes) - 1))
            previous = len(nodes) - 1
        links.append((previous, index[bottom]))
    x = _positions(nodes, links)
    laid = []
    for i, (name, level) in enumerate(nodes):
        if name.startswith("~"):
            laid.append(LaidNode(name, "waypoint", "", (), x[i], float(level)))
        elif name in members and members[name] != [name]:
            units = [m for m in members[name] if m in graph.units]
            laid.append(LaidNode(name, "folded", f"{len(units)} modules", tuple(members[name]), x[i], float(level)))
        elif name in graph.units:
            laid.append(LaidNode(name, "unit", graph.units[name], (name,), x[i], float(level)))
        else:
            laid.append(LaidNode(name, "join", graph.joins[name][0], (name,), x[i], float(level)))
    return GraphLayout(tuple(laid), tuple(links), note)


def _short(label: str, limit: int = LABEL_CHARS) -> str:
    """``label`` in ``limit`` characters, keeping its first and last parts, where it tells modules
    apart and says what they are: "0.attention.self.query" -> "0.att.sel.query"."""
    parts = label.split(".")
    for i in range(1, len(parts) - 1):
        if len(".".join(parts)) <= limit:
            break
        parts[i] = parts[i][:3]
    short = ".".join(parts)
    if len(short) > limit and len(parts) > 2:
        short = f"{parts[0]}.….{parts[-1]}"
    return short if len(short) <= limit else "…" + short[-(limit - 1) :]


def _items_and_edges(graph: GraphSummary) -> tuple[list[str], list[tuple[str, str]], str]:
    units = list(graph.units)
    if not graph.edges:
        chain = list(zip(units, units[1:], strict=False))
        return units, chain, "this report file holds no dataflow (written before it was recorded): modules in forward order"
    known = set(units) | set(graph.joins)
    edges = [(a, b) for a, b in graph.edges if a in known and b in known]
    rank = {name: float(i) for i, name in enumerate(units)}
    for a, b in edges:  # a join comes right after the last output it reads
        if b not in rank:
            rank[b] = rank.get(a, -1.0) + 0.5
        elif b in graph.joins:
            rank[b] = max(rank[b], rank.get(a, -1.0) + 0.5)
    items = sorted(known, key=lambda name: (rank.get(name, len(units)), name))
    eager = "run eagerly: an edge where a module reads another's output, otherwise the call order"
    note = eager if graph.kind == "modules" else ""
    return items, edges, note


def _path(item: str, graph: GraphSummary) -> tuple[str, ...]:
    if item in graph.joins:
        parent = graph.joins[item][1]
        return (*parent.split("."), item) if parent else (item,)
    return tuple(item.split("."))


def _shown_as(path: tuple[str, ...], item: str, expanded: Collection[str], depth: int | None) -> str:
    if depth is None:
        return item
    for length in range(depth, len(path)):
        prefix = ".".join(path[:length])
        if prefix not in expanded:
            return prefix
    return item


def _folding_depth(paths: Mapping[str, tuple[str, ...]], expanded: Collection[str], limit: int) -> int | None:
    if len(paths) <= limit:
        return None
    deepest = max(len(path) for path in paths.values())
    for depth in range(deepest - 1, 0, -1):
        groups = {_shown_as(path, item, expanded, depth) for item, path in paths.items()}
        if len(groups) <= limit:
            return depth
    return 1


def _positions(nodes: Sequence[tuple[str, int]], links: Sequence[tuple[int, int]]) -> list[float]:
    """x of every node: an order within each layer with few crossings, then each node as near its
    neighbours' mean as the nodes beside it allow (one unit apart), the layers centred on each other."""
    layers: dict[int, list[int]] = {}
    for i, (_, level) in enumerate(nodes):
        layers.setdefault(level, []).append(i)
    above: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    below: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for a, b in links:
        below[a].append(b)
        above[b].append(a)
    slot = {i: float(k) for members in layers.values() for k, i in enumerate(members)}
    levels = sorted(layers)
    for sweep in range(_SWEEPS):
        downward = sweep % 2 == 0
        for level in levels if downward else reversed(levels):
            members = layers[level]
            near = above if downward else below

            def centre(i: int, near: dict[int, list[int]] = near) -> float:
                return sum(slot[j] for j in near[i]) / len(near[i]) if near[i] else slot[i]

            members.sort(key=lambda i: (centre(i), slot[i]))
            for k, i in enumerate(members):
                slot[i] = float(k)
    x = {i: slot[i] for i in slot}
    for sweep in range(4):
        downward = sweep % 2 == 0
        for level in levels if downward else reversed(levels):
            members = layers[level]
            near = above if downward else below
            wanted = [sum(x[j] for j in near[i]) / len(near[i]) if near[i] else x[i] for i in members]
            placed = _spread(wanted)
            for i, value in zip(members, placed, strict=True):
                x[i] = value
    return [x[i] for i in range(len(nodes))]


def _spread(wanted: list[float], gap: float = 1.0) -> list[float]:
    """Positions in the given order, at least ``gap`` apart, as close to ``wanted`` (least squares)
    as that allows: a run of nodes pushed together sits where its members want it on average."""
    blocks: list[list[float]] = []  # [count, sum over members of (wanted - gap * place in the run)]
    for value in wanted:
        blocks.append([1, value])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] + blocks[-2][0] * gap > blocks[-1][1] / blocks[-1][0]:
            count, total = blocks.pop()
            blocks[-1][1] += total - count * blocks[-1][0] * gap
            blocks[-1][0] += count
    placed: list[float] = []
    for count, total in blocks:
        placed.extend(total / count + n * gap for n in range(int(count)))
    return placed
