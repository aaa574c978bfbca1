"""ModelReport: instrument a prepared model, then turn what the observers saw into reports."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import pandas as pd
import torch.fx
from torch.ao.quantization import QConfigMapping

from . import instrument
from .detectors.base import DetectorBase, DetectorResult, ReportContext, Suggestion
from .errors import (
    AlreadyPreparedError,
    DetectorConfigError,
    NotCalibratedError,
    NotPreparedError,
    ObserversRemovedError,
    QReportWarning,
    ReportNotGeneratedError,
)
from .frame import ReportFrame
from .graph import OBSERVER_CONTAINER, ModelGraph, Unit
from .qconfig import (
    ModuleSettings,
    build_equalization_mapping,
    build_qconfig_mapping,
    current_settings,
    suggested_settings,
)
from .session import QuantizationSession
from .visualizer import ModelReportVisualizer


class ReportState(str, Enum):
    CREATED = "created"
    PREPARED = "prepared"  # observers inserted, waiting for calibration batches
    REMOVED = "removed"  # observers taken out after a report was generated


class ModelReport:
    """Reports on a ``prepare_fx`` model: where to insert observers and what they found.

    Same workflow and method names as ``torch.ao.quantization.fx._model_report.ModelReport``::

        report = ModelReport(prepared, {DynamicStaticDetector(), OutlierDetector()})
        instrumented = report.prepare_detailed_calibration()
        for batch in batches:
            instrumented(batch)
        reports = report.generate_model_report(remove_inserted_observers=False)
        mapping = report.generate_qconfig_mapping()

    Every observed tensor gets one observer however many detectors read it, and each detector
    keeps its own settings (reference percentile, channel axis).
    """

    def __init__(self, model: torch.fx.GraphModule, desired_report_detectors: Iterable[DetectorBase]) -> None:
        if not isinstance(model, torch.fx.GraphModule):
            raise TypeError(
                f"ModelReport needs a torch.fx.GraphModule, got {type(model).__name__}; prepare the float "
                "model first with prepare_fx(model, qconfig_mapping, example_inputs), or call qreport_widgets.analyze(...)"
            )
        detectors = list(desired_report_detectors)
        if not detectors:
            raise DetectorConfigError("ModelReport needs at least one detector, e.g. {DynamicStaticDetector()}")
        for detector in detectors:
            if not isinstance(detector, DetectorBase):
                raise DetectorConfigError(f"{detector!r} is not a detector: subclass qreport_widgets.DetectorBase")
        names = [d.get_detector_name() for d in detectors]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise DetectorConfigError(f"each detector type may appear once; got several {', '.join(duplicates)}")
        order = {name: i for i, name in enumerate(_BUILTIN_ORDER)}
        self._model = model
        self._detectors = sorted(detectors, key=lambda d: (order.get(d.get_detector_name(), len(order)), d.get_detector_name()))
        self._state = ReportState.CREATED
        self._observer_names: dict[str, set[str]] = {name: set() for name in names}
        self._results: dict[str, DetectorResult] = {}
        self._graph: ModelGraph | None = None
        self._frame: ReportFrame | None = None
        self._batches_seen = 0
        self._session: QuantizationSession | None = None
        self.analysis_inputs: Any = None  # set by analyze(): what a later re-quantization needs

    # ------------------------------------------------------------------ PyTorch-compatible API
    def get_desired_reports_names(self) -> set[str]:
        return {d.get_detector_name() for d in self._detectors}

    def get_observers_of_interest(self) -> dict[str, set[str]]:
        return {name: set(fqns) for name, fqns in self._observer_names.items()}

    def prepare_detailed_calibration(self) -> torch.fx.GraphModule:
        """Insert the observers the detectors need and return the model to calibrate (the same object)."""
        if self._state is not ReportState.CREATED:
            raise AlreadyPreparedError(
                "observers are already inserted; run calibration batches through the model, then call "
                "generate_model_report(). For a fresh report, create a new ModelReport on a new prepare_fx model."
            )
        if hasattr(self._model, OBSERVER_CONTAINER):
            raise AlreadyPreparedError("this model already carries ModelReport observers from another ModelReport")
        graph = ModelGraph.of(self._model)
        requests = {d.get_detector_name(): d.requests(graph) for d in self._detectors}
        placements, index = instrument.plan(graph, (r for rs in requests.values() for r in rs))
        instrument.insert(self._model, placements, index)
        for name, wanted in requests.items():
            self._observer_names[name] = {
                f"{OBSERVER_CONTAINER}.{index[(r.unit, r.side.value, r.ch_axis)]}"
                for r in wanted
                if (r.unit, r.side.value, r.ch_axis) in index
            }
        self._graph = ModelGraph.of(self._model)
        self._state = ReportState.PREPARED
        return self._model

    def generate_model_report(self, remove_inserted_observers: bool = False) -> dict[str, tuple[str, dict[str, Any]]]:
        """``{detector name: (text, {module fqn: {feature: value}})}`` with PyTorch's keys.

        Reading the observers changes nothing, so calling this twice gives the same answer.
        """
        if self._state is ReportState.CREATED:
            raise NotPreparedError(
                "call prepare_detailed_calibration() and run calibration batches through the model it returns "
                "before generating the report"
            )
        if self._state is ReportState.REMOVED:
            raise ObserversRemovedError(
                "the observers were removed by generate_model_report(remove_inserted_observers=True); the report "
                "from that call is still available via results(), generate_visualizer() and generate_qconfig_mapping()"
            )
        self._analyze()
        texts = self.text_reports()
        reports = {
            name: (texts[name], {r.module_fqn: d.upstream_dict(r) for r in self._results[name].records})
            for d in self._detectors
            for name in [d.get_detector_name()]
        }
        if remove_inserted_observers:
            instrument.remove(self._model)
            self._state = ReportState.REMOVED
        return reports

    def generate_qconfig_mapping(self) -> QConfigMapping:
        """Module-name entries (no global entry, as in PyTorch) with every suggestion accepted.

        Modules are named as prepare_fx sees them, so an entry for a fused conv-bn-relu applies.
        """
        return build_qconfig_mapping(self._settings(lambda d: d.affects_qconfig))

    def generate_equalization_mapping(self) -> QConfigMapping:
        """Equalization entries only for the modules the equalization detector recommends."""
        return build_equalization_mapping(self._settings(lambda d: True))

    # ------------------------------------------------------------------ typed access
    @property
    def model(self) -> torch.fx.GraphModule:
        return self._model

    @property
    def model_name(self) -> str:
        """The float model's class name (the GraphModule's when the report did not come from analyze())."""
        inputs = self.analysis_inputs
        return type(inputs.float_model).__name__ if inputs is not None else type(self._model).__name__

    @property
    def detectors(self) -> list[DetectorBase]:
        return list(self._detectors)

    @property
    def graph(self) -> ModelGraph:
        return self._graph or ModelGraph.of(self._model)

    def results(self) -> dict[str, DetectorResult]:
        """Typed per-detector results of the last generate_model_report() call."""
        self._require_results()
        return dict(self._results)

    def suggestions(self) -> list[Suggestion]:
        self._require_results()
        order = {fqn: i for i, fqn in enumerate(self.graph.units)}
        found = [s for r in self._results.values() for s in r.suggestions]
        return sorted(found, key=lambda s: order.get(s.module_fqn, len(order)))

    def tunable_units(self) -> list[Unit]:
        """The Linear / Conv modules whose settings a user can change, in forward order."""
        return [u for u in self.graph.units.values() if u.is_linear or u.is_conv]

    def current_settings(self) -> dict[str, ModuleSettings]:
        return {u.fqn: current_settings(u) for u in self.tunable_units()}

    def suggested_settings(self) -> dict[str, ModuleSettings]:
        """Every tunable module's settings with all suggestions accepted."""
        return suggested_settings(self.tunable_units(), self.suggestions())

    def suggested_qconfig_mapping(
        self, settings: Mapping[str, ModuleSettings] | None = None, base: QConfigMapping | None = None
    ) -> QConfigMapping:
        """The starting mapping with ``settings`` (default: every suggestion) layered on top.

        Unlike generate_qconfig_mapping() the global and type entries of the starting mapping stay,
        so no layer silently drops to float, and each module keeps the observers it had except
        where a setting changes them. ``base`` defaults to the mapping analyze() prepared with; pass
        the mapping you prepared with when the report came from ModelReport directly.
        """
        settings = self.suggested_settings() if settings is None else settings
        current = {u.fqn: getattr(u.module, "qconfig", None) for u in self.tunable_units()}
        if base is None and self.analysis_inputs is not None:
            base = self.analysis_inputs.qconfig_mapping
        return build_qconfig_mapping(settings, base, current)

    def suggested_equalization_mapping(self, settings: Mapping[str, ModuleSettings] | None = None) -> QConfigMapping:
        return build_equalization_mapping(self.suggested_settings() if settings is None else settings)

    @property
    def session(self) -> QuantizationSession | None:
        """The QuantizationSession for live tuning when this report came from analyze(), else None."""
        if self._session is None and self.analysis_inputs is not None:
            inputs = self.analysis_inputs
            self._session = QuantizationSession(
                inputs.float_model, inputs.example_inputs, inputs.calibration_data, inputs.eval_data, inputs.backend,
                inputs.eval_fn, inputs.qconfig_mapping, inputs.prepare_custom_config,
            )  # fmt: skip
        return self._session

    def features_by_module(self) -> OrderedDict[str, dict[str, Any]]:
        """PyTorch's visualizer input: module fqn -> merged features of every detector, forward order."""
        self._require_results()
        merged: dict[str, dict[str, Any]] = {}
        for detector in self._detectors:
            for record in self._results[detector.get_detector_name()].records:
                merged.setdefault(record.module_fqn, {}).update(detector.upstream_dict(record))
        return OrderedDict((fqn, merged[fqn]) for fqn in self.graph.units if fqn in merged)

    def frame(self) -> ReportFrame:
        """The report as tidy tables (built once per generated report)."""
        self._require_results()
        if self._frame is None:
            self._frame = ReportFrame.from_report(self)
        return self._frame

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (module, channel) with every per-channel and per-module feature."""
        return self.frame().to_dataframe()

    def widget(self) -> Any:
        """The interactive view: ``display(report.widget())`` in a notebook."""
        from .widgets import ReportWidget

        return ReportWidget(self)

    def text_reports(self) -> dict[str, str]:
        """Each detector's text report of the last generated report."""
        self._require_results()
        return {d.get_detector_name(): d.describe(self._results[d.get_detector_name()]) for d in self._detectors}

    def calibration_batches(self) -> int:
        """Most batches any observer saw (0 before calibration or after the observers were removed)."""
        container = getattr(self._model, OBSERVER_CONTAINER, None)
        counts = [getattr(o, "num_batches_tracked", 0) for o in container.children()] if container is not None else []
        return max(counts, default=self._batches_seen)

    def save(self, path: str | Path) -> Path:
        """Write the generated report to one file (JSON and numpy arrays, no pickle); open it with
        ``qreport_widgets.load_report(path)`` to get the tables, views and widget back."""
        from .storage import save_report

        return save_report(self, path)

    def generate_visualizer(self) -> ModelReportVisualizer:
        """Tables and bqplot views of the generated report (PyTorch's method names)."""
        return ModelReportVisualizer(self.frame())

    def _settings(self, include) -> dict[str, ModuleSettings]:
        self._require_results()
        graph = self.graph
        named = {r.module_fqn for d in self._detectors if include(d) for r in self._results[d.get_detector_name()].records}
        units = [u for fqn, u in graph.units.items() if fqn in named]
        return suggested_settings(units, self.suggestions())

    def _analyze(self) -> None:
        container = getattr(self._model, OBSERVER_CONTAINER)
        observers = list(container.children())
        if observers and not any(getattr(o, "num_batches_tracked", 1) for o in observers):
            raise NotCalibratedError(
                "no calibration batch reached any observer: run your calibration data through the model "
                "returned by prepare_detailed_calibration() (not the float model) before generating the report, "
                "and check that the batches are not empty (zero elements are skipped)"
            )
        context = ReportContext(self._graph or ModelGraph.of(self._model), dict(container.index), pending=[])
        self._results = {d.get_detector_name(): d.analyze(context) for d in self._detectors}
        _warn_grouped(context.pending)
        self._frame = None
        self._batches_seen = max((getattr(o, "num_batches_tracked", 0) for o in observers), default=0)

    def _require_results(self) -> None:
        if self._results:
            return
        if self._state is ReportState.PREPARED:
            self._analyze()
            return
        raise ReportNotGeneratedError(
            "prepare_detailed_calibration(), run calibration batches, then generate_model_report() first"
        )


def _warn_grouped(pending: list[tuple[str, str]], shown: int = 8) -> None:
    """One QReportWarning per problem, naming every module that has it (a ResNet can have dozens)."""
    modules_by_message: dict[str, list[str]] = {}
    for module, message in pending:
        names = modules_by_message.setdefault(message, [])
        if module not in names:
            names.append(module)
    for message, modules in modules_by_message.items():
        names = ", ".join(modules[:shown]) + (f" and {len(modules) - shown} more modules" if len(modules) > shown else "")
        warnings.warn(f"{names}: {message}", QReportWarning, stacklevel=4)


_BUILTIN_ORDER = (
    "per_channel_detector",
    "dynamic_vs_static_detector",
    "input_weight_equalization_detector",
    "outlier_detector",
)
