"""analyze(): prepare, instrument, calibrate and report in one call, never touching the float model."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pandas as pd
import torch
from torch.ao.quantization import QConfigMapping

from .core.calibration import CalibrationData, calibrate, data_outside_inference_mode, is_one_shot, outside_inference_mode
from .core.devices import MovedBatches, device_mismatch, model_device, moved
from .core.memory import WatchedCopy
from .core.metrics import Metric
from .engines import build_engine
from .errors import DeviceMismatchError, warn_user
from .observe.detectors import (
    DetectorBase,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
)
from .observe.distributed import calibrated_across, group_of
from .report.model_report import ModelReport
from .tune.migration import observed_input_ranges
from .tune.parts import Analyzed, resolved_metric
from .tune.session import QuantizationSession


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
    eval_data: Iterable[Any] | None = None,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
    prepare_custom_config: Any = None,
    progress: bool = True,
    engine: str = "fx",
    quantizer: Any = None,
    format: str | None = None,  # noqa: A002  (the word users know)
    group_size: int | None = None,
    algorithms: tuple[str, ...] | None = None,
    formats: tuple[str, ...] | None = None,
    output_fn: Callable[[Any], torch.Tensor] | None = None,
    process_group: Any = None,
    metric: Metric | str | None = None,
    target: str | None = None,
    learned_start: str | None = None,
    exact_percentiles: bool = False,
    move_batches: bool = False,
    check_shortcuts: bool = False,
) -> ModelReport:
    """Prepare a copy of ``float_model`` (``prepare_fx``, or ``torch.export`` for PT2E), observe it
    during calibration and report.

    Args:
        float_model: the float model; it is deep-copied once and never changed.
        example_inputs: one input tuple (a single tensor is wrapped).
        calibration_data: an iterable of batches (tuples, dicts or single tensors) or a callable
            that runs the model on its data. A one-shot iterator (a generator) is kept as a list,
            since every later tuning run calibrates again.
        detectors: default: all four built-in detectors.
        qconfig_mapping: the starting mapping; default ``get_default_qconfig_mapping(backend)``.
        eval_data, eval_fn: for ``report.session`` (live tuning): batches to measure quantized
            models on (default: held-out calibration batches) and your own metric of a model.
        metric: ``"perplexity"`` for a causal language model (computed on ``eval_data``, lower is
            better; no ``eval_fn``), or ``Metric(name, higher_is_better=...)`` naming what
            ``eval_fn`` measures; ``fit`` / ``reach``'s ``target_metric`` follows its direction.
        prepare_custom_config: passed to ``prepare_fx`` here and in every later run, e.g.
            ``PrepareCustomConfig().set_non_traceable_module_classes([MyBlock])`` for a block
            whose forward FX cannot trace.
        engine: ``"fx"`` (FX graph mode: ``prepare_fx`` / ``convert_fx``), ``"pt2e"`` (torchao:
            ``torch.export`` -> ``prepare_pt2e`` / ``convert_pt2e``; needs the ``[pt2e]`` extra) or
            ``"eager"`` (torchao's ``quantize_`` per module, no graph: the engine for Hugging Face
            transformers and weight-only / int4 formats; the ``[eager]`` extra). The engine says
            what the report observes (PT2E: the exported float graph; eager: the leaf modules,
            by hooks) and runs every tuning run.
        quantizer: PT2E only: the starting quantizer (default: torchao's ``X86InductorQuantizer``
            with its default config, or XNNPACK's for ``target="xnnpack"``); Tune settings override
            it per module.
        target: PT2E and eager: where the quantized model will run. ``"x86"`` (default), or
            ``"xnnpack"`` (phones, through ExecuTorch): every run is lowered to XNNPACK, serialised
            as a ``.pte`` program and measured in ExecuTorch's runtime (output SQNR, metric and
            latency of the program, size its bytes). On PT2E, XNNPACK's quantizer (symmetric int8,
            per-channel weights) is the start; on eager, decoders as ExecuTorch's LLM export ships
            them: Linears ``"int8-dynamic-int4-weight"`` ("8da4w", grouped int4 weights) or
            ``"int8-dynamic"`` ("8da8w"), Embeddings int4 / int8 weight-only, lowered with XNNPACK's
            dynamically quantized partitioner. Needs the ``[executorch]`` extra. Eager only:
            ``"llama.cpp"``: a Hugging Face decoder (llama, mistral, qwen2, qwen3) in the same formats
            (8da4w Linears as ``Q4_0``, 8da8w as ``Q8_0``), every run written as a GGUF file and
            measured by llama.cpp (``run.quantized_model.write("model.gguf")``); the ``[llamacpp]`` extra.
        format: eager only: the starting format of every ``nn.Linear`` (``"int8-dynamic"`` by
            default; ``"int8-weight-only"``, ``"int4-weight-only"``, ``"int8-dynamic-int4-weight"``).
        group_size: eager only: the group size of a starting int4 format (32, 64 or 128; default 32).
        algorithms: eager only: the int4 weight algorithms (``"rtn"``, ``"hqq"``, ``"gptq"``, ``"awq"``,
            ``"learned"``) the size front and ``fit`` weigh per module; default all but ``"learned"``
            (minutes a decoder: name it to weigh it; GPTQ and AWQ cost a minute each over a 134M
            decoder's Linears: ``("rtn", "hqq")`` keeps a large model's fit short).
        formats: eager only: the quantized formats the size front and ``fit`` weigh besides float;
            default every format the target runs. ``("int4-weight-only", "int8-weight-only")`` for
            a model ``run.save_pretrained`` will write (a compressed-tensors checkpoint holds those).
        learned_start: eager only: the values the ``"learned"`` rounding starts from on each block,
            ``"rtn"`` (default: round to nearest's) or ``"gptq"`` (GPTQ's); which is better differs
            by model (SmolLM2: round to nearest's; the byte decoder: GPTQ's).
        output_fn: ``output_fn(model_output) -> tensor``: what output SQNR is measured on; default:
            the output, or its first tensor (a Hugging Face ``ModelOutput``'s first field).
        process_group: calibrate across the processes of this torch.distributed group (default:
            the default group, when torch.distributed is initialised, e.g. under ``torchrun``): each
            rank calibrates on the batches it was given, and the observers are merged so every rank
            holds the report one process would make from all the batches; the session's runs merge
            their observers likewise. See docs/SCALE.md.
        exact_percentiles: the outlier detector's reference percentile (p97.5) of a channel that
            holds more than 4,096 values in a batch is estimated from 4,096 or more of them, evenly
            spread (its rank within the p96.8-p97.5-p98.2, three standard errors; the report's
            text says so). ``True`` computes every percentile exactly, at up to twice the cost of
            a plain calibration pass on large activations.
        move_batches: move every batch (calibration, evaluation and the example inputs) to the float
            model's device as it is read. Default False: a batch on another device than the model is
            an error that names both, since moving each batch costs a copy.
        check_shortcuts: every shortcut the session takes (a program lowered before rewritten with new
            weights, GPTQ weights found before, an input quantized once for the Linears that read it,
            a simulation's kept results, a fit's halving) also computes its answer afresh and raises
            ``ShortcutMismatchError`` naming the shortcut where the two differ. It costs more than the
            shortcuts save; the environment variable ``QREPORT_CHECK_SHORTCUTS=1`` asks it of every
            session in the process (docs/RELIABILITY.md lists the shortcuts and their checks).

    Where things run: everything the analysis and the session make (observers, statistics, the
    simulation, GPTQ / AWQ statistics) is made on the model's device; a real run whose kernels exist
    only on the CPU (FX and PT2E int8, the eager engine's x86 and XNNPACK targets) converts a copy of
    the model there, its batches moved one at a time, and its notes say so. The float model is never
    moved.

    The report's model (``report.model``) is for analysis: ``prepare_fx``'s own observers rest
    while it calibrates, since no detector reads them. To quantize, use ``report.session`` (or
    the Tune tab), which prepares and calibrates a fresh copy for every run.
    """
    # the example inputs are often the first calibration batch: an engine that runs them to observe may
    # keep what it saw, and that batch is not run twice
    first_is_example = (
        isinstance(calibration_data, Sequence) and len(calibration_data) > 0 and calibration_data[0] is example_inputs
    )
    # batches made under torch.inference_mode (a data pipeline's): ordinary tensors from here on
    calibration_data, eval_data = data_outside_inference_mode(calibration_data), data_outside_inference_mode(eval_data)
    example_inputs = calibration_data[0] if first_is_example else outside_inference_mode(example_inputs)  # type: ignore[index]
    example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if move_batches:
        example_inputs, calibration_data, eval_data = _moved_to(
            model_device(float_model), example_inputs, calibration_data, eval_data
        )
    elif mismatch := device_mismatch(float_model, example_inputs, "The example input"):
        raise DeviceMismatchError(mismatch.strip())
    resolved_metric(eval_fn, metric)  # a metric that cannot be is said before the calibration, not after
    detectors = default_detectors(backend) if detectors is None else detectors
    options = {"qconfig_mapping": qconfig_mapping, "prepare_custom_config": prepare_custom_config}
    chosen = build_engine(
        engine,
        backend=backend,
        quantizer=quantizer,
        format=format,
        group_size=group_size,
        algorithms=algorithms,
        formats=formats,
        target=target,
        learned_start=learned_start,
        **options,
    )
    chosen.checks_shortcuts = check_shortcuts
    # the session's own modules around the caller's weights, shared (not held twice); weights changed in
    # place later are refused with an error, not tuned (memory.WatchedCopy); the analysis prepares from it
    watched = WatchedCopy(float_model)
    kept = [] if is_one_shot(calibration_data) else None  # a generator is kept for later tuning runs
    observed = chosen.observe(watched.model, example_inputs, record=first_is_example)
    name = type(float_model).__name__
    report = ModelReport(
        observed.model,
        detectors,
        model_name=name,
        graph_of=observed.graph_of,
        engine=chosen,
        tunable_modules=observed.modules,
        exact_percentiles=exact_percentiles,
    )
    instrumented = report.prepare_detailed_calibration()

    def calibrated_here() -> int:
        def on(data: CalibrationData, first: int = 0) -> int:
            return calibrate(instrumented, data, desc="calibrating with observers", progress=progress, keep=kept, first=first)

        if observed.replay is None or not observed.replay(instrumented):
            return on(calibration_data)
        rest = calibration_data[1:]  # type: ignore[index]  # a Sequence: first_is_example
        return 1 + (on(rest, first=1) if len(rest) else 0)

    with chosen.observers_paused(instrumented):  # the detectors read only the report's observers
        calibrated_across(group_of(process_group), instrumented, calibrated_here, "analyze()", report_observers=True)
    report.generate_model_report(remove_inserted_observers=False)
    analyzed = Analyzed(watched, observed.modules, observed.model, observed_input_ranges(report.frame()))
    try:
        session = QuantizationSession(
            float_model,
            example_inputs,
            kept if kept is not None else calibration_data,
            eval_data,
            eval_fn=eval_fn,
            metric=metric,
            engine=chosen,
            output_fn=output_fn,
            process_group=process_group,
            analyzed=analyzed,
        )
    except ValueError as error:  # e.g. a calibration callable without eval_data: the analysis still stands
        report.attach_session(None, f"{type(error).__name__}: {error}")
    else:
        report.attach_session(session)
        _warn_untunable(session.untunable_weights())
    return report


UNTUNABLE_SHARE = 0.01  # analyze warns when weights no tunable module holds are more of the bytes than this


def _warn_untunable(found: pd.DataFrame) -> None:
    share = float(found["share"].sum()) if len(found) else 0.0
    if share <= UNTUNABLE_SHARE:
        return
    shown = ", ".join(f"{row.weight} {tuple(row.shape)}" for row in found.head(3).itertuples())
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    warn_user(
        f"{share:.0%} of the model's weight bytes sit in {len(found)} weight{'s' if len(found) > 1 else ''} no tunable "
        f"module holds ({shown}{more}): "
        "they stay float whatever the settings, and every size counts them at full width; "
        "session.untunable_weights() lists them"
    )


def _moved_to(
    device: torch.device, example_inputs: tuple[Any, ...], calibration_data: CalibrationData, eval_data: Iterable[Any] | None
) -> tuple[tuple[Any, ...], CalibrationData, Iterable[Any] | None]:
    """The example inputs on ``device``, and the batches moved there as they are read (``move_batches``).
    A one-shot iterator stays one (it is kept as it is read); a calibration callable runs the model
    itself, so its batches are its own to place."""
    if callable(calibration_data):
        moved_calibration = calibration_data
    elif is_one_shot(calibration_data):
        moved_calibration = (moved(batch, device) for batch in calibration_data)
    elif isinstance(calibration_data, Sequence):
        moved_calibration = [moved(batch, device) for batch in calibration_data]  # read by every run: moved once
    else:
        moved_calibration = MovedBatches(calibration_data, device)
    moved_eval = None if eval_data is None else [moved(batch, device) for batch in eval_data]
    return moved(example_inputs, device), moved_calibration, moved_eval
