"""The Graph tab: the model's dataflow top to bottom, each node coloured by a number.

The layout is ``graph_layout.lay_out``'s (folded past ``NODE_LIMIT`` nodes); the drawing is one
bqplot ``Graph`` mark at fixed positions, its node colours computed here from a three-colour scale
that the ``ColorAxis`` above the graph shows. A click on a node selects it: a module is shown in
Explore and put first among the Tune rows (``on_pick``), a folded module opens.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import bqplot as bq
import ipywidgets as w
import numpy as np

from ..core import features as F
from ..observe.graph_layout import NODE_LIMIT, GraphLayout, LaidNode, lay_out
from .protocols import ReportSource, TuningSession

GOOD, MIDDLE, BAD = "#1a9850", "#fee08b", "#d73027"
NO_VALUE, JOIN = "#d9d9d9", "#ffffff"
LAYER_PX, NODE_PX, NODE_WIDTH, MARGIN = 40, 118, 106, {"top": 50, "bottom": 20, "left": 20, "right": 20}
NO_COLOUR = "nothing (module type in the tooltip)"
LOG_DECADES = 2.0


@dataclass(frozen=True)
class Metric:
    """A number per module to colour the graph by; ``lower_is_worse`` for SQNR, not for a ratio."""

    label: str
    values: Mapping[str, float]
    lower_is_worse: bool
    unit: str = ""

    @property
    def log(self) -> bool:
        """Coloured by decades: positive values spanning more than ``LOG_DECADES`` (outlier ratios)."""
        positive = [v for v in self.values.values() if math.isfinite(v) and v > 0]
        return len(positive) > 1 and not self.unit and math.log10(max(positive) / min(positive)) > LOG_DECADES

    def of(self, node: LaidNode) -> float:
        """A node's value: a folded module's is its worst member's."""
        found = [self.values[m] for m in node.members if m in self.values and not math.isnan(self.values[m])]
        if not found:
            return math.nan
        return min(found) if self.lower_is_worse else max(found)

    def text(self, value: float) -> str:
        if math.isnan(value):
            return "no value"
        return f"{value:.3g}{self.unit}" if math.isfinite(value) else f"{value}{self.unit}"


def graph_metrics(source: ReportSource, session: TuningSession | None) -> dict[str, Metric]:
    """The numbers the graph can be coloured by, the most telling first: the latest run's per-layer
    SQNR, the other runs', sensitivity and local SQNR (once computed), the report's outlier ratio."""
    found: list[Metric] = []
    if session is not None:
        for i, run in reversed(list(enumerate(session.history))):
            if run.ok and len(run.per_layer_sqnr_db):
                values = {str(k): float(v) for k, v in run.per_layer_sqnr_db.items()}
                found.append(Metric(f"per-layer SQNR · run {i} {run.label}".strip(), values, True, " dB"))
        table = session.computed().get("sensitivity")
        if table is not None and len(table):
            gain = {str(k): float(v) for k, v in table["output_sqnr_gain_db"].items()}
            found.append(Metric("sensitivity · output dB gained kept float", gain, False, " dB"))
            local = {str(k): float(v) for k, v in table["local_sqnr_db"].items()}
            found.append(Metric("local SQNR (its own error)", local, True, " dB"))
    frame = source.frame()
    if F.OUTLIER_RATIOS in frame.channel_features:
        largest = frame.per_module(F.OUTLIER_RATIOS)["max"].dropna()
        found.append(Metric("outlier ratio · largest channel", {str(k): float(v) for k, v in largest.items()}, False))
    return {metric.label: metric for metric in found}


def colour_of(value: float, low: float, high: float, lower_is_worse: bool) -> str:
    """The colour ``ColorAxis`` shows for ``value`` on [low, high]: red where worse, green where better."""
    if math.isnan(value):
        return NO_VALUE
    share = 0.5 if high <= low else (min(max(value, low), high) - low) / (high - low)
    if not lower_is_worse:
        share = 1 - share
    ends = (BAD, MIDDLE) if share < 0.5 else (MIDDLE, GOOD)
    t = share * 2 if share < 0.5 else share * 2 - 1
    a, b = (np.array([int(c[i : i + 2], 16) for i in (1, 3, 5)]) for c in ends)
    return "#" + "".join(f"{int(round(v)):02x}" for v in a + (b - a) * t)


