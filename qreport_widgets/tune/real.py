"""Real runs that land in the history: the baseline (checked against the simulation), runs of
settings, trial runs, and which runs check their kernels against their reference."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.metrics import token_ids
from ..core.progress import Progress, quiet
from ..engines.rotation import Rotation, matrix_words, online_problem, rotate
from ..engines.settings import ModuleSettings
from ..errors import DecodeSpeedError, InvalidSettingsError, ModelReleasedError, QReportWarning
from .history import History
from .migration import Migrations
from .run import ReleasedModel, RunResult
from .runner import Runner
from .simulation import Simulated
from .truth import KERNEL_AGREEMENT_DB, TruthCheck, check_truth

if TYPE_CHECKING:
    from ..engines.executorch import DecodeSpeed


class RealRuns:
    """Runs of the real quantized model for ``runner``'s float model, recorded in ``history``.

    The baseline is run once (again after a failure) and checked against ``simulated`` right
    away: the truth check (``truth``) is known before any estimate is shown.
    """

    def __init__(self, runner: Runner, history: History, simulated: Simulated, migrations: Migrations) -> None:
        self.runner, self.history, self.simulated, self.migrations = runner, history, simulated, migrations
        self._truth: TruthCheck | None = None
        self._failed: RunResult | None = None  # the latest failed baseline (failures are not recorded)

    def baseline(self, progress: Progress | None = None) -> RunResult:
        """The starting configuration's run, computed once, its notes saying where the simulation disagrees."""
        found = self.history.baseline
        if found is not None:
            return found
        runner = self.runner
        run = runner.run(
            runner.engine.base_config(),
            "baseline",
            progress,
            check_kernels=True,
            settings=runner.current_settings(),
            baseline=True,
        )
        if not run.ok:
            self._failed = run
            return run
        self._failed = None
        self.history.record(run)
        self._truth = self._check(run, progress)
        return self.history.annotated(replace(run, notes=(*run.notes, *self._truth.notes)))

    def truth(self, progress: Progress | None = None) -> TruthCheck:
        """The simulation against the real model on the starting configuration (runs the baseline if needed)."""
        baseline = self.baseline(progress)
        if self._truth is None:  # the baseline run failed: nothing real to compare with
            return TruthCheck(math.nan, math.nan, error=f"the baseline run failed: {baseline.error}")
        return self._truth

    def adopt_kernels(self, run: RunResult) -> list[str]:
        """Kernels ``run`` found computing something else than their reference that the simulation
        does not run yet, run by the simulation from now on (the truth check names them too); the
        names adopted. The baseline's inputs can hide a broken kernel: a PReLU that applies its
        slope to positive inputs agrees with its reference while a broken kernel before it leaves
        it no positive input."""
        truth = self._truth
        if truth is None or not run.ok or not isinstance(run.quantized_model, torch.nn.Module):
            return []
        low = run.kernel_sqnr_db[run.kernel_sqnr_db < KERNEL_AGREEMENT_DB]
        new = [str(name) for name in low.index if name not in truth.real_kernels]
        if not new:
            return []
        adopted = self.simulated.run_real_kernels(run.quantized_model, new)
        found = [name for name in new if name in adopted]
        if found:
            kernels = truth.kernels.copy()
            for name in found:
                kernels[name] = min(float(low[name]), float(kernels.get(name, math.inf)))
            self._truth = replace(truth, kernels=kernels, real_kernels=tuple(adopted))
        return found

    def adopted_since(self, kernels: tuple[str, ...]) -> list[str]:
        """The real kernels the simulation runs now that it did not when it ran ``kernels``."""
        return [name for name in self.truth(quiet).real_kernels if name not in kernels]

    def adopted_words(self, run_words: str, adopted: list[str]) -> str:
        """What ``adopt_kernels`` found, in a note: "the real run ... found kernels ... prelu4 (0.2 dB)"."""
        kernels = self.truth(quiet).kernels
        each = ", ".join(f"{name} ({kernels[name]:.1f} dB)" for name in adopted)
        return f"{run_words} found kernels differing from their reference that the baseline hid: {each}"

    def checked(self, progress: Progress | None = None) -> None:
        """The baseline tried once (and so the truth check made) before anything is estimated."""
        if self.history.baseline is None and self._failed is None:
            self.baseline(progress)

    def warn_if_unverified(self) -> None:
        """A warning when the simulation does not match the real model."""
        truth = self._truth
        if truth is not None and not truth.reliable:
            warnings.warn(f"{truth.status} (session.truth_check() says more)", QReportWarning, stacklevel=4)

    def unverified_note(self) -> str | None:
        """What a result planned in the simulation must say when the simulation does not match the real model."""
        truth = self._truth
        return None if truth is None or truth.reliable else truth.status

    def apply(
        self,
        settings: Mapping[str, ModuleSettings],
        *,
        label: str | None = None,
        progress: Progress | None = None,
        record: bool = True,
        check_kernels: bool = False,
        rotation: Rotation | None = None,
    ) -> RunResult:
        """A run of ``settings`` (modules left out keep their starting settings); InvalidSettingsError
        before anything runs for what the engine cannot apply. ``record=False``: a trial, measured at
        the output only and kept out of the history (its kernels checked too with ``check_kernels``).
        ``rotation``: folded into a copy of the float model first (the run's own, released with it)."""
        problem = online_problem(self.runner.engine, self.runner.float_model, rotation) if rotation is not None else ""
        if problem:  # before anything is prepared
            raise InvalidSettingsError(problem)
        config = self.runner.config_for(settings)
        source = self.migrations.model_for(settings)
        if rotation is not None:
            source = rotate(source if source is not None else self.runner.float_model, rotation, self.runner.example_inputs)
        checks = self._checks_kernels if record or check_kernels else None
        if rotation is not None and checks is not None:  # weights the baseline's check never saw
            checks = True
        return self._run(config, label, progress, record, float_model=source, settings=settings, checks=checks, rotation=rotation)

    def run_mapping(
        self, qconfig_mapping: Any, equalization_mapping: Any, label: str | None, progress: Progress | None
    ) -> RunResult:
        """A run of a configuration written by hand (FX: a QConfigMapping)."""
        config = self.runner.engine.config_of_mapping(qconfig_mapping, equalization_mapping)
        return self._run(config, label, progress, True)

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """``QuantizationSession.compare``: the runs (the float model's metric first, where there is one)
        and their per-layer SQNR."""
        ids = self.token_ids()
        metric = self.runner.metric
        column = metric.column if metric is not None else None
        runs, layers = self.history.compare(self.runner.current_settings(), column, None if ids is None else ids.numel())
        reference = self.runner.float_metric() if column is not None and len(runs) else None
        if reference is not None and column is not None:
            runs = self.history.with_float_reference(runs, column, reference)
        return runs, layers

    def annotated(self, result: RunResult) -> RunResult:
        """``result`` (a recorded run with notes added) in its run's place in the history."""
        return self.history.annotated(result)

    def decode_speed(self, run: int | RunResult | None, prompt_tokens: int, new_tokens: int) -> DecodeSpeed:
        """``run``'s (default the latest; the baseline first if there is none) decode speed where it is
        deployed, its prompt the first ``prompt_tokens`` tokens of the first evaluation batch."""
        if prompt_tokens < 1 or new_tokens < 1:
            raise ValueError(f"prompt_tokens and new_tokens must be at least 1, got {prompt_tokens} and {new_tokens}")
        if run is None:
            chosen = self.history.runs[-1] if self.history.runs else self.baseline()
        else:
            chosen = self.history.runs[self.history.position(run)]
        if not chosen.ok:
            raise DecodeSpeedError(f"{chosen.label} failed: it has no program to time ({chosen.error})")
        if isinstance(chosen.quantized_model, ReleasedModel):
            raise ModelReleasedError(f"{chosen.quantized_model.why}; pin it with session.keep(run) while it is the latest")
        ids = self.token_ids()
        if ids is None:
            raise DecodeSpeedError("decode speed takes its prompt from evaluation batches of token ids (batch x tokens)")
        prompt = ids[0, :prompt_tokens].tolist()
        speed = self.runner.engine.decode_speed(chosen.quantized_model, prompt, new_tokens)
        return self.history.record_decode(chosen, speed)

    def token_ids(self) -> torch.Tensor | None:
        """The first evaluation batch's token ids (batch x tokens), for a language model; else None."""
        return token_ids(self.runner.eval_data[0]) if self.runner.eval_data else None

    def as_code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """Python that builds the engine's configuration for ``settings``, after the code of any
        outlier-channel migration (which changes the float model first)."""
        code = self.runner.engine.config_as_code(self.runner.config_for(settings))
        moved = self.migrations.as_code(settings)
        return f"import torch\n\n# on the float model, before prepare:\n{moved}\n{code}" if moved else code

    def _run(
        self,
        config: Any,
        label: str | None,
        progress: Progress | None,
        record: bool,
        *,
        float_model: torch.nn.Module | None = None,
        settings: Mapping[str, ModuleSettings] | None = None,
        checks: bool | Callable[[torch.nn.Module], bool] | None = None,
        rotation: Rotation | None = None,
    ) -> RunResult:
        label = self.history.unique_label(label or self.history.next_label())
        checks = checks if checks is not None else self._checks_kernels if record else None
        self.simulated.rest()  # a real run's peak on top of what the simulation can rebuild
        result = self.runner.run(
            config, label, progress, per_layer=record, check_kernels=checks, float_model=float_model, settings=settings
        )
        if rotation is not None:
            matrices = matrix_words(self.runner.float_model, rotation)
            said = f"rotated: {rotation.words} folded into the float weights first (seed {rotation.seed}; {matrices})"
            result = replace(result.noted(said), rotation=rotation)
        if not record:
            return result
        if rotation is not None:  # its kernels hold the rotated weights: the simulation of the float model never takes them
            return self.history.record(self._rotated_kernels_noted(result))
        adopted = self.adopt_kernels(result)  # a kernel the baseline's inputs hid: the simulation runs it now
        if adopted:
            said = self.adopted_words("this run", adopted)
            result = result.noted(f"{said}; the simulation runs them from now on (estimates made before are redone)")
        return self.history.record(result)

    @staticmethod
    def _rotated_kernels_noted(run: RunResult) -> RunResult:
        """A rotated run with the kernels it found differing from their reference named, and why the
        simulation (of the float model as given, unrotated) does not run them."""
        low = run.kernel_sqnr_db[run.kernel_sqnr_db < KERNEL_AGREEMENT_DB]
        if low.empty:
            return run
        each = ", ".join(f"{name} ({float(db):.1f} dB)" for name, db in low.items())
        return run.noted(
            f"this rotated run found kernels differing from their reference: {each}; they compute the rotated "
            "weights, so the simulation of the unrotated model does not take them (a rotated front's does, in fit)"
        )

    def _checks_kernels(self, prepared: torch.nn.Module) -> bool:
        """Whether a run checks its kernels against their reference (a reference conversion, about a
        fifth of a bare run): every run once the baseline found a kernel that differs, and a run that
        quantizes a module the start keeps float (a kernel not checked yet)."""
        truth = self._truth
        if self.history.baseline is None or (truth is not None and truth.disagreeing):
            return True
        runner = self.runner
        checked = {m.fqn for m in runner.modules if not m.current.keep_float}
        return any(not m.current.keep_float and m.fqn not in checked for m in runner.engine.tunable_modules(prepared))

    def _check(self, baseline: RunResult, progress: Progress | None) -> TruthCheck:
        try:
            simulation = self.simulated.simulation(progress)
        except Exception as error:  # the simulation of an unusual model: say so, keep the session usable
            found = f"{type(error).__name__}: {error}"
            return TruthCheck(baseline.output_sqnr_db, math.nan, baseline.kernel_sqnr_db, error=found)

        def simulated() -> float:
            return self.simulated.simulate_each([()], quiet, "checking the simulation", metric=False)[0][0]

        runner = self.runner
        batch = runner.eval_data[0]

        def inner() -> pd.Series:
            return runner.engine.inner_sqnr(runner.float_model, baseline.quantized_model, batch)

        return check_truth(baseline, simulation, simulated, self.simulated.run_real_kernels, runner.float_model, batch, inner)
