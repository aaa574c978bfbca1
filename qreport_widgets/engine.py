"""The seam between the engine-neutral session and one quantization workflow: FX graph mode
(``fx.FxEngine``) or torchao's PT2E (``pt2e.engine.Pt2eEngine``).

A session asks its engine for exactly these steps and nothing else, so views, detectors and the
session never name a torch quantization API.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd
import torch

from .settings import ModuleSettings, TunableModule


class Engine(Protocol):
    """prepare -> (calibrate, done by the session) -> convert, plus what a run measures."""

    name: str

    def base_config(self) -> Any:
        """The starting configuration (what the baseline run uses)."""

    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> Any:
        """The starting configuration with ``settings`` (already validated) applied to those modules."""

    def prepare(self, float_model: torch.nn.Module, config: Any, example_inputs: tuple[Any, ...]) -> torch.nn.Module:
        """A copy of ``float_model`` with observers, ready for calibration (``float_model`` is unchanged)."""

    def observers_paused(self, prepared: torch.nn.Module) -> AbstractContextManager[None]:
        """The engine's own observers pass tensors through untouched while the context is open."""

    def tunable_modules(self, prepared: torch.nn.Module) -> list[TunableModule]:
        """The modules whose settings can be changed, in forward order, with what they do now."""

    def convert(self, prepared: torch.nn.Module) -> torch.nn.Module:
        """The quantized model of a calibrated prepared model."""

    def per_layer_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) of each layer's output, quantized model against float, on one batch."""

    def conversions(self, prepared: torch.nn.Module, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(per layer type: total / quantized / float, per module: float type -> converted type)."""

    def run_notes(self, config: Any, quantized: torch.nn.Module) -> list[str]:
        """What ``config`` asked that ``quantized`` does not do, one line per module (a silent no-op
        shown), and anything else the run's numbers need said."""

    def config_as_code(self, config: Any) -> str:
        """Python that rebuilds ``config``, to paste into a pipeline."""

    def simulator(
        self,
        prepared: torch.nn.Module,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None] | None = None,
    ) -> Simulation:
        """From ``prepared`` (``float_model`` prepared with the starting configuration, calibrated): a
        simulation in which any set of ``modules`` can be kept float without calibrating again
        (``calibrate(model)`` runs the calibration data, for variants that observe something new)."""


@dataclass(frozen=True)
class Variant:
    """One configuration to simulate, relative to the starting one: modules kept float, and modules
    whose weights are quantized with the other scheme (per channel where they start per tensor, or
    the reverse)."""

    float_modules: frozenset[str] = frozenset()
    other_weights: frozenset[str] = frozenset()

    @staticmethod
    def of(variant: Variant | Iterable[str]) -> Variant:
        """A Variant as is; any other iterable as the names of the modules kept float."""
        return variant if isinstance(variant, Variant) else Variant(frozenset(variant))


class Simulation(Protocol):
    model: torch.nn.Module  # the simulated model as last configured

    def configure(self, variant: Variant | Iterable[str] = ()) -> None: ...

    def outputs(self, batches: Sequence[Any], variant: Variant | Iterable[str] = ()) -> list[Any]: ...

    def outputs_each(
        self, batches: Sequence[Any], variants: Sequence[Variant | Iterable[str]], step: Callable[[], None] | None = None
    ) -> list[list[Any]]: ...

    def local_sqnr(self, batch: Any) -> dict[str, float]: ...
