"""The units of a ``torch.export`` graph: modules are gone there, so a unit is the run of ops that
``nn_module_stack`` attributes to one leaf module (or one ``torch.nn`` module, such as
MultiheadAttention), read from its first outside input to its first output used outside it; the
float model's module objects give types and weights."""

from __future__ import annotations

import copy

import torch
import torch.fx
from torch import nn

from ...observe.graph import ModelGraph, Unit, leaf_module_name


def exported_graph(
    model: torch.fx.GraphModule, float_model: nn.Module, per_channel_weights: dict[str, bool] | None = None
) -> ModelGraph:
    """The units of a ``torch.export`` graph of ``float_model`` (whose modules give types and
    weights); ``per_channel_weights`` says how the starting quantizer quantizes each module's weights."""
    modules = dict(float_model.named_modules())
    graph = ModelGraph(model, modules=modules, per_channel_weights=dict(per_channel_weights or {}))
    groups: dict[str, list[torch.fx.Node]] = {}
    position = {node: i for i, node in enumerate(model.graph.nodes)}
    for node in model.graph.nodes:
        fqn = leaf_module_name(node)
        if fqn is not None and fqn in modules and _is_observable(modules[fqn]):
            groups.setdefault(fqn, []).append(node)
    for fqn, nodes in groups.items():
        members = set(nodes)
        output = next((n for n in nodes if any(u not in members for u in n.users)), nodes[-1])
        first = next((a for n in nodes for a in n.all_input_nodes if a not in members and a.op != "get_attr"), None)
        module = _with_graph_weights(model, modules[fqn], nodes)
        graph.units[fqn] = Unit(fqn, output, module, position[output], input=first)
    graph.units = dict(sorted(graph.units.items(), key=lambda item: item[1].order))
    for fqn, module in modules.items():
        if fqn and fqn not in graph.units and next(module.children(), None) is None:
            owner = next((u for u in graph.units if fqn.startswith(f"{u}.")), None)
            if owner:
                why = f"runs inside {owner} ({graph.units[owner].type_name}), which is observed as a whole"
            elif isinstance(module, nn.modules.batchnorm._BatchNorm):
                why = "folded into the conv before it, as every PT2E run folds it (that conv's output is observed)"
            else:
                why = "torch.export left no op of its own for it (traced away, or never called)"
            graph.skipped[fqn] = why
    return graph


def _with_graph_weights(model: torch.fx.GraphModule, module: nn.Module, nodes: list[torch.fx.Node]) -> nn.Module:
    """``module``, or a shallow copy holding the weight and bias its op reads in the graph where the
    graph's differ (a batch norm folded into a conv)."""
    for node in nodes:
        found = {}
        for name, arg in zip(("weight", "bias"), node.args[1:3], strict=False):  # a bias may be absent
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                owner, _, attribute = str(arg.target).rpartition(".")
                found[name] = getattr(model.get_submodule(owner) if owner else model, attribute)
        current = getattr(module, "weight", None)
        if "weight" in found and isinstance(current, torch.Tensor) and found["weight"] is not current:
            if found["weight"].shape == current.shape and not torch.equal(found["weight"], current):
                copied = copy.copy(module)
                copied._parameters = dict(module._parameters)  # the original keeps its own
                for name, value in found.items():
                    copied._parameters[name] = nn.Parameter(value.detach(), requires_grad=False)
                return copied
    return module


def _is_observable(module: nn.Module) -> bool:
    """A leaf module, or a torch.nn module whose insides torch.export does not attribute to children."""
    return next(module.children(), None) is None or type(module).__module__.startswith("torch.nn.modules")
