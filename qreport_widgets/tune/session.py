"""QuantizationSession: quantize a float copy again and again with other settings, and measure.

The session is a facade: each public method is one delegation to a part built once, here, from
values (see the package's docstring). The caller's float model is never touched: the session's
copy shares its weights and refuses them once they were changed in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd
import torch

from ..core.calibration import CalibrationData
from ..core.metrics import Metric
from ..core.progress import Progress
from ..engines import build_engine
from ..engines.contract import Engine, Simulation, Variant
from ..engines.rotation import Rotation, rotate, rotation_problems
from ..engines.settings import ModuleSettings, TunableModule, module_blocks, with_suggestions
from ..errors import InvalidSettingsError
from ..observe.records import Suggestion
from .diagnosis import ReachPlan, metric_target
from .migration import Migration, input_producers
from .mixed import fit, weighed_fit
from .parts import Analyzed, build_parts
from .run import RunResult
from .truth import TruthCheck
from .verify import VerifiedSuggestions

if TYPE_CHECKING:
    from ..engines.executorch import DecodeSpeed

T = TypeVar("T")


class QuantizationSession:
    """Quantize a float model again and again with different settings and compare.

    Args:
        float_model: the caller's object is never changed; the session's copy shares its weights.
        example_inputs: one input tuple for preparing the model.
        calibration_data: an iterable of batches (re-iterable; a one-shot iterator is kept as a
            list) or a callable that runs a model on its data.
        eval_data: batches for the metrics; default: the last quarter of the calibration batches,
            held out from calibration (all of them when there is a single batch).
        backend: the quantized engine (``x86``, ``fbgemm``, ``qnnpack``, ``onednn``).
        eval_fn: ``eval_fn(model) -> float``, your own metric (e.g. accuracy), shown next to ours.
        metric: ``"perplexity"`` (a causal language model's, computed on ``eval_data``; no
            ``eval_fn``), or ``Metric(name, higher_is_better=...)`` saying what ``eval_fn``
            measures (default: "metric", higher is better). Targets on it are met at or above them
            when higher is better, at or below them when lower is.
        qconfig_mapping: FX: the starting mapping the baseline uses (default: the backend's default).
        prepare_custom_config: FX: passed to every ``prepare_fx`` (non-traceable modules, ...).
        engine: an Engine, or an engine's name (``"fx"``, ``"pt2e"``, ``"eager"``) built from the
            arguments above; default: FX graph mode.
        output_fn: ``output_fn(model_output) -> tensor``, the tensor output SQNR is measured on;
            default: the output, or its first tensor (``metrics.output_tensor``).
        process_group: a torch.distributed group whose ranks each calibrate on their own batches
            and merge the prepared model's observers before every convert (default: the default
            group when torch.distributed is initialised). Metrics are measured on each rank's
            ``eval_data``: give every rank the same evaluation batches for the same numbers.
        analyzed: what ``analyze()`` found of ``float_model`` (its watched copy replaces one made here).
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
        analyzed: Analyzed | None = None,
        metric: Metric | str | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            mapping = {"qconfig_mapping": qconfig_mapping, "prepare_custom_config": prepare_custom_config}
            engine = build_engine(engine or "fx", backend=backend, **mapping)
        given = {
            "eval_fn": eval_fn,
            "output_fn": output_fn,
            "process_group": process_group,
            "analyzed": analyzed,
            "metric": metric,
        }
        self.parts = build_parts(engine, float_model, example_inputs, calibration_data, eval_data, **given)
        runner = self.parts.runner
        self.engine, self.example_inputs, self.eval_fn, self.metric = engine, runner.example_inputs, runner.eval_fn, runner.metric
        batches = runner.batches
        self.calibration_data, self.eval_data, self.eval_description = batches.calibration, batches.eval, batches.eval_description
        self.history: list[RunResult] = self.parts.history.runs  # the recorded runs in order (the same list)
        self._rotated: dict[Rotation, QuantizationSession] = {}  # a session on each rotated float model fit weighed

    # ---- what it holds ----------------------------------------------------------------------------
    @property
    def float_model(self) -> torch.nn.Module:
        """The session's float model: its own modules around the user's weights, which it shares
        (read-only; ``FloatModelChangedError`` once they were changed in place)."""
        return self.parts.runner.float_model

    @property
    def modules(self) -> list[TunableModule]:
        """The modules whose settings can be changed, in forward order, with what they do now."""
        return self.parts.runner.modules

    def current_settings(self) -> dict[str, ModuleSettings]:
        """What each tunable module does under the starting configuration."""
        return self.parts.runner.current_settings()

    def suggested_settings(self, suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]:
        """The current settings with ``suggestions`` (e.g. ``report.suggestions()``) accepted, unmeasured."""
        return with_suggestions(self.modules, suggestions)

    def reference_outputs(self) -> list[torch.Tensor]:
        """The float model's outputs on the evaluation batches (computed once)."""
        return self.parts.runner.reference_outputs()

    def output_of(self, output: Any) -> torch.Tensor:
        """A model output as the tensor output SQNR compares."""
        return self.parts.runner.output_of(output)

    # ---- real runs (real.py, history.py) ------------------------------------------------------------
    def baseline(self, progress: Progress | None = None) -> RunResult:
        """The starting configuration's run, computed once, and checked against the simulation
        (``truth_check``): where they disagree its notes say so."""
        return self.parts.real.baseline(progress)

    def apply(
        self,
        settings: Mapping[str, ModuleSettings],
        *,
        label: str | None = None,
        progress: Progress | None = None,
        record: bool = True,
        rotation: Rotation | bool | None = None,
    ) -> RunResult:
        """Quantize with ``settings`` (module name -> ModuleSettings; modules left out keep their
        current settings) and measure.

        Settings the engine cannot apply raise InvalidSettingsError before anything runs; a failure
        during the run is returned as a RunResult with ``error`` set and leaves the history alone.
        With ``record=False`` the run is a trial: not added to the history, and measured at the
        output only (no per-layer SQNR). ``rotation`` (a decoder in the Llama layout): the run
        quantizes the float model with ``Rotation()``'s orthogonal rotations folded into its weights
        (the same logits, fewer outlier channels; ``engines/rotation.py``), its per-layer SQNR read
        against that rotated float model; InvalidSettingsError names why a model does not take it.
        ``rotation=True`` is ``Rotation()``.
        """
        chosen = Rotation() if rotation is True else rotation or None
        return self.parts.real.apply(settings, label=label, progress=progress, record=record, rotation=chosen)

    def rotation_problems(self) -> dict[str, str]:
        """Which rotations (``R1``, ``R2``) the float model does not take, each with why; empty: both apply."""
        return rotation_problems(self.float_model)

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
        return self.parts.real.run_mapping(qconfig_mapping, equalization_mapping, label, progress)

    def settings_as_code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """Python that builds the engine's configuration for ``settings``, to paste into a pipeline
        (after the code of any outlier-channel migration, which changes the float model first)."""
        return self.parts.real.as_code(settings)

    def decode_speed(self, run: int | RunResult | None = None, prompt_tokens: int = 32, new_tokens: int = 32) -> DecodeSpeed:
        """Milliseconds per generated token of a run's decoder where it is deployed (engine='eager',
        target='xnnpack'): the run's quantized model exported again with a static KV cache, lowered the
        same way, fed a prompt (the first evaluation sequence's first ``prompt_tokens`` tokens) and
        generating ``new_tokens`` greedily in ExecuTorch's runtime. ``run``: its position or the run
        (default the latest)."""
        return self.parts.real.decode_speed(run, prompt_tokens, new_tokens)

    def truth_check(self, progress: Progress | None = None) -> TruthCheck:
        """The simulation against the real model on the starting configuration (see ``truth.py``):
        the gap, the modules whose quantized kernels differ from their reference, and whether the
        simulation, running those real kernels, now matches. Runs the baseline if needed."""
        return self.parts.real.truth(progress)

    def keep(self, run: int | RunResult, keep: bool = True) -> RunResult:
        """Pin a run of the history (its position or the run) so its quantized model is kept; the
        session otherwise keeps only the latest run's and releases the others' when a run is
        recorded (their measurements stay). ``keep=False`` unpins it (released at the next run)."""
        return self.parts.history.keep(run, keep)

    def kept(self, run: int | RunResult) -> bool:
        """Whether a run of the history is pinned (its quantized model is kept, see ``keep``)."""
        return self.parts.history.kept(run)

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        """One row per run (metrics as columns), and per-layer SQNR with one column per run. With a
        metric (``eval_fn``), the float model's is the first row (``float model``): the reference."""
        ids = self.parts.real.token_ids()
        column = self.metric.column if self.metric is not None else None
        runs, layers = self.parts.history.compare(self.current_settings(), column, None if ids is None else ids.numel())
        reference = self.float_metric() if column is not None and len(runs) else None
        if reference is not None and column is not None:
            runs = self.parts.history.with_float_reference(runs, column, reference)
        return runs, layers

    def float_metric(self) -> float | None:
        """The session's metric (``eval_fn``) on the float model, computed once: what
        ``max_metric_loss`` / ``max_metric_gap`` targets are relative to. None without a metric."""
        return self.parts.runner.float_metric()

    # ---- what the data allows (migration.py, verify.py) -------------------------------------------
    def migrations(self) -> dict[str, Migration]:
        """Module -> the outlier-channel scale migration its input allows (``ModuleSettings.migrate``),
        found once on the calibration data; each is exact in float (checked)."""
        return self.parts.migrations.found()

    def input_producers(self, names: Iterable[str]) -> dict[str, str]:
        """Module -> the module whose output is its input (where one module produces it)."""
        return input_producers(self.float_model, names)

    def equalization_float_error(self, fqn: str) -> float:
        """Relative change of the float model's output when the engine equalizes ``fqn`` (0: exact;
        NaN for an engine without equalization)."""
        return self.parts.runner.equalization_float_error({fqn: ModuleSettings(equalize=True)})

    def verified_suggestions(
        self, suggestions: Iterable[Suggestion], *, nan_metric: Iterable[str] = (), progress: Progress | None = None
    ) -> VerifiedSuggestions:
        """``suggestions`` (e.g. ``report.suggestions()``) and what the simulation finds by itself,
        each measured before it is offered (see ``verify.py``); ``nan_metric`` names the modules
        whose equalization metric is NaN. Computed once per session."""
        return self.parts.verification.verified(suggestions, nan_metric, progress)

    # ---- diagnosis (diagnosis.py), on the simulation ----------------------------------------------
    def simulation(self, progress: Progress | None = None) -> Simulation:
        """The starting configuration calibrated once, as a simulation in which modules can be kept
        float without calibrating again (checked against the real baseline when first built)."""
        return self.parts.diagnosis.simulation(progress)

    def simulate(self, float_modules: Variant | Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric with ``float_modules`` kept float (or in a Variant)."""
        return self.parts.diagnosis.simulate(float_modules)

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | None = None,
        desc: str = "simulating",
        metric: bool = True,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each variant; see ``Simulated.simulate_each``."""
        return self.parts.diagnosis.simulate_each(variants, progress, desc, metric)

    def sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which module hurts, one module at a time: the output SQNR gained when each module alone
        stays float, simulated; see ``Diagnosis.sensitivity``. Warns when the simulation does not
        match the real model."""
        return self._warned(self.parts.diagnosis.sensitivity(progress, metric=metric))

    def block_sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which block (``model.layers.3``) hurts: each kept float whole, simulated; see ``Diagnosis.block_sensitivity``."""
        return self._warned(self.parts.diagnosis.block_sensitivity(progress, metric=metric))

    def blocks(self) -> dict[str, list[str]]:
        """The session's modules grouped by the numbered block that holds them (``model.layers.3`` of
        a decoder, ``layer1.0`` of a ResNet; a module in none is its own), forward order: the blocks
        ``block_sensitivity``, ``reach(by_block=True)`` and ``fit(by_block=True)`` work with (they
        take the modules there is something to choose for). Nothing is computed."""
        return module_blocks(m.fqn for m in self.modules)

    def block_sqnr(self, run: RunResult, batch: int = 0) -> pd.Series:
        """Each block's output SQNR (dB) in ``run``'s model against the float model's (rotated as the
        run was: a rotation turns the residual stream, an SQNR does not change under it), on
        evaluation batch ``batch``: where along the model a real run's error grows, and what a
        rotation bought block by block. An ExecuTorch program is read inside the runtime (lowered
        again with the blocks' outputs tapped). Empty where the engine keeps no block (FX, PT2E)."""
        if not run.ok:
            raise InvalidSettingsError(f"block_sqnr() reads a run's model, and the run {run.label!r} failed: {run.error}")
        if not run.quantized_model:
            raise InvalidSettingsError(
                f"block_sqnr() reads a run's model, and the run {run.label!r} no longer holds it ({run.quantized_model!r})"
            )
        reference = self.float_model
        if run.rotation is not None:
            twin = self._rotated.get(run.rotation)
            reference = twin.float_model if twin is not None else rotate(self.float_model, run.rotation)
        data = self.eval_data
        if not 0 <= batch < len(data):
            raise IndexError(f"batch {batch} of {len(data)} evaluation batches")
        with torch.no_grad():
            return self.engine.block_sqnr(reference, run.quantized_model, data[batch])

    def format_sensitivity(self, progress: Progress | None = None) -> pd.DataFrame:
        """What each format costs where (eager engine); see ``Diagnosis.format_sensitivity``."""
        return self._warned(self.parts.diagnosis.format_sensitivity(progress))

    def tradeoff(self, progress: Progress | None = None) -> pd.DataFrame:
        """The one-at-a-time ranking's modules kept float one after the other, simulated (not the
        in-context search: see ``search_path()``); see ``Diagnosis.tradeoff``."""
        return self._warned(self.parts.diagnosis.tradeoff(progress))

    def plan_reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        progress: Progress | None = None,
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone; see ``Diagnosis.plan_reach``."""
        target_metric, _ = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        return self.parts.diagnosis.plan_reach(target_sqnr_db, target_metric, by_block=by_block, progress=progress)

    def reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        progress: Progress | None = None,
    ) -> RunResult:
        """The fewest modules kept float that meet the target, each picked by what it gains given the
        picks before (the in-context search), confirmed by a real run; ``by_block=True``: the fewest
        blocks (``blocks()``), each kept float whole; see ``Diagnosis.reach``.

        The metric's target is ``target_metric`` (absolute), or relative to the float model's metric
        (``float_metric()``): ``max_metric_loss=0.01`` lets it be at most 1% worse (lower accuracy,
        higher perplexity), ``max_metric_gap=0.5`` at most 0.5 worse in its own units."""
        target_metric, how = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        run = self.parts.diagnosis.reach(target_sqnr_db, target_metric, by_block=by_block, progress=progress)
        return run if how is None else self.parts.real.annotated(run.noted(how))

    def search_path(self) -> pd.DataFrame:
        """The last ``reach()``'s in-context search as a table: each step's modules, its gain given
        the steps before, the cumulative simulated output SQNR, and the real run's SQNR at the
        chosen point; see ``SearchPath.frame``."""
        return self.parts.diagnosis.search_path()

    # ---- mixed precision (mixed.py), on the simulation --------------------------------------------
    def pareto(self, progress: Progress | None = None, *, by_block: bool = False) -> pd.DataFrame:
        """The size front of per-module choices, smallest first, each point better than every smaller
        one: ``size_bytes`` (deployed), ``simulated_output_sqnr_db``, ``simulated_metric`` (with
        ``eval_fn``), ``formats`` and ``settings`` (for ``apply``). Simulated, computed once; see
        ``mixed.py``. ``by_block=True``: every module of a block (``blocks()``) takes the same choice."""
        return self._warned(self.parts.mixed.front(progress, by_block).points.copy())

    def uniform_points(self, progress: Progress | None = None, *, by_block: bool = False) -> pd.DataFrame:
        """The same choice on every module that offers it (``all float``, ``all int4-weight-only
        (group 32)`` ...) and the baseline, simulated as ``pareto()`` rows, indexed by label
        (computed with ``pareto(by_block=...)``'s front)."""
        return self.parts.mixed.front(progress, by_block).uniform.copy()

    def fit(
        self,
        max_size_bytes: float | None = None,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        rotation: Rotation | bool | None = None,
        progress: Progress | None = None,
    ) -> RunResult:
        """A real run of the size front's best point within ``max_size_bytes`` (deployed bytes), or
        of its smallest point that meets ``target_sqnr_db`` / ``target_metric`` (within the budget
        when both are given). When the real run misses (too large, or short of the target) the next
        point along the front is run, up to three more runs; the notes say met, not met or out of
        reach, and by how far. ``by_block=True``: on the front where every module of a block
        (``blocks()``) takes the same choice. ``max_metric_loss`` / ``max_metric_gap``: a metric
        target relative to the float model's, as in ``reach``.

        ``rotation``: weigh the float model rotated (``Rotation()``, or True for R1 + R2) against
        not, as one more choice: the rotated model's own front is simulated on a session of its own
        (kept for the next fit), and the fit runs first on the front whose starting point the
        simulation ranks better (the target met at fewer bytes, else the better metric within the
        budget). When that fit's real run fits the budget and meets the target, it is returned and
        the other front was weighed in simulation only; else the other fit runs too and the better
        real run is returned. Rotated runs are recorded here as rotated; the notes name the other."""
        target_metric, how = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        if rotation is True:
            rotation = Rotation()
        if rotation and self.rotation_problems():
            raise InvalidSettingsError(f"fit(rotation=...) on a model the rotations do not apply to: {self.rotation_problems()}")
        goal = (max_size_bytes, target_sqnr_db, target_metric)
        if not rotation:
            run = self.parts.mixed.fit(*goal, progress, by_block)
        else:
            twin = self._rotated_session(rotation)
            fronts = (self.parts.mixed.front(progress, by_block), twin.parts.mixed.front(progress, by_block))

            def rotated_apply(settings: Mapping[str, ModuleSettings], **given: Any) -> RunResult:
                return self.parts.real.apply(settings, rotation=rotation, **given)

            def rotated_fit() -> RunResult:
                return self.parts.real.annotated(fit(rotated_apply, fronts[1], *goal, progress, self.metric))

            def plain_fit() -> RunResult:
                return self.parts.mixed.fit(*goal, progress, by_block)

            run = self.parts.real.annotated(weighed_fit(plain_fit, rotated_fit, fronts, rotation, *goal, self.metric))
        return run if how is None else self.parts.real.annotated(run.noted(how))

    def _rotated_session(self, rotation: Rotation) -> QuantizationSession:
        """A session on the float model with ``rotation`` folded in, the same data, metric and engine
        options (its simulation is the rotated model's); made once per rotation."""
        if rotation not in self._rotated:
            runner = self.parts.runner
            self._rotated[rotation] = QuantizationSession(
                rotate(self.float_model, rotation),
                self.example_inputs,
                self.calibration_data,
                self.eval_data,
                eval_fn=runner.eval_fn,
                metric=runner.metric,
                engine=self.engine.renewed(),
                output_fn=runner.output_fn,
            )
        return self._rotated[rotation]

    def computed(self) -> dict[str, pd.DataFrame]:
        """The diagnoses computed so far, without computing any: ``sensitivity``, ``tradeoff`` and
        ``size_front`` (the ``pareto()`` table), where they were asked for (the HTML export shows them)."""
        return {**self.parts.diagnosis.computed(), **self.parts.mixed.computed()}

    def _warned(self, found: T) -> T:
        self.parts.real.warn_if_unverified()
        return found
