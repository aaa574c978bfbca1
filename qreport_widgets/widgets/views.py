"""The Explore tab's views: points or a line, histogram and table of one feature, plus the module card.

Figures and marks are created once; a selection change rewrites mark data in place. Only the
visible view is refreshed; a hidden one catches up when it is shown.
"""

from __future__ import annotations

import html
from enum import Enum

import ipywidgets as w
import numpy as np
import pandas as pd

from ..core import features as F
from ..observe.frame import MODULE, ReportFrame
from .plots import HistogramView, LineView, scrolling_table, trimmed_histogram

ALL_MODULES = ""
ACTIVATION_VALUES = "input activation values"  # the observer's recorded histogram, not a report key
TABLE_ROWS = 200
AS_HISTOGRAM = "<i>Recorded values are drawn as a histogram in every view but Table.</i>"


# what each of torch's report keys measures, in words (the raw key stays in the tables and tooltips)
READABLE = {
    F.OUTLIER_RATIOS: "outlier ratio: channel max / reference percentile",
    F.INPUT_PER_CHANNEL_MAX: "input max per channel",
    F.INPUT_PER_CHANNEL_MIN: "input min per channel",
    F.WEIGHT_PER_CHANNEL_MAX: "weight max per channel",
    F.WEIGHT_PER_CHANNEL_MIN: "weight min per channel",
    F.EQUALIZATION_COMP_METRICS: "equalization balance per channel (weight vs input range)",
    F.EQUALIZATION_RECOMMENDED: "equalization recommended per channel",
    F.OUTLIERS_DETECTED: "outliers detected per channel",
    F.CONSTANT_BATCH_COUNTS: "batches with a constant channel",
    F.OUTLIER_BATCHES_USED: "batches used for the outlier ratio",
    F.INPUT_COMP_STAT: "input: batch range / whole-data range (dynamic vs static)",
    F.OUTPUT_COMP_STAT: "output: batch range / whole-data range (dynamic vs static)",
    F.INPUT_GLOBAL_MAX: "input max",
    F.INPUT_GLOBAL_MIN: "input min",
    F.WEIGHT_GLOBAL_MAX: "weight max",
    F.WEIGHT_GLOBAL_MIN: "weight min",
}


def readable(feature: str) -> str:
    return READABLE.get(feature, feature.replace("_", " "))


def short_name(feature: str) -> str:
    """The feature in a few words, for a figure's title and axis: "outlier ratio"."""
    return readable(feature).split(":")[0].split(" (")[0]


class View(str, Enum):
    POINTS = "Points"  # a point per channel (one module) or per module (all modules)
    LINE = "Line"  # the same points joined in channel or forward order
    HISTOGRAM = "Histogram"
    TABLE = "Table"


ALONG_AN_INDEX = (View.POINTS, View.LINE)  # both drawn by one LineView


def thresholds_for(frame: ReportFrame, module: str, feature: str) -> dict[str, float]:
    """The detector threshold(s) to draw with ``feature``."""

    def value(column: str) -> float | None:
        if column not in frame.modules:
            return None
        series = frame.modules[column] if module == ALL_MODULES else frame.modules.loc[[module], column]
        present = pd.to_numeric(series, errors="coerce").dropna()
        return float(present.iloc[0]) if len(present) else None

    if feature == F.OUTLIER_RATIOS:
        return {"outlier threshold": value(F.OUTLIER_RATIO_THRESHOLD)}
    if feature == F.EQUALIZATION_COMP_METRICS:
        t = value(F.EQUALIZATION_THRESHOLD)
        return {} if not t else {"equalization band (low)": t, "equalization band (high)": 1 / t}
    if feature in (F.INPUT_COMP_STAT, F.OUTPUT_COMP_STAT):
        return {"dynamic tolerance": value(F.TOLERANCE)}
    return {}


# the detector's own verdict on each drawn feature: the report column holding it, and its words
VERDICTS = {
    F.OUTLIER_RATIOS: (F.OUTLIERS_DETECTED, "above the outlier threshold"),
    F.EQUALIZATION_COMP_METRICS: (F.EQUALIZATION_RECOMMENDED, "outside the equalization band"),
    F.INPUT_COMP_STAT: (F.INPUT_DATA_CLASSIFICATION, "non-stationary (at or below the dynamic tolerance)"),
    F.OUTPUT_COMP_STAT: (F.OUTPUT_DATA_CLASSIFICATION, "non-stationary (at or below the dynamic tolerance)"),
}


def is_flagged(verdicts: pd.Series) -> np.ndarray:
    """A verdict column as a mask: a per-channel flag that is set, or a range classified non-stationary."""
    return (verdicts.eq(1) | verdicts.eq(F.NON_STATIONARY)).to_numpy(dtype=bool)


def flagged_modules(frame: ReportFrame, feature: str) -> pd.Series | None:
    """Per module (forward order), whether the detector behind ``feature`` flags it: a per-channel
    verdict set on one of its channels, or a per-module verdict; None when no verdict goes with
    ``feature``. A module without the verdict is False."""
    column = VERDICTS.get(feature, (None, ""))[0]
    if column in frame.channels:
        verdicts = frame.channels.groupby(MODULE, sort=False)[column].max().reindex(frame.module_names)
    elif column in frame.modules:
        verdicts = frame.modules[column]
    else:
        return None
    return pd.Series(is_flagged(verdicts), index=frame.module_names)


