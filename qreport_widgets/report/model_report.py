"""ModelReport: instrument a prepared model, then turn what the observers saw into reports."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch.fx
from torch.ao.quantization import QConfigMapping

from ..core.features import DetectorName
from ..engines import build_engine
from ..engines.contract import Engine
from ..engines.settings import ModuleSettings, TunableModule, with_suggestions
from ..errors import (
    AlreadyPreparedError,
    DetectorConfigError,
    NotCalibratedError,
    NotPreparedError,
    ObserversRemovedError,
    ReportNotGeneratedError,
    warn_user,
)
from ..observe import instrument
from ..observe.analysis import Analysis, GraphSummary, build_analysis
from ..observe.detectors.base import DetectorBase, ReportContext
from ..observe.frame import ReportFrame
from ..observe.graph import OBSERVER_CONTAINER, ModelGraph
from ..observe.observer import PERCENTILE_SAMPLE
from ..observe.records import DetectorResult, Suggestion
from ..tune.verify import VerifiedSuggestions, nan_equalization_metric

if TYPE_CHECKING:
    from ..observe.visualizer import ModelReportVisualizer
    from ..share.model_explorer import ModelExplorerFiles
    from ..tune.run import RunResult
    from ..tune.session import QuantizationSession


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
    keeps its own settings (reference percentile, channel axis). What the detectors find is one
    immutable :class:`~qreport_widgets.observe.analysis.Analysis` (``report.analysis()``); the tables, report
    files and the widget read that. A report made by ``analyze()`` also carries the
    ``QuantizationSession`` for tuning (``report.session``).

    ``engine`` and ``tunable_modules``: the engine that prepared ``model`` and the modules it can
    tune (``analyze()`` gives them; without them FX's rules read the prepared model).
    ``exact_percentiles``: percentiles of channels with more than 4,096 values a batch are
    estimated from an evenly spread sample unless this is True (see ``analyze``).
    """

    def __init__(
        self,
        model: torch.fx.GraphModule,
        desired_report_detectors: Iterable[DetectorBase],
        *,
        model_name: str | None = None,
        graph_of: Callable[[torch.fx.GraphModule], ModelGraph] = ModelGraph.of,
        engine: Engine | None = None,
        tunable_modules: Sequence[TunableModule] | None = None,
        exact_percentiles: bool = False,
    ) -> None:
        if not isinstance(model, torch.fx.GraphModule) and graph_of == ModelGraph.of:  # an eager map comes with its reader
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
        order = {name.value: i for i, name in enumerate(DetectorName)}
        self._model = model
        self._model_name = model_name or type(model).__name__
        self._detectors = sorted(detectors, key=lambda d: (order.get(d.get_detector_name(), len(order)), d.get_detector_name()))
        self._state = ReportState.CREATED
        self._observer_names: dict[str, set[str]] = {name: set() for name in names}
        self._results: dict[str, DetectorResult] = {}
        self._analysis: Analysis | None = None
        self._graph: ModelGraph | None = None
        self._graph_of = graph_of  # how units are read: prepare_fx's modules, or an exported graph's
        self._session: QuantizationSession | None = None
        self._session_problem = ""
        self._engine = engine  # analyze()'s engine and the tunable modules it read
        self._modules = None if tunable_modules is None else list(tunable_modules)
        self._percentile_sample = None if exact_percentiles else PERCENTILE_SAMPLE

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
        graph = self._graph_of(self._model)
        requests = {d.get_detector_name(): d.requests(graph) for d in self._detectors}
        placements, index = instrument.plan(graph, (r for rs in requests.values() for r in rs))
        instrument.insert(self._model, placements, index, self._percentile_sample)
        for name, wanted in requests.items():
            self._observer_names[name] = {
                f"{OBSERVER_CONTAINER}.{index[(r.unit, r.side.value, r.ch_axis)]}"
                for r in wanted
                if (r.unit, r.side.value, r.ch_axis) in index
            }
        self._graph = self._graph_of(self._model)
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
        texts = self.analysis().texts
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
        fx = _upstream_engine()
        return fx.qconfig_mapping_of(fx.config_for(self._settings(lambda d: d.affects_qconfig), []))

    def generate_equalization_mapping(self) -> QConfigMapping:
        """Equalization entries only for the modules the equalization detector recommends."""
        return _equalization_mapping(self._settings(lambda d: True))

    # ------------------------------------------------------------------ typed access
    @property
    def model(self) -> torch.fx.GraphModule:
        return self._model

    @property
    def model_name(self) -> str:
        """The float model's class name (the GraphModule's when the report did not come from analyze())."""
        return self._model_name

    @property
    def detectors(self) -> list[DetectorBase]:
        return list(self._detectors)

    @property
    def graph(self) -> ModelGraph:
        return self._graph or self._graph_of(self._model)

    @property
    def session(self) -> QuantizationSession | None:
        """The QuantizationSession for live tuning when this report came from analyze(), else None."""
        return self._session

    def results(self) -> dict[str, DetectorResult]:
        """Typed per-detector results of the last generate_model_report() call."""
        self._require_results()
        return dict(self._results)

    def analysis(self) -> Analysis:
        """The generated report as one immutable value (what tables, files and the widget read)."""
        self._require_results()
        assert self._analysis is not None
        return self._analysis

    def suggestions(self) -> list[Suggestion]:
        return self.analysis().suggestions()

    def tunable_modules(self) -> list[TunableModule]:
        """The Linear / Conv modules whose settings a user can change, in forward order (the
        engine of analyze() says which; FX's rules read the prepared model otherwise)."""
        if self._session is not None:
            return self._session.modules
        if self._modules is not None:
            return list(self._modules)
        return _upstream_engine().tunable_modules(self._model)

    def current_settings(self) -> dict[str, ModuleSettings]:
        return {m.fqn: m.current for m in self.tunable_modules()}

    def suggested_settings(self) -> dict[str, ModuleSettings]:
        """Every tunable module's settings with all suggestions accepted, unmeasured (as upstream)."""
        return with_suggestions(self.tunable_modules(), self.suggestions())

    def verified_suggestions(self, progress: Callable[[int, int | None], None] | bool | None = None) -> VerifiedSuggestions:
        """The suggestions, and what the simulation finds by itself, each measured before it is
        offered; Accept all measured as a whole (needs the session of ``analyze()``)."""
        if self._session is None:
            raise RuntimeError("verifying suggestions runs the model: build the report with analyze(model, ...)")
        nan_metric = nan_equalization_metric(self.analysis().frame())
        return self._session.verified_suggestions(self.suggestions(), nan_metric=nan_metric, progress=progress)

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
        engine = self._engine if base is None and self._engine is not None else _upstream_engine(base)
        mapping = engine.qconfig_mapping_of(engine.config_for(settings, self.tunable_modules()))
        if mapping is None:
            raise TypeError(
                f"suggested_qconfig_mapping() builds FX's QConfigMapping; this report's engine is {engine.name}: "
                "report.session.settings_as_code(settings) gives its set-up as code"
            )
        return mapping

    def suggested_equalization_mapping(self, settings: Mapping[str, ModuleSettings] | None = None) -> QConfigMapping:
        return _equalization_mapping(self.suggested_settings() if settings is None else settings)

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
        return self.analysis().frame()

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (module, channel) with every per-channel and per-module feature."""
        return self.frame().to_dataframe()

    def widget(self) -> Any:
        """The interactive view: ``display(report.widget())`` in a notebook."""
        from ..widgets import ReportWidget

        if self._session is not None:
            return ReportWidget(self.analysis(), self._session)
        if self._session_problem:
            unavailable = "Live tuning is unavailable."
            return ReportWidget(self.analysis(), tuning_unavailable=unavailable, tuning_error=self._session_problem)
        return ReportWidget(
            self.analysis(),
            tuning_unavailable="Live tuning needs the float model and calibration data: build the report with "
            "qreport_widgets.analyze(model, example_inputs, calibration_data).",
        )

    def save_html(self, path: str | Path, runs: bool = True) -> Path:
        """The report as one self-contained HTML file that opens offline, with no kernel: the
        detectors' reports and suggestions, the flagged modules' figures, the graph and, with
        ``runs`` and a session, every run, the diagnoses computed so far and the settings as code."""
        from ..widgets.html_export import write_html

        return write_html(self.analysis(), path, self._session if runs else None)

    def to_model_explorer(
        self, directory: str | Path, run: int | str | RunResult | None = None, *, sensitivity: bool = True
    ) -> ModelExplorerFiles:
        """The float model for Google's Model Explorer: its exported program as
        ``directory/model.pt2`` (``torch.export.save``) and a node-data JSON per metric, keyed by
        the program's node ids: ``run``'s per-layer SQNR (default: the baseline, run if needed) and
        its kernels' SQNR where it checked them, and with ``sensitivity`` what keeping each module
        float gains (``session.sensitivity()``, computed if needed). Open them with
        ``show_in_model_explorer()`` or ``files.command()`` in a shell. Needs the session of
        ``analyze()`` and the ``[explorer]`` extra."""
        from ..share.model_explorer import (
            GAIN_THRESHOLDS,
            KERNEL_THRESHOLDS,
            SQNR_THRESHOLDS,
            NodeMetric,
            model_explorer_api,
            write_model_explorer,
        )

        model_explorer_api()  # the extra named before anything runs
        session = self._require_session("writing Model Explorer files")
        chosen = _run_of(session, run)
        metrics = {
            f"per-layer SQNR dB ({chosen.label})": NodeMetric(
                chosen.per_layer_sqnr_db.to_dict(), SQNR_THRESHOLDS, f"each layer's output SQNR in the run {chosen.label!r}"
            )
        }
        if len(chosen.kernel_sqnr_db):
            metrics[f"kernel SQNR dB ({chosen.label})"] = NodeMetric(
                chosen.kernel_sqnr_db.to_dict(), KERNEL_THRESHOLDS, "each quantized kernel against its reference"
            )
        if sensitivity:
            gains = session.sensitivity()["output_sqnr_gain_db"]
            metrics["sensitivity gain dB"] = NodeMetric(
                gains.to_dict(), GAIN_THRESHOLDS, "output SQNR gained by keeping the module float alone (simulated)"
            )
        return write_model_explorer(directory, session.float_model, session.example_inputs, metrics)

    def show_in_model_explorer(
        self, directory: str | Path | None = None, run: int | str | RunResult | None = None, *, port: int | None = None
    ) -> Any:
        """``to_model_explorer`` (into a new temporary folder when ``directory`` is None), then
        Model Explorer's server on those files in a process of its own: the returned object shows
        the app in the notebook, with a link; ``.stop()`` ends the server."""
        import tempfile

        from ..share.model_explorer import model_explorer_api, show

        model_explorer_api()
        folder = directory if directory is not None else tempfile.mkdtemp(prefix="qreport-model-explorer-")
        return show(self.to_model_explorer(folder, run), port=port)

    def _require_session(self, doing: str) -> QuantizationSession:
        if self._session is None:
            raise RuntimeError(f"{doing} runs the model: build the report with qreport_widgets.analyze(model, ...)")
        return self._session

    def text_reports(self) -> dict[str, str]:
        """Each detector's text report of the last generated report."""
        return self.analysis().text_reports()

    def calibration_batches(self) -> int:
        """Most batches any observer saw (0 before calibration; the last report's count once removed)."""
        container = getattr(self._model, OBSERVER_CONTAINER, None)
        counts = [getattr(o, "num_batches_tracked", 0) for o in container.children()] if container is not None else []
        return max(counts, default=self._analysis.batches if self._analysis is not None else 0)

    def save(self, path: str | Path) -> Path:
        """Write the generated report to one file (JSON and numpy arrays, no pickle); open it with
        ``qreport_widgets.load_report(path)`` to get the tables, views and widget back."""
        from ..share.storage import save_analysis

        return save_analysis(self.analysis(), path)

    def generate_visualizer(self) -> ModelReportVisualizer:
        """Tables and bqplot views of the generated report (PyTorch's method names)."""
        from ..observe.visualizer import ModelReportVisualizer

        return ModelReportVisualizer(self.frame())

    def attach_session(self, session: QuantizationSession | None, problem: str = "") -> None:
        """The session tuning runs use (``report.session``, the widget's Tune tab), or why none
        could be built (``problem``, shown in the Tune tab)."""
        self._session, self._session_problem = session, problem

    def _settings(self, include) -> dict[str, ModuleSettings]:
        self._require_results()
        named = {r.module_fqn for d in self._detectors if include(d) for r in self._results[d.get_detector_name()].records}
        return with_suggestions([m for m in self.tunable_modules() if m.fqn in named], self.suggestions())

    def _analyze(self) -> None:
        container = getattr(self._model, OBSERVER_CONTAINER)
        observers = list(container.children())
        if observers and not any(getattr(o, "num_batches_tracked", 1) for o in observers):
            raise NotCalibratedError(
                "no calibration batch reached any observer: run your calibration data through the model "
                "returned by prepare_detailed_calibration() (not the float model) before generating the report, "
                "and check that the batches are not empty (zero elements are skipped)"
            )
        graph = self._graph or self._graph_of(self._model)
        context = ReportContext(graph, dict(container.index), pending=[])
        self._results = {d.get_detector_name(): d.analyze(context) for d in self._detectors}
        _warn_grouped(context.pending)
        batches = max((getattr(o, "num_batches_tracked", 0) for o in observers), default=0)
        self._analysis = build_analysis(self._model_name, self._detectors, self._results, _summary(graph), batches)

    def _require_results(self) -> None:
        if self._results:
            return
        if self._state is ReportState.PREPARED:
            self._analyze()
            return
        raise ReportNotGeneratedError(
            "prepare_detailed_calibration(), run calibration batches, then generate_model_report() first"
        )


