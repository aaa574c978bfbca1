"""Per-module settings -> FX's QConfigMapping and equalization mapping, and back to Python code."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.ao.quantization import QConfig, QConfigMapping
from torch.ao.quantization.fx._equalize import default_equalization_qconfig
from torch.ao.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    default_dynamic_quant_observer,
    default_observer,
    default_per_channel_weight_observer,
    default_weight_observer,
)

from ...core.calibration import torch_warnings_hidden
from ...observe.detectors.per_channel import uses_per_channel
from ...observe.graph import ModelGraph, Unit, is_quantization_observer
from ..settings import ModuleSettings, Setting, TunableModule
from .observers import PercentileObserver

_NO_PER_CHANNEL = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class FxConfig:
    """What ``prepare_fx`` takes: a QConfigMapping and, optionally, an input-weight equalization mapping."""

    qconfig_mapping: QConfigMapping
    equalization_mapping: QConfigMapping | None = None

    def as_code(self) -> str:
        """Python that rebuilds this configuration's module entries (``mapping_as_code``)."""
        return mapping_as_code(self.qconfig_mapping, self.equalization_mapping)


@dataclass(frozen=True)
class FunctionalOp:
    """A quantized functional op (an add, a mul, ...): where ``set_module_name_object_type_order``
    finds it (the module it runs in, its function, its index among that function's calls there),
    its QConfig, and its node's name in the prepared graph."""

    scope: str
    target: Callable[..., Any]
    index: int
    qconfig: QConfig
    node_name: str


_FUNCTIONAL = (operator.add, torch.add, operator.mul, torch.mul, torch.cat, operator.matmul, torch.matmul, torch.bmm)


def tunable_modules(graph: ModelGraph) -> list[TunableModule]:
    """What of a prepare_fx model can be tuned, in forward order, with its current QConfig: every
    Linear and Conv; every other module whose output FX quantizes (PReLU, activations, pooling,
    norms, softmax); every quantized add, mul, cat and matmul (named ``<module>.add``,
    ``<module>.add_1``, ...). The last two can be kept float, nothing else."""
    found, units = [], {unit.node: unit for unit in graph.units.values()}
    attrs = graph.model.meta.get("_observed_graph_module_attrs")
    scopes = getattr(attrs, "node_name_to_scope", {}) or {}
    qconfigs = getattr(attrs, "node_name_to_qconfig", {}) or {}
    calls: dict[tuple[str, Any], int] = {}  # FX's count of a function's calls per module
    for node in graph.model.graph.nodes:
        unit = units.get(node)
        if unit is not None:
            if unit.is_linear or unit.is_conv:
                found.append(_tunable(unit))
            elif _output_observed(graph, unit):
                found.append(_float_choice(unit))
        elif node.op == "call_function" and node.name in scopes:
            scope = scopes[node.name][0]
            index = calls.get((scope, node.target), 0)
            calls[scope, node.target] = index + 1
            qconfig = qconfigs.get(node.name)
            if node.target in _FUNCTIONAL and qconfig is not None and _observed_around(graph, node):
                name = getattr(node.target, "__name__", str(node.target)) + (f"_{index}" if index else "")
                op = FunctionalOp(scope, node.target, index, qconfig, node.name)
                found.append(_float_choice_of(f"{scope}.{name}" if scope else name, name.split("_")[0], op))
    return found


def _observed_around(graph: ModelGraph, node: torch.fx.Node) -> bool:
    """Whether FX quantizes around a functional op: an observer reads its output or one of its inputs."""
    nodes = [*node.users, *node.all_input_nodes]
    return any(n.op == "call_module" and is_quantization_observer(graph.modules.get(str(n.target), nn.Identity())) for n in nodes)


def _output_observed(graph: ModelGraph, unit: Unit) -> bool:
    """Whether prepare_fx quantizes ``unit``'s output: it has a qconfig and an observer reads it."""
    if getattr(unit.module, "qconfig", None) is None:
        return False
    return any(
        user.op == "call_module" and is_quantization_observer(graph.modules.get(str(user.target), nn.Identity()))
        for user in unit.node.users
    )


def _float_choice(unit: Unit) -> TunableModule:
    """A quantized op that is not a Linear or Conv: it can be kept float, nothing else."""
    return _float_choice_of(unit.fqn, unit.type_name, unit.module.qconfig)


