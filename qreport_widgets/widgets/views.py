"""The Explore tab's views: line, histogram and table of one feature, plus the module card.

Figures and marks are created once; a selection change rewrites mark data in place. Only the
visible view is refreshed; a hidden one catches up when it is shown.
"""

from __future__ import annotations

import html
from enum import Enum

import ipywidgets as w
import numpy as np
import pandas as pd

from .. import features as F
from ..frame import MODULE, ReportFrame
from .plots import HistogramView, LineView, histogram_of, trimmed_histogram

ALL_MODULES = ""
ACTIVATION_VALUES = "input activation values"  # the observer's recorded histogram, not a report key
TABLE_ROWS = 200


class View(str, Enum):
    LINE = "Line"
    HISTOGRAM = "Histogram"
    TABLE = "Table"


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


class ExploreViews(w.VBox):
    """Line / histogram / table of the selected feature, one visible at a time."""

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame
        self.line = LineView()
        self.histogram = HistogramView()
        self.table = w.HTML(layout={"max_height": "420px", "overflow": "auto"})
        self.message = w.HTML()
        self._shown: dict[View, tuple[str, str, str]] = {}
        super().__init__([self.message, self.line.figure])

    def show(self, module: str, feature: str, view: View, prefix: str = "") -> None:
        panes = {View.LINE: self.line.figure, View.HISTOGRAM: self.histogram.figure, View.TABLE: self.table}
        with self.hold_sync():
            # only the visible pane is attached: a hidden bqplot figure has no size to lay out in
            if self.children[1] is not panes[view]:
                self.children = (self.message, panes[view])
            key = (module, feature, prefix)
            if self._shown.get(view) == key:
                return
            self._shown[view] = key
            self.message.value = ""
            if view is View.TABLE:
                self.table.value = self._table_html(module, prefix)
            elif view is View.LINE:
                self._draw_line(module, feature)
            else:
                self._draw_histogram(module, feature)

    # ---- line ----------------------------------------------------------------------------------
    def _draw_line(self, module: str, feature: str) -> None:
        frame = self.frame
        if feature == ACTIVATION_VALUES:
            counts, edges = trimmed_histogram(*frame.histograms.get(module, (np.zeros(0), np.zeros(0))))
            centres = (edges[:-1] + edges[1:]) / 2 if edges.size else edges
            self.line.update(counts, x=centres, title=f"{module} · input values", x_label="value", y_label="count")
            return
        thresholds = thresholds_for(frame, module, feature)
        if feature in frame.channel_features and module != ALL_MODULES:
            values = frame.channel_values(module, feature)
            self.line.update(values, thresholds=thresholds, title=f"{module} · {feature}", x_label="channel", y_label=feature)
        elif feature in frame.channel_features:
            stats = frame.per_module(feature)
            self.line.update(
                stats["mean"].to_numpy(), low=stats["min"].to_numpy(), high=stats["max"].to_numpy(), thresholds=thresholds,
                title=f"{feature}: mean per module, min-max band", x_label="module (forward order)", y_label=feature,
            )  # fmt: skip
        else:
            values = pd.to_numeric(frame.modules[feature], errors="coerce").to_numpy(dtype=float)
            where = "" if module == ALL_MODULES else f" (selected: {module}, #{frame.modules.at[module, 'order']})"
            self.line.update(values, thresholds=thresholds, title=f"{feature} per module{where}",
                             x_label="module (forward order)", y_label=feature)  # fmt: skip

    # ---- histogram -----------------------------------------------------------------------------
    def _draw_histogram(self, module: str, feature: str) -> None:
        frame = self.frame
        if feature == ACTIVATION_VALUES:
            counts, edges = trimmed_histogram(*frame.histograms.get(module, (np.zeros(0), np.zeros(0))))
            self.histogram.update(counts, edges, title=f"{module} · recorded input values", x_label="value")
            return
        if feature in frame.channel_features:
            values = frame.channel_values(module, feature) if module != ALL_MODULES else frame.channels[feature].to_numpy(float)
            scope = module or "all modules"
        else:
            values, scope = pd.to_numeric(frame.modules[feature], errors="coerce").to_numpy(dtype=float), "per module"
        finite = np.isfinite(values)
        if not finite.all():
            self.message.value = f"<i>{int((~finite).sum())} non-finite value(s) left out of the histogram</i>"
        self.histogram.update(*histogram_of(values, 30), title=f"{feature} · {scope}", x_label=feature)

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
    return f"<h4 style='margin:8px 0 4px'>{html.escape(title)}</h4><div style='overflow-x:auto'>{body}</div>"
