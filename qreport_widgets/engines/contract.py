"""The contract between the engine-neutral core and one quantization workflow.

An engine is one package (``fx/``, ``pt2e/``, ``eager/``) with one ``Engine`` subclass and its own
options type (``Engine.options_type``), registered by name in the registry (``engines/__init__.py``).
The analysis asks it what to observe (``observe``); the session asks it to prepare, convert and
measure; nothing outside the engine's package names its workflow. The abstract methods are what
every engine must do; the others have a default body that says what an engine without that
ability does, so the core never probes an engine or compares its name.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import pandas as pd
import torch
import torch.fx

from ..core.calibration import call_with
from ..core.memory import give_back
from ..core.progress import Progress
from ..errors import DecodeSpeedError
from .settings import ModuleSettings, Setting, TunableModule
from .sizes import packed_bytes, saved_bytes, weight_bytes

if TYPE_CHECKING:
    from ..observe.graph import ModelGraph
    from .executorch import DecodeSpeed

ConfigT = TypeVar("ConfigT")


# the old bag of every engine's options, to be removed once callers use build_engine:
@dataclass(frozen=True)
class Observation:
    """What the analysis instruments: ``model`` (a GraphModule the report's observers go into, or a
    model run eagerly whose ``graph`` maps its modules' tensors, observed by hooks), ``graph_of``
    (how its units and channel axes are read) and the tunable modules of the start."""

    model: torch.nn.Module
    graph_of: Callable[[Any], ModelGraph]
    modules: list[TunableModule]
    # ``replay(instrumented) -> bool``: feeds the report's observers what they would see on the example
    # inputs, from the pass ``observe`` already made on them (only when asked to ``record``); False when
    # it cannot (a tensor changed in place after it was seen), and the batch is then run as any other
    replay: Callable[[torch.nn.Module], bool] | None = None


@dataclass(frozen=True)
class RunNotes:
    """What a run's numbers need said: run-level lines, and per module what it did not carry out."""

    notes: tuple[str, ...] = ()
    module_notes: Mapping[str, str] = field(default_factory=dict)


class Engine(ABC, Generic[ConfigT]):
    """prepare -> (calibrate, done by the session) -> convert, what a run measures, and a simulation.

    ``ConfigT`` is the engine's own configuration (FX: a QConfigMapping and an equalization
    mapping; PT2E: a quantizer set-up); the core only passes it back to the engine.
    """

    name: ClassVar[str]  # the name analyze(engine=...) takes
    options_type: ClassVar[type[Any]]  # the engine's own options: a frozen dataclass (FxOptions, ...)
    options_hint: ClassVar[str]  # what build_engine says after refusing another engine's argument
    # every shortcut this engine's work takes also computes its answer afresh and raises where they
    # differ (``core.shortcuts``; analyze(..., check_shortcuts=True)); the environment can ask it too
    checks_shortcuts: bool = False

    @classmethod
    @abstractmethod
    def from_options(cls, options: Any) -> Engine[ConfigT]:
        """The engine built from ``options``, an instance of ``options_type``."""

    # ---- observation ----------------------------------------------------------------------------
    @abstractmethod
    def observe(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...], *, record: bool = False) -> Observation:
        """What the analysis instruments for ``float_model`` (which it must not change). ``record``: the
        example inputs are also the first calibration batch; an engine that runs them to observe may
        keep what it saw and give ``Observation.replay``, so calibration need not run them again."""

    # ---- configuration --------------------------------------------------------------------------
    @abstractmethod
    def base_config(self) -> ConfigT:
        """The starting configuration (what the baseline run uses)."""

    @abstractmethod
    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> ConfigT:
        """The starting configuration with ``settings`` (already validated) applied to those modules."""

    @abstractmethod
    def config_as_code(self, config: ConfigT) -> str:
        """Python that rebuilds ``config``, to paste into a pipeline."""

    def config_of_mapping(self, qconfig_mapping: Any, equalization_mapping: Any = None) -> ConfigT:
        """A configuration from a hand-written QConfigMapping (``session.run``). Default: refused,
        for engines that are not configured by QConfigMappings."""
        raise TypeError(f"run(qconfig_mapping) is for the FX engine; this session uses {self.name}: use apply(settings)")

    def qconfig_mapping_of(self, config: ConfigT) -> Any:
        """The QConfigMapping in ``config`` (``RunResult.qconfig_mapping``). Default: None."""
        return None

    def equalization_mapping_of(self, config: ConfigT) -> Any:
        """The equalization mapping in ``config`` (``RunResult.equalization_mapping``). Default: None."""
        return None

    # ---- the workflow ---------------------------------------------------------------------------
    @property
    def kernel_device(self) -> torch.device | None:
        """Where this engine's quantized models run: a real run of a model that lives elsewhere
        prepares, calibrates and converts a copy there, its batches moved one at a time. None: on the
        model's own device (default)."""
        return None

    def rotated_front_problem(self) -> str:
        """Why ``fit(rotation=...)`` cannot weigh a rotated model's size front on this engine; ""
        where it can. Default: the int4 formats and algorithms the rotation is weighed for are the
        eager engine's, which says "" here."""
        return (
            f"fit(rotation=...) weighs a rotated decoder's size front over the eager engine's int4 formats and "
            f"algorithms; on the {self.name} engine, measure a rotated run with apply(settings, rotation=...)"
        )

    def online_transform_problem(self) -> str:
        """Why a product computed as the model runs on a Linear's input (R4's Hadamard on
        ``down_proj``'s) cannot be measured by this engine's runs; "" where it can (default)."""
        return ""

    def online_rotation_problem(self) -> str:
        """Why a product computed as the model runs on a norm's output (R1 on a decoder whose blocks
        end in a norm: Gemma, OLMo 2) cannot be measured by this engine's runs; "" where it can (default)."""
        return ""

    def kernel_words(self) -> str:
        """What a real run measures with, for its notes when the model lives on another device than
        ``kernel_device`` ("the CPU's x86 kernels")."""
        return f"{self.name}'s kernels"

    @abstractmethod
    def prepare(self, float_model: torch.nn.Module, config: ConfigT, example_inputs: tuple[Any, ...]) -> torch.nn.Module:
        """A copy of ``float_model`` with observers, ready for calibration (``float_model`` is unchanged)."""

    @abstractmethod
    def tunable_modules(self, prepared: torch.nn.Module) -> list[TunableModule]:
        """The modules whose settings can be changed, in forward order, with what they do now."""

    @abstractmethod
    def convert(self, prepared: torch.nn.Module, progress: Progress | None = None) -> torch.nn.Module:
        """The quantized model of a calibrated prepared model. ``progress``: the stages of a
        conversion that has them (a program lowered for a phone: export, lowering, serialising),
        one step each; None, a bar naming them."""

    def calibrates(self, config: ConfigT) -> bool:
        """Whether a run with ``config`` needs the calibration data before ``convert``. Default:
        True (static activations observe it); an engine whose formats need none says False."""
        return True

    def computes_where_the_model_is(self, config: ConfigT) -> bool:
        """Whether a run with ``config`` whose model lives on another device than ``kernel_device``
        (a GPU) calibrates there, on the model's own weights and batches, and only then moves to
        the kernels' device (``relocated``): its calibration computes weights (GPTQ, the learned
        rounding) that are many times faster on the GPU and move as plain tensors. Default: False
        (observers are calibrated on a copy where the kernels are)."""
        return False

    def relocated(self, prepared: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """A calibrated ``prepared`` model as a copy on ``device``, with what its calibration found,
        ready for ``convert`` (``prepared`` is left as it is); for an engine that
        ``computes_where_the_model_is``."""
        raise NotImplementedError(f"the {self.name} engine calibrates where its kernels are")

    def calibration_passes(
        self, prepared: torch.nn.Module, progress: Progress | None = None, data_key: str | None = None
    ) -> Iterator[MutableMapping[str, Any] | None]:
        """The passes over the calibration data a run needs before ``convert``, when it
        ``calibrates``: the runner calibrates ``prepared`` once per item. An item is None, or what
        the pass gathers besides observers (name -> an object with ``merge_``), which the runner
        merges across torch.distributed ranks as it does observers. ``progress``: told of work the
        engine does between passes (it may raise to stop). ``data_key``: the calibration data's
        fingerprint (``Runner.calibration_key``; None where it has none), for what an engine keeps
        of one run's calibration for the next. Default: one pass, None."""
        yield None

    def observers_paused(self, prepared: torch.nn.Module) -> AbstractContextManager[None]:
        """The engine's own observers pass tensors through untouched while the context is open.
        Default: nothing to pause."""
        return nullcontext()

    # ---- what a run measures --------------------------------------------------------------------
    @abstractmethod
    def per_layer_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) of each layer's output, quantized model against float, on one batch."""

    @abstractmethod
    def conversions(self, prepared: torch.nn.Module, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(per layer type: total / quantized / float, per module: float type -> converted type)."""

    def stored_bytes(self, quantized: torch.nn.Module) -> int:
        """What storing the quantized model takes (``RunResult.size_bytes``). Default: the bytes
        ``torch.save`` writes for its state dict."""
        return saved_bytes(quantized)

    def deployed_bytes(self, quantized: torch.nn.Module) -> int:
        """The quantized model as a deployed (packed) layout stores it (``RunResult.deployed_bytes``).
        Default: its state dict counted by ``sizes.packed_bytes`` (int8 one byte, scales four)."""
        return packed_bytes(quantized)

    def decode_speed(self, quantized: torch.nn.Module, prompt: Sequence[int], new_tokens: int) -> DecodeSpeed:
        """How fast a run's decoder generates where it is deployed: ``prompt`` fed, ``new_tokens``
        generated greedily (``executorch.DecodeSpeed``). Default: not measured by this engine."""
        raise DecodeSpeedError(
            "decode speed is measured for Hugging Face decoders quantized for a phone: "
            "analyze(..., engine='eager', target='xnnpack')"
        )

    # ---- mixed precision (mixed.py) -------------------------------------------------------------
    def unbuildable(self, float_module: torch.nn.Module, choice: ModuleSettings) -> str:
        """Why the target cannot build ``float_module`` in ``choice`` (a size choice), "" where it can:
        a front never ranks a point that holds it. Default: "" (the engine's kernels take every choice
        it offers)."""
        return ""

    def size_choices(self, module: TunableModule) -> list[ModuleSettings]:
        """What the size front may give ``module``, its starting settings first: each changes its
        deployed size. Default (int8 engines): a quantized module with weights stays as it starts,
        or is kept float, or where it starts per-tensor takes per-channel weights; nothing for the
        others."""
        start = module.current
        if start.keep_float or not module.weighted:
            return []
        found = [start]
        if module.allows(Setting.KEEP_FLOAT):
            found.append(ModuleSettings(keep_float=True))
        if not start.per_channel and module.allows(Setting.PER_CHANNEL):
            found.append(replace(start, per_channel=True))
        return found if len(found) > 1 else []

    def module_bytes(self, float_module: torch.nn.Module, choice: ModuleSettings) -> int:
        """``float_module``'s weight as deployed with ``choice``, counted as ``deployed_bytes``
        counts it; only differences between choices matter. Default: ``sizes.weight_bytes``."""
        return weight_bytes(float_module, choice)

    def reference_model(self, prepared: torch.nn.Module) -> torch.nn.Module | None:
        """The reference quantized model of the calibrated ``prepared`` (float ops between quantize
        and dequantize, what the simulation follows), taken before ``convert``; ``prepared`` is not
        changed. Default: None, for an engine whose ``convert`` gives reference ops already."""
        return None

    def kernel_sqnr(self, reference: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) of each quantized module's real kernel against ``reference``'s module on the
        same quantized input, on one batch: low where a kernel computes something else than its
        reference. Default: empty (``reference_model`` gave None)."""
        return pd.Series(dtype=float, name="kernel SQNR (dB)")

    def renewed(self) -> Engine[ConfigT]:
        """A new engine of the same options, for a session of its own on another float model (``fit``
        weighing a rotated one). Default: refused, naming the engine."""
        raise NotImplementedError(f"{type(self).__name__} does not start a second session on another float model")

    def block_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at each block's output (a decoder's layers, ``module_blocks``) in ``quantized``
        against ``float_model``'s, on ``batch``: where along the model the error grows. Default:
        empty (a quantized model that keeps no block of the float model's)."""
        return pd.Series(dtype=float, name="SQNR (dB)")

    def inner_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at the outputs of the model's blocks as the real run computes them inside, where
        its per-layer SQNR reads another model (an ExecuTorch program: read off the eager model it was
        lowered from). Costs a lowering: the truth check asks it only where the real run and the
        simulation part. Default: empty (the per-layer SQNR is the real run's own)."""
        return pd.Series(dtype=float, name="SQNR (dB)")

    def per_layer_failure(self, error: Exception) -> str:
        """Why per-layer SQNR is missing when ``per_layer_sqnr`` raised ``error``, in words."""
        return f"the layers could not be read ({type(error).__name__})"

    def run_notes(self, config: ConfigT, quantized: torch.nn.Module) -> RunNotes:
        """What ``config`` asked that ``quantized`` does not do, per module (a silent no-op shown),
        and anything else the run's numbers need said. Default: nothing (an engine that carries
        out its configuration or raises)."""
        return RunNotes()

    def equalization_float_error(
        self,
        float_model: torch.nn.Module,
        config: ConfigT,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None],
        batch: Any,
    ) -> float:
        """How far input-weight equalization under ``config`` moves the float model's output
        (relative error on ``batch``; 0 when exact). Default: NaN, for engines without equalization."""
        return math.nan

    # ---- the simulation -------------------------------------------------------------------------
    @abstractmethod
    def simulator(
        self,
        prepared: torch.nn.Module,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None],
        data_key: Callable[[], str | None] | None = None,
    ) -> Simulation:
        """From ``prepared`` (``float_model`` prepared with the starting configuration, calibrated): a
        simulation in which any set of ``modules`` can be kept float without calibrating again
        (``calibrate(model)`` runs the calibration data, for variants that observe something new;
        ``data_key()`` gives its fingerprint as ``calibration_passes`` takes it)."""


