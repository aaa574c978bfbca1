"""The Tune tab's runs: the history table and the per-layer SQNR of each run as grouped bars."""

from __future__ import annotations

import html
from collections.abc import Sequence

import bqplot as bq
import ipywidgets as w
import numpy as np
import pandas as pd

from ..tune.history import FLOAT_REFERENCE
from ..tune.run import Change, changes_text
from .plots import bar_range, scrolling_table
from .protocols import TuningSession

TOP_LAYERS = 20  # bars per run in the per-layer chart; the full table is session.compare()
SQNR_VIEW, DELTA_VIEW = "SQNR per run", "change vs baseline"
RUNS_DRAWN = 4  # the baseline and the last three runs in the per-layer chart
SERIES_COLORS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
KERNEL_COLOR = "#d62728"  # the kernel check's series: red, used by no run


class RunsTable(w.HTML):
    """One row per run: its changes shortened (all of them on hover), numbers with three digits; as
    wide as the tab, scrolling sideways when the table is wider (its last columns stay reachable)."""

    def __init__(self) -> None:
        super().__init__(layout={"width": "100%", "min_width": "0"})
        self.add_class("qr-runs")

    def show(self, runs: pd.DataFrame, changed: Sequence[Sequence[Change] | None]) -> None:
        """``runs``: ``session.compare()``'s table; ``changed``: each run's changes as rows
        (``RunResult.changed``), in the history's order, drawn in the ``changes`` column (the float
        model's reference row, first where there is one, keeps its words)."""
        shown = runs.assign(
            **{c: runs[c].map(lambda v: html.escape(str(v))) for c in runs.select_dtypes(include=["object", "string"])}
        )
        if "changes" in runs:  # the runs' rows (not the float model's reference row) drawn from their changes
            recorded = runs["run"] != FLOAT_REFERENCE if "run" in runs else pd.Series(True, index=runs.index)
            shown.loc[recorded, "changes"] = [short_changes(rows) for rows in changed]
        if "run" in runs:  # a label is a name: one line
            shown["run"] = shown["run"].map(lambda v: f"<span style='white-space:nowrap'>{v}</span>")
        table = shown.to_html(index=False, float_format=number, border=0, escape=False, na_rep="")
        # the content box may shrink to the tab's width, so the table scrolls inside it instead of
        # overflowing; its headers wrap (two lines at most, "output SQNR / (dB)") so a dozen columns fit
        fit = (
            "<style>.qr-runs .widget-html-content{min-width:0;max-width:100%}"
            ".qr-runs .qr-table th{white-space:normal;min-width:4.5em;vertical-align:bottom}</style>"
        )
        self.value = fit + "<h4 style='margin:6px 0'>Runs</h4>" + scrolling_table(table)


class LayersChart(w.VBox):
    """Per-layer SQNR of every run, or each run's change from the baseline; the marks are built
    once and updated in place."""

    def __init__(self) -> None:
        self.view = w.ToggleButtons(
            options=[SQNR_VIEW, DELTA_VIEW],
            value=SQNR_VIEW,
            style={"button_width": "170px"},
            tooltips=["each run's SQNR per layer", "each run minus the baseline, per layer: where a change helped or hurt"],
        )
        self.figure, self.bars, self.x_scale = _sqnr_figure()
        # the runs named above the chart, in HTML that wraps: bqplot's legend is a box inside the plot
        # that grows with the longest name and is cut at the figure's edge ("fit <= ... perplexity <= ...")
        self.legend = w.HTML(layout=w.Layout(margin="4px 0 0 60px"))
        self._layers = pd.DataFrame()
        self._kernels: pd.Series | None = None
        super().__init__([self.view, self.legend, self.figure])
        self.view.observe(self._on_view_change, "value")

    def _on_view_change(self, _change: dict) -> None:
        if len(self._layers):
            self.draw(self._layers, self._kernels)

    def draw(self, layers: pd.DataFrame, kernels: pd.Series | None = None) -> None:
        """``layers``: one column per run (the baseline first), one row per layer. Past TOP_LAYERS
        layers, those lowest (or most changed) in the last run, in forward order. ``kernels``: the
        modules whose quantized kernel differs from its reference (kernel SQNR, named by its run),
        drawn as a red series of their own beside the runs' SQNR."""
        self._layers, self._kernels = layers, kernels
        layers = layers.replace([np.inf, -np.inf], np.nan)
        if layers.shape[1] == 0:  # no run measured per layer yet
            return
        if layers.shape[1] > RUNS_DRAWN:  # the baseline and the latest runs: more groups are too thin to read
            layers = layers.iloc[:, [0, *range(layers.shape[1] - RUNS_DRAWN + 1, layers.shape[1])]]
        delta = self.view.value == DELTA_VIEW and layers.shape[1] > 1
        if delta:
            layers = layers.iloc[:, 1:].sub(layers.iloc[:, 0], axis=0)
        total, last = len(layers), layers.iloc[:, -1]
        what = "SQNR change vs baseline" if delta else "Per-layer SQNR"
        title = what
        if total > TOP_LAYERS:
            chosen = last.abs().nlargest(TOP_LAYERS).index if delta else last.nsmallest(TOP_LAYERS).index
            layers = layers[layers.index.isin(set(chosen))]
            title = f"{what}: {TOP_LAYERS} {'most changed' if delta else 'lowest'} of {total} layers"
        colors = SERIES_COLORS[1 : layers.shape[1] + 1] if delta else SERIES_COLORS[: layers.shape[1]]
        if kernels is not None and not delta:
            layers = layers.join(kernels.reindex(layers.index).rename(str(kernels.name)))
            colors = [*colors, KERNEL_COLOR]
            title += " · red: kernels that differ"
        low, high, span = bar_range(layers.to_numpy(dtype=np.float64).ravel())
        labels = [f"{c} - baseline" if delta else str(c) for c in layers.columns]
        self.legend.value = legend_html(labels, colors)
        with self.figure.hold_sync():
            self.figure.title = title
            self.figure.fig_margin = {**self.figure.fig_margin, "left": _left_margin(list(layers.index))}
            self.x_scale.domain = list(layers.index)
            self.bars.scales["y"].min, self.bars.scales["y"].max = low, high + 0.05 * span  # the tallest bar clear of the title
            self.figure.axes[1].label = "change (dB)" if delta else "SQNR (dB)"
            self.bars.tooltip.labels = ["layer", "change (dB)" if delta else "SQNR (dB)"]
            with self.bars.hold_sync():
                self.bars.x = list(layers.index)
                self.bars.y = layers.T.to_numpy(dtype=np.float32, na_value=0.0)
                self.bars.labels = labels
                self.bars.colors = colors


