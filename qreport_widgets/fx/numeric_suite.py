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

from ..calibration import call_with, torch_warnings_hidden
from ..graph import ModelGraph
from ..run import conversion_tables

_QUANTIZED_NAMESPACES = ("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized", "torch.nn.quantized")
_MULS = {torch.mul, operator.mul, torch.ops.quantized.mul, torch.ops.quantized.mul_relu}


def per_layer_sqnr(float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
    """Output SQNR of every matched layer, from torch's Numeric Suite FX on one batch."""
    # input-weight equalization adds a float mul before each equalized layer that the float model
    # lacks, so muls are left out of the matching on both sides (squeeze-excitation gates and layer
    # scales become quantized muls that would otherwise pair with the wrong float op)
    unmatchable = get_unmatchable_types_map()
    unmatchable["funs_unmatchable"] = unmatchable["funs_unmatchable"] | _MULS
    with torch_warnings_hidden(), _cached_reversed_fusions():
        # add_loggers builds new GraphModules around the same submodules; neither model is changed
        logged_float, logged_quantized = ns.add_loggers(
            "float", float_model, "quantized", quantized, _CopyingLogger, unmatchable_types_map=unmatchable
        )
        with torch.no_grad():
            call_with(logged_float, batch)
            call_with(logged_quantized, batch)
        results = ns.extract_logger_info(logged_float, logged_quantized, _CopyingLogger, "quantized")
        ns.extend_logger_results_with_comparison(results, "float", "quantized", compute_sqnr, "sqnr")
        ns.maybe_add_missing_fqns(results)
    modules = {n.name: str(n.target) for n in getattr(quantized, "graph", torch.fx.Graph()).nodes if n.op == "call_module"}
    values = {}
    for layer, by_type in results.items():
        for entries in by_type.values():
            info = entries["quantized"][0]
            name = info.get("fqn") or modules.get(info.get("ref_node_name", layer), layer)
            values[name] = float(torch.as_tensor(info["sqnr"][0]).mean())
    return pd.Series(values, name="SQNR (dB)", dtype=float)


class _CopyingLogger(ns.OutputLogger):
    """Numeric Suite's logger keeps a reference to each layer's output; an in-place op after the layer
    (``Hardswish(inplace=True)``, ``x.relu_()``) then overwrites what was logged. This one keeps a copy."""

    def forward(self, x):
        if self.enabled and self.save_activations and isinstance(x, torch.Tensor):
            self.stats.append(x.detach().clone())
            return x
        return super().forward(x)


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
