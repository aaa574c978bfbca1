"""analyze(): prepare, instrument, calibrate and report in one call, never touching the float model."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_fx

from .calibration import CalibrationData, calibrate
from .detectors import DetectorBase, DynamicStaticDetector, InputWeightEqualizationDetector, OutlierDetector, PerChannelDetector
from .errors import UntraceableModelError
from .report import ModelReport


def default_detectors(backend: str = "x86") -> list[DetectorBase]:
    return [
        PerChannelDetector(backend),
        DynamicStaticDetector(),
        InputWeightEqualizationDetector(0.5),
        OutlierDetector(),
    ]


def prepare(
    float_model: torch.nn.Module, qconfig_mapping: QConfigMapping, example_inputs: tuple[Any, ...], **kwargs: Any
) -> torch.fx.GraphModule:
    """``prepare_fx`` on a deep copy, with tracing failures turned into an error that says what to try."""
    model = copy.deepcopy(float_model).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return prepare_fx(model, qconfig_mapping, example_inputs, **kwargs)
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError, RuntimeError, AttributeError) as error:
        where = _user_frame(error)
        raise UntraceableModelError(
            f"torch.fx could not trace {type(float_model).__name__}: {type(error).__name__}: {error}{where}\n"
            "FX traces with symbolic values, so Python control flow that depends on tensor values "
            "(if x.sum() > 0, loops over x.shape[0] ...) cannot be traced. Options: pass "
            "prepare_custom_config=PrepareCustomConfig().set_non_traceable_module_names([...]) or "
            ".set_non_traceable_module_classes([...]) to keep the offending submodule as one opaque call, "
            "fix input-dependent arguments with concrete_args, or move the branch out of forward()."
        ) from error


def analyze(
    float_model: torch.nn.Module,
    example_inputs: Any,
    calibration_data: CalibrationData,
    detectors: Iterable[DetectorBase] | None = None,
    qconfig_mapping: QConfigMapping | None = None,
    backend: str = "x86",
    *,
    progress: bool = True,
) -> ModelReport:
    """Prepare a copy of ``float_model`` with ``prepare_fx``, observe it during calibration and report.

    Args:
        float_model: the float model; it is deep-copied and never changed.
        example_inputs: one input tuple (a single tensor is wrapped).
        calibration_data: an iterable of batches (tuples, dicts or single tensors) or a callable
            that runs the model on its data.
        detectors: default: all four built-in detectors.
        qconfig_mapping: the starting mapping; default ``get_default_qconfig_mapping(backend)``.
    """
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
    prepared = prepare(float_model, mapping, example_inputs)
    report = ModelReport(prepared, default_detectors(backend) if detectors is None else detectors)
    instrumented = report.prepare_detailed_calibration()
    batches = calibrate(instrumented, calibration_data, desc="calibrating with observers", progress=progress)
    report.generate_model_report(remove_inserted_observers=False)
    report.analysis_inputs = AnalysisInputs(float_model, example_inputs, calibration_data, mapping, backend, batches)
    return report


class AnalysisInputs:
    """What analyze() was given, kept for re-running quantization later (the float model by reference)."""

    def __init__(self, float_model, example_inputs, calibration_data, qconfig_mapping, backend, batches) -> None:
        self.float_model = float_model
        self.example_inputs = example_inputs
        self.calibration_data = calibration_data
        self.qconfig_mapping = qconfig_mapping
        self.backend = backend
        self.batches = batches


def _user_frame(error: BaseException) -> str:
    """' (at file:line)' for the deepest traceback frame outside torch, if there is one."""
    tb, found = error.__traceback__, ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "qreport_widgets" not in filename:
            found = f" (at {filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found