def _summary(graph: ModelGraph) -> GraphSummary:
    joins, edges = graph.dataflow()
    return GraphSummary(
        joins=MappingProxyType(joins),
        edges=tuple(edges),
        units=MappingProxyType({fqn: unit.type_name for fqn, unit in graph.units.items()}),
        ops=MappingProxyType(graph.op_counts()),
        layer_types=MappingProxyType(graph.layer_type_counts()),
        skipped=MappingProxyType(dict(graph.skipped)),
        kind=graph.kind,
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
        warn_user(f"{names}: {message}")


def _upstream_engine(base: QConfigMapping | None = None) -> Engine:
    """FX over ``base`` (default: an empty mapping): torch's API speaks QConfigMappings, whichever
    engine analyzed the model."""
    return build_engine("fx", qconfig_mapping=base if base is not None else QConfigMapping())


def _equalization_mapping(settings: Mapping[str, ModuleSettings]) -> QConfigMapping:
    fx = _upstream_engine()
    mapping = fx.equalization_mapping_of(fx.config_for(settings, []))
    return mapping if mapping is not None else QConfigMapping()


def _run_of(session: QuantizationSession, run: int | str | RunResult | None) -> RunResult:
    """A recorded run named by its index or label, the run itself, or (None) the baseline, run if needed."""
    if run is None:
        found = session.baseline()
    elif isinstance(run, int):
        found = session.history[run]
    elif isinstance(run, str):
        matches = [r for r in session.history if r.label == run]
        if not matches:
            labels = ", ".join(repr(r.label) for r in session.history) or "none yet"
            raise KeyError(f"no run labelled {run!r}; the runs: {labels}")
        found = matches[-1]
    else:
        found = run
    if not found.ok:
        raise RuntimeError(f"the run {found.label!r} failed ({found.error}): nothing to show of it")
    return found
