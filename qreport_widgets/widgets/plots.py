"""bqplot figures of the widget, which the visualizer's plot methods return too.

Each view owns one Figure and its marks; ``update`` methods change mark data in place under ``hold_sync``.
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Sequence
from typing import Any

import bqplot as bq
import numpy as np

MAX_DRAWN_POINTS = 2048  # more channels than this are drawn as min / mean / max per bucket
NORMAL, FLAGGED, BAND = "#1f77b4", "#d62728", "#9ecae1"
LOG_FLOOR = 0.5  # where bars stand on a log count axis (every drawn count is >= 1)


def finite32(values: Any) -> np.ndarray:
    """float32 for the wire (bqplot sends numpy arrays as binary), non-finite values as NaN."""
    array = np.asarray(values, dtype=np.float32)
    return np.where(np.isfinite(array), array, np.nan).astype(np.float32)


def bucketed(values: np.ndarray, max_points: int = MAX_DRAWN_POINTS) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x, mean, low, high of ``values``, bucketed to at most ``max_points`` points."""
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if n <= max_points:
        x = np.arange(n, dtype=np.float64)
        return x, values, values, values
    size = int(np.ceil(n / max_points))
    padded = np.full(size * int(np.ceil(n / size)), np.nan)
    padded[:n] = values
    blocks = padded.reshape(-1, size)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN buckets stay NaN
        return (
            np.arange(blocks.shape[0]) * size + (size - 1) / 2,
            np.nanmean(blocks, axis=1),
            np.nanmin(blocks, axis=1),
            np.nanmax(blocks, axis=1),
        )


class LineView:
    """Values against an index as points (channels and modules are separate things, so no line
    joins them), flagged points in red, an optional min-max band and horizontal threshold lines.

    The thresholds' names are not drawn over the data: ``legend_html`` describes them, for a
    caption outside the figure.
    """

    def __init__(self, title: str = "", x_label: str = "channel", y_label: str = "") -> None:
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        scales = {"x": self.x_scale, "y": self.y_scale}
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=[x_label, "value"], formats=["", ".4g"])
        self.band = bq.Lines(
            x=np.zeros(0, np.float32), y=np.zeros((2, 0), np.float32), scales=scales, fill="between",
            fill_colors=["#9ecae1"], fill_opacities=[0.35], colors=["#9ecae1"], stroke_width=0.5, display_legend=False,
        )  # fmt: skip
        self.points = bq.Scatter(
            x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales=scales, colors=[NORMAL],
            default_size=24, display_names=False, tooltip=self.tooltip,
        )  # fmt: skip
        self.flagged = bq.Scatter(
            x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales=scales, colors=[FLAGGED],
            default_size=40, display_names=False, tooltip=self.tooltip,
        )  # fmt: skip
        self.thresholds = bq.Lines(
            x=np.zeros(0, np.float32), y=np.zeros((0, 0), np.float32), scales=scales, colors=[FLAGGED],
            line_style="dashed", display_legend=False, labels=[],
        )  # fmt: skip
        self.x_axis = bq.Axis(scale=self.x_scale, label=x_label, tick_format=",.6~r")
        self.y_axis = bq.Axis(scale=self.y_scale, side="left", label=y_label, tick_format=",.3~r", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.band, self.thresholds, self.points, self.flagged], axes=[self.x_axis, self.y_axis], title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20}, layout={"width": "100%", "height": "340px"},
        )  # fmt: skip
        self.legend_html = ""

    def update(
        self,
        y: np.ndarray,
        *,
        x: np.ndarray | None = None,
        low: np.ndarray | None = None,
        high: np.ndarray | None = None,
        names: Sequence[str] | None = None,
        flagged: np.ndarray | None = None,
        flagged_label: str = "",
        thresholds: dict[str, float] | None = None,
        title: str | None = None,
        x_label: str | None = None,
        y_label: str | None = None,
    ) -> None:
        """Draw ``y`` (bucketed past ``MAX_DRAWN_POINTS`` when no ``x`` is given).

        ``names`` label the points in the hover; ``flagged`` (a mask over ``y``) draws those
        points in red and counts them in the legend as ``flagged_label`` (no mask, no count).
        """
        counted = flagged is not None
        y = np.asarray(y, dtype=np.float64)
        if x is None and y.size > MAX_DRAWN_POINTS:
            x, y, low, high = bucketed(y)
            names, flagged, counted = None, None, False  # a bucket is many channels: no single name or flag
        x = np.arange(y.size, dtype=np.float64) if x is None else np.asarray(x, dtype=np.float64)
        flagged = np.zeros(y.size, bool) if flagged is None else np.asarray(flagged, dtype=bool)
        # points without a finite value are left out (x keeps the gap)
        keep = np.isfinite(y)
        if low is not None and high is not None:
            keep &= np.isfinite(low) & np.isfinite(high)
            low, high = np.asarray(low)[keep], np.asarray(high)[keep]
        x, y, flagged = x[keep], y[keep], flagged[keep]
        names = None if names is None else np.asarray(list(names), dtype=object)[keep]
        thresholds = finite_values(thresholds)
        span = np.array([x.min(), x.max()]) if x.size else np.zeros(2)
        size = 24 if y.size <= 256 else 6
        with self.figure.hold_sync():
            for mark, mask in ((self.points, ~flagged), (self.flagged, flagged)):
                with mark.hold_sync():
                    mark.x, mark.y = finite32(x[mask]), finite32(y[mask])
                    mark.names = None if names is None else [str(n) for n in names[mask]]
                    mark.default_size = size if mark is self.points else max(size, 40)
            with self.band.hold_sync():
                if low is not None and high is not None:
                    self.band.x, self.band.y = finite32(x), np.vstack([finite32(low), finite32(high)])
                else:
                    self.band.x, self.band.y = np.zeros(0, np.float32), np.zeros((2, 0), np.float32)
            with self.thresholds.hold_sync():
                self.thresholds.x = finite32(span)
                self.thresholds.y = np.array([[v, v] for v in thresholds.values()], dtype=np.float32).reshape(-1, 2)
                self.thresholds.labels = list(thresholds)
            if title is not None:
                self.figure.title = title
            if x_label is not None:
                self.x_axis.label = x_label
            if y_label is not None:
                self.y_axis.label = y_label
            label = self.x_axis.label
            with self.tooltip.hold_sync():
                self.tooltip.fields = ["name", "y"] if names is not None else ["x", "y"]
                self.tooltip.labels = [label, "value"]
        self.legend_html = legend_html(
            thresholds, flagged=int(flagged.sum()), total=int(y.size), flagged_label=flagged_label if counted else "",
            band=low is not None,
        )  # fmt: skip

    def drawn(self) -> tuple[np.ndarray, np.ndarray]:
        """x and y of every point drawn, red or not, in x order."""
        x = np.concatenate([np.asarray(self.points.x), np.asarray(self.flagged.x)])
        y = np.concatenate([np.asarray(self.points.y), np.asarray(self.flagged.y)])
        order = np.argsort(x, kind="stable")
        return x[order], y[order]


