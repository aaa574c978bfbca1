"""Reading a PT2E graph: its Linear / Conv ops per module, how each was converted, their outputs on
a batch, and one op's own error (its quantized form on the float model's input)."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.fx
from torch.fx.node import map_arg

from ...core.calibration import call_with
from ...core.histograms import searches_kept
from ...core.memory import models_forgotten
from ...observe.graph import leaf_module_name
from ..settings import ModuleSettings
from .quantizer import torchao_pt2e

WEIGHTED_OPS = frozenset({"aten.linear.default", "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default"})
OBSERVER_PREFIX = "activation_post_process"


@contextmanager
def pt2e_warnings_hidden() -> Iterator[None]:
    """torch's and torchao's own warnings hidden (per-module configs and observers warn on every
    call); the package's own warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch(ao)?(\.|$)")
        warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)  # copying an exported module
        yield


def weighted_ops(model: torch.fx.GraphModule, last: bool = True) -> dict[str, torch.fx.Node]:
    """Module name -> its Linear / Conv op (the last one it ran, or the first), in graph order."""
    found: dict[str, torch.fx.Node] = {}
    for node in model.graph.nodes:
        if node.op == "call_function" and str(node.target) in WEIGHTED_OPS:
            fqn = leaf_module_name(node)
            if fqn is not None and (last or fqn not in found):
                found[fqn] = node
    return found