def outlier_markers(frame: ReportFrame, module: str, counts: np.ndarray, edges: np.ndarray) -> dict[str, float]:
    """The outlier rule applied to a whole recorded tensor: ``ratio threshold`` times the reference
    percentile, on each side where that percentile has the side's sign."""
    columns = (F.OUTLIER_RATIO_THRESHOLD, F.OUTLIER_REFERENCE_PERCENTILE)
    if not counts.size or not all(c in frame.modules for c in columns) or module not in frame.modules.index:
        return {}
    ratio, percentile = (pd.to_numeric(frame.modules.at[module, c], errors="coerce") for c in columns)
    if not (np.isfinite(ratio) and np.isfinite(percentile)):
        return {}
    cumulative = np.cumsum(counts) / counts.sum()
    upper = float(edges[1:][min(np.searchsorted(cumulative, percentile), counts.size - 1)])
    lower = float(edges[:-1][min(np.searchsorted(cumulative, 1.0 - percentile), counts.size - 1)])
    markers = {}
    for value, share in ((upper, percentile), (lower, 1.0 - percentile)):
        limit = ratio * value
        if value != 0 and (value > 0) == (share > 0.5):
            markers[f"outlier rule: {ratio:g} x the {share * 100:.3g}th percentile"] = limit
    return markers


class ExploreViews(w.VBox):
    """Points or a line / histogram / table of the selected feature, one visible at a time, with a
    key to the figure's lines, red points and axis scale under it."""

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame
        self.line = LineView()
        self.histogram = HistogramView()
        self.values = HistogramView(log_counts=True)  # the recorded input values: their tail matters
        self.table = w.HTML(layout={"max_height": "420px", "overflow": "auto"})
        self.message = w.HTML()
        self.legend = w.HTML()
        self._shown: dict[View, tuple[tuple[str, str, str], str, str]] = {}  # pane: (what, message, legend)
        super().__init__([self.message, self.line.figure, self.legend])

    def show(self, module: str, feature: str, view: View, prefix: str = "") -> None:
        note = ""
        if feature == ACTIVATION_VALUES and view in ALONG_AN_INDEX:
            view, note = View.HISTOGRAM, AS_HISTOGRAM  # a histogram of values; as points it says the same, less clearly
        pane = View.POINTS if view in ALONG_AN_INDEX else view
        figures = {View.POINTS: self.line.figure, View.HISTOGRAM: self.histogram.figure, View.TABLE: self.table}
        if feature == ACTIVATION_VALUES:
            figures[View.HISTOGRAM] = self.values.figure
        with self.hold_sync():
            # only the visible pane is attached: a hidden bqplot figure has no size to lay out in
            if self.children[1] is not figures[pane]:
                self.children = (self.message, figures[pane], self.legend)
            if pane is View.POINTS:
                self.line.join(view is View.LINE)
            key = (module, feature, prefix)
            shown = self._shown.get(pane)
            if shown is not None and shown[0] == key:  # drawn already: the message and key come back with it
                self.message.value, self.legend.value = note or shown[1], shown[2]
                return
            self.message.value = note
            if view is View.TABLE:
                self.table.value = self._table_html(module, prefix)
                self.legend.value = ""
            elif pane is View.POINTS:
                self._draw_line(module, feature)
                self.legend.value = self.line.legend_html + _report_key(feature)
            elif feature == ACTIVATION_VALUES:
                self._draw_values(module)
                self.legend.value = self.values.legend_html
            else:
                self._draw_histogram(module, feature)
                self.legend.value = self.histogram.legend_html + _report_key(feature)
            self._shown[pane] = (key, "" if note else self.message.value, self.legend.value)

    # ---- line ----------------------------------------------------------------------------------
    def _draw_line(self, module: str, feature: str) -> None:
        frame = self.frame
        thresholds = thresholds_for(frame, module, feature)
        column, words = VERDICTS.get(feature, (None, ""))
        has_verdict = column is not None and (column in frame.channels or column in frame.modules)
        name = short_name(feature)
        if feature in frame.channel_features and module != ALL_MODULES:
            block = frame.channel_block(module)
            self.line.update(
                block[feature].to_numpy(dtype=np.float64),
                thresholds=thresholds,
                flagged=is_flagged(block[column]) if has_verdict else None,
                flagged_label=f"channels {words}",
                title=f"{module} · {name}",
                x_label="channel",
                y_label=name,
            )
        elif feature in frame.channel_features:
            stats = frame.per_module(feature)
            by_module = flagged_modules(frame, feature)  # a module is red when the detector flags one of its channels
            self.line.update(
                stats["mean"].to_numpy(),
                low=stats["min"].to_numpy(),
                high=stats["max"].to_numpy(),
                names=list(stats.index),
                thresholds=thresholds,
                flagged=None if by_module is None else by_module.to_numpy(),
                flagged_label=f"modules with a channel {words}",
                title=f"{name}: mean per module",
                x_label="module (forward order)",
                y_label=name,
            )
        else:
            values = pd.to_numeric(frame.modules[feature], errors="coerce").to_numpy(dtype=float)
            by_module = flagged_modules(frame, feature)
            where = "" if module == ALL_MODULES else f" (selected: {module}, #{frame.modules.at[module, 'order']})"
            self.line.update(
                values,
                names=list(frame.modules.index),
                thresholds=thresholds,
                flagged=None if by_module is None else by_module.to_numpy(),
                flagged_label=f"modules {words}",
                title=f"{name} per module{where}",
                x_label="module (forward order)",
                y_label=name,
            )

    # ---- histogram -----------------------------------------------------------------------------
    def _draw_values(self, module: str) -> None:
        counts, edges = trimmed_histogram(*self.frame.histograms.get(module, (np.zeros(0), np.zeros(0))))
        markers = outlier_markers(self.frame, module, counts, edges)
        self.values.update(counts, edges, markers=markers, title=f"{module} · recorded input values", x_label="value")

    def _draw_histogram(self, module: str, feature: str) -> None:
        frame = self.frame
        if feature in frame.channel_features:
            values = frame.channel_values(module, feature) if module != ALL_MODULES else frame.channels[feature].to_numpy(float)
            scope = module or "all modules"
        else:
            values, scope = pd.to_numeric(frame.modules[feature], errors="coerce").to_numpy(dtype=float), "per module"
        finite = np.isfinite(values)
        if not finite.all():
            self.message.value = f"<i>{int((~finite).sum())} non-finite value(s) left out of the histogram</i>"
        thresholds = thresholds_for(frame, module, feature)
        self.histogram.show_values(
            values, 30, markers=thresholds, title=f"{short_name(feature)} · {scope}", x_label=short_name(feature)
        )

    # ---- table ---------------------------------------------------------------------------------
    def _table_html(self, module: str, prefix: str) -> str:
        frame = self.frame
        text = prefix.strip().lower()  # the Find box: part of a name or type, as for the module list
        types = frame.modules["module_type"].astype(str)
        names = (
            [m for m in frame.module_names if frame.present.get(m) and (not text or text in f"{m} {types[m]}".lower())]
            if module == ALL_MODULES
            else [module]
        )
        suggestions = frame.suggestions[frame.suggestions[MODULE].isin(names)]
        parts = [_titled("Suggestions", suggestions.drop(columns=["evidence"]), "No suggestions for these modules.")]
        tensor = frame.modules.loc[names].drop(columns=["order"])
        tensor = tensor.loc[:, tensor.notna().any()]
        parts.append(_titled("Per-module features", tensor.reset_index(), "No per-module features."))
        if module != ALL_MODULES:
            block = frame.channel_block(module)
            block = block.loc[:, block.notna().any()].drop(columns=[MODULE])
            note = f" (first {TABLE_ROWS} of {len(block)})" if len(block) > TABLE_ROWS else ""
            parts.append(_titled(f"Per-channel features{note}", block.head(TABLE_ROWS), "No per-channel features."))
        return "".join(parts)


