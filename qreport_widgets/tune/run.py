"""RunResult: one prepare -> calibrate -> convert run and what it measured."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..engines.settings import ModuleSettings
from ..errors import CheckpointError, ModelReleasedError

# save_pretrained without tokenizer=: the call says what to pass (a checkpoint without one loads, and cannot be served)
_ASK = object()


@dataclass(frozen=True)
class Change:
    """What a run changed on one module, against its starting settings: ``what`` names each
    setting turned on (``per_channel``, ``format=int4-weight-only``) or off (``no dynamic``)."""

    module: str
    what: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"{self.module}: {', '.join(self.what)}"


@dataclass(frozen=True, eq=False)
class RunResult:
    """One prepare -> calibrate -> convert run and what it measured (field names are public API).

    Built once, never changed: a relabelled or annotated copy is ``dataclasses.replace(run, ...)``.
    Two runs are equal only when they are the same run (their tables do not compare as values).
    ``notes`` are about the run as a whole; ``module_notes`` say per module what the run did not
    carry out of its settings.
    """

    config: Any  # the engine's configuration of this run
    # the model this run made; a ReleasedModel once a later run replaced it (see ReleasedModel)
    quantized_model: torch.nn.Module | ReleasedModel | None
    output_sqnr_db: float
    per_layer_sqnr_db: pd.Series
    size_bytes: int
    latency_ms: float  # median time per evaluation batch on one thread, after a warm-up, in ms
    duration_s: float
    error: str | None = None
    label: str = ""
    mean_batch_sqnr_db: float = math.nan
    quantized_layers: int = 0
    eval_metric: float | None = None
    eval_batches: str = ""
    summary: pd.DataFrame = field(default_factory=pd.DataFrame)
    conversions: pd.DataFrame = field(default_factory=pd.DataFrame)
    notes: tuple[str, ...] = ()  # what could not be measured, and why; what the numbers need said
    settings: Mapping[str, ModuleSettings] | None = None  # what apply() was given (None for run())
    latency_spread_ms: float = math.nan  # slowest minus fastest evaluation batch, in ms
    module_notes: Mapping[str, str] = field(default_factory=dict)  # module -> what the run did not carry out
    # module -> its quantized kernel's SQNR against its reference on the same input (truth.py); empty where
    # the run did not check (a run after a baseline whose kernels all agree, quantizing nothing new)
    kernel_sqnr_db: pd.Series = field(default_factory=lambda: pd.Series(dtype=float, name="kernel SQNR (dB)"))
    # the weights as a deployed (packed) layout stores them: int4 at 4 bits where this process keeps
    # them unpacked in int8 (eager engine), one byte per int8 value and four per scale (sizes.py). 0 for a failed run
    deployed_bytes: int = 0
    baseline: bool = False  # the starting configuration's run (session.baseline())
    rotation: Any = None  # the engines.rotation.Rotation folded into the float weights first, or None

    def __post_init__(self) -> None:
        # a run's own copies: nothing a caller keeps changes it later
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "module_notes", dict(self.module_notes))
        if self.settings is not None:
            object.__setattr__(self, "settings", dict(self.settings))

    @property
    def qconfig_mapping(self) -> Any:
        """The FX engine's QConfigMapping of this run, None for another engine (``config`` is the
        whole configuration; FX's carries its mappings under these names)."""
        return getattr(self.config, "qconfig_mapping", None)

    @property
    def equalization_mapping(self) -> Any:
        """The FX engine's input-weight equalization mapping of this run, if any."""
        return getattr(self.config, "equalization_mapping", None)

    def changed(self, start: Mapping[str, ModuleSettings]) -> tuple[Change, ...] | None:
        """What this run's settings change from ``start`` (each module's starting settings), one
        Change per module changed, after a rotation of the float model's weights if it had one; None
        for a run of a hand-written configuration (``run()``)."""
        if self.settings is None:
            return None
        found = [] if self.rotation is None else [Change("the float model", (f"rotated: {self.rotation.words}",))]
        for fqn, choice in self.settings.items():
            before = start.get(fqn)
            if before is None or choice == before:
                continue
            if choice.keep_float:  # what it was quantized with no longer matters
                found.append(Change(fqn, ("keep_float",)))
                continue
            values = {f.name: getattr(choice, f.name) for f in fields(choice)}
            words = [
                name if value is True else f"{name}={value}"
                for name, value in values.items()
                if value != getattr(before, name) and value not in (False, "")
            ]
            undone = [
                "was float" if name == "keep_float" else f"no {name}"
                for name, value in values.items()
                if value in (False, "") and getattr(before, name)
            ]
            found.append(Change(fqn, (*words, *undone)))
        return tuple(found)

    def changes(self, start: Mapping[str, ModuleSettings]) -> str:
        """``changed(start)`` in words, as the runs table shows it."""
        return changes_text(self.changed(start))

    @property
    def ok(self) -> bool:
        return self.error is None

    def noted(self, *notes: str) -> RunResult:
        """A copy with ``notes`` added to the run-level notes."""
        return replace(self, notes=(*self.notes, *notes))

    def save_pretrained(
        self,
        path: str | os.PathLike,
        tokenizer: Any = _ASK,
        overwrite: bool = False,
        quant_method: str = "compressed-tensors",
    ) -> Path:
        """This run's model as a Hugging Face checkpoint folder, which transformers loads
        (``from_pretrained``): an eager-engine run on the x86 target. ``quant_method``:
        ``"compressed-tensors"``, the pack-quantized form llm-compressor writes for vLLM (int4 / int8
        weight-only modules; needs the ``checkpoint`` extra), or ``"torchao"``, the form transformers
        saves a ``TorchAoConfig`` model in (every format, int8 dynamic activations too; int4 values
        one to a byte, as torchao holds them on x86). ``engines/eager/checkpoint.py`` says what each
        holds and refuses. ``tokenizer``: the model's tokenizer, written beside it (None: none). An
        existing ``path`` is kept unless ``overwrite``; nothing is half written."""
        if tokenizer is _ASK:
            raise CheckpointError(
                "save_pretrained(path, tokenizer=...): pass the tokenizer the model was loaded with "
                "(AutoTokenizer.from_pretrained(...)), or tokenizer=None to write the weights and config alone"
            )
        if not self.ok:
            raise CheckpointError(f"run {self.label!r} failed ({self.error}): it has no model to write")
        if isinstance(self.quantized_model, ReleasedModel):
            raise CheckpointError(f"run {self.label!r}'s model was released: {self.quantized_model.why}")
        writer = getattr(self.config, "save_pretrained", None)  # the engine's configuration says how, where it can
        if writer is None:
            raise CheckpointError(
                f"run {self.label!r} is not the eager engine's: a checkpoint holds torchao's int4 / int8 formats "
                "(analyze(..., engine='eager'))"
            )
        return writer(self.quantized_model, path, tokenizer, overwrite, quant_method)


