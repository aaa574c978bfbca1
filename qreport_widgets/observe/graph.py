"""What a prepared FX model or an exported graph offers to observe: its modules, their tensors and
channel axes.

A *unit* is a module with its own ``call_module`` node, named as ``prepare_fx`` sees it: a fused
``ConvReLU2d`` is one unit ``conv`` (not ``conv.0``), and a leaf module that FX traced through has no
unit at all. In a ``torch.export`` graph modules are gone; a unit there is the run of ops that
``nn_module_stack`` attributes to one leaf module (or one ``torch.nn`` module, such as
MultiheadAttention), read from its first outside input to its first output used outside it
(``pt2e/graph.py`` reads those).
An observation point is a tensor (an FX node) plus the channel axis to read it along; a tensor
used by several units is observed once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn
from torch.ao.nn.intrinsic import _FusedModule
from torch.ao.quantization.fake_quantize import FakeQuantizeBase
from torch.ao.quantization.observer import ObserverBase

from ..core.features import Side

OBSERVER_CONTAINER = "model_report_observers"

_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CHANNEL_FIRST = (*_CONV_TYPES, nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
CHANNEL_LAST = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Bilinear, nn.Embedding, nn.EmbeddingBag)  # (..., features)


@dataclass(frozen=True)
class Unit:
    """One observable module of the prepared model."""

    fqn: str
    node: torch.fx.Node
    module: nn.Module
    order: int
    input: torch.fx.Node | None = None  # an exported graph's unit: the tensor it reads first

    @property
    def base(self) -> nn.Module:
        """The weighted module inside a fused unit, the unit itself otherwise."""
        return self.module[0] if isinstance(self.module, _FusedModule) else self.module

    @property
    def type_name(self) -> str:
        return type(self.module).__name__

    @property
    def is_linear(self) -> bool:
        return isinstance(self.base, nn.Linear)

    @property
    def is_conv(self) -> bool:
        return isinstance(self.base, _CONV_TYPES)

    @property
    def weight(self) -> torch.Tensor | None:
        weight = getattr(self.base, "weight", None)
        return weight if isinstance(weight, torch.Tensor) else None


@dataclass
class ModelGraph:
    """Units, skipped modules and axis rules of one prepared GraphModule."""

    model: torch.fx.GraphModule
    units: dict[str, Unit] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    # an exported graph carries no qconfig: module -> whether the starting quantizer quantizes its
    # weights per channel (modules it leaves float are absent); None for prepare_fx models
    per_channel_weights: dict[str, bool] | None = None
    # "graph": an FX or exported graph; "modules": a model run eagerly, its leaf modules in call
    # order, observed by hooks (no graph of ops)
    kind: str = "graph"

    @classmethod
    def of(cls, model: torch.fx.GraphModule) -> ModelGraph:
        modules = dict(model.named_modules(remove_duplicate=False))
        graph = cls(model, modules=modules)
        called: set[str] = set()
        for order, node in enumerate(model.graph.nodes):
            if node.op != "call_module" or node.target in called:
                continue
            module = modules.get(str(node.target))
            if module is None or is_quantization_observer(module) or str(node.target).startswith(OBSERVER_CONTAINER):
                continue
            called.add(str(node.target))
            graph.units[str(node.target)] = Unit(str(node.target), node, module, order)
        fused_children = {
            f"{fqn}.{child}"
            for fqn, unit in graph.units.items()
            if isinstance(unit.module, _FusedModule)
            for child, _ in unit.module.named_modules()
            if child
        }
        for fqn, module in modules.items():
            if not fqn or fqn in graph.units or fqn in fused_children or fqn.startswith(OBSERVER_CONTAINER):
                continue
            if is_quantization_observer(module) or next(module.children(), None) is not None:
                continue
            owner = next((u for u in graph.units if fqn.startswith(f"{u}.")), None)
            graph.skipped[fqn] = (
                f"runs inside {owner} ({graph.units[owner].type_name}), which is observed as a whole"
                if owner
                else "FX traced through it or it is never called: the graph has no call_module node for it"
            )
        return graph

    def op_counts(self) -> dict[str, int]:
        """FX node ops of the model as prepare_fx built it (observers of any kind left out); for a
        model run eagerly, its leaf modules called and the inputs they read from outside a module."""
        if self.kind == "modules":
            nodes = list(self.model.graph.nodes)
            return {
                "leaf modules called": sum(n.op == "call_module" for n in nodes),
                "inputs read from outside a module": sum(n.op == "placeholder" for n in nodes),
            }
        counts = dict.fromkeys(("placeholder", "get_attr", "call_function", "call_module", "call_method", "output"), 0)
        for node in self.model.graph.nodes:
            if node.op == "call_module" and _is_instrumentation_target(self.modules, str(node.target)):
                continue
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts

    def layer_type_counts(self) -> dict[str, int]:
        """How many units of each module type, most common first."""
        counts: dict[str, int] = {}
        for unit in self.units.values():
            counts[unit.type_name] = counts.get(unit.type_name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def dataflow(self) -> tuple[dict[str, tuple[str, str]], list[tuple[str, str]]]:
        """Which unit's output reaches which: ``(joins, edges)``.

        Ops outside the units are looked through (observers, reshapes, activations called as
        functions), except where two or more units' outputs meet (an ``add`` closing a residual, a
        ``cat``): such a join is a node of its own, named ``<node name>``, with its op and the module
        whose forward ran it (``joins``: id -> (op, parent module)). Edges are (from, to) pairs of
        unit names and join ids in forward order. A model run eagerly has edges where a leaf module
        reads another's output; a leaf that reads a tensor made outside any module follows the leaf
        called before it.
        """
        owner: dict[torch.fx.Node, str] = {}
        for node in self.model.graph.nodes:
            name = str(node.target) if node.op == "call_module" else leaf_module_name(node)
            if name is not None and name in self.units:
                owner[node] = name
        joins: dict[str, tuple[str, str]] = {}
        edges: dict[tuple[str, str], None] = {}
        reaching: dict[torch.fx.Node, frozenset[str]] = {}
        previous: str | None = None
        for node in self.model.graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                reaching[node] = frozenset()
                continue
            incoming = frozenset().union(*(reaching.get(a, frozenset()) for a in node.all_input_nodes))
            here = owner.get(node)
            if here is None and len(incoming) > 1 and not self._is_observer_call(node):
                here = f"<{node.name}>"
                joins[here] = (_op_name(node), _parent_module(node, incoming))
            if here is None:
                reaching[node] = incoming
                continue
            sources = incoming - {here}
            if not sources and self.kind == "modules" and previous is not None and previous != here:
                sources = frozenset({previous})
            for source in sorted(sources, key=self._position):
                edges[(source, here)] = None
            reaching[node] = frozenset({here})
            previous = here if here in self.units else previous
        return joins, list(edges)

    def _position(self, name: str) -> int:
        unit = self.units.get(name)
        return unit.order if unit is not None else -1

    def _is_observer_call(self, node: torch.fx.Node) -> bool:
        return node.op == "call_module" and _is_instrumentation_target(self.modules, str(node.target))

    def input_node(self, unit: Unit) -> torch.fx.Node | None:
        """The tensor a unit reads first, looking through the observers prepare_fx inserted."""
        if unit.input is not None:
            return self._through_observers(unit.input)
        for arg in (*unit.node.args, *unit.node.kwargs.values()):
            if isinstance(arg, torch.fx.Node):
                return self._through_observers(arg)
        return None

    def point(self, unit: Unit, side: Side, ch_axis: int | None) -> tuple[torch.fx.Node, int] | None:
        node = unit.node if side is Side.OUTPUT else self.input_node(unit)
        if node is None:
            return None
        return node, self.default_axis(unit) if ch_axis is None else ch_axis

    def default_axis(self, unit: Unit) -> int:
        """Channel axis for a unit's tensors: Conv and norms over channels dim 1, Linear the last dim.

        Element-wise modules (ReLU, GELU, Dropout ...) take the axis of the layer that produced
        their input, so a GELU after a Linear on (batch, tokens, hidden) sees ``hidden`` channels.
        """
        module = unit.base
        if isinstance(module, CHANNEL_FIRST):
            return 1
        if isinstance(module, CHANNEL_LAST):
            return -1
        return self._producer_axis(self.input_node(unit))

    def _producer_axis(self, node: torch.fx.Node | None) -> int:
        modules = self.modules
        for _ in range(64):
            if node is None or node.op in ("placeholder", "get_attr"):
                return node.meta.get("channel_axis", 1) if node is not None else 1
            name = str(node.target) if node.op == "call_module" else leaf_module_name(node)
            if name is not None:
                module = modules.get(name)
                if isinstance(module, _FusedModule):
                    module = module[0]
                if isinstance(module, CHANNEL_FIRST):
                    return 1
                if isinstance(module, CHANNEL_LAST):
                    return -1
            node = next((a for a in node.args if isinstance(a, torch.fx.Node)), None)
        return 1

    def _through_observers(self, node: torch.fx.Node) -> torch.fx.Node:
        modules = self.modules
        while node.op == "call_module" and isinstance(modules.get(str(node.target)), ObserverBase):
            first = node.args[0] if node.args else None
            if not isinstance(first, torch.fx.Node):
                break
            node = first
        return node


def leaf_module_name(node: torch.fx.Node) -> str | None:
    """The innermost module an exported graph's op ran in (``nn_module_stack``), None outside any."""
    return _innermost_module(node) if node.op == "call_function" else None


def _innermost_module(node: torch.fx.Node) -> str | None:
    """The innermost module of the stack the tracer recorded for ``node``, None without one."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return str(list(stack.values())[-1][0]).split("@")[0]


def _op_name(node: torch.fx.Node) -> str:
    """``add`` for ``operator.add``, ``aten.add.Tensor`` and a ``.add`` method call alike."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return str(name).split(".")[0].strip("_") or str(name)


def _parent_module(node: torch.fx.Node, sources: frozenset[str]) -> str:
    """The module whose forward ran ``node``: its recorded module stack, else the deepest module
    every source lies in ("" for the model itself)."""
    recorded = _innermost_module(node)
    if recorded is not None:
        return recorded
    parts = [s.split(".")[:-1] for s in sources if not s.startswith("<")]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _is_instrumentation_target(modules: dict[str, nn.Module], target: str) -> bool:
    return target.startswith(OBSERVER_CONTAINER) or is_quantization_observer(modules.get(target, nn.Identity()))


def is_quantization_observer(module: nn.Module) -> bool:
    """An observer or fake-quantize module (prepare_fx's, or ours)."""
    return isinstance(module, (ObserverBase, FakeQuantizeBase))