@dataclass(frozen=True)
class Variant:
    """One configuration to simulate, relative to the starting one: modules kept float, modules
    whose weights are quantized with the other scheme (per channel where they start per tensor, or
    the reverse), on an engine with formats modules given other settings (module, settings), and
    where the engine offers them, modules with another activation observer or dynamic activations."""

    float_modules: frozenset[str] = frozenset()
    other_weights: frozenset[str] = frozenset()
    settings: frozenset[tuple[str, ModuleSettings]] = frozenset()
    observers: frozenset[tuple[str, str]] = frozenset()  # (module, activation observer of its output)
    dynamic: frozenset[str] = frozenset()  # modules whose input is quantized per batch (dynamic activations)

    @staticmethod
    def of(variant: Variant | Iterable[str]) -> Variant:
        """A Variant as is; any other iterable as the names of the modules kept float."""
        return variant if isinstance(variant, Variant) else Variant(frozenset(variant))


Reduce = Callable[[int, Any], Any]  # (batch index, a simulated output) -> what to keep of it


class WholePasses:
    """``outputs`` and ``outputs_each`` of a simulation whose ``configure(variant)`` makes ``model``
    the variant's model, run as whole forward passes (PT2E, eager)."""

    model: torch.nn.Module

    def configure(self, variant: Variant | Iterable[str] = ()) -> None:
        raise NotImplementedError

    def rest(self) -> None:
        """Nothing to drop (see ``Simulation.rest``)."""

    def outputs(self, batches: Sequence[Any], variant: Variant | Iterable[str] = ()) -> list[Any]:
        return self.outputs_each(batches, [variant])[0]

    def outputs_each(
        self,
        batches: Sequence[Any],
        variants: Sequence[Variant | Iterable[str]],
        step: Callable[[], None] | None = None,
        reduce: Reduce | None = None,
    ) -> list[list[Any]]:
        found: list[list[Any]] = [[] for _ in variants]
        self.before_passes(variants)
        for position in self.pass_order(variants):
            self.configure(variants[position])
            outputs = []
            with torch.no_grad(), self.passes(batches) as at:
                for index, batch in enumerate(batches):
                    at(index)
                    output = call_with(self.model, batch)
                    outputs.append(output if reduce is None else reduce(index, output))
                    if step is not None:
                        step()
            found[position] = outputs
            give_back()  # the variant's freed weights and activations
        return found

    def before_passes(self, variants: Sequence[Variant | Iterable[str]]) -> None:
        """What ``outputs_each`` readies for all of ``variants`` before their passes (here nothing)."""

    def pass_order(self, variants: Sequence[Variant | Iterable[str]]) -> list[int]:
        """The order to run ``variants`` in (positions); ``outputs_each`` returns them in theirs."""
        return list(range(len(variants)))

    @contextmanager
    def passes(self, batches: Sequence[Any]) -> Iterator[Callable[[int], None]]:
        """Around one variant's passes over ``batches``, as configured: what is told the index of
        each batch before its pass (here nothing; the eager engine's replay starts them late)."""
        yield lambda index: None


