"""The rotated float model beside the session's: its twin parts, ``fit``'s weighing, ``block_sqnr``.

A rotation (``engines/rotation.py``) changes the float model every run reads: a rotated run is
measured against the rotated float model, and a fit that weighs rotation needs the rotated model's
own size front. Both come from a *twin*: the parts of a session over the rotated float model, with
the same batches, metric, engine options and process group, built once per rotation and kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from ..core.progress import Progress
from ..engines.rotation import Rotation, online_problem, rotate, rotation_problems
from ..engines.settings import ModuleSettings
from ..errors import InvalidSettingsError
from .mixed import MixedPrecision, fit_budget, weighed_fit
from .real import RealRuns
from .run import RunResult
from .runner import Runner


@dataclass(frozen=True)
class Twin:
    """What is read of a session's parts over the rotated model (``parts.build_parts``)."""

    runner: Runner
    mixed: MixedPrecision


class Rotations:
    """The twins of ``runner``'s float model, one per rotation, made by ``twin_of(rotated model)``."""

    def __init__(self, runner: Runner, real: RealRuns, mixed: MixedPrecision, twin_of: Callable[[torch.nn.Module], Twin]) -> None:
        self.runner, self.real, self.mixed, self._twin_of = runner, real, mixed, twin_of
        self._twins: dict[Rotation, Twin] = {}

    @property
    def twins(self) -> Mapping[Rotation, Twin]:
        """The twins made so far."""
        return dict(self._twins)

    def problems(self) -> dict[str, str]:
        return rotation_problems(self.runner.float_model)

    def twin(self, rotation: Rotation) -> Twin:
        """The parts of a session on the float model with ``rotation`` folded in; made once."""
        if rotation not in self._twins:
            self._twins[rotation] = self._twin_of(rotate(self.runner.float_model, rotation, self.runner.example_inputs))
        return self._twins[rotation]

    def reference(self, rotation: Rotation | None) -> torch.nn.Module:
        """The float model a run with ``rotation`` is read against."""
        if rotation is None:
            return self.runner.float_model
        twin = self._twins.get(rotation)
        return twin.runner.float_model if twin is not None else rotate(self.runner.float_model, rotation)

    def block_sqnr(self, run: RunResult, batch: int) -> pd.Series:
        if not run.ok:
            raise InvalidSettingsError(f"block_sqnr() reads a run's model, and the run {run.label!r} failed: {run.error}")
        if not run.quantized_model:
            raise InvalidSettingsError(
                f"block_sqnr() reads a run's model, and the run {run.label!r} no longer holds it ({run.quantized_model!r})"
            )
        data = self.runner.batches.eval
        if not 0 <= batch < len(data):
            raise IndexError(f"batch {batch} of {len(data)} evaluation batches")
        with torch.no_grad():
            return self.runner.engine.block_sqnr(self.reference(run.rotation), run.quantized_model, data[batch])

    def check(self, rotation: Rotation) -> None:
        """``fit(rotation=...)`` refused before any front is built: on an engine without the int4
        fronts, where a rotation asked for does not apply, or R4 where its product cannot be measured."""
        engine = self.runner.engine
        if engine.rotated_front_problem():
            raise InvalidSettingsError(engine.rotated_front_problem())
        asked = {"R1": rotation.residual, "R2": rotation.values}
        problems = {name: why for name, why in self.problems().items() if asked.get(name)}
        if problems:
            raise InvalidSettingsError(
                f"fit(rotation={rotation!r}) on a model the rotations do not apply to: "
                + "; ".join(f"{name}: {why}" for name, why in problems.items())
            )
        problem = online_problem(engine, self.runner.float_model, rotation)
        if problem:
            raise InvalidSettingsError(problem)

    def fit(
        self,
        goal: tuple[float | None, float | None, float | None],
        rotation: Rotation | bool | None,
        by_block: bool,
        progress: Progress | None,
    ) -> RunResult:
        """``QuantizationSession.fit``: on the plain front, or weighed against the ``rotation``'s."""
        if rotation is True:
            rotation = Rotation()
        if not rotation:
            return self.mixed.fit(*goal, progress, by_block)
        self.check(rotation)
        self.mixed.check_goal(*goal)
        twin = self.twin(rotation)
        budget = fit_budget(*goal)
        fronts = (self.mixed.front(progress, by_block, budget), twin.mixed.front(progress, by_block, budget))
        metric = self.runner.metric

        def rotated_apply(settings: Mapping[str, ModuleSettings], **given: Any) -> RunResult:
            return self.real.apply(settings, rotation=rotation, **given)

        def rotated_fit() -> RunResult:  # the twin's simulation takes the kernels its real runs find
            return self.real.annotated(twin.mixed.fit(*goal, progress, by_block, apply=rotated_apply))

        def plain_fit() -> RunResult:
            return self.mixed.fit(*goal, progress, by_block)

        return self.real.annotated(weighed_fit(plain_fit, rotated_fit, fronts, rotation, *goal, metric))
