"""QuantizationSession: quantize a pristine float copy again and again with other settings, and measure.

The session is engine-neutral: its engine (FX graph mode by default; any engine of
``engines.py``) prepares, converts and reads per-layer numbers; the session owns the float copy,
the data, validation, the runs and their history, and hands the simulation to its diagnosis
(sensitivity, trade-off, reach) and its verifier. The caller's float model is deep-copied once
and never touched.
"""

from __future__ import annotations

import io
import itertools
import math
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..core.calibration import CalibrationData, calibrate, call_with
from ..core.memory import WatchedCopy, WeightPool
from ..core.metrics import output_tensor, sqnr_db
from ..core.progress import Progress, quiet
from ..engines import engine_named
from ..engines.contract import Engine, EngineOptions, Simulation, Variant
from ..engines.settings import FORMATS, ModuleSettings, TunableModule, validate_all, with_suggestions
from ..errors import CalibrationError, InvalidSettingsError, ModelReleasedError, QReportWarning
from ..observe.distributed import calibrated_across, group_of
from ..observe.records import Suggestion
from .diagnosis import Diagnosis, ReachPlan
from .migration import Migration, find_migrations, input_producers, migrated
from .mixed import SizeFront, fit, size_front
from .run import ReleasedModel, RunResult
from .truth import KERNEL_AGREEMENT_DB, TruthCheck, check_truth
from .verify import VerifiedSuggestions, Verifier, refusals


