"""Suggestions and user overrides -> QConfigMapping and equalization mapping."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.ao.quantization import QConfig, QConfigMapping
from torch.ao.quantization.fx._equalize import default_equalization_qconfig
from torch.ao.quantization.observer import (
    default_dynamic_quant_observer,
    default_observer,
    default_per_channel_weight_observer,
    default_weight_observer,
)

from .detectors.base import Suggestion
from .features import SuggestionKind
from .graph import Unit

_NO_PER_CHANNEL = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class ModuleSettings:
    """The per-module choices a user can accept or override."""

    dynamic: bool = False
    per_channel: bool = False
    equalize: bool = False
    keep_float: bool = False


class InvalidSettingsError(ValueError):
    pass


def validate(unit: Unit, settings: ModuleSettings) -> None:
    """Refuse combinations FX cannot convert, with the reason."""
    if settings.dynamic and not unit.is_linear:
        raise InvalidSettingsError(f"{unit.fqn}: dynamic quantization needs a Linear layer, not {unit.type_name}")
    if settings.per_channel and (isinstance(unit.base, _NO_PER_CHANNEL) or not (unit.is_linear or unit.is_conv)):
        raise InvalidSettingsError(f"{unit.fqn}: per-channel weights need a Linear or Conv layer, not {unit.type_name}")
    if settings.equalize and not (unit.is_linear or unit.is_conv):
        raise InvalidSettingsError(f"{unit.fqn}: input-weight equalization needs a Linear or Conv layer")


def qconfig_for(settings: ModuleSettings) -> QConfig | None:
    """The QConfig PyTorch's ModelReport builds for the same choices (None keeps the layer float)."""
    if settings.keep_float:
        return None
    activation = default_dynamic_quant_observer if settings.dynamic else default_observer
    weight = default_per_channel_weight_observer if settings.per_channel else default_weight_observer
    return QConfig(activation=activation, weight=weight)


def suggested_settings(units: Iterable[Unit], suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]:
    """Per-module settings with every suggestion accepted, for the given units (in their order)."""
    kinds: dict[str, set[SuggestionKind]] = {}
    for suggestion in suggestions:
        kinds.setdefault(suggestion.module_fqn, set()).add(suggestion.kind)
    settings = {}
    for unit in units:
        chosen = kinds.get(unit.fqn, set())
        settings[unit.fqn] = ModuleSettings(
            dynamic=SuggestionKind.DYNAMIC in chosen,
            per_channel=SuggestionKind.PER_CHANNEL in chosen or _already_per_channel(unit),
            equalize=SuggestionKind.EQUALIZATION in chosen,
        )
    return settings


def build_qconfig_mapping(settings: Mapping[str, ModuleSettings], base: QConfigMapping | None = None) -> QConfigMapping:
    """``base`` (copied, never changed) with one module-name entry per module in ``settings``."""
    mapping = copy.deepcopy(base) if base is not None else QConfigMapping()
    for fqn, choice in settings.items():
        mapping.set_module_name(fqn, qconfig_for(choice))
    return mapping


def build_equalization_mapping(settings: Mapping[str, ModuleSettings]) -> QConfigMapping:
    mapping = QConfigMapping()
    for fqn, choice in settings.items():
        if choice.equalize and not choice.keep_float:
            mapping.set_module_name(fqn, default_equalization_qconfig)
    return mapping


def _already_per_channel(unit: Unit) -> bool:
    from .detectors.per_channel import _uses_per_channel

    qconfig = getattr(unit.module, "qconfig", None)
    return qconfig is not None and _uses_per_channel(qconfig)