class ReleasedModel:
    """Where a run's quantized model was: a session keeps the quantized models of its latest run and
    of the runs pinned with ``session.keep(run)``, and releases the others' (their measurements stay).

    Any use of it (an attribute, a call) raises ModelReleasedError saying when it was released and
    how to keep a model; it is falsy, so ``if run.quantized_model:`` reads as "still here".
    """

    __slots__ = ("_why",)

    def __init__(self, label: str, why: str) -> None:
        object.__setattr__(self, "_why", f"the quantized model of {label!r} was released {why}")

    @property
    def why(self) -> str:
        return object.__getattribute__(self, "_why")

    def _refuse(self) -> ModelReleasedError:
        return ModelReleasedError(
            f"{self.why}. Its measurements are all still in the run; for the model itself, pin the run "
            "before the next one (session.keep(run), or Pin in the Tune tab) or apply its settings again "
            "(session.apply(run.settings))"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):  # copy, pickle, pandas probing: not there
            raise AttributeError(name)
        raise self._refuse()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<{self.why}>"


def changes_text(changed: Sequence[Change] | None) -> str:
    """A run's changes in words: "fc1: per_channel; fc2: keep_float"."""
    if changed is None:
        return HAND_WRITTEN
    return "; ".join(c.text for c in changed) or NO_CHANGE


HAND_WRITTEN = "a hand-written mapping"
NO_CHANGE = "the starting settings"