class QuantizationSession:
    """Quantize a float model again and again with different settings and compare.

    Args:
        float_model: deep-copied once; the caller's object is never changed.
        example_inputs: one input tuple for preparing the model.
        calibration_data: an iterable of batches (re-iterable; a one-shot iterator is kept as a
            list) or a callable that runs a model on its data.
        eval_data: batches for the metrics; default: the last quarter of the calibration batches,
            held out from calibration (all of them when there is a single batch).
        backend: the quantized engine (``x86``, ``fbgemm``, ``qnnpack``, ``onednn``).
        eval_fn: ``eval_fn(model) -> float``, your own metric (e.g. accuracy), shown next to ours.
        qconfig_mapping: the starting mapping the baseline uses (default: the backend's default).
        prepare_custom_config: passed to every ``prepare_fx`` (non-traceable modules, ...).
        engine: the quantization workflow: an Engine, or an engine's name (``"fx"``, ``"pt2e"``,
            ``"eager"``) built from the arguments above; default: FX graph mode from ``qconfig_mapping``.
        output_fn: ``output_fn(model_output) -> tensor``, the tensor output SQNR is measured on;
            default: the output, or its first tensor (``metrics.output_tensor``).
        process_group: a torch.distributed group whose ranks each calibrate on their own batches
            and merge the prepared model's observers before every convert (default: the default
            group when torch.distributed is initialised). Metrics are measured on each rank's
            ``eval_data``: give every rank the same evaluation batches for the same numbers.
    """

    def __init__(
        self,
        float_model: torch.nn.Module,
        example_inputs: Any,
        calibration_data: CalibrationData,
        eval_data: Iterable[Any] | None = None,
        backend: str = "x86",
        eval_fn: Callable[[torch.nn.Module], float] | None = None,
        qconfig_mapping: Any = None,
        prepare_custom_config: Any = None,
        *,
        engine: Engine | str | None = None,
        output_fn: Callable[[Any], torch.Tensor] | None = None,
        process_group: Any = None,
    ) -> None:
        if not isinstance(engine, Engine):
            engine = engine_named(engine or "fx", EngineOptions(backend, qconfig_mapping, prepare_custom_config))
        self._start(WatchedCopy(float_model), engine, example_inputs, calibration_data, eval_data, eval_fn, None)
        self._output_fn = output_fn
        self._group = group_of(process_group)

    @classmethod
    def _adopt(
        cls,
        float_copy: WatchedCopy,
        engine: Engine,
        example_inputs: tuple[Any, ...],
        calibration_data: CalibrationData,
        eval_data: Iterable[Any] | None,
        eval_fn: Callable[[torch.nn.Module], float] | None,
        modules: list[TunableModule],
        output_fn: Callable[[Any], torch.Tensor] | None = None,
        group: Any = None,
    ) -> QuantizationSession:
        """A session that owns ``float_copy`` (a watched copy already) and knows the tunable modules
        from an earlier prepare with the starting configuration, as ``analyze()`` has them."""
        session = cls.__new__(cls)
        session._start(float_copy, engine, example_inputs, calibration_data, eval_data, eval_fn, modules)
        session._output_fn = output_fn
        session._group = group
        return session

    def _start(self, float_copy, engine, example_inputs, calibration_data, eval_data, eval_fn, modules) -> None:
        self._watched: WatchedCopy = float_copy  # the user's weights, shared; changed in place -> an error
        self.engine = engine
        self.example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.eval_fn = eval_fn
        self._output_fn: Callable[[Any], torch.Tensor] | None = None
        self._group: Any = None  # the torch.distributed group the runs calibrate across (distributed.py)
        self.calibration_data, self.eval_data, self.eval_description = _split(calibration_data, eval_data)
        self.history: list[RunResult] = []
        self._weights = WeightPool()  # weights equal across prepares, held once (memory.py)
        # module -> max |x| per input channel as analyze() observed them: finding migrations needs no pass then
        self._observed_input_ranges: dict[str, torch.Tensor] = {}
        self._pinned: set[int] = set()  # history positions whose quantized model is kept (keep())
        self._modules: list[TunableModule] | None = None if modules is None else list(modules)
        self._baseline: RunResult | None = None
        self._float_outputs: list[torch.Tensor] | None = None
        self._simulation: Simulation | None = None
        self._truth: TruthCheck | None = None
        self._verified: VerifiedSuggestions | None = None
        self._migrations: dict[str, Migration] | None = None
        self._front: SizeFront | None = None
        self._diagnosis = Diagnosis(self)

    @property
    def float_model(self) -> torch.nn.Module:
        """The session's float model: its own modules around the user's weights, which it shares
        (read-only; ``FloatModelChangedError`` once they were changed in place)."""
        return self._watched.model

    @property
    def _float(self) -> torch.nn.Module:
        return self._watched.model

    @property
    def modules(self) -> list[TunableModule]:
        """The modules whose settings can be changed, in forward order, with what they do now."""
        if self._modules is None:
            prepared = self._prepare(self._float, self.engine.base_config())
            self._modules = self.engine.tunable_modules(prepared)
        return list(self._modules)

    def current_settings(self) -> dict[str, ModuleSettings]:
        """What each tunable module does under the starting configuration."""
        return {m.fqn: m.current for m in self.modules}

    def suggested_settings(self, suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]:
        """The current settings with ``suggestions`` (e.g. ``report.suggestions()``) accepted, unmeasured."""
        return with_suggestions(self.modules, suggestions)

    def verified_suggestions(
        self, suggestions: Iterable[Suggestion], *, nan_metric: Iterable[str] = (), progress: Progress | None = None
    ) -> VerifiedSuggestions:
        """``suggestions`` (e.g. ``report.suggestions()``) and what the simulation finds by itself,
        each measured before it is offered (see ``verify.py``); ``nan_metric`` names the modules
        whose equalization metric is NaN. Computed once per session."""
        if self._verified is None:
            verifier = Verifier(self, refusals(dict(self._float.named_modules()), nan_metric))
            self._verified = verifier.verify(verifier.candidates(suggestions), progress)
        return self._verified

    def equalization_float_error(self, fqn: str) -> float:
        """Relative change of the float model's output when the engine equalizes ``fqn`` (0: exact;
        NaN for an engine without equalization)."""
        config = self._config_for({fqn: ModuleSettings(equalize=True)})
        return self.engine.equalization_float_error(
            self._float, config, self.example_inputs, self._calibratequietly, self.eval_data[0]
        )

    def migrations(self) -> dict[str, Migration]:
        """Module -> the outlier-channel scale migration its input allows (``ModuleSettings.migrate``),
        found once on the calibration data (from the input ranges the analysis observed, where it
        has them); each is exact in float (checked)."""
        if self._migrations is None:
            data = self.calibration_data  # a calibration callable gives no batches: the held-out ones then
            batches = list(self.eval_data) if callable(data) else list(data)
            consumers = [m.fqn for m in self.modules]
            known = self._observed_input_ranges
            self._migrations = find_migrations(self._float, batches, consumers, known_ranges=known) if batches else {}
        return dict(self._migrations)

    def input_producers(self, names: Iterable[str]) -> dict[str, str]:
        """Module -> the module whose output is its input (where one module produces it)."""
        return input_producers(self._float, names)

    def settings_as_code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """Python that builds the engine's configuration for ``settings``, to paste into a pipeline
        (after the code of any outlier-channel migration, which changes the float model first)."""
        code = self.engine.config_as_code(self._config_for(settings))
        moves = self._migrations_for(settings)
        if not moves:
            return code
        moved = "".join(m.as_code() for m in moves)
        return f"import torch\n\n# on the float model, before prepare:\n{moved}\n{code}"

    def baseline(self, progress: Progress | None = None) -> RunResult:
        """The starting configuration's run, computed once, and checked against the simulation
        (``truth_check``): where they disagree its notes say so."""
        if self._baseline is None or not self._baseline.ok:
            run = self._run(self.engine.base_config(), "baseline", progress, settings=self.current_settings())
            self._baseline = run
            if run.ok:
                self._truth = self._check_truth(run, progress)
                if self._truth.notes:
                    self._baseline = replace(run, notes=(*run.notes, *self._truth.notes))
                    self.history[self.history.index(run)] = self._baseline
        return self._baseline

    def truth_check(self, progress: Progress | None = None) -> TruthCheck:
        """The simulation against the real model on the starting configuration (see ``truth.py``):
        the gap, the modules whose quantized kernels differ from their reference, and whether the
        simulation, running those real kernels, now matches. Runs the baseline if needed."""
        baseline = self.baseline(progress)
        if self._truth is None:  # the baseline run failed: nothing real to compare with
            return TruthCheck(math.nan, math.nan, error=f"the baseline run failed: {baseline.error}")
        return self._truth

    def _check_truth(self, baseline: RunResult, progress: Progress | None) -> TruthCheck:
        try:
            simulation = self.simulation(progress)
        except Exception as error:  # the simulation of an unusual model: say so, keep the session usable
            return TruthCheck(
                baseline.output_sqnr_db, math.nan, baseline.kernel_sqnr_db, error=f"{type(error).__name__}: {error}"
            )

        def simulated() -> float:
            return self._diagnosis.simulate_each([()], quiet, "checking the simulation", metric=False)[0][0]

        return check_truth(baseline, simulation, simulated, self._float, self.eval_data[0])

    def apply(
        self,
        settings: Mapping[str, ModuleSettings],
        *,
        label: str | None = None,
        progress: Progress | None = None,
        record: bool = True,
    ) -> RunResult:
        """Quantize with ``settings`` (module name -> ModuleSettings; modules left out keep their
        current settings) and measure.

        Settings the engine cannot apply raise InvalidSettingsError before anything runs; a failure
        during the run is returned as a RunResult with ``error`` set and leaves the history alone.
        With ``record=False`` the run is a trial: not added to the history, and measured at the
        output only (no per-layer SQNR).
        """
        config = self._config_for(settings)
        moves = self._migrations_for(settings)
        source = migrated(self._float, moves) if moves else None
        return self._run(config, label, progress, record, float_model=source, settings=settings)

    def run(
        self,
        qconfig_mapping: Any,
        equalization_mapping: Any = None,
        *,
        label: str | None = None,
        progress: Progress | None = None,
    ) -> RunResult:
        """FX: prepare_fx with a QConfigMapping you wrote (and an equalization mapping) -> calibrate ->
        convert_fx -> metrics. Failures do not raise: the result carries ``error``. Other engines
        raise TypeError (use ``apply(settings)``)."""
        return self._run(self.engine.config_of_mapping(qconfig_mapping, equalization_mapping), label, progress)

    def keep(self, run: int | RunResult, keep: bool = True) -> RunResult:
        """Pin a run of the history (its position or the run) so its quantized model is kept; the
        session otherwise keeps only the latest run's and releases the others' when a run is
        recorded (their measurements stay). ``keep=False`` unpins it (released at the next run)."""
        index = self._position(run)
        found = self.history[index]
        if keep and isinstance(found.quantized_model, ReleasedModel):
            raise ModelReleasedError(
                f"{found.quantized_model.why}; pin a run while it is the latest, or apply its settings again "
                "(session.apply(run.settings)) and pin that run"
            )
        (self._pinned.add if keep else self._pinned.discard)(index)
        return found

    def kept(self, run: int | RunResult) -> bool:
        """Whether a run of the history is pinned (its quantized model is kept, see ``keep``)."""
        return self._position(run) in self._pinned

    def _position(self, run: int | RunResult) -> int:
        if isinstance(run, int):
            if not -len(self.history) <= run < len(self.history):
                raise IndexError(f"no run {run} in a history of {len(self.history)} run(s)")
            return run % len(self.history)
        for i, recorded in enumerate(self.history):
            if recorded is run:
                return i
        raise ValueError(f"{run.label!r} is not a run of this session's history")

    def _release_older(self) -> None:
        """Release the quantized models of every run but the latest and the pinned ones."""
        latest = self.history[-1]
        for i, run in enumerate(self.history[:-1]):
            if i in self._pinned or not isinstance(run.quantized_model, torch.nn.Module):
                continue
            released = replace(run, quantized_model=ReleasedModel(run.label, f"when {latest.label!r} was recorded"))
            self.history[i] = released
            if self._baseline is run:
                self._baseline = released

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """One row per run (metrics as columns), and per-layer SQNR with one column per run."""
        start = self.current_settings()
        rows = [
            {
                "run": r.label,
                "changes": r.changes(start),
                "output SQNR (dB)": r.output_sqnr_db,
                "mean batch SQNR (dB)": r.mean_batch_sqnr_db,
                "quantized layers": r.quantized_layers,
                "size (KB)": r.size_bytes / 1024,
                "deployed size (KB)": r.deployed_bytes / 1024,
                "latency (ms, 1 thread)": r.latency_ms,
                "latency spread (ms)": r.latency_spread_ms,
                **({"your metric": r.eval_metric} if self.eval_fn is not None else {}),
                "duration (s)": r.duration_s,
                "model": _model_state(r, i in self._pinned),
            }
            for i, r in enumerate(self.history)
        ]
        runs = pd.DataFrame(rows)
        layers = pd.DataFrame({r.label: r.per_layer_sqnr_db for r in self.history})
        return runs, layers

    # ---- diagnosis (diagnosis.py), on the simulation ------------------------------------------
    def simulation(self, progress: Progress | None = None) -> Simulation:
        """The starting configuration calibrated once, as a simulation in which modules can be kept
        float without calibrating again (built on first use, then kept; it shares the float weights,
        so it is refused like the float model once they were changed in place)."""
        self._watched.check()
        if self._simulation is None:
            config = self.engine.base_config()
            prepared = self._prepare(self._float, config)
            if self.engine.calibrates(config):
                self._calibrate(prepared, "sensitivity: calibrating", progress is None, progress)
            self._simulation = self.engine.simulator(
                prepared, self.modules, self._float, self.example_inputs, self._calibratequietly
            )
            if self._baseline is None:  # checked against the real model before anything is estimated with it
                self.baseline(progress)
        return self._simulation

    def simulate(self, float_modules: Variant | Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric with ``float_modules`` kept float (or in a Variant)."""
        return self._diagnosis.simulate(float_modules)

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | None = None,
        desc: str = "simulating",
        metric: bool = True,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each variant; see ``Diagnosis.simulate_each``."""
        return self._diagnosis.simulate_each(variants, progress, desc, metric)

    def sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which module hurts: the output SQNR gained when each module alone stays float, simulated;
        see ``Diagnosis.sensitivity``. Warns when the simulation does not match the real model."""
        table = self._diagnosis.sensitivity(progress, metric=metric)
        self._warn_if_unverified()
        return table

    def format_sensitivity(self, progress: Progress | None = None) -> pd.DataFrame:
        """What each format costs where: for each module the start quantizes, on an engine with
        formats (eager), the simulated output SQNR (dB) when it alone takes each format it allows
        (the others as they start); NaN where a format does not apply. Sorted by ``cost_db``, what
        its starting format costs (float minus start: the gain of keeping it float), most first.
        Empty on engines without formats. Computed in the simulation, no real run."""
        modules = [m for m in self.modules if m.formats and not m.current.keep_float]
        columns = [name for name in ("float", *FORMATS[1:])]
        if not modules:
            return pd.DataFrame(columns=[*columns, "start", "cost_db"], dtype=float)
        variants: list[Variant] = [Variant()]
        cells: list[tuple[str, str]] = []
        for module in modules:
            for name in columns:
                if module.format_allowed(name) and (name == "float" or name != module.current.format):
                    variants.append(Variant(settings=frozenset({(module.fqn, ModuleSettings(format=name))})))
                    cells.append((module.fqn, name))
        (start, _), *each = self._diagnosis.simulate_each(variants, progress, "format sensitivity", metric=False)
        table = pd.DataFrame(math.nan, index=pd.Index([m.fqn for m in modules], name="module"), columns=columns)
        for (fqn, name), (sqnr, _) in zip(cells, each, strict=True):
            table.loc[fqn, name] = sqnr
        for module in modules:
            table.loc[module.fqn, module.current.format] = start
        table["start"] = [m.current.quantized_format for m in modules]
        table["cost_db"] = table["float"] - start
        self._warn_if_unverified()
        return table.sort_values("cost_db", ascending=False, kind="stable")

    def tradeoff(self, progress: Progress | None = None) -> pd.DataFrame:
        """The most harmful modules kept float one after the other, simulated; see ``Diagnosis.tradeoff``."""
        curve = self._diagnosis.tradeoff(progress)
        self._warn_if_unverified()
        return curve

    def plan_reach(
        self, target_sqnr_db: float | None = None, target_metric: float | None = None, *, progress: Progress | None = None
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone; see ``Diagnosis.plan_reach``."""
        return self._diagnosis.plan_reach(target_sqnr_db, target_metric, progress=progress)

    def reach(
        self, target_sqnr_db: float | None = None, target_metric: float | None = None, *, progress: Progress | None = None
    ) -> RunResult:
        """The fewest modules kept float (most harmful first) that meet the target, confirmed by a
        real run; see ``Diagnosis.reach``."""
        result = self._diagnosis.reach(target_sqnr_db, target_metric, progress=progress)
        truth = self._truth
        if truth is not None and not truth.reliable:
            result = result.noted(f"{truth.status}: the plan was simulated, each step is a real run")
        return self._recorded(result)

    # ---- mixed precision (mixed.py), on the simulation ----------------------------------------
    def pareto(self, progress: Progress | None = None) -> pd.DataFrame:
        """The size front: per-module choices (on the eager engine float and every format with its
        group sizes; on FX and PT2E int8 or float, per-tensor or per-channel), one row per point,
        smallest first, each better than every smaller one. Columns ``size_bytes`` (deployed, as
        ``RunResult.deployed_bytes`` counts it, estimated from the baseline's real size),
        ``simulated_output_sqnr_db``, ``simulated_metric`` (with ``eval_fn``), ``formats`` (the
        choices counted) and ``settings`` (module -> ModuleSettings, for ``apply``). Found in the
        simulation (calibrated once), no real run per point; computed once. See ``mixed.py``."""
        front = self._size_front(progress)
        self._warn_if_unverified()
        return front.points.copy()

    def uniform_points(self, progress: Progress | None = None) -> pd.DataFrame:
        """The same choice on every module that offers it (``all float``, ``all int4-weight-only
        (group 32)`` ...) and the baseline, simulated as ``pareto()`` rows, indexed by label."""
        return self._size_front(progress).uniform.copy()

    def fit(
        self,
        max_size_bytes: float | None = None,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        progress: Progress | None = None,
    ) -> RunResult:
        """A real run of the size front's best point within ``max_size_bytes`` (deployed bytes), or
        of its smallest point that meets ``target_sqnr_db`` / ``target_metric`` (within the budget
        when both are given). When the real run misses (too large, or short of the target) the next
        point along the front is run, up to three more runs; the notes say met, not met or out of
        reach, and by how far."""
        if target_metric is not None and self.eval_fn is None:
            raise ValueError("target_metric needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
        if max_size_bytes is None and target_sqnr_db is None and target_metric is None:
            raise ValueError("fit() needs max_size_bytes, target_sqnr_db, target_metric or a combination")
        return self._recorded(fit(self, self._size_front(progress), max_size_bytes, target_sqnr_db, target_metric, progress))

    def computed(self) -> dict[str, pd.DataFrame]:
        """The diagnoses computed so far, without computing any: ``sensitivity``, ``tradeoff`` and
        ``size_front`` (the ``pareto()`` table), where they were asked for (the HTML export shows them)."""
        found = self._diagnosis.computed()
        if self._front is not None:
            found["size_front"] = self._front.points.copy()
        return found

    def _recorded(self, result: RunResult) -> RunResult:
        """``result``, a copy of a run in the history with notes added, in that run's place."""
        for i, run in enumerate(self.history):
            if result.ok and run.quantized_model is result.quantized_model and run.label == result.label:
                self.history[i] = result
        return result

    def _size_front(self, progress: Progress | None) -> SizeFront:
        if self._front is None:
            self._front = size_front(self, progress)
        return self._front

    def _warn_if_unverified(self) -> None:
        truth = self._truth
        if truth is not None and not truth.reliable:
            warnings.warn(f"{truth.status} (session.truth_check() says more)", QReportWarning, stacklevel=3)

    def reference_outputs(self) -> list[torch.Tensor]:
        """The float model's outputs on the evaluation batches (computed once)."""
        self._watched.check()
        if self._float_outputs is None:
            with torch.no_grad():
                self._float_outputs = [self.output_of(call_with(self._float, b)) for b in self.eval_data]
        return self._float_outputs

    def output_of(self, output: Any) -> torch.Tensor:
        """A model output as the tensor output SQNR compares: ``output_fn``'s, else the output or its
        first tensor."""
        if self._output_fn is None:
            return output_tensor(output)
        found = self._output_fn(output)
        if not isinstance(found, torch.Tensor):
            raise TypeError(f"output_fn must return a tensor, got {type(found).__name__}")
        return found.detach().float()

    # ---- runs ----------------------------------------------------------------------------------
    def _prepare(self, source: torch.nn.Module, config: Any) -> torch.nn.Module:
        """The engine's prepare, holding the weights it folds (a batch norm into a conv) once across runs."""
        return self._weights.share(self.engine.prepare(source, config, self.example_inputs))

    def _calibratequietly(self, model: torch.nn.Module) -> None:
        self._calibrate(model, "calibrating a variant", False, None)

    def _calibrate(self, model: torch.nn.Module, desc: str, bar: bool, on_batch: Progress | None) -> None:
        """Calibrate ``model`` on this process's batches, then merge its observers across the
        session's torch.distributed group (if any) so every rank converts the same model."""
        calibrated_across(
            self._group, model, lambda: calibrate(model, self.calibration_data, desc=desc, progress=bar, on_batch=on_batch), desc
        )

    def _config_for(self, settings: Mapping[str, ModuleSettings]) -> Any:
        modules = self.modules
        validate_all(modules, settings)
        self._migrations_for(settings)  # refuses a migration where none was found
        return self.engine.config_for(settings, modules)

    def _migrations_for(self, settings: Mapping[str, ModuleSettings]) -> list[Migration]:
        wanted = [fqn for fqn, choice in settings.items() if choice.migrate and not choice.keep_float]
        if not wanted:
            return []
        found = self.migrations()
        missing = [fqn for fqn in wanted if fqn not in found]
        if missing:
            raise InvalidSettingsError(
                f"{', '.join(missing)}: no outlier input channels to migrate (or no exact migration: its input "
                "must come from one LayerNorm / BatchNorm / Linear / Conv that nothing else reads)"
            )
        return [found[fqn] for fqn in wanted]

    def _run(
        self,
        config: Any,
        label: str | None,
        progress: Progress | None,
        record: bool = True,
        float_model: torch.nn.Module | None = None,
        settings: Mapping[str, ModuleSettings] | None = None,
    ) -> RunResult:
        """prepare -> calibrate -> convert -> measure, as one RunResult (built once, here)."""
        label = label or f"run {len(self.history) + 1}"
        engine = self.engine
        start = time.perf_counter()
        given = {
            "label": label, "settings": settings, "config": config,
            "qconfig_mapping": engine.qconfig_mapping_of(config), "equalization_mapping": engine.equalization_mapping_of(config),
        }  # fmt: skip
        try:
            _require_float32(self._float)
            source = self._float if float_model is None else float_model
            prepared = self._prepare(source, config)
            if engine.calibrates(config):
                self._calibrate(prepared, f"{label}: calibrating", progress is None, progress)
            # before convert changes prepared
            reference = engine.reference_model(prepared) if record and self._checks_kernels(prepared) else None
            quantized = engine.convert(prepared)
            measured = self._measure(quantized, prepared, config, label, per_layer=record, float_model=source,
                                     reference_model=reference)  # fmt: skip
            result = RunResult(**given, **measured, duration_s=time.perf_counter() - start)
        except Exception as error:  # user models and data: report, keep the session usable
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            result = RunResult(
                **given, quantized_model=None, output_sqnr_db=math.nan, per_layer_sqnr_db=pd.Series(dtype=float),
                size_bytes=0, latency_ms=math.nan, duration_s=time.perf_counter() - start, error=detail,
            )  # fmt: skip
        if result.ok and record:
            self.history.append(result)
            self._release_older()
        return result

    def _checks_kernels(self, prepared: torch.nn.Module) -> bool:
        """Whether a run checks its kernels against their reference (a reference conversion, about a
        fifth of a bare run): the baseline, every run once the baseline found a kernel that differs,
        and a run that quantizes a module the start keeps float (a kernel not checked yet)."""
        truth = self._truth
        if self._baseline is None or not self._baseline.ok or (truth is not None and truth.disagreeing):
            return True
        checked = {m.fqn for m in self.modules if not m.current.keep_float}
        return any(not m.current.keep_float and m.fqn not in checked for m in self.engine.tunable_modules(prepared))

    def _measure(
        self,
        quantized: torch.nn.Module,
        prepared: torch.nn.Module,
        config: Any,
        label: str,
        per_layer: bool = True,
        float_model: torch.nn.Module | None = None,
        reference_model: torch.nn.Module | None = None,
    ) -> dict[str, Any]:
        """What a run measured, as RunResult fields: output SQNR against the float model's outputs;
        per-layer SQNR against ``float_model``, the float model the run was prepared from (a
        migration rescales some layers' outputs, exactly)."""
        reference = self.reference_outputs()
        outputs = []
        with torch.no_grad():
            try:
                call_with(quantized, self.eval_data[0])  # warm-up: first calls pay for allocations and packing
                seconds = _timed_calls(quantized, self.eval_data, outputs, self.output_of)
            except Exception as error:
                raise CalibrationError(f"{label}: the quantized model failed on the evaluation data: {error}") from error
        batch_sqnr = [sqnr_db(r, o) for r, o in zip(reference, outputs, strict=True)]
        notes, layers = [], pd.Series(dtype=float, name="SQNR (dB)")
        try:
            if per_layer:
                float_layers = self._float if float_model is None else float_model
                layers = self.engine.per_layer_sqnr(float_layers, quantized, self.eval_data[0])
        except Exception as error:  # an engine cannot pair every graph; the run itself is fine
            notes.append(f"per-layer SQNR unavailable: {self.engine.per_layer_failure(error)}")
        kernels = pd.Series(dtype=float, name="kernel SQNR (dB)")
        if reference_model is not None:
            try:
                kernels = self.engine.kernel_sqnr(reference_model, quantized, self.eval_data[0])
            except Exception as error:  # a module the check cannot call alone; the run itself is fine
                notes.append(f"kernel check unavailable: {type(error).__name__}: {error}")
        said = self.engine.run_notes(config, quantized)  # settings the quantized model did not carry out
        module_notes = dict(said.module_notes)
        for name, value in kernels[kernels < KERNEL_AGREEMENT_DB].items():
            kernel_note = f"its quantized kernel differs from its reference ({value:.1f} dB on the same input): keep it float"
            module_notes[name] = f"{module_notes[name]}; {kernel_note}" if name in module_notes else kernel_note
        summary, conversions = self.engine.conversions(prepared, quantized)
        size = _serialized_size(quantized)
        return {
            "quantized_model": quantized,
            "output_sqnr_db": sqnr_db(torch.cat([r.flatten() for r in reference]), torch.cat([o.flatten() for o in outputs])),
            "per_layer_sqnr_db": layers,
            "size_bytes": size,
            "deployed_bytes": self.engine.deployed_bytes(quantized),
            "latency_ms": float(np.median(seconds) * 1000),
            "latency_spread_ms": float((max(seconds) - min(seconds)) * 1000),
            "mean_batch_sqnr_db": float(np.mean(batch_sqnr)),
            "quantized_layers": int(conversions["quantized"].sum()) if len(conversions) else 0,
            "eval_metric": float(self.eval_fn(quantized)) if self.eval_fn is not None else None,
            "eval_batches": self.eval_description,
            "summary": summary,
            "conversions": conversions,
            "notes": (*notes, *said.notes),
            "module_notes": module_notes,
            "kernel_sqnr_db": kernels,
        }


def _model_state(run: RunResult, pinned: bool) -> str:
    """What the history holds of a run's quantized model, in the runs table's words."""
    if pinned:
        return "pinned"
    return "released" if isinstance(run.quantized_model, ReleasedModel) else "kept"


def _require_float32(model: torch.nn.Module) -> None:
    """torch's quantized kernels take float32 only; say so before prepare_fx gets far."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32}
    if dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise TypeError(
            f"the model has {names} parameters, but torch's quantization works on float32 models: quantize "
            "model.float() with float32 batches (the report of the model as it is stays valid)"
        )


def _split(calibration_data, eval_data) -> tuple[Any, list[Any], str]:
    if callable(calibration_data):
        if eval_data is None:
            raise ValueError("with a calibration callable, pass eval_data (batches to measure the quantized model on)")
        return calibration_data, list(eval_data), "the eval_data you passed"
    batches = list(calibration_data)
    if not batches:
        raise ValueError("calibration_data is empty; pass at least one batch")
    if eval_data is not None:
        return batches, list(eval_data), "the eval_data you passed"
    if len(batches) == 1:
        return batches, batches, "the single calibration batch (too few batches to hold one out)"
    held = max(1, len(batches) // 4)
    return batches[:-held], batches[-held:], f"the last {held} of {len(batches)} calibration batches, held out of calibration"


def _serialized_size(model: torch.nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


LATENCY_CALLS = (3, 7)  # timed calls per run: at least 3, at most 7 ...
LATENCY_BUDGET_S = 0.2  # ... stopping after 3 once this long was spent


def _timed_calls(
    model: torch.nn.Module, batches: Sequence[Any], outputs: list[torch.Tensor], output_of: Callable[[Any], torch.Tensor]
) -> list[float]:
    """Seconds per call of ``model`` on one thread: each evaluation batch once (its output appended
    to ``outputs``), then more calls cycling through them while LATENCY_CALLS asks for them.

    One thread: on a busy machine (a browser drawing the notebook beside the kernel) torch's
    thread pool waits on the other threads and a 1 ms model measured 150 ms; one thread measures
    the model, and is the same on every machine."""

    def timed(batch: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        output = call_with(model, batch)
        return output, time.perf_counter() - start

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = []
        for batch in batches:  # the evaluation pass: its outputs and its times
            output, took = timed(batch)
            outputs.append(output_of(output))
            seconds.append(took)
        fewest, most = LATENCY_CALLS
        for batch in itertools.cycle(batches):  # more calls while the figure needs them
            if len(seconds) >= most or (len(seconds) >= fewest and sum(seconds) >= LATENCY_BUDGET_S):
                break
            seconds.append(timed(batch)[1])
        return seconds
    finally:
        torch.set_num_threads(threads)