class ModuleCard(w.HTML):
    """What the report says about the selected module, in a few lines."""

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame
        super().__init__(layout={"width": "300px", "min_width": "260px"})

    def show(self, module: str) -> None:
        frame = self.frame
        if module == ALL_MODULES:
            counts = frame.suggestions["kind"].value_counts()
            lines = [f"<b>{len(frame.module_names)} observed modules</b>"]
            lines += [f"{kind}: {count}" for kind, count in counts.items()] or ["no suggestions"]
        else:
            row = frame.modules.loc[module]
            lines = [f"<b>{html.escape(module)}</b>", f"{row['module_type']}, {row['channels']} channels"]
            for column in (F.INPUT_DATA_CLASSIFICATION, F.OUTPUT_DATA_CLASSIFICATION):
                if column in frame.modules and isinstance(row[column], str):
                    lines.append(f"{column.split('_')[0]}: {row[column]}")
            mine = frame.suggestions[frame.suggestions[MODULE] == module]
            lines.append("<b>Suggestions</b>" if len(mine) else "<i>no suggestions</i>")
            lines += [f"• <b>{html.escape(k)}</b>: {html.escape(r)}" for k, r in zip(mine["kind"], mine["reason"], strict=True)]
        self.value = "<div style='font-size:12px;line-height:1.5'>" + "<br>".join(lines) + "</div>"


def _titled(title: str, table: pd.DataFrame, empty: str) -> str:
    body = table.to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="", border=0) if len(table) else f"<i>{empty}</i>"
    # wide tables scroll sideways inside the tab instead of being cut at its edge
    return f"<h4 style='margin:8px 0 4px'>{html.escape(title)}</h4>{scrolling_table(body)}"


def _report_key(feature: str) -> str:
    """torch's report key of the feature drawn, for code that reads the report's dictionaries."""
    return f"<div style='font-size:11px;color:#888;margin-left:75px'>report key: <code>{html.escape(feature)}</code></div>"
