"""bqplot figures of the widget, which the visualizer's plot methods return too.

Each view owns one Figure and its marks; ``update`` methods change mark data in place under ``hold_sync``.
"""

from __future__ import annotations

import warnings
from typing import Any

import bqplot as bq
import numpy as np

MAX_DRAWN_POINTS = 2048  # more channels than this are drawn as min / mean / max per bucket


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
    """Values against an index, an optional min-max band, and horizontal threshold lines."""

    def __init__(self, title: str = "", x_label: str = "channel", y_label: str = "") -> None:
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale()
        scales = {"x": self.x_scale, "y": self.y_scale}
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=[x_label, "value"], formats=["", ".4g"])
        self.band = bq.Lines(
            x=np.zeros(0, np.float32), y=np.zeros((2, 0), np.float32), scales=scales, fill="between",
            fill_colors=["#9ecae1"], fill_opacities=[0.35], colors=["#9ecae1"], stroke_width=0.5, display_legend=False,
        )  # fmt: skip
        self.line = bq.Lines(
            x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales=scales, colors=["#1f77b4"],
            marker="circle", marker_size=12, tooltip=self.tooltip,
        )  # fmt: skip
        self.thresholds = bq.Lines(
            x=np.zeros(0, np.float32), y=np.zeros((0, 0), np.float32), scales=scales, colors=["#d62728"],
            line_style="dashed", display_legend=True, labels=[],
        )  # fmt: skip
        self.x_axis = bq.Axis(scale=self.x_scale, label=x_label)
        self.y_axis = bq.Axis(scale=self.y_scale, orientation="vertical", label=y_label, tick_format=".3g", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.band, self.line, self.thresholds], axes=[self.x_axis, self.y_axis], title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20}, layout={"width": "100%", "height": "340px"},
            legend_location="top-right",
        )  # fmt: skip

    def update(
        self,
        y: np.ndarray,
        *,
        x: np.ndarray | None = None,
        low: np.ndarray | None = None,
        high: np.ndarray | None = None,
        thresholds: dict[str, float] | None = None,
        title: str | None = None,
        x_label: str | None = None,
        y_label: str | None = None,
    ) -> None:
        y = np.asarray(y, dtype=np.float64)
        if x is None and y.size > MAX_DRAWN_POINTS:
            x, y, low, high = bucketed(y)
        x = np.arange(y.size, dtype=np.float64) if x is None else np.asarray(x, dtype=np.float64)
        # SVG paths cannot hold NaN: points without a finite value are left out (x keeps the gap)
        keep = np.isfinite(y)
        if low is not None and high is not None:
            keep &= np.isfinite(low) & np.isfinite(high)
            low, high = np.asarray(low)[keep], np.asarray(high)[keep]
        x, y = x[keep], y[keep]
        thresholds = {k: v for k, v in (thresholds or {}).items() if v is not None and np.isfinite(v)}
        span = np.array([x.min(), x.max()]) if x.size else np.zeros(2)
        with self.figure.hold_sync():
            with self.line.hold_sync():
                self.line.x, self.line.y = finite32(x), finite32(y)
                self.line.marker = "circle" if y.size <= 64 else None
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
                self.tooltip.labels = [x_label, "value"]
            if y_label is not None:
                self.y_axis.label = y_label


class HistogramView:
    """Bars of counts over bin edges, binned in Python (only the bars are sent)."""

    def __init__(self, title: str = "", x_label: str = "value") -> None:
        self.x_scale, self.y_scale = bq.LinearScale(), bq.LinearScale(min=0.0)
        self.tooltip = bq.Tooltip(fields=["x", "y"], labels=["bin centre", "count"], formats=[".4g", ""])
        self.bars = bq.Bars(
            x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales={"x": self.x_scale, "y": self.y_scale},
            colors=["#1f77b4"], padding=0.05, tooltip=self.tooltip,
        )  # fmt: skip
        self.x_axis = bq.Axis(scale=self.x_scale, label=x_label, tick_format=".3g")
        self.y_axis = bq.Axis(scale=self.y_scale, orientation="vertical", label="count", tick_format=",.0f", label_offset="55px")
        self.figure = bq.Figure(
            marks=[self.bars], axes=[self.x_axis, self.y_axis], title=title,
            fig_margin={"top": 40, "bottom": 45, "left": 75, "right": 20}, layout={"width": "100%", "height": "340px"},
        )  # fmt: skip

    def update(self, counts: np.ndarray, edges: np.ndarray, *, title: str | None = None, x_label: str | None = None) -> None:
        counts, edges = np.asarray(counts, dtype=np.float64), np.asarray(edges, dtype=np.float64)
        centres = (edges[:-1] + edges[1:]) / 2 if edges.size > 1 else np.zeros(0)
        keep = np.isfinite(centres) & np.isfinite(counts) & (counts > 0)  # an empty bin is a gap, not a flat bar
        centres, counts = centres[keep], counts[keep]
        with self.figure.hold_sync():
            with self.bars.hold_sync():
                self.bars.x, self.bars.y = finite32(centres), finite32(counts)
            if title is not None:
                self.figure.title = title
            if x_label is not None:
                self.x_axis.label = x_label


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
