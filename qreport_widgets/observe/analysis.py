"""Analysis: everything the observation half of the tool finds out about a model, as one value.

``analyze()`` and ``ModelReport`` produce it, ``load_report`` reads it back from a file, and the
tables (``ReportFrame``), report files and the widget read nothing else. It is immutable: tuning
runs, views and saving never change it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .frame import ReportFrame
from .records import Column, DetectorResult, StoredRecord, Suggestion

if TYPE_CHECKING:
    import pandas as pd

    from .visualizer import ModelReportVisualizer


@dataclass(frozen=True)
class GraphSummary:
    """The model as the analysis saw it: observed modules in forward order, graph op counts, layer
    types, and the modules that could not be observed with the reason."""

    units: Mapping[str, str]  # module -> type name, forward order
    ops: Mapping[str, int]
    layer_types: Mapping[str, int]
    skipped: Mapping[str, str]
    kind: str = "graph"  # "modules": the leaf modules of a model run eagerly, in call order (no graph)
    # the dataflow between units (ModelGraph.dataflow): where outputs of several units meet, and
    # (from, to) edges; empty for report files written before it was recorded
    joins: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    edges: tuple[tuple[str, str], ...] = ()

    def op_counts(self) -> dict[str, int]:
        return dict(self.ops)

    def layer_type_counts(self) -> dict[str, int]:
        return dict(self.layer_types)


@dataclass(frozen=True, eq=False)
class Analysis:
    """One model's report: typed records per detector, their texts, the graph, batch count.

    ``source`` and ``saved_at`` are set when the analysis was read from a file.
    """

    model_name: str
    detectors: tuple[str, ...]
    results: Mapping[str, DetectorResult]
    texts: Mapping[str, str]
    graph: GraphSummary
    batches: int
    saved_at: str | None = None
    source: Path | None = None
    versions: Mapping[str, str] = field(default_factory=dict)

    @functools.cached_property
    def features(self) -> Mapping[str, Mapping[str, Column]]:
        """Module -> its columns from every detector (later detectors win a shared key), forward order."""
        merged: dict[str, dict[str, Column]] = {}
        for result in self.results.values():
            for record in result.records:
                merged.setdefault(record.module_fqn, {}).update(record.columns())
        return MappingProxyType({fqn: MappingProxyType(merged[fqn]) for fqn in self.graph.units if fqn in merged})

    def suggestions(self) -> list[Suggestion]:
        """Every detector's suggestions, in forward order of the modules."""
        order = {fqn: i for i, fqn in enumerate(self.graph.units)}
        found = [s for result in self.results.values() for s in result.suggestions]
        return sorted(found, key=lambda s: order.get(s.module_fqn, len(order)))

    def histograms(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The recorded value histogram (counts, edges) of each module that has one."""
        found = {}
        for result in self.results.values():
            for record in result.records:
                counts = getattr(record, "histogram", None)
                if isinstance(counts, np.ndarray) and counts.size:
                    found[record.module_fqn] = (counts, record.histogram_edges)
        return found

    def text_reports(self) -> dict[str, str]:
        return dict(self.texts)

    def calibration_batches(self) -> int:
        return self.batches

    def frame(self) -> ReportFrame:
        """The analysis as tidy tables (built once)."""
        return self._frame

    @functools.cached_property
    def _frame(self) -> ReportFrame:
        return ReportFrame.from_features(self.features, self.graph.units, self.suggestions(), self.histograms())

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (module, channel) with every per-channel and per-module feature."""
        return self.frame().to_dataframe()

    def generate_visualizer(self) -> ModelReportVisualizer:
        from .visualizer import ModelReportVisualizer

        return ModelReportVisualizer(self.frame())

    def __repr__(self) -> str:
        where = f" from {self.source}" if self.source else ""
        counts = f"{len(self.features)} modules, {len(self.detectors)} detectors"
        return f"<{type(self).__name__} of {self.model_name}{where}: {counts}>"


def build_analysis(
    model_name: str,
    detectors: Iterable[Any],
    results: Mapping[str, DetectorResult],
    graph: GraphSummary,
    batches: int,
) -> Analysis:
    """The Analysis of one report. A custom detector's records without a ``columns()`` method are
    kept as StoredRecords of the columns the detector gives for them."""
    detectors = list(detectors)
    kept, texts = {}, {}
    for detector in detectors:
        name = detector.get_detector_name()
        result = results[name]
        records = tuple(
            record if callable(getattr(record, "columns", None)) else StoredRecord(record.module_fqn, detector.columns(record))
            for record in result.records
        )
        kept[name] = DetectorResult(result.detector, records, result.notes, result.suggestions)
        texts[name] = detector.describe(result)
    return Analysis(
        model_name=model_name,
        detectors=tuple(kept),
        results=MappingProxyType(kept),
        texts=MappingProxyType(texts),
        graph=graph,
        batches=batches,
    )