def _float_choice_of(fqn: str, type_name: str, native: Any) -> TunableModule:
    why = f"{type_name} is quantized as a whole: it can be kept float, not tuned"
    unavailable = {setting: why for setting in Setting if setting is not Setting.KEEP_FLOAT}
    return TunableModule(fqn, type_name, ModuleSettings(), unavailable, native=native, weighted=False)


def _tunable(unit: Unit) -> TunableModule:
    qconfig = getattr(unit.module, "qconfig", None)
    current = (
        ModuleSettings(keep_float=True)
        if qconfig is None
        else ModuleSettings(dynamic=_is_dynamic(qconfig), per_channel=uses_per_channel(qconfig))
    )
    unavailable = {}
    if not unit.is_linear:
        unavailable["dynamic"] = f"dynamic quantization needs a Linear layer, not {unit.type_name}"
    if isinstance(unit.base, _NO_PER_CHANNEL):
        unavailable["per_channel"] = f"FX quantizes {unit.type_name} weights per tensor only"
    return TunableModule(unit.fqn, unit.type_name, current, unavailable, native=qconfig)


def qconfig_for(settings: ModuleSettings, current: QConfig | None = None) -> QConfig | None:
    """The QConfig for ``settings`` (None keeps the layer float).

    Without ``current`` it is the QConfig PyTorch's ModelReport builds for the same choices. With
    the module's current QConfig only what the settings change is replaced, so a suggestion is
    layered on top of the starting mapping instead of resetting the layer's observers.
    """
    if settings.keep_float:
        return None
    if current is None:
        activation = default_dynamic_quant_observer if settings.dynamic else default_observer
        if settings.observer and not settings.dynamic:
            activation = activation_observer(settings.observer, like=activation)
        weight = default_per_channel_weight_observer if settings.per_channel else default_weight_observer
        return QConfig(activation=activation, weight=weight)
    if settings.dynamic:
        activation = current.activation if _is_dynamic(current) else default_dynamic_quant_observer
    else:
        activation = default_observer if _is_dynamic(current) else current.activation
    if settings.observer and not settings.dynamic:
        activation = activation_observer(settings.observer, like=activation)
    if settings.per_channel:
        weight = current.weight if uses_per_channel(current) else default_per_channel_weight_observer
    else:
        weight = default_weight_observer if uses_per_channel(current) else current.weight
    return QConfig(activation=activation, weight=weight)


ACTIVATION_OBSERVERS = {"minmax": MinMaxObserver, "histogram": HistogramObserver, "percentile": PercentileObserver}


def activation_observer(name: str, like: Any) -> Any:
    """Observer ``name`` (a key of ACTIVATION_OBSERVERS) with the dtype and range of the factory ``like``."""
    if name not in ACTIVATION_OBSERVERS:
        raise ValueError(f"unknown activation observer {name!r}; pick one of {', '.join(ACTIVATION_OBSERVERS)}")
    keywords = getattr(getattr(like, "p", like), "keywords", {}) or {}
    kept = {k: v for k, v in keywords.items() if k in ("dtype", "qscheme", "reduce_range", "quant_min", "quant_max")}
    return ACTIVATION_OBSERVERS[name].with_args(**kept)


def build_qconfig_mapping(
    settings: Mapping[str, ModuleSettings],
    base: QConfigMapping | None = None,
    current: Mapping[str, QConfig | None] | None = None,
) -> QConfigMapping:
    """``base`` (copied, never changed) with one module-name entry per module in ``settings``.

    With ``current`` (module -> its QConfig today) the settings are layered on top of it.
    """
    mapping = copy.deepcopy(base) if base is not None else QConfigMapping()
    for fqn, choice in settings.items():
        now = (current or {}).get(fqn)
        if isinstance(now, FunctionalOp):  # an add, a mul ...: by module, function and call index
            mapping.set_module_name_object_type_order(now.scope, now.target, now.index, qconfig_for(choice, now.qconfig))
        else:
            mapping.set_module_name(fqn, qconfig_for(choice, now))
    return mapping


