"""ModelReportVisualizer: PyTorch's table / plot / histogram methods, built on ReportFrame.

Same method names, filters and table layout as ``torch.ao.quantization.fx._model_report``'s
visualizer, with three differences: every module keeps its own channel count, a missing value is
NaN rather than the string "Not Applicable", and the views return objects (DataFrames, bqplot
Figures) instead of printing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from .frame import CHANNEL, MODULE, ReportFrame

TABLE_TENSOR_KEY = "tensor_level_info"
TABLE_CHANNEL_KEY = "channel_level_info"


@dataclass(frozen=True)
class Tables:
    """The tensor-level and channel-level tables; displays as two HTML tables in a notebook."""

    tensor_level: pd.DataFrame
    channel_level: pd.DataFrame

    def _repr_html_(self) -> str:
        parts = []
        for title, table in (("Tensor level information", self.tensor_level), ("Channel level information", self.channel_level)):
            if len(table.columns) > 2 + (title.startswith("Channel")):
                parts.append(f"<h4>{title}</h4>{table.to_html(index=False, max_rows=60)}")
        return "".join(parts) or "<p>No data points to generate table with.</p>"

    def __str__(self) -> str:
        return f"Tensor level information\n{self.tensor_level}\n\nChannel level information\n{self.channel_level}"


class ModelReportVisualizer:
    """Tables and plots of a generated report. Build it with ``report.generate_visualizer()``."""

    TABLE_TENSOR_KEY = TABLE_TENSOR_KEY
    TABLE_CHANNEL_KEY = TABLE_CHANNEL_KEY

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame

    # ---- names ---------------------------------------------------------------------------------
    def get_all_unique_module_fqns(self) -> set[str]:
        return set(self.frame.module_names)

    def get_all_unique_feature_names(self, plottable_features_only: bool = True) -> set[str]:
        """Feature names; plottable ones are numeric (per-channel or per-tensor)."""
        names = set(self.frame.channel_features)
        for feature in self.frame.tensor_features:
            if not plottable_features_only or self.frame.is_numeric(feature):
                names.add(feature)
        return names

    # ---- tables --------------------------------------------------------------------------------
    def tables(self, feature_filter: str = "", module_fqn_filter: str = "") -> Tables:
        """Both tables as DataFrames, filtered by substrings of feature and module names."""
        modules = [m for m in self.frame.module_names if module_fqn_filter in m]
        tensor_features = sorted(
            f for f in self.frame.tensor_features if feature_filter in f and _reported(self.frame, f, modules)
        )
        channel_features = sorted(
            f for f in self.frame.channel_features if feature_filter in f and _reported(self.frame, f, modules)
        )
        tensor = self.frame.modules.loc[modules, tensor_features].reset_index()
        tensor.insert(0, "idx", np.arange(len(tensor)))
        tensor = tensor.rename(columns={MODULE: "layer_fqn"})
        channels = self.frame.channels
        channel = channels.loc[channels[MODULE].isin(modules), [MODULE, CHANNEL, *channel_features]].reset_index(drop=True)
        channel.insert(0, "idx", np.arange(len(channel)))
        channel = channel.rename(columns={MODULE: "layer_fqn"})
        if not tensor_features:
            tensor = tensor.iloc[:0]
        if not channel_features:
            channel = channel.iloc[:0]
        return Tables(tensor, channel)

    def generate_filtered_tables(self, feature_filter: str = "", module_fqn_filter: str = "") -> dict[str, tuple[list, list]]:
        """PyTorch's shape: ``{key: (headers, rows)}`` for the tensor and the channel table."""
        tables = self.tables(feature_filter, module_fqn_filter)
        result = {}
        for key, table in ((TABLE_TENSOR_KEY, tables.tensor_level), (TABLE_CHANNEL_KEY, tables.channel_level)):
            rows = [[_plain(v) for v in row] for row in table.itertuples(index=False, name=None)]
            result[key] = (list(table.columns) if rows else [], rows)
        return result

    def generate_table_visualization(self, feature_filter: str = "", module_fqn_filter: str = "") -> Tables:
        return self.tables(feature_filter, module_fqn_filter)

    # ---- plots ---------------------------------------------------------------------------------
    def generate_plot_visualization(self, feature_filter: str, module_fqn_filter: str = "") -> Any:
        """A bqplot Figure of one feature as a line: per channel for one module, per module otherwise.

        As in PyTorch, the values are joined by a line in forward order; over several modules a
        per-channel feature is the mean per module, here with a min-max band (PyTorch plots the
        mean only, assuming equal channel counts). Values spanning decades get a log axis.
        """
        from ..widgets.plots import LineView

        feature, per_channel, modules = self._single_feature(feature_filter, module_fqn_filter)
        view = LineView(title=f"{feature} plot", y_label=feature, joined=True)
        if per_channel and len(modules) == 1:
            view.update(self.frame.channel_values(modules[0], feature), title=f"{feature} · {modules[0]}", x_label="channel")
        elif per_channel:
            grouped = self.frame.per_module(feature, modules)
            view.update(
                grouped["mean"],
                low=grouped["min"],
                high=grouped["max"],
                names=list(grouped.index),
                x_label="module (forward order)",
            )
        else:
            values = self.frame.modules.loc[modules, feature].astype(float).to_numpy()
            view.update(values, names=modules, x_label="module (forward order)")
        return view.figure

    def generate_histogram_visualization(self, feature_filter: str, module_fqn_filter: str = "", num_bins: int = 10) -> Any:
        """A bqplot Figure with the distribution of one feature over the matching modules / channels
        (in bins of equal ratio on a log axis when the values span decades)."""
        from ..widgets.plots import HistogramView

        feature, per_channel, modules = self._single_feature(feature_filter, module_fqn_filter)
        if per_channel:
            values = self.frame.channels.loc[self.frame.channels[MODULE].isin(modules), feature].to_numpy(dtype=float)
        else:
            values = self.frame.modules.loc[modules, feature].astype(float).to_numpy()
        view = HistogramView(title=f"{feature} histogram", x_label=feature)
        view.show_values(values, num_bins)
        return view.figure

    def _single_feature(self, feature_filter: str, module_fqn_filter: str) -> tuple[str, bool, list[str]]:
        modules = [m for m in self.frame.module_names if module_fqn_filter in m]
        plottable = self.get_all_unique_feature_names(plottable_features_only=True)
        matches = sorted(f for f in plottable if feature_filter in f and _reported(self.frame, f, modules))
        exact = [f for f in matches if f == feature_filter]
        if exact:
            matches = exact
        if len(matches) != 1:
            raise ValueError(
                f"the feature filter {feature_filter!r} matches {len(matches)} plottable features "
                f"({', '.join(matches[:6]) or 'none'}); pick one of get_all_unique_feature_names()"
            )
        feature = matches[0]
        present = [m for m in modules if feature in self.frame.present.get(m, ())]
        return feature, feature in self.frame.channel_features, present


def _reported(frame: ReportFrame, feature: str, modules: list[str]) -> bool:
    return any(feature in frame.present.get(m, ()) for m in modules)


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if value is pd.NA:
        return float("nan")
    return value
