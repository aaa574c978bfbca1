"""bqplot figures of the widget, which the visualizer's plot methods return too.

Each view owns one Figure and its marks; ``update`` methods change mark data in place under ``hold_sync``.
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import bqplot as bq
import numpy as np

MAX_DRAWN_POINTS = 2048  # more channels than this are drawn as min / mean / max per bucket
NORMAL, FLAGGED, BAND = "#1f77b4", "#d62728", "#9ecae1"
LOG_FLOOR = 0.5  # where bars stand on a log count axis (every drawn count is >= 1)
LOG_DECADES = 2.0  # positive values spanning more decades than this are drawn on a log axis...
LOG_MAX_LEFT_OUT = 0.1  # ...unless more than this share of them is <= 0 (no place on a log axis)
EMPTY = np.zeros(0, np.float32)


@dataclass(frozen=True)
class AxisScale:
    """How values are laid along an axis: linear or ``log``, and how many finite values a log
    axis leaves out (``left_out``: those <= 0)."""

    log: bool = False
    left_out: int = 0

    def label(self, text: str) -> str:
        return f"{text} (log scale)" if self.log else text

    def notes(self) -> list[str]:
        """What the key under the figure says about the axis."""
        if not self.log:
            return []
        return ["log scale"] + ([f"{self.left_out} value(s) ≤ 0 not drawn on it"] if self.left_out else [])


def axis_scale(values: Any, reach: Any = ()) -> AxisScale:
    """The axis for ``values`` (points) and ``reach`` (what else the axis must show: a band's ends).

    Log when the positive ones span more than ``LOG_DECADES`` decades (largest / smallest > 100)
    and at most ``LOG_MAX_LEFT_OUT`` of the finite points are <= 0 (those are left out and
    counted); linear otherwise, where one large value squashes the rest flat but a sign change
    or many zeros stay visible. NaN and infinities are never drawn and count for neither.
    """
    points = np.asarray(values, dtype=np.float64).ravel()
    points = points[np.isfinite(points)]
    every = np.concatenate([points, np.asarray(reach, dtype=np.float64).ravel()])
    positive = every[np.isfinite(every) & (every > 0)]
    if positive.size < 2 or np.log10(positive.max() / positive.min()) <= LOG_DECADES:
        return AxisScale()
    left_out = int((points <= 0).sum())
    return AxisScale(log=True, left_out=left_out) if left_out <= LOG_MAX_LEFT_OUT * points.size else AxisScale()


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
    """Values against an index as points, or with ``joined`` as points joined by a line in x order;
    flagged points in red on top, an optional min-max band and horizontal threshold lines.

    The y axis is linear or logarithmic as ``axis_scale`` decides for the values drawn: both
    scales are built once and the marks and the axis are pointed at one of them. The thresholds'
    names are not drawn over the data: ``legend_html`` describes them, for a caption outside the
    figure.
    """

    def __init__(self, title: str = "", x_label: str = "channel", y_label: str = "", joined: bool = False) -> None:
        self.x_scale, self.linear_y, self.log_y = bq.LinearScale(), bq.LinearScale(), bq.LogScale()
        scales = {"x": self.x_scale, "y": self.linear_y}
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=[x_label, "value"], formats=["", ".4g"])
        self.band = bq.Lines(
            x=EMPTY,
            y=np.zeros((2, 0), np.float32),
            scales=scales,
            fill="between",
            fill_colors=["#9ecae1"],
            fill_opacities=[0.35],
            colors=["#9ecae1"],
            stroke_width=0.5,
            display_legend=False,
        )
        self.line = bq.Lines(x=EMPTY, y=EMPTY, scales=scales, colors=[NORMAL], stroke_width=1.5, display_legend=False)
        self.points = bq.Scatter(
            x=EMPTY,
            y=EMPTY,
            scales=scales,
            colors=[NORMAL],
            default_size=24,
            display_names=False,
            tooltip=self.tooltip,
        )
        self.flagged = bq.Scatter(
            x=EMPTY,
            y=EMPTY,
            scales=scales,
            colors=[FLAGGED],
            default_size=40,
            display_names=False,
            tooltip=self.tooltip,
        )
        self.thresholds = bq.Lines(
            x=EMPTY,
            y=np.zeros((0, 0), np.float32),
            scales=scales,
            colors=[FLAGGED],
            line_style="dashed",
            display_legend=False,
            labels=[],
        )
        self.x_axis = bq.Axis(scale=self.x_scale, label=x_label, tick_format=",.6~r")
        self.y_axis = bq.Axis(scale=self.linear_y, side="left", label=y_label, tick_format=",.3~r", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.band, self.thresholds, self.line, self.points, self.flagged],
            axes=[self.x_axis, self.y_axis],
            title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20},
            layout={"width": "100%", "height": "340px"},
        )
        self.joined = joined
        self.scale = AxisScale()
        self.y_label = y_label
        self.legend_html = ""
        self._size = 24

    @property
    def y_scale(self) -> bq.Scale:
        """The y scale in use: ``linear_y`` or ``log_y``."""
        return self.y_axis.scale

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
        infinite = int(np.isinf(y).sum())
        band = low is not None and high is not None
        if band:
            low, high = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
        self.scale = scale = axis_scale(y, [low, high] if band else ())
        # points without a finite value (or <= 0 on a log axis) are left out; x keeps the gap
        keep = np.isfinite(y)
        if scale.log:
            keep &= y > 0
        if band:
            keep &= np.isfinite(low) & np.isfinite(high)
            low, high = low[keep], high[keep]
        x, y, flagged = x[keep], y[keep], flagged[keep]
        clipped = band and scale.log and bool((low <= 0).any())
        if clipped:  # the band reaches below a log axis: it stops at the smallest positive value
            low = np.maximum(low, np.concatenate([y, low[low > 0]]).min())
        names = None if names is None else np.asarray(list(names), dtype=object)[keep]
        thresholds = {k: v for k, v in finite_values(thresholds).items() if v > 0 or not scale.log}
        span = np.array([x.min(), x.max()]) if x.size else np.zeros(2)
        y_scale = self.log_y if scale.log else self.linear_y
        scales = {"x": self.x_scale, "y": y_scale}
        self._size = 24 if y.size <= 256 else 6
        if y_label is not None:
            self.y_label = y_label
        with self.figure.hold_sync():
            for mark, mask in ((self.points, ~flagged), (self.flagged, flagged)):
                with mark.hold_sync():
                    mark.scales = scales
                    mark.x, mark.y = finite32(x[mask]), finite32(y[mask])
                    mark.names = None if names is None else [str(n) for n in names[mask]]
                    mark.default_size = self._point_size() if mark is self.points else max(self._size, 40)
            with self.band.hold_sync():
                self.band.scales = scales
                if band:
                    self.band.x, self.band.y = finite32(x), np.vstack([finite32(low), finite32(high)])
                else:
                    self.band.x, self.band.y = EMPTY, np.zeros((2, 0), np.float32)
            with self.thresholds.hold_sync():
                self.thresholds.scales = scales
                self.thresholds.x = finite32(span)
                self.thresholds.y = np.array([[v, v] for v in thresholds.values()], dtype=np.float32).reshape(-1, 2)
                self.thresholds.labels = list(thresholds)
            with self.line.hold_sync():
                self.line.scales = scales
                self._draw_line()
            with self.y_axis.hold_sync():
                self.y_axis.scale = y_scale
                self.y_axis.label = scale.label(self.y_label)
            if title is not None:
                self.figure.title = title
            if x_label is not None:
                self.x_axis.label = x_label
            label = self.x_axis.label
            with self.tooltip.hold_sync():
                self.tooltip.fields = ["name", "y"] if names is not None else ["x", "y"]
                self.tooltip.labels = [label, "value"]
        notes = scale.notes() + ([f"{infinite} infinite value(s) not drawn"] if infinite else [])
        self.legend_html = legend_html(
            thresholds,
            flagged=int(flagged.sum()),
            total=int(y.size),
            flagged_label=flagged_label if counted else "",
            band=band,
            band_clipped=clipped,
            notes=notes,
        )

    def join(self, joined: bool) -> None:
        """Join the points drawn by a line, or draw them alone; nothing else changes."""
        if joined == self.joined:
            return
        self.joined = joined
        with self.figure.hold_sync(), self.line.hold_sync(), self.points.hold_sync():
            self._draw_line()
            self.points.default_size = self._point_size()

    def drawn(self) -> tuple[np.ndarray, np.ndarray]:
        """x and y of every point drawn, red or not, in x order."""
        x = np.concatenate([np.asarray(self.points.x), np.asarray(self.flagged.x)])
        y = np.concatenate([np.asarray(self.points.y), np.asarray(self.flagged.y)])
        order = np.argsort(x, kind="stable")
        return x[order], y[order]

    def _draw_line(self) -> None:
        self.line.x, self.line.y = self.drawn() if self.joined else (EMPTY, EMPTY)

    def _point_size(self) -> int:
        """Points on a line are small marks to hover over; alone they are the picture."""
        return min(self._size, 10) if self.joined else self._size


class HistogramView:
    """Bars of counts over bin edges, binned in Python (only the bars are sent).

    With ``log_counts`` the count axis is logarithmic: a tail of a few values in thousands stays
    visible. ``show_values`` bins raw values on a log value axis when ``axis_scale`` says so (both
    value scales are built once; the marks and the axis are pointed at one). ``markers`` are
    vertical dashed lines at values (thresholds), described in ``legend_html``.
    """

    def __init__(self, title: str = "", x_label: str = "value", log_counts: bool = False) -> None:
        self.linear_x, self.log_x = bq.LinearScale(), bq.LogScale()
        # a log scale has no zero: bars stand on LOG_FLOOR, below the smallest count drawn (1)
        self.y_scale = bq.LogScale(min=LOG_FLOOR) if log_counts else bq.LinearScale(min=0.0)
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=["bin centre", "count"], formats=[".4g", ",.0f"])
        self.bars = bq.Bars(
            x=EMPTY,
            y=EMPTY,
            scales={"x": self.linear_x, "y": self.y_scale},
            colors=[NORMAL],
            padding=0.05,
            tooltip=self.tooltip,
            base=LOG_FLOOR if log_counts else 0.0,
        )
        self.markers = bq.Lines(
            x=np.zeros((0, 2), np.float32),
            y=np.zeros((0, 2), np.float32),
            scales={"x": self.linear_x, "y": self.y_scale},
            colors=[FLAGGED],
            line_style="dashed",
            display_legend=False,
        )
        self.x_axis = bq.Axis(scale=self.linear_x, label=x_label, tick_format=",.3~r")
        count_label = "count (log scale)" if log_counts else "count"
        self.y_axis = bq.Axis(scale=self.y_scale, side="left", label=count_label, tick_format=",.0f", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.bars, self.markers],
            axes=[self.x_axis, self.y_axis],
            title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20},
            layout={"width": "100%", "height": "340px"},
        )
        self.log_counts = log_counts
        self.x_label = x_label
        self.legend_html = ""

    @property
    def x_scale(self) -> bq.Scale:
        """The value scale in use: ``linear_x`` or ``log_x``."""
        return self.x_axis.scale

    def show_values(
        self,
        values: np.ndarray,
        bins: int = 30,
        *,
        markers: dict[str, float] | None = None,
        title: str | None = None,
        x_label: str | None = None,
    ) -> AxisScale:
        """Bin the finite ``values`` (in equal ratios on a log axis) and draw them; returns the axis chosen."""
        scale = axis_scale(values)
        self.update(*histogram_of(values, bins, log=scale.log), scale=scale, markers=markers, title=title, x_label=x_label)
        return scale

    def update(
        self,
        counts: np.ndarray,
        edges: np.ndarray,
        *,
        scale: AxisScale | None = None,
        markers: dict[str, float] | None = None,
        title: str | None = None,
        x_label: str | None = None,
    ) -> None:
        """Draw binned counts; ``scale`` (linear by default) is the value axis the edges were made for."""
        scale = scale or AxisScale()
        counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
        if edges.size < 2:
            centres = np.zeros(0)
        elif scale.log:
            centres = np.sqrt(edges[:-1] * edges[1:])  # the middle of a bin on a log axis
        else:
            centres = (edges[:-1] + edges[1:]) / 2
        keep = np.isfinite(centres) & np.isfinite(counts) & (counts > 0)  # an empty bin is a gap, not a flat bar
        centres, counts = centres[keep], counts[keep]
        markers = {k: v for k, v in finite_values(markers).items() if v > 0 or not scale.log}
        # a line beyond every value would stretch the axis and squeeze the bars: named, not drawn
        inside = {k: v for k, v in markers.items() if centres.size and edges[0] <= v <= edges[-1]}
        top = float(counts.max(initial=1.0)) * (2.0 if self.log_counts else 1.05)
        x_scale = self.log_x if scale.log else self.linear_x
        if x_label is not None:
            self.x_label = x_label
        with self.figure.hold_sync():
            with self.bars.hold_sync():
                self.bars.scales = {"x": x_scale, "y": self.y_scale}
                self.bars.x, self.bars.y = finite32(centres), finite32(counts)
            if self.log_counts:
                self.y_scale.max = top  # headroom above the tallest bar; the floor stays fixed
            with self.markers.hold_sync():
                self.markers.scales = {"x": x_scale, "y": self.y_scale}
                self.markers.x = np.array([[v, v] for v in inside.values()], dtype=np.float32).reshape(-1, 2)
                bottom = LOG_FLOOR if self.log_counts else 0.0
                self.markers.y = np.array([[bottom, top]] * len(inside), dtype=np.float32).reshape(-1, 2)
            with self.x_axis.hold_sync():
                self.x_axis.scale = x_scale
                self.x_axis.label = scale.label(self.x_label)
            if title is not None:
                self.figure.title = title
        beyond = {k: v for k, v in markers.items() if k not in inside}
        self.legend_html = legend_html(inside, vertical=True, beyond=beyond, notes=scale.notes())


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
    band_clipped: bool = False,
    vertical: bool = False,
    beyond: dict[str, float] | None = None,
    notes: Sequence[str] = (),
) -> str:
    """A one-line key for a figure: the dashed lines with their values, the red points, the band,
    the lines not drawn because no value reaches them (``beyond``) and ``notes`` on the axes."""
    parts = []
    if band:
        clipped = " (cut at the axis where a min is ≤ 0)" if band_clipped else ""
        parts.append(f"<span style='color:{BAND}'>&#9632;</span> min-max over the module's channels{clipped}")
    for label, value in lines.items():
        where = "at" if vertical else "="
        parts.append(f"<span style='color:{FLAGGED}'>- - -</span> {html.escape(label)} {where} {value:.4g}")
    for label, value in (beyond or {}).items():
        parts.append(f"{html.escape(label)} at {value:.4g}: beyond every value")
    if flagged_label and total:
        parts.append(f"<span style='color:{FLAGGED}'>&#9679;</span> {flagged} of {total} {html.escape(flagged_label)}")
    parts += [html.escape(note) for note in notes]
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


def histogram_of(values: np.ndarray, bins: int = 30, log: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Counts and edges of the finite ``values`` (an empty histogram when there are none); with
    ``log``, of the positive ones in bins of equal ratio."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values) & (values > 0 if log else True)]
    if values.size == 0:
        return np.zeros(0), np.zeros(0)
    if log and values.max() > values.min():
        return np.histogram(values, bins=np.geomspace(values.min(), values.max(), bins + 1))
    return np.histogram(values, bins=bins)


def trimmed_histogram(counts: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop empty bins at both ends (the observer's range is a power of two around the data)."""
    filled = np.flatnonzero(counts)
    if filled.size == 0:
        return counts[:0], edges[:0]
    lo, hi = filled[0], filled[-1] + 1
    return counts[lo:hi], edges[lo : hi + 1]
