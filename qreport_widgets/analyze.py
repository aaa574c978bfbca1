"""analyze(): prepare, instrument, calibrate and report in one call, never touching the float model."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping

from .calibration import CalibrationData, calibrate, is_one_shot
from .detectors import DetectorBase, DynamicStaticDetector, InputWeightEqualizationDetector, OutlierDetector, PerChannelDetector
from .pipeline import prepare, torch_observers_paused
from .report import ModelReport


def default_detectors(backend: str = "x86") -> list[DetectorBase]:
    return [
        PerChannelDetector(backend),
        DynamicStaticDetector(),
        InputWeightEqualizationDetector(0.5),
        OutlierDetector(),
    ]


def analyze(
    float_model: torch.nn.Module,
    example_inputs: Any,
    calibration_data: CalibrationData,
    detectors: Iterable[DetectorBase] | None = None,
    qconfig_mapping: QConfigMapping | None = None,
    backend: str = "x86",
    *,
    eval_data: Any = None,
    eval_fn: Any = None,
    prepare_custom_config: Any = None,
    progress: bool = True,
) -> ModelReport:
    """Prepare a copy of ``float_model`` with ``prepare_fx``, observe it during calibration and report.

    Args:
        float_model: the float model; it is deep-copied and never changed.
        example_inputs: one input tuple (a single tensor is wrapped).
        calibration_data: an iterable of batches (tuples, dicts or single tensors) or a callable
            that runs the model on its data. A one-shot iterator (a generator) is kept as a list,
            since every later tuning run calibrates again.
        detectors: default: all four built-in detectors.
        qconfig_mapping: the starting mapping; default ``get_default_qconfig_mapping(backend)``.
        eval_data, eval_fn: for ``report.session`` (live tuning): batches to measure quantized
            models on (default: held-out calibration batches) and your own metric of a model.
        prepare_custom_config: passed to ``prepare_fx`` here and in every later run, e.g.
            ``PrepareCustomConfig().set_non_traceable_module_classes([MyBlock])`` for a block
            whose forward FX cannot trace.

    The report's model (``report.model``) is for analysis: ``prepare_fx``'s own observers rest
    while it calibrates, since no detector reads them. To quantize, use ``report.session`` (or
    the Tune tab), which prepares and calibrates a fresh copy for every run.
    """
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
    prepared = prepare(float_model, mapping, example_inputs, prepare_custom_config=prepare_custom_config)
    report = ModelReport(prepared, default_detectors(backend) if detectors is None else detectors)
    instrumented = report.prepare_detailed_calibration()
    kept = [] if is_one_shot(calibration_data) else None  # a generator is kept for later tuning runs
    with torch_observers_paused(instrumented):  # the detectors read only the report's observers
        batches = calibrate(instrumented, calibration_data, desc="calibrating with observers", progress=progress, keep=kept)
    calibration_data = kept if kept is not None else calibration_data
    report.generate_model_report(remove_inserted_observers=False)
    # a pristine copy as it was analyzed: later edits to the caller's model do not leak into tuning
    report.analysis_inputs = AnalysisInputs(
        copy.deepcopy(float_model).eval(), example_inputs, calibration_data, mapping, backend, batches, eval_data, eval_fn,
        prepare_custom_config,
    )  # fmt: skip
    return report


@dataclass
class AnalysisInputs:
    """What analyze() was given, kept for re-running quantization later (a copy of the float model)."""

    float_model: torch.nn.Module
    example_inputs: tuple[Any, ...]
    calibration_data: Any
    qconfig_mapping: QConfigMapping
    backend: str
    batches: int
    eval_data: Any = None
    eval_fn: Any = None
    prepare_custom_config: Any = None