# the rotated tick labels (9 px, at -35 degrees, ending at their tick) reach this far left of it per
# character; the first few ticks sit about this far apart on a narrow screen
_TICK_PX_PER_CHAR, _NARROW_BAND_PX, _LEFT_PX = 4.2, 20, 60


def _left_margin(layers: Sequence[str]) -> int:
    """Room left of the plot for the y axis and for the first ticks' rotated names (a decoder's
    ``model.layers.0.self_attn.v_proj`` reaches 130 px left of its tick), so none is cut at the edge."""
    reach = (_TICK_PX_PER_CHAR * len(str(name)) - _NARROW_BAND_PX * (i + 0.5) for i, name in enumerate(layers[:4]))
    return int(max(_LEFT_PX, *reach, 0) + 0.5)


def legend_html(labels: Sequence[str], colors: Sequence[str]) -> str:
    """Each series' colour and name, the names wrapping onto more lines as the width asks."""
    items = "".join(
        "<span style='display:inline-flex;align-items:center;max-width:100%;overflow-wrap:anywhere'>"
        f"<span style='flex:none;width:10px;height:10px;margin-right:5px;background:{color}'></span>"
        f"{html.escape(label)}</span>"
        for label, color in zip(labels, colors, strict=True)
    )
    return f"<div class='qr-legend' style='display:flex;flex-wrap:wrap;gap:2px 16px;font-size:12px;line-height:1.4'>{items}</div>"


def run_changes(session: TuningSession) -> list[tuple[Change, ...] | None]:
    """Each recorded run's changes from the starting settings, as rows, in the history's order."""
    start = session.current_settings()
    return [run.changed(start) for run in session.history]


def short_changes(changed: Sequence[Change] | None, shown: int = 2) -> str:
    """A run's changes in the runs table: modules changed the same way said once ("28 modules:
    format=int4-weight-only, group_size=32"), the largest such group first, the first few groups
    shown and the rest counted; every module on hover."""
    whole = changes_text(changed)
    if not changed:
        short = whole
    else:
        groups: dict[tuple[str, ...], list[str]] = {}
        for change in changed:
            groups.setdefault(change.what, []).append(change.module)
        ordered = sorted(groups.items(), key=lambda item: -len(item[1]))  # stable: forward order among equals
        said = [
            f"{len(names)} modules: {', '.join(what)}" if len(names) > 1 else f"{names[0]}: {', '.join(what)}"
            for what, names in ordered
        ]
        left = sum(len(names) for _, names in ordered[shown:])
        short = "; ".join(said[:shown]) + (f"; +{left} more module{'s' * (left > 1)}" if left else "")
    return f"<span title='{html.escape(whole)}' style='display:inline-block;min-width:14em'>{html.escape(short)}</span>"


def number(value: float) -> str:
    """Three significant digits, thousands written out: 2,806 rather than 2.81e+03."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _sqnr_figure() -> tuple[bq.Figure, bq.Bars, bq.OrdinalScale]:
    x_scale, y_scale = bq.OrdinalScale(), bq.LinearScale(min=0.0)
    bars = bq.Bars(
        x=[],
        y=np.zeros((0, 0), np.float32),
        scales={"x": x_scale, "y": y_scale},
        type="grouped",
        display_legend=False,  # the runs are named in HTML above the figure (LayersChart.legend)
        labels=[],
        colors=SERIES_COLORS[:1],
        padding=0.15,
        tooltip=bq.Tooltip(fields=["x", "y"], labels=["layer", "SQNR (dB)"], formats=["", ".1f"]),
    )
    # module names are long: rotated ticks with room under them, and no axis title to collide with
    axes = [
        bq.Axis(scale=x_scale, tick_rotate=-35, tick_style={"font-size": "9px", "text-anchor": "end"}),
        bq.Axis(scale=y_scale, side="left", label="SQNR (dB)", label_offset="40px"),
    ]
    figure = bq.Figure(
        marks=[bars],
        axes=axes,
        title="Per-layer SQNR",
        fig_margin={"top": 50, "bottom": 110, "left": 60, "right": 20},
        layout={"width": "100%", "height": "380px"},
    )
    return figure, bars, x_scale