def value_range(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    return min(finite), max(finite)


class GraphPane(w.VBox):
    """The Graph tab. ``on_pick(module)`` is called when a module's node is clicked."""

    def __init__(
        self,
        source: ReportSource,
        session: TuningSession | None = None,
        on_pick: Callable[[str], str] | None = None,
        limit: int = NODE_LIMIT,
        hidden: bool = False,
        clickable: bool = True,
    ) -> None:
        self.source, self.session, self.on_pick, self.limit = source, session, on_pick, limit
        self.clickable = clickable  # False in a page with no kernel behind it (the HTML export)
        self.expanded: set[str] = set()
        self.metrics: dict[str, Metric] = {}
        self.colour_by = w.Dropdown(description="Colour by", layout={"width": "430px"}, style={"description_width": "70px"})
        self.fold_all = w.Button(
            description="Fold again",
            icon="compress",
            layout={"width": "120px", "display": "none"},
            tooltip="fold the modules opened by a click",
        )
        self.folding = w.HTML()
        self.key = w.HTML()
        self.picked = w.HTML()
        self.scale = bq.ColorScale(colors=[BAD, MIDDLE, GOOD], min=0.0, max=1.0)
        self.colour_axis = bq.ColorAxis(scale=self.scale, side="top", label="", num_ticks=5, tick_format=".3g")
        x, y = bq.LinearScale(), bq.LinearScale(reverse=True)
        tooltip = bq.Tooltip(fields=["name", "type", "shown"], labels=["module", "type", "value"])
        self.mark = bq.Graph(
            node_data=[],
            link_data=[],
            scales={"x": x, "y": y},
            link_type="line",
            directed=False,
            highlight_links=True,
            tooltip=tooltip,
            colors=[NO_VALUE],
            selected_style={"stroke": "#000", "stroke-width": "3px"},
        )
        # an invisible scatter holds the colour scale, so the axis above the graph has a mark to follow
        self.legend_mark = bq.Scatter(
            x=[0.0], y=[0.0], color=[0.0], scales={"x": x, "y": y, "color": self.scale}, default_size=0, visible=False
        )
        self.figure = bq.Figure(
            marks=[self.mark, self.legend_mark],
            axes=[self.colour_axis],
            fig_margin=MARGIN,
            layout={"width": "100%", "height": "400px"},
            min_aspect_ratio=0.01,
            max_aspect_ratio=100,
            padding_x=0.0,
            padding_y=0.0,
            display_toolbar=False,
        )
        # a figure laid out in a hidden tab has no size: it joins when the tab is first shown
        self.canvas = w.Box([] if hidden else [self.figure], layout={"max_height": "640px", "overflow": "auto", "width": "100%"})
        self.layout_: GraphLayout | None = None
        self._nodes: list[dict] = []  # each node's drawing, before the numbers
        self._links: list[dict] = []
        self._sent = 0
        self._refreshing = False
        self._chosen = False  # the user picked a number: a new run does not take its place
        super().__init__(
            [
                w.HBox([self.colour_by, self.fold_all], layout={"align_items": "center"}),
                self.folding,
                self.key,
                self.canvas,
                self.picked,
            ]
        )
        self.refresh()
        self.colour_by.observe(self._on_colour_change, "value")
        self.mark.observe(self._on_selected, "selected")
        self.fold_all.on_click(lambda _button: self.fold())

    # ---- what the user does ----------------------------------------------------------------------
    def refresh(self) -> None:
        """Offer the numbers there are now (a new run, sensitivity computed), keeping the choice."""
        self.metrics = graph_metrics(self.source, self.session)
        options = [*self.metrics, NO_COLOUR]
        keep = self.colour_by.value if self._chosen and self.colour_by.value in options else options[0]
        self._refreshing = True
        try:
            with self.hold_sync():
                self.colour_by.options = options
                self.colour_by.value = keep
        finally:
            self._refreshing = False
        if self.layout_ is None:
            self._draw()
        else:
            self._colour()

    def show(self) -> None:
        """The tab is shown: the figure joins the page (the first time) with the numbers there are now."""
        if not self.canvas.children:
            self.canvas.children = (self.figure,)
        self.refresh()

    def pick(self, node_id: str) -> None:
        """What a click on ``node_id`` does: a folded module opens, a module is shown in Explore and Tune."""
        laid = self.layout_
        index = laid.index(node_id) if laid is not None else None
        if laid is None or index is None or laid.nodes[index].kind == "waypoint":
            raise KeyError(f"{node_id!r} is not a node of the graph as drawn")
        node = laid.nodes[index]
        if node.kind == "folded":
            self.expanded.add(node.id)
            self._draw()
            self.picked.value = f"Opened <b>{html.escape(node.id)}</b>: its {len(node.members)} parts are drawn."
            return
        metric = self.metrics.get(self.colour_by.value)
        value = f" · {html.escape(metric.label)}: <b>{metric.text(metric.of(node))}</b>" if metric else ""
        if node.kind == "join":
            self.picked.value = f"<b>{html.escape(node.type)}</b>: where the outputs drawn above it meet{value}."
            return
        said = ""
        if self.on_pick is not None:
            said = self.on_pick(node.id) or ""
        self.picked.value = f"<b>{html.escape(node.id)}</b> ({html.escape(node.type)}){value}. {said}"

    def fold(self) -> None:
        """Fold again every module a click opened."""
        self.expanded.clear()
        self._draw()
        self.picked.value = ""

    # ---- drawing -------------------------------------------------------------------------------
    def _draw(self) -> None:
        laid = self.layout_ = lay_out(self.source.graph, self.expanded, self.limit)  # type: ignore[arg-type]
        shown = laid.shown
        folded = [n for n in shown if n.kind == "folded"]
        parts = [f"{len(shown)} nodes in {laid.layers} layers"]
        if folded:
            how = "click one to open it" if self.clickable else "the notebook's Graph tab opens them"
            parts.append(f"{len(folded)} modules folded to stay under {self.limit} nodes: {how}")
        if laid.note:
            parts.append(laid.note)
        self.folding.value = "<span style='color:#555'>" + "; ".join(html.escape(p) for p in parts) + "</span>"
        self.fold_all.layout.display = "" if self.expanded else "none"
        nodes = [self._node_data(n, label) for n, label in zip(laid.nodes, laid.labels(), strict=True)]
        links = [{"source": a, "target": b} for a, b in laid.edges]
        xs = np.array([n.x for n in laid.nodes], dtype=np.float64)
        ys = np.array([n.y for n in laid.nodes], dtype=np.float64)
        low = float(xs.min()) if len(xs) else 0.0
        high = float(xs.max()) if len(xs) else 1.0
        across = high - low
        # bqplot keeps half a node's width free on every side of the graph (its view padding)
        inset = 2 * (NODE_WIDTH // 2 + 1)
        height = max(laid.layers, 2) * LAYER_PX + MARGIN["top"] + MARGIN["bottom"] + inset
        width = int((across + 1) * NODE_PX) + MARGIN["left"] + MARGIN["right"] + inset
        with self.hold_sync(), self.mark.hold_sync():
            self.mark.scales["x"].min, self.mark.scales["x"].max = low - 0.5, high + 0.5
            self.mark.scales["y"].min, self.mark.scales["y"].max = -0.5, max(laid.layers, 2) - 0.5
            self.mark.selected = None
            self._nodes, self._links = nodes, links
            self.mark.x, self.mark.y = xs, ys
            self.figure.layout.height = f"{height}px"
            self.figure.layout.min_width = f"{width}px"
            self._colour()

    def _node_data(self, node: LaidNode, label: str) -> dict:
        if node.kind == "waypoint":
            return {"label": " ", "shape": "circle", "shape_attrs": {"r": 0.5}, "name": "", "type": "", "shown": ""}
        if node.kind == "join":
            return {
                "label": node.type[:5],
                "shape": "circle",
                "shape_attrs": {"r": 11},
                "name": node.id,
                "type": f"{node.type} (outputs meet)",
                "shown": "",
            }
        shape = {
            "width": NODE_WIDTH,
            "height": 22,
            "rx": 11 if node.kind == "folded" else 3,
            "ry": 11 if node.kind == "folded" else 3,
        }
        return {"label": label, "shape": "rect", "shape_attrs": shape, "name": node.id, "type": node.type, "shown": ""}

    def _colour(self) -> None:
        laid = self.layout_
        if laid is None:
            return
        metric = self.metrics.get(self.colour_by.value)
        values = [metric.of(n) if metric is not None and n.kind in ("unit", "folded") else math.nan for n in laid.nodes]
        log = metric is not None and metric.log
        drawn = [math.log10(v) if log and v > 0 else (math.nan if log else v) for v in values]
        low, high = value_range(drawn)
        colours = []
        for node, value in zip(laid.nodes, drawn, strict=True):
            if node.kind == "waypoint":
                colours.append("#666")
            elif node.kind == "join":
                colours.append(JOIN)
            elif metric is None:
                colours.append(NO_VALUE)
            else:
                colours.append(colour_of(value, low, high, metric.lower_is_worse))
        data = []
        for node, item, value in zip(laid.nodes, self._nodes, values, strict=True):
            shown = metric.text(value) if metric is not None and node.kind in ("unit", "folded") else ""
            if node.kind == "folded":
                shown = f"{shown} (worst of {len(node.members)})" if metric is not None else f"{len(node.members)} parts"
            data.append({**item, "shown": shown})
        with self.hold_sync(), self.mark.hold_sync():
            self.mark.node_data = data
            # the links go with every new node list, as new objects: bqplot resolves a link's ends to
            # the node objects of the list it came with, and kept links would point at the old ones
            self._sent += 1
            self.mark.link_data = [{**link, "sent": self._sent} for link in self._links]
            self.mark.colors = colours
            self.scale.min, self.scale.max = (low, high) if high > low else (low - 0.5, low + 0.5)
            self.scale.colors = [BAD, MIDDLE, GOOD] if (metric is None or metric.lower_is_worse) else [GOOD, MIDDLE, BAD]
            self.colour_axis.label = ""  # named in the key: a label beside the bar is cut at the figure's edge
            self.colour_axis.visible = metric is not None
        if metric is None:
            self.key.value = "<span style='color:#555'>Run the baseline or sensitivity (Tune tab) for numbers per layer.</span>"
        else:
            measured = sum(not math.isnan(v) for v, n in zip(values, laid.nodes, strict=True) if n.kind in ("unit", "folded"))
            worse = "low" if metric.lower_is_worse else "high"
            scale = " (the bar above in log10, decades)" if log else " (the bar above)"
            self.key.value = (
                f"<span style='color:#555'><b>{html.escape(metric.label)}</b>{scale}: "
                f"red: worse ({worse} values), green: better; grey: no value "
                f"({measured} of {len(laid.shown)} nodes have one); white circles: where outputs meet "
                "(add, cat)</span>"
            )

    def _on_colour_change(self, _change: dict) -> None:
        if not self._refreshing:
            self._chosen = True
            self._colour()

    def _on_selected(self, change: dict) -> None:
        selected, laid = change["new"], self.layout_
        if selected is None or not len(selected) or laid is None:
            return
        index = int(selected[-1])
        if 0 <= index < len(laid.nodes) and laid.nodes[index].kind != "waypoint":
            self.pick(laid.nodes[index].id)
