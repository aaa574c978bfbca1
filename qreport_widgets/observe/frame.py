"""ReportFrame: the report as tidy pandas tables, which every view reads.

- ``modules``: one row per observed module in forward order: order, module type, channel count
  and every per-tensor feature (floats, bools, strings);
- ``channels``: one row per (module, channel), every per-channel feature as a float column, NaN
  where a feature does not apply; modules with different channel counts are normal;
- ``suggestions``: one row per (module, detector recommendation): kind, reason, evidence.

Built with numpy slices per (module, feature), never one value at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .records import Column, Suggestion

MODULE = "module"
CHANNEL = "channel"
ORDER = "order"
MODULE_TYPE = "module_type"
CHANNELS = "channels"
_SUGGESTION_COLUMNS = [MODULE, "detector", "kind", "reason", "evidence"]


@dataclass(frozen=True)
class ReportFrame:
    modules: pd.DataFrame
    channels: pd.DataFrame
    suggestions: pd.DataFrame
    histograms: Mapping[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    present: Mapping[str, frozenset[str]] = field(default_factory=dict)  # features each module reports

    @classmethod
    def from_features(
        cls,
        features_by_module: Mapping[str, Mapping[str, Column]],
        module_types: Mapping[str, str] | None = None,
        suggestions: Iterable[Suggestion] = (),
        histograms: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> ReportFrame:
        """From ``{module: {feature: column}}`` in forward order (see ``records.py`` for columns)."""
        names = list(features_by_module)
        per_tensor: dict[str, list[Any]] = {}
        per_channel: dict[str, dict[int, np.ndarray]] = {}
        counts = np.zeros(len(names), dtype=np.int64)
        for i, fqn in enumerate(names):
            for feature, value in features_by_module[fqn].items():
                if isinstance(value, np.ndarray) and value.ndim == 1:
                    per_channel.setdefault(feature, {})[i] = value
                    counts[i] = max(counts[i], value.size)
                else:
                    per_tensor.setdefault(feature, [None] * len(names))[i] = _as_scalar(value)
        starts = np.concatenate([[0], np.cumsum(counts)])
        total = int(starts[-1])
        channel_columns: dict[str, np.ndarray] = {
            MODULE: np.repeat(np.array(names, dtype=object), counts),
            CHANNEL: np.arange(total) - np.repeat(starts[:-1], counts),
        }
        for feature, arrays in per_channel.items():
            column = np.full(total, np.nan)
            for i, array in arrays.items():
                column[starts[i] : starts[i] + array.size] = array
            channel_columns[feature] = column
        channels = pd.DataFrame(channel_columns)
        module_types = module_types or {}
        modules = pd.DataFrame(
            {
                ORDER: np.arange(len(names)),
                MODULE_TYPE: [module_types.get(n, "") for n in names],
                CHANNELS: counts,
                **{feature: pd.Series(values, index=names, dtype=_dtype_of(values)) for feature, values in per_tensor.items()},
            },
            index=pd.Index(names, name=MODULE),
        )
        table = pd.DataFrame(
            [(s.module_fqn, s.detector, s.kind.value, s.reason, s.evidence) for s in suggestions], columns=_SUGGESTION_COLUMNS
        )
        present = {fqn: frozenset(features_by_module[fqn]) for fqn in names}
        return cls(modules, channels, table, dict(histograms or {}), present)

    # ------------------------------------------------------------------ lookups for views
    @property
    def module_names(self) -> list[str]:
        return list(self.modules.index)

    @property
    def channel_features(self) -> list[str]:
        return [c for c in self.channels.columns if c not in (MODULE, CHANNEL)]

    @property
    def tensor_features(self) -> list[str]:
        return [c for c in self.modules.columns if c not in (ORDER, MODULE_TYPE, CHANNELS)]

    def is_numeric(self, feature: str) -> bool:
        """Whether a per-module feature holds numbers that can be plotted (not flags or text)."""
        column = self.modules[feature]
        return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)

    def per_module(self, feature: str, modules: list[str] | None = None) -> pd.DataFrame:
        """Mean, min and max of a per-channel feature for each module (forward order, NaN left out)."""
        modules = self.module_names if modules is None else modules
        rows = self.channels[[MODULE, feature]].dropna()
        rows = rows[rows[MODULE].isin(modules)]
        return rows.groupby(MODULE, sort=False)[feature].agg(["mean", "min", "max"]).reindex(modules)

    def features_of(self, module: str) -> tuple[list[str], list[str]]:
        """(per-channel, per-tensor) features ``module`` reports (a NaN value still counts)."""
        present = self.present.get(module, frozenset())
        return [f for f in self.channel_features if f in present], [f for f in self.tensor_features if f in present]

    def channel_block(self, module: str) -> pd.DataFrame:
        """The ``channels`` rows of one module (a contiguous slice, no scan)."""
        order = int(self.modules.at[module, ORDER])
        start = int(self.modules[CHANNELS].iloc[:order].sum())
        return self.channels.iloc[start : start + int(self.modules.at[module, CHANNELS])]

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (module, channel) with every per-channel and per-module feature."""
        return self.channels.join(self.modules, on=MODULE)

    def channel_values(self, module: str, feature: str) -> np.ndarray:
        return self.channel_block(module)[feature].to_numpy(dtype=np.float64)


def _as_scalar(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)):
        return value.item()
    return value


def _dtype_of(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return "boolean"
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return "float64"
    return object
