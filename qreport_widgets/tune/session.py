"""QuantizationSession: quantize a float copy again and again with other settings, and measure.

The session is a facade: each public method is one delegation to a part built once (``parts.py``)
from values (see the package's docstring); the questions answered on the simulation (sensitivity,
reach, the size front and fit) are its half in ``questions.py``. The caller's float model is never touched: the session's
copy shares its weights and refuses them once they were changed in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import pandas as pd
import torch

from ..core.calibration import CalibrationData
from ..core.metrics import Metric
from ..core.progress import Progress, shown
from ..engines import build_engine
from ..engines.contract import Engine
from ..engines.rotation import Rotation
from ..engines.settings import ModuleSettings, TunableModule, with_suggestions
from ..observe.records import Suggestion
from .migration import Migration, input_producers
from .parts import Analyzed, build_parts
from .questions import SimulatedQuestions
from .run import RunResult
from .truth import TruthCheck
from .verify import VerifiedSuggestions

if TYPE_CHECKING:
    from ..engines.executorch import DecodeSpeed

T = TypeVar("T")


class QuantizationSession(SimulatedQuestions):
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

    def untunable_weights(self) -> pd.DataFrame:
        """The weights no tunable module holds (they stay float whatever the settings: a mixture of
        experts' 3-d expert weights, a custom module's matrix), largest first, with their share of
        the model's weight bytes; ``analyze`` warns when they are more than 1% of them."""
        return self.parts.runner.untunable_weights()

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
    def baseline(self, progress: Progress | bool | None = None) -> RunResult:
        """The starting configuration's run, computed once, and checked against the simulation
        (``truth_check``): where they disagree its notes say so."""
        return self.parts.real.baseline(shown(progress))

    def apply(
        self,
        settings: Mapping[str, ModuleSettings],
        *,
        label: str | None = None,
        progress: Progress | bool | None = None,
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
        ``rotation=True`` is ``Rotation()``. ``label``: the run's name (None: ``run N``); a name a
        recorded run already has gets `` (2)``, `` (3)``... so that each names one run.
        """
        chosen = Rotation() if rotation is True else rotation or None
        return self.parts.real.apply(settings, label=label, progress=shown(progress), record=record, rotation=chosen)

    def rotation_problems(self) -> dict[str, str]:
        """Which rotations (``R1``, ``R2``) the float model does not take, each with why; empty: both apply."""
        return self.parts.rotations.problems()

    def run(
        self,
        qconfig_mapping: Any,
        equalization_mapping: Any = None,
        *,
        label: str | None = None,
        progress: Progress | bool | None = None,
    ) -> RunResult:
        """FX: prepare_fx with a QConfigMapping you wrote (and an equalization mapping) -> calibrate ->
        convert_fx -> metrics. Failures do not raise: the result carries ``error``. Other engines
        raise TypeError (use ``apply(settings)``)."""
        return self.parts.real.run_mapping(qconfig_mapping, equalization_mapping, label, shown(progress))

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

    def truth_check(self, progress: Progress | bool | None = None) -> TruthCheck:
        """The simulation against the real model on the starting configuration (see ``truth.py``):
        the gap, the modules whose quantized kernels differ from their reference, and whether the
        simulation, running those real kernels, now matches. Runs the baseline if needed."""
        return self.parts.real.truth(shown(progress))

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
        return self.parts.real.compare()

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
        self, suggestions: Iterable[Suggestion], *, nan_metric: Iterable[str] = (), progress: Progress | bool | None = None
    ) -> VerifiedSuggestions:
        """``suggestions`` (e.g. ``report.suggestions()``) and what the simulation finds by itself,
        each measured before it is offered (see ``verify.py``); ``nan_metric`` names the modules
        whose equalization metric is NaN. Computed once per session."""
        return self.parts.verification.verified(suggestions, nan_metric, shown(progress))