class HistogramView:
    """Bars of counts over bin edges, binned in Python (only the bars are sent).

    With ``log_counts`` the count axis is logarithmic: a tail of a few values in thousands stays
    visible. ``markers`` are vertical dashed lines at values (thresholds), described in
    ``legend_html``.
    """

    def __init__(self, title: str = "", x_label: str = "value", log_counts: bool = False) -> None:
        self.x_scale = bq.LinearScale()
        # a log scale has no zero: bars stand on LOG_FLOOR, below the smallest count drawn (1)
        self.y_scale = bq.LogScale(min=LOG_FLOOR) if log_counts else bq.LinearScale(min=0.0)
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=["bin centre", "count"], formats=[".4g", ",.0f"])
        self.bars = bq.Bars(
            x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales={"x": self.x_scale, "y": self.y_scale},
            colors=[NORMAL], padding=0.05, tooltip=self.tooltip, base=LOG_FLOOR if log_counts else 0.0,
        )  # fmt: skip
        self.markers = bq.Lines(
            x=np.zeros((0, 2), np.float32), y=np.zeros((0, 2), np.float32), scales={"x": self.x_scale, "y": self.y_scale},
            colors=[FLAGGED], line_style="dashed", display_legend=False,
        )  # fmt: skip
        self.x_axis = bq.Axis(scale=self.x_scale, label=x_label, tick_format=",.3~r")
        count_label = "count (log scale)" if log_counts else "count"
        self.y_axis = bq.Axis(scale=self.y_scale, side="left", label=count_label, tick_format=",.0f", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.bars, self.markers], axes=[self.x_axis, self.y_axis], title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20}, layout={"width": "100%", "height": "340px"},
        )  # fmt: skip
        self.log_counts = log_counts
        self.legend_html = ""

    def update(
        self,
        counts: np.ndarray,
        edges: np.ndarray,
        *,
        markers: dict[str, float] | None = None,
        title: str | None = None,
        x_label: str | None = None,
    ) -> None:
        counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
        centres = (edges[:-1] + edges[1:]) / 2 if edges.size > 1 else np.zeros(0)
        keep = np.isfinite(centres) & np.isfinite(counts) & (counts > 0)  # an empty bin is a gap, not a flat bar
        centres, counts = centres[keep], counts[keep]
        markers = finite_values(markers)
        # a line beyond every value would stretch the axis and squeeze the bars: named, not drawn
        inside = {k: v for k, v in markers.items() if centres.size and edges[0] <= v <= edges[-1]}
        top = float(counts.max(initial=1.0)) * (2.0 if self.log_counts else 1.05)
        with self.figure.hold_sync():
            with self.bars.hold_sync():
                self.bars.x, self.bars.y = finite32(centres), finite32(counts)
            if self.log_counts:
                self.y_scale.max = top  # headroom above the tallest bar; the floor stays fixed
            with self.markers.hold_sync():
                self.markers.x = np.array([[v, v] for v in inside.values()], dtype=np.float32).reshape(-1, 2)
                bottom = LOG_FLOOR if self.log_counts else 0.0
                self.markers.y = np.array([[bottom, top]] * len(inside), dtype=np.float32).reshape(-1, 2)
            if title is not None:
                self.figure.title = title
            if x_label is not None:
                self.x_axis.label = x_label
        beyond = {k: v for k, v in markers.items() if k not in inside}
        self.legend_html = legend_html(inside, vertical=True, beyond=beyond)


