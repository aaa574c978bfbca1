"""QuantizationSession: re-run prepare_fx -> calibrate -> convert_fx on a pristine copy and measure.

The caller's float model is deep-copied once and never touched; every run prepares its own copy.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.quantize_fx import convert_fx

from .calibration import CalibrationData, calibrate, call_with
from .errors import CalibrationError
from .metrics import per_layer_sqnr, quantization_summary, sqnr_db
from .pipeline import prepare


@dataclass
class RunResult:
    """One prepare -> calibrate -> convert run and what it measured (field names are public API)."""

    qconfig_mapping: QConfigMapping
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
    equalization_mapping: QConfigMapping | None = None
    notes: list[str] = field(default_factory=list)  # what could not be measured, and why

    @property
    def ok(self) -> bool:
        return self.error is None


class QuantizationSession:
    """Quantize a float model again and again with different QConfigMappings and compare.

    Args:
        float_model: deep-copied once; the caller's object is never changed.
        example_inputs: one input tuple for ``prepare_fx``.
        calibration_data: an iterable of batches (re-iterable; a one-shot iterator is kept as a
            list) or a callable that runs a model on its data.
        eval_data: batches for the metrics; default: the last quarter of the calibration batches,
            held out from calibration (all of them when there is a single batch).
        eval_fn: ``eval_fn(model) -> float``, your own metric (e.g. accuracy), shown next to ours.
        qconfig_mapping: the starting mapping the baseline uses (default: the backend's default).
        prepare_custom_config: passed to every ``prepare_fx`` (non-traceable modules, ...).
    """

    def __init__(
        self,
        float_model: torch.nn.Module,
        example_inputs: Any,
        calibration_data: CalibrationData,
        eval_data: Iterable[Any] | None = None,
        backend: str = "x86",
        eval_fn: Callable[[torch.nn.Module], float] | None = None,
        qconfig_mapping: QConfigMapping | None = None,
        prepare_custom_config: Any = None,
    ) -> None:
        from torch.ao.quantization import get_default_qconfig_mapping

        self._float = copy.deepcopy(float_model).eval()
        self.example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.backend = backend
        self.eval_fn = eval_fn
        self.prepare_custom_config = prepare_custom_config
        self.qconfig_mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
        self.calibration_data, self.eval_data, self.eval_description = _split(calibration_data, eval_data)
        self.history: list[RunResult] = []
        self._baseline: RunResult | None = None
        self._float_outputs: list[torch.Tensor] | None = None

    @property
    def float_model(self) -> torch.nn.Module:
        """The session's own float copy (read-only by convention; runs deep-copy it again)."""
        return self._float

    def baseline(self, progress: Callable[[int, int | None], None] | None = None) -> RunResult:
        """The starting mapping's run, computed once."""
        if self._baseline is None or not self._baseline.ok:
            self._baseline = self.run(self.qconfig_mapping, label="baseline", progress=progress)
        return self._baseline

    def run(
        self,
        qconfig_mapping: QConfigMapping,
        equalization_mapping: QConfigMapping | None = None,
        *,
        label: str | None = None,
        progress: Callable[[int, int | None], None] | None = None,
    ) -> RunResult:
        """prepare_fx (with the equalization mapping when given) -> calibrate -> convert_fx -> metrics.

        Failures do not raise: the result carries ``error`` and the history is left unchanged.
        """
        label = label or f"run {len(self.history) + 1}"
        start = time.perf_counter()
        try:
            _require_float32(self._float)
            extra = {"_equalization_config": equalization_mapping} if equalization_mapping is not None else {}
            if self.prepare_custom_config is not None:
                extra["prepare_custom_config"] = self.prepare_custom_config
            prepared = prepare(self._float, qconfig_mapping, self.example_inputs, **extra)
            calibrate(prepared, self.calibration_data, desc=f"{label}: calibrating", progress=progress is None, on_batch=progress)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantized = convert_fx(prepared)
            result = self._measure(quantized, prepared, qconfig_mapping, equalization_mapping, label)
        except Exception as error:  # user models and data: report, keep the session usable
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            result = RunResult(qconfig_mapping, None, math.nan, pd.Series(dtype=float), 0, math.nan, 0.0, detail, label)
        result.duration_s = time.perf_counter() - start
        if result.ok:
            self.history.append(result)
        return result

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

    # ---- metrics -------------------------------------------------------------------------------
    def _reference_outputs(self) -> list[torch.Tensor]:
        if self._float_outputs is None:
            with torch.no_grad():
                self._float_outputs = [_tensor_output(call_with(self._float, b)) for b in self.eval_data]
        return self._float_outputs

    def _measure(self, quantized, prepared, mapping, equalization, label) -> RunResult:
        reference = self._reference_outputs()
        outputs, seconds = [], []
        with torch.no_grad():
            try:
                for batch in self.eval_data:
                    start = time.perf_counter()
                    outputs.append(_tensor_output(call_with(quantized, batch)))
                    seconds.append(time.perf_counter() - start)
            except Exception as error:
                raise CalibrationError(f"{label}: the quantized model failed on the evaluation data: {error}") from error
        batch_sqnr = [sqnr_db(r, o) for r, o in zip(reference, outputs, strict=True)]
        notes = []
        try:
            layers = per_layer_sqnr(self._float, quantized, self.eval_data[0])
        except Exception as error:  # Numeric Suite cannot pair every graph; the run itself is fine
            layers = pd.Series(dtype=float, name="SQNR (dB)")
            notes.append(f"per-layer SQNR unavailable: Numeric Suite could not match the two graphs ({type(error).__name__})")
        summary, conversions = quantization_summary(prepared, quantized)
        return RunResult(
            qconfig_mapping=mapping,
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
            equalization_mapping=equalization,
            notes=notes,
        )


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


def _tensor_output(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output.detach().float()
    if isinstance(output, (tuple, list)):
        return torch.cat([_tensor_output(o).flatten() for o in output if isinstance(o, (torch.Tensor, tuple, list))])
    if isinstance(output, dict):
        return torch.cat([_tensor_output(v).flatten() for v in output.values()])
    if dataclasses.is_dataclass(output):  # model-output classes of transformer libraries, say
        fields = [getattr(output, f.name) for f in dataclasses.fields(output)]
        return torch.cat([_tensor_output(v).flatten() for v in fields if isinstance(v, (torch.Tensor, tuple, list, dict))])
    raise TypeError(
        f"cannot compare model outputs of type {type(output).__name__}: return tensors, or tuples, lists, dicts "
        "or dataclasses of them"
    )


def _serialized_size(model: torch.nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes
