"""The parts a session is made of, built once, here, each given the values it needs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.calibration import CalibrationData, data_outside_inference_mode, outside_inference_mode
from ..core.memory import WatchedCopy, WeightPool
from ..core.metrics import PERPLEXITY, Metric
from ..engines.contract import Engine
from ..engines.settings import TunableModule
from ..observe.distributed import group_of
from .diagnosis import Diagnosis
from .history import History
from .migration import Migrations
from .mixed import MixedPrecision
from .real import RealRuns
from .rotations import Rotations, Twin
from .runner import Batches, Runner
from .simulation import Simulated
from .verify import Verification


@dataclass(frozen=True)
class Analyzed:
    """What ``analyze()`` already found of the float model, so a session need not find it again:
    the watched copy the analysis prepared from, the tunable modules of the start, the analysis'
    prepared model (the weights it folded are every run's) and the input ranges it observed
    (module -> max |x| per input channel; finding migrations then needs no pass)."""

    float_copy: WatchedCopy
    modules: Sequence[TunableModule]
    prepared: torch.nn.Module
    input_ranges: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Parts:
    """One session's parts. Only ``runner`` prepares, calibrates and converts; each part is given
    what it uses, so none holds the session and none depends on which was asked first."""

    runner: Runner  # prepare -> calibrate -> convert -> measure one configuration
    history: History  # the recorded runs, which keep their models
    simulated: Simulated  # the start calibrated once, variants by forward passes
    migrations: Migrations  # the outlier-channel migrations the float model allows
    real: RealRuns  # the baseline and its truth check, applied settings, trial runs
    diagnosis: Diagnosis  # sensitivity, trade-off, reach
    mixed: MixedPrecision  # the size front, fit
    verification: Verification  # suggestions measured before they are offered
    rotations: Rotations  # the rotated float model's twin parts, fit weighing rotation, block SQNR


def resolved_metric(
    eval_fn: Callable[[torch.nn.Module], float] | None, metric: Metric | str | None, eval_batches: Sequence[Any] = ()
) -> tuple[Callable[[torch.nn.Module], float] | None, Metric | None]:
    """The session's metric function (``metric="perplexity"``: on ``eval_batches``) and what it
    measures (None without one); a clear error for a combination that cannot be."""
    if isinstance(metric, str):
        if metric != PERPLEXITY.name:
            raise ValueError(
                f"metric={metric!r} is not one the tool computes; pass 'perplexity', or eval_fn= with metric=Metric(...)"
            )
        if eval_fn is not None:
            raise ValueError("pass either eval_fn= or metric='perplexity' (computed on the evaluation batches), not both")
        return lambda model: PERPLEXITY.of_model(model, eval_batches), PERPLEXITY
    if metric is not None and not isinstance(metric, Metric):
        raise TypeError(f"metric= takes 'perplexity' or a Metric(name, higher_is_better=...), got {type(metric).__name__}")
    if metric is not None and eval_fn is None:
        if metric.from_outputs:  # computed from the outputs on the evaluation batches
            return lambda model: metric.of_model(model, eval_batches), metric
        raise ValueError(
            "metric=Metric(...) says what eval_fn= measures: pass eval_fn= too, give the Metric batch_terms= and "
            "combine= (computed from the outputs), or pass metric='perplexity'"
        )
    return eval_fn, (metric or Metric()) if eval_fn is not None else None


def build_parts(
    engine: Engine,
    float_model: torch.nn.Module,
    example_inputs: Any,
    calibration_data: CalibrationData,
    eval_data: Iterable[Any] | None,
    *,
    eval_fn: Callable[[torch.nn.Module], float] | None,
    output_fn: Callable[[Any], torch.Tensor] | None,
    process_group: Any,
    analyzed: Analyzed | None,
    metric: Metric | str | None = None,
) -> Parts:
    """A session's parts over ``float_model`` (or the watched copy ``analyzed`` has of it)."""
    batches = Batches.split(data_outside_inference_mode(calibration_data), data_outside_inference_mode(eval_data))
    example_inputs = outside_inference_mode(example_inputs)
    eval_fn, metric = resolved_metric(eval_fn, metric, batches.eval)
    weights = WeightPool()  # weights equal across prepares, held once (core/memory.py)
    if analyzed is not None:
        weights.share(analyzed.prepared)
    runner = Runner(
        engine,
        analyzed.float_copy if analyzed is not None else WatchedCopy(float_model),
        example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
        batches,
        eval_fn=eval_fn,
        output_fn=output_fn,
        group=group_of(process_group),
        modules=analyzed.modules if analyzed is not None else None,
        weights=weights,
        metric=metric,
    )
    history, simulated = History(), Simulated(runner)
    migrations = Migrations(runner, analyzed.input_ranges if analyzed is not None else None)
    real = RealRuns(runner, history, simulated, migrations)
    diagnosis = Diagnosis(runner, simulated, real)
    mixed = MixedPrecision(runner, simulated, real)
    verification = Verification(runner, real, diagnosis, migrations)

    def twin_of(rotated: torch.nn.Module) -> Twin:  # the same data, metric, engine options and ranks
        given = {"eval_fn": eval_fn, "output_fn": output_fn, "process_group": process_group, "analyzed": None}
        twin = build_parts(
            engine.renewed(), rotated, runner.example_inputs, batches.calibration, batches.eval, **given, metric=metric
        )
        return Twin(twin.runner, twin.mixed)

    rotations = Rotations(runner, real, mixed, twin_of)
    return Parts(runner, history, simulated, migrations, real, diagnosis, mixed, verification, rotations)