def build_equalization_mapping(settings: Mapping[str, ModuleSettings]) -> QConfigMapping:
    mapping = QConfigMapping()
    for fqn, choice in settings.items():
        if choice.equalize and not choice.keep_float:
            mapping.set_module_name(fqn, default_equalization_qconfig)
    return mapping


def mapping_as_code(mapping: QConfigMapping, equalization: QConfigMapping | None = None) -> str:
    """Python that rebuilds the module-name entries of ``mapping`` (to paste into a pipeline)."""
    lines = [
        "import torch",
        "from torch.ao.quantization import QConfig, get_default_qconfig_mapping",
        "from torch.ao.quantization.observer import *  # noqa: F403",
        "",
        "qconfig_mapping = get_default_qconfig_mapping('x86')  # or your starting mapping",
    ]
    outside = sorted({_outside_torch(getattr(q, "activation", None)) for q in mapping.module_name_qconfigs.values()} - {""})
    lines[3:3] = outside  # after torch's imports
    for fqn, qconfig in mapping.module_name_qconfigs.items():
        lines.append(f"qconfig_mapping.set_module_name({fqn!r}, {_qconfig_code(qconfig)})")
    ordered = mapping.module_name_object_type_order_qconfigs
    if ordered:
        lines.insert(1, "import operator")
    for (scope, target, index), qconfig in ordered.items():
        where = f"{scope!r}, {_callable_code(target)}, {index}"
        lines.append(f"qconfig_mapping.set_module_name_object_type_order({where}, {_qconfig_code(qconfig)})")
    if any(qconfig is None for qconfig in mapping.module_name_qconfigs.values()):
        lines += [
            "",
            "# torch's convert_fx quantizes a float PReLU, LayerNorm, Softmax, ... between quantized ops anyway",
            "# (and fails on PReLU); this convert keeps every module set to None float:",
            "from qreport_widgets.engines.fx.lowering import convert_fx_keeping_float",
            "# quantized = convert_fx_keeping_float(prepared)  # instead of convert_fx(prepared)",
        ]
    if equalization is not None and equalization.module_name_qconfigs:
        lines += [
            "",
            "from torch.ao.quantization import QConfigMapping",
            "from torch.ao.quantization.fx._equalize import default_equalization_qconfig",
            "equalization_mapping = QConfigMapping()",
        ]
        for fqn in equalization.module_name_qconfigs:
            lines.append(f"equalization_mapping.set_module_name({fqn!r}, default_equalization_qconfig)")
        lines.append("# prepare_fx(model, qconfig_mapping, example_inputs, _equalization_config=equalization_mapping)")
    return "\n".join(lines) + "\n"


def _qconfig_code(qconfig: QConfig | None) -> str:
    if qconfig is None:
        return "None"
    parts = [f"{name}={_observer_code(getattr(qconfig, name))}" for name in ("activation", "weight")]
    return f"QConfig({', '.join(parts)})"


def _callable_code(function: Callable[..., Any]) -> str:
    """``operator.add``, ``torch.cat``: the function as an expression after ``import operator, torch``."""
    name = function.__name__
    if getattr(operator, name, None) is function:
        return f"operator.{name}"
    if getattr(torch, name, None) is function:
        return f"torch.{name}"
    return f"{function.__module__}.{name}"


def _observer_code(factory) -> str:
    partial = getattr(factory, "p", factory)
    func = getattr(partial, "func", partial)
    keywords = {k: v for k, v in getattr(partial, "keywords", {}).items() if k != "factory_kwargs"}
    args = ", ".join(f"{k}={_value_code(v)}" for k, v in keywords.items())
    return f"{func.__name__}.with_args({args})" if args else func.__name__


def _outside_torch(factory) -> str:
    """The import line of an observer class that torch.ao.quantization.observer does not define."""
    func = getattr(getattr(factory, "p", factory), "func", None)
    if func is None or func.__module__ == "torch.ao.quantization.observer":
        return ""
    return f"from {func.__module__} import {func.__name__}"


def _value_code(value) -> str:
    if isinstance(value, (torch.dtype, torch.qscheme)):
        return f"torch.{str(value).removeprefix('torch.')}"
    return repr(value)


def _is_dynamic(qconfig: QConfig) -> bool:
    with torch_warnings_hidden():  # building an observer to ask makes torch warn about its arguments
        return bool(getattr(qconfig.activation(), "is_dynamic", False))