class Simulation(Protocol):
    """The starting configuration calibrated once, in which modules can be switched per Variant."""

    model: torch.nn.Module  # the simulated model as last configured
    tunable: Sequence[str]  # the modules diagnosis ranks, in forward order (a Variant may keep any tunable module float)
    others: Sequence[str]  # the other ops a Variant may keep float (not ranked: their kernel agrees), forward order

    def configure(self, variant: Variant | Iterable[str] = ()) -> None:
        """Make ``model`` the simulated model of ``variant``."""

    def outputs(self, batches: Sequence[Any], variant: Variant | Iterable[str] = ()) -> list[Any]:
        """The simulated model's outputs on ``batches`` under ``variant``."""

    def outputs_each(
        self,
        batches: Sequence[Any],
        variants: Sequence[Variant | Iterable[str]],
        step: Callable[[], None] | None = None,
        reduce: Reduce | None = None,
    ) -> list[list[Any]]:
        """``outputs(batches, v)`` for each variant; ``step()`` after each variant and batch. With
        ``reduce``, each output is replaced by ``reduce(batch index, output)`` as soon as it exists,
        so that only what that keeps stays alive (a decoder's logits, for dozens of variants, would
        not fit)."""

    def local_sqnr(self, batch: Any) -> dict[str, float]:
        """Each tunable module's own error (dB): quantized, on the float model's input to it."""

    def rest(self) -> None:
        """Drop what is rebuilt on the next ``configure`` (a real run is about to start); ``model``
        may compute something else until then."""

    def run_real_kernels(self, quantized: torch.nn.Module, names: Iterable[str]) -> list[str]:
        """Compute the modules ``names`` with ``quantized``'s kernels instead of their reference
        (where the real kernels disagree with it); the names it now runs real kernels for."""


def conversion_tables(rows: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """From one row per layer ("module", "float type", "converted type", "quantized"): per float
    type the layers in all, quantized and left float; and the rows as a table."""
    conversions = pd.DataFrame(rows, columns=["module", "float type", "converted type", "quantized"])
    summary = (
        conversions.groupby("float type", sort=False)["quantized"]
        .agg(total="size", quantized="sum")
        .assign(float=lambda df: df["total"] - df["quantized"])
        .reset_index()
    )
    return summary, conversions