def finite_values(lines: dict[str, float | None] | None) -> dict[str, float]:
    """The named values that can be drawn (a threshold a detector did not report is None)."""
    return {k: v for k, v in (lines or {}).items() if v is not None and np.isfinite(v)}


def legend_html(
    lines: dict[str, float],
    *,
    flagged: int = 0,
    total: int = 0,
    flagged_label: str = "",
    band: bool = False,
    vertical: bool = False,
    beyond: dict[str, float] | None = None,
) -> str:
    """A one-line key for a figure: the dashed lines with their values, the red points, the band,
    and the lines not drawn because no value reaches them (``beyond``)."""
    parts = []
    if band:
        parts.append(f"<span style='color:{BAND}'>&#9632;</span> min-max over the module's channels")
    for label, value in lines.items():
        where = "at" if vertical else "="
        parts.append(f"<span style='color:{FLAGGED}'>- - -</span> {html.escape(label)} {where} {value:.4g}")
    for label, value in (beyond or {}).items():
        parts.append(f"{html.escape(label)} at {value:.4g}: beyond every value")
    if flagged_label and total:
        parts.append(f"<span style='color:{FLAGGED}'>&#9679;</span> {flagged} of {total} {html.escape(flagged_label)}")
    return "<div style='font-size:12px;color:#444;margin:0 0 0 75px'>" + " &nbsp;·&nbsp; ".join(parts) + "</div>" if parts else ""


def scrolling_table(table_html: str) -> str:
    """HTML tables that scroll sideways when wider than the tab, their headers on one line each
    (a narrow tab would otherwise stack a header a word per line)."""
    style = "<style>.qr-table th{white-space:nowrap}</style>"
    return f"<div class='qr-table' style='overflow-x:auto'>{style}{table_html}</div>"


def bar_range(values: np.ndarray) -> tuple[float, float, float]:
    """(low, high, span) of bar values, zero always included: bqplot draws grouped or based Bars
    flat unless their value scale has both ends set."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    low, high = min(0.0, float(values.min(initial=0.0))), max(0.0, float(values.max(initial=0.0)))
    return low, high, (high - low) or 1.0


def histogram_of(values: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """Counts and edges of the finite ``values`` (an empty histogram when there are none)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if values.size == 0:
        return np.zeros(0), np.zeros(0)
    return np.histogram(values, bins=bins)


def trimmed_histogram(counts: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty bins at both ends (the observer's range is a power of two around the data)."""
    filled = np.flatnonzero(counts)
    if filled.size == 0:
        return counts[:0], edges[:0]
    lo, hi = filled[0], filled[-1] + 1
    return counts[lo:hi], edges[lo : hi + 1]
