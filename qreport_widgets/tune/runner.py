"""One configuration of the float model, prepared -> calibrated -> converted -> measured, as a RunResult.

``Runner`` owns what every run shares: the engine, the float model (a watched copy sharing the
user's weights), the batches, the output the SQNR is measured on, the torch.distributed group and
the weights prepares fold. It records nothing: the history decides what a run leaves behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from ..core.calibration import CalibrationData, calibrate, call_with, data_fingerprint
from ..core.devices import MovedBatches, copy_on, model_device, moved
from ..core.experts import experts_words
from ..core.linears import transposed_words
from ..core.memory import WatchedCopy, WeightPool, ensure_room, give_back, tensors_bytes
from ..core.metrics import Metric, output_tensor, power_terms, sqnr_db
from ..core.progress import Progress, Stopped
from ..engines.contract import Engine
from ..engines.settings import ModuleSettings, TunableModule, validate_all
from ..errors import CalibrationError, NotEnoughMemoryError
from ..observe.distributed import calibrated_across
from .run import RunResult
from .truth import KERNEL_AGREEMENT_DB

LATENCY_CALLS = (3, 7)  # timed calls per run: at least 3, at most 7 ...
LATENCY_BUDGET_S = 0.2  # ... stopping after 3 once this long was spent


@dataclass(frozen=True)
class Batches:
    """The data of every run: what calibrates (batches, or a callable that runs a model on its data)
    and what the quantized model is measured on, with where the latter came from in words."""

    calibration: CalibrationData
    eval: list[Any]
    eval_description: str

    @classmethod
    def split(cls, calibration_data: CalibrationData, eval_data: Iterable[Any] | None) -> Batches:
        """``eval_data`` when given, else the last quarter of the calibration batches, held out of
        calibration (all of them when there is a single batch)."""
        if callable(calibration_data):
            if eval_data is None:
                raise ValueError("with a calibration callable, pass eval_data (batches to measure the quantized model on)")
            return cls(calibration_data, list(eval_data), "the eval_data you passed")
        batches = list(calibration_data)
        if not batches:
            raise ValueError("calibration_data is empty; pass at least one batch")
        if eval_data is not None:
            return cls(batches, list(eval_data), "the eval_data you passed")
        if len(batches) == 1:
            return cls(batches, batches, "the single calibration batch (too few batches to hold one out)")
        held = max(1, len(batches) // 4)
        words = f"the last {held} of {len(batches)} calibration batches, held out of calibration"
        return cls(batches[:-held], batches[-held:], words)

    def for_searching(self) -> list[Any]:
        """Batches to look for outlier channels in: the calibration batches, or the held-out ones
        when a calibration callable gives none."""
        return list(self.eval) if callable(self.calibration) else list(self.calibration)


class Runner:
    """Prepare, calibrate, convert and measure one configuration of the float model.

    Args:
        engine: the quantization workflow.
        float_copy: the float model, its weights shared with the user's and watched.
        example_inputs: one input tuple for preparing.
        batches: calibration and evaluation data.
        eval_fn: ``eval_fn(model) -> float``, the user's metric, or None.
        metric: what ``eval_fn`` measures (its name and direction); None without one.
        output_fn: the tensor output SQNR is measured on (default: the output or its first tensor).
        group: the torch.distributed group calibrations merge their observers across, or None.
        modules: the tunable modules an earlier prepare of the start found (found here when None).
        weights: weights equal across prepares, held once.
    """

    def __init__(
        self,
        engine: Engine,
        float_copy: WatchedCopy,
        example_inputs: tuple[Any, ...],
        batches: Batches,
        *,
        eval_fn: Callable[[torch.nn.Module], float] | None = None,
        output_fn: Callable[[Any], torch.Tensor] | None = None,
        group: Any = None,
        modules: Sequence[TunableModule] | None = None,
        weights: WeightPool | None = None,
        metric: Metric | None = None,
    ) -> None:
        self.engine = engine
        self.metric = metric
        self.example_inputs = example_inputs
        self.batches = batches
        self.metric_calls = 0  # models the user's eval_fn has scored (a fit says how many it spent)
        self.eval_fn = None if eval_fn is None else self._counted(eval_fn)
        self._watched = float_copy
        self.output_fn = output_fn  # as given (None: the output or its first tensor)
        self.group = group  # the torch.distributed group calibrations merge across (None: this process alone)
        self._modules = None if modules is None else list(modules)
        self._weights = weights or WeightPool()
        self._reference: list[torch.Tensor] | None = None
        self._signal_powers: dict[int, float] = {}  # evaluation batch -> its reference output's signal power
        self._float_metric: float | None = None

    @property
    def metric_from_outputs(self) -> bool:
        """Whether the session's metric is read off the outputs on the evaluation batches
        (``Metric.from_outputs``: perplexity), so the pass that gives the output SQNR gives it too."""
        return self.eval_fn is not None and self.metric is not None and self.metric.from_outputs

    @property
    def float_model(self) -> torch.nn.Module:
        """The float model, after checking its weights were not changed in place."""
        return self._watched.model

    @property
    def eval_data(self) -> list[Any]:
        return self.batches.eval

    @property
    def modules(self) -> list[TunableModule]:
        """The tunable modules in forward order, with what the start does to each."""
        if self._modules is None:
            prepared = self.prepare(self.float_model, self.engine.base_config())
            self._modules = self.engine.tunable_modules(prepared)
        return list(self._modules)

    def current_settings(self) -> dict[str, ModuleSettings]:
        return {m.fqn: m.current for m in self.modules}

    def untunable_weights(self) -> pd.DataFrame:
        """The float model's weights (two dimensions or more over 1; tied ones once) that no tunable module holds, so
        they stay float whatever the settings (a mixture of experts' 3-d expert weights, a custom
        module's matrix): ``weight``, ``shape``, ``bytes`` and ``share`` of all the weights' bytes."""
        owners = {m.fqn for m in self.modules}
        rows, total = [], 0
        for name, weight in self.float_model.named_parameters():
            size = weight.numel() * weight.element_size()
            total += size
            matrix = sum(size > 1 for size in weight.shape) >= 2  # not a (1, tokens, width) table or a token
            if matrix and name.rpartition(".")[0] not in owners:
                rows.append({"weight": name, "shape": tuple(weight.shape), "bytes": size})
        found = pd.DataFrame(rows, columns=["weight", "shape", "bytes"])
        found["share"] = found["bytes"] / max(total, 1)
        return found.sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True)

    def config_for(self, settings: Mapping[str, ModuleSettings]) -> Any:
        """The engine's configuration of ``settings``; InvalidSettingsError for what it cannot apply."""
        modules = self.modules
        validate_all(modules, settings)
        return self.engine.config_for(settings, modules)

    def prepare(self, source: torch.nn.Module, config: Any) -> torch.nn.Module:
        """The engine's prepare, holding the weights it folds (a batch norm into a conv) once across runs;
        the example inputs go where ``source`` is (a run's copy on the CPU)."""
        example_inputs = moved(self.example_inputs, model_device(source))
        return self._weights.share(self.engine.prepare(source, config, example_inputs))

    def calibrate(
        self,
        model: torch.nn.Module,
        desc: str,
        bar: bool = False,
        on_batch: Progress | None = None,
        statistics: MutableMapping[str, Any] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Calibrate ``model`` on this process's batches, then merge its observers, and the
        ``statistics`` the pass gathered (an engine's calibration pass item), across the
        torch.distributed group (if any) so every rank converts the same model. ``device``: where
        ``model`` is, when not where the batches are (each batch is moved there as it is read)."""
        data = self.batches.calibration
        if device is not None and not callable(data):
            data = MovedBatches(data, device)

        def here() -> int:
            return calibrate(model, data, desc=desc, progress=bar, on_batch=on_batch)

        calibrated_across(self.group, model, here, desc, statistics=statistics)

    def calibrate_quietly(self, model: torch.nn.Module, statistics: MutableMapping[str, Any] | None = None) -> None:
        self.calibrate(model, "calibrating a variant", statistics=statistics)

    def calibration_key(self) -> str | None:
        """The calibration data's fingerprint (``data_fingerprint``, read again at each call), with
        every rank's across the torch.distributed group, whose merged statistics a run's weights come
        from; None for a calibration callable, on any rank."""
        key = data_fingerprint(self.batches.calibration)
        if self.group is None:
            return key
        keys: list[str | None] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(keys, key, group=self.group)
        return None if any(k is None for k in keys) else hashlib.sha256(" ".join(keys).encode()).hexdigest()  # type: ignore[arg-type]

    def calibrated_start(self, desc: str, progress: Progress | None) -> torch.nn.Module:
        """The starting configuration, prepared and calibrated (not converted)."""
        config = self.engine.base_config()
        prepared = self.prepare(self.float_model, config)
        if self.engine.calibrates(config):
            with contextlib.closing(self.engine.calibration_passes(prepared, progress, self.calibration_key())) as passes:
                for statistics in passes:
                    self.calibrate(prepared, desc, progress is None, progress, statistics)
        return prepared

    def reference_outputs(self) -> list[torch.Tensor]:
        """The float model's outputs on the evaluation batches (computed once)."""
        model = self.float_model
        if self._reference is None:
            with torch.no_grad():
                self._reference = [self.output_of(call_with(model, b)) for b in self.eval_data]
        return self._reference

    def _counted(self, eval_fn: Callable[[torch.nn.Module], float]) -> Callable[[torch.nn.Module], float]:
        def scored(model: torch.nn.Module) -> float:
            self.metric_calls += 1
            return eval_fn(model)

        return scored

    def float_metric(self) -> float | None:
        """The session's metric (``eval_fn``) of the float model, computed once; None without one."""
        if self.eval_fn is None:
            return None
        if self._float_metric is None:
            with torch.no_grad():
                self._float_metric = float(self.eval_fn(self.float_model))
        return self._float_metric

    def output_of(self, output: Any) -> torch.Tensor:
        """A model output as the tensor output SQNR compares: ``output_fn``'s, else the output or its first tensor."""
        if self.output_fn is None:
            return output_tensor(output)
        found = self.output_fn(output)
        if not isinstance(found, torch.Tensor):
            raise TypeError(f"output_fn must return a tensor, got {type(found).__name__}")
        return found.detach().float()

    def output_sqnr(self, outputs: Sequence[Any]) -> float:
        """Output SQNR (dB) of a model's outputs on the evaluation batches against the float model's."""
        reference = torch.cat([r.flatten() for r in self.reference_outputs()])
        return sqnr_db(reference, torch.cat([self.output_of(o).flatten() for o in outputs]))

    def output_terms(self, index: int, output: Any, reference: torch.Tensor | None = None) -> tuple[float, float]:
        """(signal, noise) power of a model's output on evaluation batch ``index`` against the float
        model's (or ``reference``, a part of it the output is): what the output SQNR adds over
        batches (``core.metrics.sqnr_of``)."""
        if reference is not None:
            return power_terms(reference, self.output_of(output))
        terms = power_terms(self.reference_outputs()[index], self.output_of(output), self._signal_powers.get(index))
        self._signal_powers[index] = terms[0]  # the float output's, the same for every output read against it
        return terms

    def ensure_room(self, step: str, doing: str, settings: Mapping[str, ModuleSettings] | None = None) -> None:
        """Refuses ``doing`` when the machine has not the memory it is estimated to need
        (``core.memory.ensure_room``) for the modules ``settings`` (the start's when None) quantize."""
        chosen = self.current_settings() if settings is None else {**self.current_settings(), **settings}
        modules = dict(self.float_model.named_modules())  # an FX module name may be a function's (an add)
        weights = (getattr(modules.get(fqn), "weight", None) for fqn, s in chosen.items() if not s.keep_float)
        output = max((r.numel() * r.element_size() for r in self._reference or ()), default=0)
        ensure_room(step, tensors_bytes([w for w in weights if isinstance(w, torch.Tensor)]), output, doing)

    def equalization_float_error(self, settings: Mapping[str, ModuleSettings]) -> float:
        """Relative change of the float model's output when the engine equalizes as ``settings`` ask
        (0: exact; NaN for an engine without equalization)."""
        return self.engine.equalization_float_error(
            self.float_model, self.config_for(settings), self.example_inputs, self.calibrate_quietly, self.eval_data[0]
        )

    def run(
        self,
        config: Any,
        label: str,
        progress: Progress | None = None,
        *,
        per_layer: bool = True,
        check_kernels: bool | Callable[[torch.nn.Module], bool] | None = None,
        float_model: torch.nn.Module | None = None,
        settings: Mapping[str, ModuleSettings] | None = None,
        baseline: bool = False,
    ) -> RunResult:
        """prepare -> calibrate -> convert -> measure, as one RunResult (built once, here).

        ``float_model``: what to prepare instead of the float model (a migrated copy).
        ``check_kernels``: whether to check each quantized kernel against its reference (a reference
        conversion, about a fifth of a bare run), or a function of the prepared model that says.
        Failures do not raise: the result carries ``error``; a run the machine has not the memory for
        is refused (``NotEnoughMemoryError``). ``per_layer=False`` measures the output only."""
        engine = self.engine
        start = time.perf_counter()
        given = {"label": label, "settings": settings, "config": config, "baseline": baseline}
        try:
            source = self.float_model if float_model is None else float_model
            _require_float32(source)
            self.ensure_room("run", f"the run {label!r}", settings)
            lives, place = model_device(source), engine.kernel_device
            moved_to = place if place is not None and lives != place else None
            calibrates = engine.calibrates(config)
            # weights computed from the calibration batches (GPTQ, the learned rounding) are computed
            # where the model and its batches are, then the calibrated model moves to its kernels
            computed_there = moved_to is not None and calibrates and engine.computes_where_the_model_is(config)
            where_it_lives = source
            if moved_to is not None:  # the run's own copy where its kernels are, released with the run
                source = copy_on(source, moved_to)
            prepared = self.prepare(where_it_lives if computed_there else source, config)
            if calibrates:
                device = None if computed_there else moved_to
                with contextlib.closing(engine.calibration_passes(prepared, progress, self.calibration_key())) as passes:
                    for statistics in passes:
                        self.calibrate(prepared, f"{label}: calibrating", progress is None, progress, statistics, device)
            if computed_there:
                prepared = engine.relocated(prepared, moved_to)
            # before convert changes prepared
            checks = check_kernels(prepared) if callable(check_kernels) else bool(check_kernels)
            reference = engine.reference_model(prepared) if checks else None
            quantized = engine.convert(prepared, progress)
            measured = self._measure(quantized, prepared, config, label, per_layer, source, reference, moved_to)
            if moved_to is not None:
                said = f"measured on {engine.kernel_words()}: the model is on {lives}, so the run converted a copy of it there"
                if computed_there:
                    said += f"; the weights it computes from the calibration batches were computed on {lives}"
                measured["notes"] = (said, *measured["notes"])
            del prepared, reference, source
            give_back()  # what converting and measuring freed
            return RunResult(**given, **measured, duration_s=time.perf_counter() - start)
        except (NotEnoughMemoryError, Stopped):  # refused before it started, or stopped by its caller: not a failed run
            raise
        except Exception as error:  # user models and data: report, keep the session usable
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            return RunResult(
                **given,
                quantized_model=None,
                output_sqnr_db=math.nan,
                per_layer_sqnr_db=pd.Series(dtype=float),
                size_bytes=0,
                latency_ms=math.nan,
                duration_s=time.perf_counter() - start,
                error=detail,
            )

    def _measure(
        self,
        quantized: torch.nn.Module,
        prepared: torch.nn.Module,
        config: Any,
        label: str,
        per_layer: bool,
        float_model: torch.nn.Module,
        reference_model: torch.nn.Module | None,
        device: torch.device | None = None,
    ) -> dict[str, Any]:
        """What a run measured, as RunResult fields: output SQNR against the float model's outputs;
        per-layer SQNR against ``float_model``, the float model the run was prepared from (a
        migration rescales some layers' outputs, exactly). ``device``: where the run's models are,
        when not where the batches are."""
        engine = self.engine
        batches = self.eval_data if device is None else [moved(b, device) for b in self.eval_data]  # read several times
        batch = batches[0]
        reference = self.reference_outputs()
        outputs: list[torch.Tensor] = []
        # a metric read off the outputs (perplexity) is added up over this pass, not called for again
        metric = self.metric if self.metric_from_outputs else None
        terms: list[tuple[float, ...]] = []
        each = None if metric is None else lambda b, output: terms.append(tuple(metric.batch_terms(b, output)))
        with torch.no_grad():
            try:
                call_with(quantized, batch)  # warm-up: first calls pay for allocations and packing
                seconds = _timed_calls(quantized, batches, outputs, self.output_of, each)
            except Exception as error:
                raise CalibrationError(f"{label}: the quantized model failed on the evaluation data: {error}") from error
        notes, layers = [], pd.Series(dtype=float, name="SQNR (dB)")
        try:
            if per_layer:
                layers = engine.per_layer_sqnr(float_model, quantized, batch)
                layers = layers[~layers.index.isin(identities(float_model))]
        except Exception as error:  # an engine cannot pair every graph; the run itself is fine
            notes.append(f"per-layer SQNR unavailable: {engine.per_layer_failure(error)}")
        kernels = pd.Series(dtype=float, name="kernel SQNR (dB)")
        if reference_model is not None:
            try:
                kernels = engine.kernel_sqnr(reference_model, quantized, batch)
            except Exception as error:  # a module the check cannot call alone; the run itself is fine
                notes.append(f"kernel check unavailable: {type(error).__name__}: {error}")
        said = engine.run_notes(config, quantized)  # settings the quantized model did not carry out
        if self._watched.as_linears:
            notes.append(transposed_words(self._watched.as_linears))
        if self._watched.experts:
            first = self._watched.model.get_submodule(self._watched.experts[0])
            notes.append(experts_words(self._watched.experts, first.num_experts))
        summary, conversions = engine.conversions(prepared, quantized)
        if metric is not None:
            value: float | None = float(metric.combine(terms))  # type: ignore[misc]
        else:
            value = float(self.eval_fn(quantized)) if self.eval_fn is not None else None
        everything = torch.cat([r.flatten() for r in reference]), torch.cat([o.flatten() for o in outputs])
        return {
            "quantized_model": quantized,
            "output_sqnr_db": sqnr_db(*everything),
            "per_layer_sqnr_db": layers,
            "size_bytes": engine.stored_bytes(quantized),
            "deployed_bytes": engine.deployed_bytes(quantized),
            "latency_ms": float(np.median(seconds) * 1000),
            "latency_spread_ms": float((max(seconds) - min(seconds)) * 1000),
            "mean_batch_sqnr_db": float(np.mean([sqnr_db(r, o) for r, o in zip(reference, outputs, strict=True)])),
            "quantized_layers": int(conversions["quantized"].sum()) if len(conversions) else 0,
            "eval_metric": value,
            "eval_batches": self.batches.eval_description,
            "summary": summary,
            "conversions": conversions,
            "notes": (*notes, *said.notes),
            "module_notes": _with_kernel_notes(said.module_notes, kernels),
            "kernel_sqnr_db": kernels,
        }


_IDENTITIES = (nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def identities(model: nn.Module) -> set[str]:
    """The modules of ``model`` that pass their input through in eval (dropout, ``nn.Identity``):
    no layer of their own, so no row of the per-layer SQNR (they would repeat the layer before)."""
    return {name for name, module in model.named_modules() if isinstance(module, _IDENTITIES)}


def _with_kernel_notes(module_notes: Mapping[str, str], kernels: pd.Series) -> dict[str, str]:
    """The engine's notes per module, with a line for each kernel that differs from its reference."""
    found = dict(module_notes)
    for name, value in kernels[kernels < KERNEL_AGREEMENT_DB].items():
        note = f"its quantized kernel differs from its reference ({value:.1f} dB on the same input): keep it float"
        found[name] = f"{found[name]}; {note}" if name in found else note
    return found


def _require_float32(model: torch.nn.Module) -> None:
    """torch's quantized kernels take float32 only; say so before prepare gets far."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32}
    if dtypes:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise TypeError(
            f"the model has {names} parameters, but torch's quantization works on float32 models: quantize "
            "model.float() with float32 batches (the report of the model as it is stays valid)"
        )


def _timed_calls(
    model: torch.nn.Module,
    batches: Iterable[Any],
    outputs: list[torch.Tensor],
    output_of: Callable[[Any], torch.Tensor],
    each: Callable[[Any, Any], None] | None = None,
) -> list[float]:
    """Seconds per call of ``model`` on one thread: each evaluation batch once (its output appended
    to ``outputs``, and ``each(batch, output)`` called with the model's own output), then more calls
    cycling through them while LATENCY_CALLS asks for them.

    One thread: on a busy machine (a browser drawing the notebook beside the kernel) torch's
    thread pool waits on the other threads and a 1 ms model measured 150 ms; one thread measures
    the model, and is the same on every machine. A model executed in another process (an ExecuTorch
    program, ``last_call_s``) is timed there: the hand-over of its inputs and outputs is not its latency."""

    def timed(batch: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        output = call_with(model, batch)
        took = time.perf_counter() - start
        return output, getattr(model, "last_call_s", None) or took

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds = []
        for batch in batches:  # the evaluation pass: its outputs and its times
            output, took = timed(batch)
            outputs.append(output_of(output))
            if each is not None:
                each(batch, output)
            seconds.append(took)
        fewest, most = LATENCY_CALLS
        for batch in itertools.cycle(batches):  # more calls while the figure needs them
            if len(seconds) >= most or (len(seconds) >= fewest and sum(seconds) >= LATENCY_BUDGET_S):
                break
            seconds.append(timed(batch)[1])
        return seconds
    finally:
        torch.set_num_threads(threads)