def observer_nodes(model: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """prepare_pt2e's observer nodes."""
    return [n for n in model.graph.nodes if n.op == "call_module" and str(n.target).startswith(OBSERVER_PREFIX)]


def convert(prepared: torch.nn.Module) -> torch.fx.GraphModule:
    """``convert_pt2e`` of ``prepared`` (which it consumes), torchao's warnings hidden.

    ``convert_pt2e`` looks for quantization-aware-training conv -> batch norm patterns whenever a
    batch norm is left in the graph, by exporting about a hundred pattern graphs (24 s per convert
    on tests/zoo.py's DenseNet, whose batch norms precede their convs). A ``prepare_pt2e`` graph
    has no such pattern (its conv -> batch norm pairs were folded when it was prepared), so the
    search is skipped; the converted model is the same (tested).
    """
    from torchao.quantization.pt2e import quantize_pt2e

    with pt2e_warnings_hidden(), models_forgotten(), searches_kept():
        if not callable(getattr(quantize_pt2e, "_fold_conv_bn_qat", None)):
            return torchao_pt2e().convert_pt2e(prepared)
        with mock.patch.object(quantize_pt2e, "_fold_conv_bn_qat", _unchanged):
            return torchao_pt2e().convert_pt2e(prepared)


def _unchanged(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    return model


def eval_only(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Let ``model.eval()`` work on a graph exported in eval mode (torch.export refuses the call).

    The graph already computes as in eval mode, so ``eval()`` changes nothing; torchao's
    ``allow_exported_model_train_eval`` would rewrite dropout and batch norm patterns on every call
    (0.8 s per call on a ResNet-18 layout, exporting its patterns each time). Training is refused.
    """

    def eval_(self: torch.nn.Module) -> torch.nn.Module:
        return self

    def train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        if mode:
            raise RuntimeError("this graph was exported in eval mode and cannot be trained; export the model again")
        return self

    model.eval = types.MethodType(eval_, model)
    model.train = types.MethodType(train, model)
    return model


@contextmanager
def observers_paused(prepared: torch.nn.Module, keep: set[str] = frozenset()) -> Iterator[None]:
    """prepare_pt2e's observers (but those named in ``keep``) return their input without recording
    it while the context is open."""
    names = (str(node.target) for node in observer_nodes(prepared))
    observers = (prepared.get_submodule(name) for name in names if name not in keep)
    paused = list({id(observer): observer for observer in observers}.values())  # one module may serve several nodes
    for observer in paused:
        observer.forward = _identity
    try:
        yield
    finally:
        for observer in paused:
            del observer.forward


def _identity(x: Any) -> Any:
    return x


class _Recorder(torch.nn.Module):
    def __init__(self, store: dict[str, Any], key: str) -> None:
        super().__init__()
        self.store, self.key = store, key

    def forward(self, x: Any) -> Any:
        self.store[self.key] = x
        return x


@contextmanager
def recording(model: torch.fx.GraphModule, nodes: Mapping[str, torch.fx.Node]) -> Iterator[dict[str, Any]]:
    """While open, each call of ``model`` stores the value of ``nodes[key]`` under ``key``; the graph
    is restored on exit."""
    store: dict[str, Any] = {}
    added = []
    for index, (key, node) in enumerate(nodes.items()):
        name = f"_qreport_recorder_{index}"
        model.add_module(name, _Recorder(store, key))
        with model.graph.inserting_after(node):
            added.append((name, model.graph.call_module(name, (node,))))
    model.recompile()
    try:
        yield store
    finally:
        for name, node in added:
            model.graph.erase_node(node)
            delattr(model, name)
        model.recompile()


def layer_outputs(model: torch.fx.GraphModule, batch: Any) -> dict[str, torch.Tensor]:
    """Module name -> the output of its (last) Linear / Conv op on ``batch``."""
    with recording(model, weighted_ops(model)) as store, torch.no_grad():
        call_with(model, batch)
    return dict(store)


def layer_inputs_and_outputs(model: torch.fx.GraphModule, batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Module name -> the activation its (last) Linear / Conv op reads, and the op's output."""
    ops = weighted_ops(model)
    nodes = {f"out:{fqn}": node for fqn, node in ops.items()}
    nodes.update({f"in:{fqn}": node.args[0] for fqn, node in ops.items() if isinstance(node.args[0], torch.fx.Node)})
    with recording(model, nodes) as store, torch.no_grad():
        call_with(model, batch)
    inputs = {key[3:]: value for key, value in store.items() if key.startswith("in:")}
    outputs = {key[4:]: value for key, value in store.items() if key.startswith("out:")}
    return inputs, outputs


def is_quantize_op(node: Any) -> bool:
    """A quantize / dequantize / choose_qparams op (or the getitem that unpacks qparams)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = str(node.target)
    return target.startswith("quantized_decomposed.") or (
        "getitem" in target and isinstance(node.args[0], torch.fx.Node) and is_quantize_op(node.args[0])
    )


def op_on(model: torch.fx.GraphModule, node: torch.fx.Node, activation: torch.Tensor) -> torch.Tensor:
    """``node`` (a Linear / Conv op of a converted graph) evaluated on ``activation`` in place of the
    tensor its quantize -> dequantize chain reads: the op's own error, nothing accumulated before it."""
    source = node.args[0]
    while is_quantize_op(source):
        source = source.args[0]
    values: dict[torch.fx.Node, Any] = {source: activation}

    def value(arg: torch.fx.Node) -> Any:
        if arg not in values:
            if arg.op == "get_attr":
                values[arg] = _attr(model, str(arg.target))
            elif arg.op == "call_function":
                values[arg] = arg.target(*map_arg(arg.args, value), **map_arg(arg.kwargs, value))
            else:
                raise LookupError(f"{node.name} depends on {arg.op} {arg.name} beyond its own quantize ops")
        return values[arg]

    with torch.no_grad():
        return node.target(*map_arg(node.args, value), **map_arg(node.kwargs, value))


def _attr(model: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


@dataclass(frozen=True)
class ConvertedLayer:
    """How one weighted module ended up in a converted PT2E graph."""

    weight: str  # "per-channel", "per-tensor" or "float"
    activation: str  # "static", "dynamic" or "float"

    def matches(self, settings: ModuleSettings) -> bool:
        """Whether the graph carries out ``settings`` (a silent no-op does not)."""
        if settings.keep_float:  # a float op may read a tensor the op before it quantized at its output
            return self.weight == "float"
        wanted = "per-channel" if settings.per_channel else "per-tensor"
        return self.weight == wanted and self.activation == ("dynamic" if settings.dynamic else "static")


def converted_layers(converted: torch.fx.GraphModule) -> dict[str, ConvertedLayer]:
    """Module name -> how its linear / conv op was converted, read from the q/dq ops around it."""
    return {
        fqn: ConvertedLayer(weight=_weight_kind(node.args[1]), activation=_activation_kind(node.args[0]))
        for fqn, node in weighted_ops(converted).items()
    }


def _weight_kind(weight: object) -> str:
    target = str(getattr(weight, "target", ""))
    if "dequantize_per_channel" in target:
        return "per-channel"
    return "per-tensor" if "dequantize_per_tensor" in target else "float"


def _activation_kind(activation: object) -> str:
    target = str(getattr(activation, "target", ""))
    if "dequantize_per_tensor.tensor" in target:  # qparams computed from the tensor at run time
        return "dynamic"
    return "static" if "dequantize_per_tensor" in target else "float"
