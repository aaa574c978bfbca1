"""QuantizationSession: quantize a pristine float copy again and again with other settings, and measure.

The session is engine-neutral: the engine (``fx.FxEngine`` by default) prepares, converts and
reads per-layer numbers; the session owns the float copy, the data, validation, the runs and
their history. The caller's float model is deep-copied once and never touched.
"""

from __future__ import annotations

import copy
import io
import math
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from .calibration import CalibrationData, calibrate, call_with
from .engine import Engine, Simulation
from .errors import CalibrationError
from .metrics import output_tensor, sqnr_db
from .records import Suggestion
from .settings import ModuleSettings, TunableModule, validate_all, with_suggestions

Progress = Callable[[int, "int | None"], None]


@dataclass
class RunResult:
    """One prepare -> calibrate -> convert run and what it measured (field names are public API)."""

    qconfig_mapping: Any  # the FX engine's QConfigMapping (None for another engine)
    quantized_model: torch.nn.Module | None
    output_sqnr_db: float
    per_layer_sqnr_db: pd.Series
    size_bytes: int
    latency_ms: float  # median seconds per evaluation batch, in ms
    duration_s: float
    error: str | None = None
    label: str = ""
    mean_batch_sqnr_db: float = math.nan
    quantized_layers: int = 0
    eval_metric: float | None = None
    eval_batches: str = ""
    summary: pd.DataFrame = field(default_factory=pd.DataFrame)
    conversions: pd.DataFrame = field(default_factory=pd.DataFrame)
    equalization_mapping: Any = None
    notes: list[str] = field(default_factory=list)  # what could not be measured, and why
    settings: Mapping[str, ModuleSettings] | None = None  # what apply() was given (None for run())
    config: Any = None  # the engine's configuration of this run

    @property
    def ok(self) -> bool:
        return self.error is None


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
        engine: the quantization workflow; default: FX graph mode from ``qconfig_mapping``.
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
        engine: Engine | None = None,
    ) -> None:
        if engine is None:
            from .fx import FxEngine

            engine = FxEngine(backend, qconfig_mapping, prepare_custom_config)
        self._start(copy.deepcopy(float_model).eval(), engine, example_inputs, calibration_data, eval_data, eval_fn, None)

    @classmethod
    def _adopt(
        cls,
        float_copy: torch.nn.Module,
        engine: Engine,
        example_inputs: tuple[Any, ...],
        calibration_data: CalibrationData,
        eval_data: Iterable[Any] | None,
        eval_fn: Callable[[torch.nn.Module], float] | None,
        modules: list[TunableModule],
    ) -> QuantizationSession:
        """A session that owns ``float_copy`` (a private copy already) and knows the tunable modules
        from an earlier prepare with the starting configuration, as ``analyze()`` has them."""
        session = cls.__new__(cls)
        session._start(float_copy, engine, example_inputs, calibration_data, eval_data, eval_fn, modules)
        return session

    def _start(self, float_copy, engine, example_inputs, calibration_data, eval_data, eval_fn, modules) -> None:
        self._float = float_copy
        self.engine = engine
        self.example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.eval_fn = eval_fn
        self.calibration_data, self.eval_data, self.eval_description = _split(calibration_data, eval_data)
        self.history: list[RunResult] = []
        self._modules: list[TunableModule] | None = None if modules is None else list(modules)
        self._baseline: RunResult | None = None
        self._float_outputs: list[torch.Tensor] | None = None
        self._simulation: Simulation | None = None
        self._sensitivity: pd.DataFrame | None = None

    @property
    def float_model(self) -> torch.nn.Module:
        """The session's own float copy (read-only by convention; runs deep-copy it again)."""
        return self._float

    @property
    def modules(self) -> list[TunableModule]:
        """The modules whose settings can be changed, in forward order, with what they do now."""
        if self._modules is None:
            prepared = self.engine.prepare(self._float, self.engine.base_config(), self.example_inputs)
            self._modules = self.engine.tunable_modules(prepared)
        return list(self._modules)

    def current_settings(self) -> dict[str, ModuleSettings]:
        """What each tunable module does under the starting configuration."""
        return {m.fqn: m.current for m in self.modules}

    def suggested_settings(self, suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]:
        """The current settings with ``suggestions`` (e.g. ``report.suggestions()``) accepted."""
        return with_suggestions(self.modules, suggestions)

    def settings_as_code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """Python that builds the engine's configuration for ``settings``, to paste into a pipeline."""
        return self.engine.config_as_code(self._config_for(settings))

    def baseline(self, progress: Progress | None = None) -> RunResult:
        """The starting configuration's run, computed once."""
        if self._baseline is None or not self._baseline.ok:
            self._baseline = self._run(self.engine.base_config(), "baseline", progress)
        return self._baseline

    def apply(
        self, settings: Mapping[str, ModuleSettings], *, label: str | None = None, progress: Progress | None = None
    ) -> RunResult:
        """Quantize with ``settings`` (module name -> ModuleSettings; modules left out keep their
        current settings) and measure.

        Settings the engine cannot apply raise InvalidSettingsError before anything runs; a failure
        during the run is returned as a RunResult with ``error`` set and leaves the history alone.
        """
        config = self._config_for(settings)
        result = self._run(config, label, progress)
        result.settings = dict(settings)
        return result

    def run(
        self,
        qconfig_mapping: Any,
        equalization_mapping: Any = None,
        *,
        label: str | None = None,
        progress: Progress | None = None,
    ) -> RunResult:
        """FX: prepare_fx with a QConfigMapping you wrote (and an equalization mapping) -> calibrate ->
        convert_fx -> metrics. Failures do not raise: the result carries ``error``."""
        from .fx import FxConfig, FxEngine

        if not isinstance(self.engine, FxEngine):
            raise TypeError(
                f"run(qconfig_mapping) is for the FX engine; this session uses {self.engine.name}: use apply(settings)"
            )
        return self._run(FxConfig(qconfig_mapping, equalization_mapping), label, progress)

    def simulation(self, progress: Progress | None = None) -> Simulation:
        """The starting configuration calibrated once, as a simulation in which modules can be kept
        float without calibrating again (built on first use, then kept)."""
        if self._simulation is None:
            prepared = self.engine.prepare(self._float, self.engine.base_config(), self.example_inputs)
            calibrate(prepared, self.calibration_data, desc="sensitivity: calibrating", progress=progress is None,
                      on_batch=progress)  # fmt: skip
            self._simulation = self.engine.simulator(prepared, [m.fqn for m in self.modules], self._float, self.example_inputs)
        return self._simulation

    def simulate(self, float_modules: Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric with ``float_modules`` kept float."""
        simulation = self.simulation()
        outputs = [output_tensor(o) for o in simulation.outputs(self.eval_data, float_modules)]
        reference = self._reference_outputs()
        sqnr = sqnr_db(torch.cat([r.flatten() for r in reference]), torch.cat([o.flatten() for o in outputs]))
        metric = None
        if self.eval_fn is not None:
            with torch.no_grad():
                metric = float(self.eval_fn(simulation.model))
        return sqnr, metric

    def sensitivity(self, progress: Progress | None = None) -> pd.DataFrame:
        """Which module hurts: for each tunable module, the output SQNR gained when only it stays
        float, estimated by simulation (calibrated once, forward passes only), most harmful first.

        Columns: ``output_sqnr_gain_db``; ``metric_gain`` (with ``eval_fn``); ``local_sqnr_db``, the
        module's own error on the inputs the float model gives it (not accumulated from earlier
        layers); ``simulated_output_sqnr_db``. ``progress(done, total)`` is called after each module.
        """
        if self._sensitivity is not None:
            return self._sensitivity.copy()
        simulation = self.simulation(progress)
        names = list(simulation.tunable)
        base_sqnr, base_metric = self.simulate(())
        local = simulation.local_sqnr(self.eval_data[0])
        rows = []
        bar = tqdm(total=len(names), desc="sensitivity", unit="module", disable=progress is not None, leave=False)
        try:
            for done, name in enumerate(names, 1):
                sqnr, metric = self.simulate([name])
                rows.append(
                    {
                        "module": name,
                        "output_sqnr_gain_db": sqnr - base_sqnr,
                        **({"metric_gain": metric - base_metric} if metric is not None and base_metric is not None else {}),
                        "local_sqnr_db": local.get(name, math.nan),
                        "simulated_output_sqnr_db": sqnr,
                    }
                )
                bar.update()
                if progress is not None:
                    progress(done, len(names))
        finally:
            bar.close()
            simulation.configure(())
        table = pd.DataFrame(rows, columns=["module", "output_sqnr_gain_db", "local_sqnr_db", "simulated_output_sqnr_db"]
                             if not rows else None)  # fmt: skip
        self._sensitivity = table.set_index("module").sort_values("output_sqnr_gain_db", ascending=False, kind="stable")
        return self._sensitivity.copy()

    def tradeoff(self, progress: Progress | None = None) -> pd.DataFrame:
        """The trade-off curve: keeping the most harmful modules float one after the other (the
        sensitivity ranking), the simulated output SQNR (and metric) after each step.

        One row per number of float modules, from 0: ``added`` (the module made float at that step),
        ``simulated_output_sqnr_db`` and, with ``eval_fn``, ``simulated_metric``.
        """
        order = list(self.sensitivity(progress).index)
        rows = []
        for count in range(len(order) + 1):
            sqnr, metric = self.simulate(order[:count])
            rows.append(
                {
                    "float_modules": count,
                    "added": order[count - 1] if count else "",
                    "simulated_output_sqnr_db": sqnr,
                    **({"simulated_metric": metric} if metric is not None else {}),
                }
            )
        self.simulation().configure(())
        return pd.DataFrame(rows).set_index("float_modules")

    def reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        progress: Progress | None = None,
    ) -> RunResult:
        """The fewest modules kept float (most harmful first) that meet the target, confirmed by a real run.

        The simulation picks the count; a real prepare -> calibrate -> convert run confirms it, and
        if the real run falls short the next modules are added (up to three more real runs). When
        no count meets the target even in simulation, the run of the best simulated point is
        returned. Either way ``notes`` say whether the target was met, and the run's ``settings``
        name the float modules.
        """
        plan = self.plan_reach(target_sqnr_db, target_metric, progress=progress)
        order, count, target, meets = plan.order, plan.float_count, plan.target, plan.meets
        label = f"reach {target}"
        if not plan.met:
            result = self._float_run(order[:count], label, progress)
            result.notes.append(
                f"{target} is out of reach: even in simulation the best is {plan.simulated_sqnr_db:.2f} dB "
                f"with {count} module(s) float; this run keeps those float"
            )
            return result
        for _ in range(4):  # the real run may fall short of the simulated one: add the next module
            result = self._float_run(order[:count], label, progress)
            if not result.ok or meets(result.output_sqnr_db, result.eval_metric) or count >= len(order):
                break
            count += 1
        verdict = "met" if result.ok and meets(result.output_sqnr_db, result.eval_metric) else "not met by the real run"
        result.notes.append(
            f"{target}: {verdict} with {count} of {len(order)} modules float ({', '.join(order[:count]) or 'none'})"
        )
        return result

    def plan_reach(
        self, target_sqnr_db: float | None = None, target_metric: float | None = None, *, progress: Progress | None = None
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone: the fewest most-harmful modules to keep
        float for the target, or the best point of the trade-off curve when none meets it."""
        if target_sqnr_db is None and target_metric is None:
            raise ValueError("reach() needs target_sqnr_db, target_metric or both")
        if target_metric is not None and self.eval_fn is None:
            raise ValueError("target_metric needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
        curve = self.tradeoff(progress)
        plan = ReachPlan(target_sqnr_db, target_metric, [name for name in curve["added"] if name], 0, math.nan, False)
        metrics = curve["simulated_metric"] if "simulated_metric" in curve else pd.Series(math.nan, index=curve.index)
        for count in curve.index:
            if plan.meets(curve.at[count, "simulated_output_sqnr_db"], metrics[count]):
                plan.float_count, plan.met = int(count), True
                break
        else:
            plan.float_count = int(curve["simulated_output_sqnr_db"].idxmax())
        plan.simulated_sqnr_db = float(curve.at[plan.float_count, "simulated_output_sqnr_db"])
        return plan

    def _float_run(self, float_modules: Sequence[str], label: str, progress: Progress | None) -> RunResult:
        return self.apply({name: ModuleSettings(keep_float=True) for name in float_modules}, label=label, progress=progress)

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """One row per run (metrics as columns), and per-layer SQNR with one column per run."""
        rows = [
            {
                "run": r.label,
                "output SQNR (dB)": r.output_sqnr_db,
                "mean batch SQNR (dB)": r.mean_batch_sqnr_db,
                "quantized layers": r.quantized_layers,
                "size (KB)": r.size_bytes / 1024,
                "latency (ms)": r.latency_ms,
                **({"your metric": r.eval_metric} if self.eval_fn is not None else {}),
                "duration (s)": r.duration_s,
            }
            for r in self.history
        ]
        runs = pd.DataFrame(rows)
        layers = pd.DataFrame({r.label: r.per_layer_sqnr_db for r in self.history})
        return runs, layers

    # ---- runs ----------------------------------------------------------------------------------
    def _config_for(self, settings: Mapping[str, ModuleSettings]) -> Any:
        modules = self.modules
        validate_all(modules, settings)
        return self.engine.config_for(settings, modules)

    def _run(self, config: Any, label: str | None, progress: Progress | None) -> RunResult:
        label = label or f"run {len(self.history) + 1}"
        engine = self.engine
        start = time.perf_counter()
        try:
            _require_float32(self._float)
            prepared = engine.prepare(self._float, config, self.example_inputs)
            calibrate(prepared, self.calibration_data, desc=f"{label}: calibrating", progress=progress is None, on_batch=progress)
            quantized = engine.convert(prepared)
            result = self._measure(quantized, prepared, config, label)
        except Exception as error:  # user models and data: report, keep the session usable
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            result = RunResult(_mapping_of(config), None, math.nan, pd.Series(dtype=float), 0, math.nan, 0.0, detail, label)
            result.config = config
        result.duration_s = time.perf_counter() - start
        if result.ok:
            self.history.append(result)
        return result

    def _reference_outputs(self) -> list[torch.Tensor]:
        if self._float_outputs is None:
            with torch.no_grad():
                self._float_outputs = [output_tensor(call_with(self._float, b)) for b in self.eval_data]
        return self._float_outputs

    def _measure(self, quantized: torch.nn.Module, prepared: torch.nn.Module, config: Any, label: str) -> RunResult:
        reference = self._reference_outputs()
        outputs, seconds = [], []
        with torch.no_grad():
            try:
                for batch in self.eval_data:
                    start = time.perf_counter()
                    outputs.append(output_tensor(call_with(quantized, batch)))
                    seconds.append(time.perf_counter() - start)
            except Exception as error:
                raise CalibrationError(f"{label}: the quantized model failed on the evaluation data: {error}") from error
        batch_sqnr = [sqnr_db(r, o) for r, o in zip(reference, outputs, strict=True)]
        notes = []
        try:
            layers = self.engine.per_layer_sqnr(self._float, quantized, self.eval_data[0])
        except Exception as error:  # Numeric Suite cannot pair every graph; the run itself is fine
            layers = pd.Series(dtype=float, name="SQNR (dB)")
            notes.append(f"per-layer SQNR unavailable: Numeric Suite could not match the two graphs ({type(error).__name__})")
        summary, conversions = self.engine.conversions(prepared, quantized)
        return RunResult(
            qconfig_mapping=_mapping_of(config),
            quantized_model=quantized,
            output_sqnr_db=sqnr_db(torch.cat([r.flatten() for r in reference]), torch.cat([o.flatten() for o in outputs])),
            per_layer_sqnr_db=layers,
            size_bytes=_serialized_size(quantized),
            latency_ms=float(np.median(seconds) * 1000),
            duration_s=0.0,
            label=label,
            mean_batch_sqnr_db=float(np.mean(batch_sqnr)),
            quantized_layers=int(conversions["quantized"].sum()) if len(conversions) else 0,
            eval_metric=float(self.eval_fn(quantized)) if self.eval_fn is not None else None,
            eval_batches=self.eval_description,
            summary=summary,
            conversions=conversions,
            equalization_mapping=getattr(config, "equalization_mapping", None),
            notes=notes,
            config=config,
        )


@dataclass
class ReachPlan:
    """The float modules reach() would try for a target, decided in simulation."""

    target_sqnr_db: float | None
    target_metric: float | None
    order: list[str]  # most harmful first
    float_count: int
    simulated_sqnr_db: float
    met: bool  # whether the simulation meets the target with ``float_modules``

    @property
    def float_modules(self) -> list[str]:
        return self.order[: self.float_count]

    @property
    def target(self) -> str:
        parts = [f"output SQNR >= {self.target_sqnr_db:g} dB"] if self.target_sqnr_db is not None else []
        return " and ".join(parts + ([f"metric >= {self.target_metric:g}"] if self.target_metric is not None else []))

    def meets(self, sqnr: float, metric: float | None) -> bool:
        sqnr_ok = self.target_sqnr_db is None or sqnr >= self.target_sqnr_db
        metric_ok = self.target_metric is None or (metric is not None and metric >= self.target_metric)
        return sqnr_ok and metric_ok


def _mapping_of(config: Any) -> Any:
    return getattr(config, "qconfig_mapping", None)


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
