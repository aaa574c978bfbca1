"""What torch's Numeric Suite FX and the converted graph say about a quantized FX model."""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any

import pandas as pd
import torch
import torch.ao.ns._numeric_suite_fx as ns
from torch.ao.ns.fx import graph_matcher
from torch.ao.ns.fx.mappings import get_unmatchable_types_map
from torch.ao.ns.fx.utils import compute_sqnr

from ...core.calibration import call_with, torch_warnings_hidden
from ...observe.graph import ModelGraph
from ..contract import conversion_tables

_QUANTIZED_NAMESPACES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized", "torch.nn.quantized")
_MULS = {torch.mul, operator.mul, torch.ops.quantized.mul, torch.ops.quantized.mul_relu}


def per_layer_sqnr(float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
    """Output SQNR of every layer torch's Numeric Suite FX matches between the two models, on one
    batch (a layer called more than once: its first call).

    The quantized model runs first and each matched layer keeps its first output (quantized: one
    byte a value); the float model then compares each layer's output with it as the forward pass
    reaches the layer and lets it go, so no float copy of the batch's activations is ever held."""
    # input-weight equalization adds a float mul before each equalized layer that the float model
    # lacks, so muls are left out of the matching on both sides (squeeze-excitation gates and layer
    # scales become quantized muls that would otherwise pair with the wrong float op)
    unmatchable = get_unmatchable_types_map()
    unmatchable["funs_unmatchable"] = unmatchable["funs_unmatchable"] | _MULS
    with torch_warnings_hidden(), _cached_reversed_fusions():
        # add_loggers builds new GraphModules around the same submodules; neither model is changed
        logged_float, logged_quantized = ns.add_loggers(
            "float", float_model, "quantized", quantized, _ComparingLogger, unmatchable_types_map=unmatchable
        )
        kept = {logger.pair: logger for logger in _loggers(logged_quantized)}
        compared = [logger for logger in _loggers(logged_float) if logger.pair in kept]
        for logger in compared:
            logger.partner = kept[logger.pair]
        with torch.no_grad():
            for logger in kept.values():
                logger.keeping = True
            call_with(logged_quantized, batch)
            call_with(logged_float, batch)
    modules = {n.name: str(n.target) for n in getattr(quantized, "graph", torch.fx.Graph()).nodes if n.op == "call_module"}
    values, named = {}, set()
    for logger in compared:  # per layer, its first output as Numeric Suite orders them
        if logger.ref_name in named or logger.sqnr is None:
            continue
        named.add(logger.ref_name)
        partner = logger.partner
        name = partner.fqn or logger.fqn or modules.get(partner.ref_node_name, partner.ref_node_name)
        values[name] = logger.sqnr
    return pd.Series(values, name="SQNR (dB)", dtype=float)


class _ComparingLogger(ns.OutputLogger):
    """On the quantized side (``keeping``), keeps a copy of the layer's first output (a copy: an
    in-place op after the layer, ``Hardswish(inplace=True)`` or ``x.relu_()``, would overwrite it);
    on the float side, compares the layer's first output with its ``partner``'s and drops that."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keeping = False
        self.partner: _ComparingLogger | None = None
        self.first: Any = None
        self.seen = False
        self.sqnr: float | None = None

    @property
    def pair(self) -> tuple[Any, ...]:
        return self.ref_name, self.results_type, self.index_of_arg, self.index_within_arg

    def forward(self, x: Any) -> Any:
        if self.seen or not self.enabled:
            return x
        self.seen = True
        if self.keeping:
            self.first = _copied(x)
        elif self.partner is not None and self.partner.first is not None:
            sqnr = compute_sqnr(_copied(x), self.partner.first)
            self.partner.first = None
            if sqnr is not None:
                self.sqnr = float(torch.as_tensor(sqnr).mean())
        return x


def _loggers(model: torch.nn.Module) -> list[_ComparingLogger]:
    return [module for module in model.modules() if isinstance(module, _ComparingLogger)]


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v) for v in value)
    return value


@contextlib.contextmanager
def _cached_reversed_fusions():
    """Numeric Suite's graph matcher rebuilds the (constant) native fusion list for every subgraph it
    looks at, which is most of an Apply's metric time on small models; compute it once instead."""
    original = graph_matcher.get_reversed_fusions
    cached = functools.lru_cache(maxsize=1)(original)
    graph_matcher.get_reversed_fusions = cached
    try:
        yield
    finally:
        graph_matcher.get_reversed_fusions = original


def _converted_name(module: Any) -> str:
    """A converted module's class with what makes it differ from the float class of the same name
    (torch's quantized ConvReLU2d is also called ConvReLU2d)."""
    if module is None:
        return "(folded away)"
    path, name = type(module).__module__, type(module).__name__
    if ".dynamic" in path:
        return f"dynamic quantized {name}"
    if ".reference" in path:
        return f"reference {name}"
    return f"quantized {name}" if ".quantized" in path else name


def quantization_summary(prepared: torch.fx.GraphModule, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per original layer type: total / quantized / float; and per module: float type -> converted type.

    Only layers with weights are counted (Linear, Conv, norms, ...): element-wise modules keep their
    type and simply run on whatever tensors reach them.
    """
    graph = ModelGraph.of(prepared)
    rows = []
    for fqn, unit in graph.units.items():
        if unit.weight is None:
            continue
        try:
            converted = quantized.get_submodule(fqn)
        except AttributeError:
            converted = None
        kind = f"{type(converted).__module__}.{type(converted).__name__}" if converted is not None else "(folded away)"
        rows.append(
            {
                "module": fqn,
                "float type": unit.type_name,
                "converted type": _converted_name(converted),
                "quantized": kind.startswith(_QUANTIZED_NAMESPACES),
            }
        )
    return conversion_tables(rows)
