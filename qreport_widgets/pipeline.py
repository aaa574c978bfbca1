"""The torch steps every run shares: prepare_fx on a copy, with errors that say what to try."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.fake_quantize import FakeQuantizeBase
from torch.ao.quantization.observer import ObserverBase
from torch.ao.quantization.quantize_fx import prepare_fx

from .errors import QReportWarning, UntraceableModelError


def prepare(
    float_model: torch.nn.Module, qconfig_mapping: QConfigMapping, example_inputs: tuple[Any, ...], **kwargs: Any
) -> torch.fx.GraphModule:
    """``prepare_fx`` on a deep copy, with tracing failures turned into an error that says what to try.

    ``kwargs`` go to ``prepare_fx`` (``prepare_custom_config``, ``_equalization_config``, ...).
    Observers prepare_fx puts on integer or bool tensors (a padding mask, token ids) are taken out:
    torch's observers cannot run on them, and such tensors are never quantized.
    """
    model = copy.deepcopy(float_model).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            prepared = prepare_fx(model, qconfig_mapping, example_inputs, **kwargs)
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError, RuntimeError, AttributeError) as error:
        where = _user_frame(error)
        raise UntraceableModelError(
            f"torch.fx could not trace {type(float_model).__name__}: {type(error).__name__}: {error}{where}\n"
            "FX traces with symbolic values, so Python control flow that depends on tensor values "
            "(if x.sum() > 0, loops over x.shape[0] ...) cannot be traced. Options: pass "
            "prepare_custom_config=PrepareCustomConfig().set_non_traceable_module_names([...]) or "
            ".set_non_traceable_module_classes([...]) to keep the offending submodule as one opaque call, "
            "fix input-dependent arguments with concrete_args, or move the branch out of forward()."
        ) from error
    _drop_observers_on_non_float(prepared, example_inputs)
    return prepared


class _DtypeProbe(torch.fx.Interpreter):
    """Runs the prepared graph on the example inputs without calling torch's observers, noting the
    dtype that reaches each of them."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.dtypes: dict[torch.fx.Node, torch.dtype] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op == "call_module" and isinstance(self.module.get_submodule(node.target), (ObserverBase, FakeQuantizeBase)):
            value = self.env[node.args[0]] if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                self.dtypes[node] = value.dtype
            return value
        return super().run_node(node)


def _drop_observers_on_non_float(prepared: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> None:
    probe = _DtypeProbe(prepared)
    try:
        with torch.no_grad():
            probe.run(*example_inputs)
    except Exception:  # the example inputs do not run: calibration will say which batch and why
        return
    removed = [node for node, dtype in probe.dtypes.items() if not (dtype.is_floating_point or dtype.is_complex)]
    for node in removed:
        source = node.args[0]
        node.replace_all_uses_with(source)
        prepared.graph.erase_node(node)
        delattr(prepared, node.target)
        warnings.warn(
            f"{source.name}: prepare_fx put an observer on a {str(probe.dtypes[node]).removeprefix('torch.')} tensor "
            "(produced by this node); it was removed, since such tensors are not quantized",
            QReportWarning,
            stacklevel=3,
        )
    if removed:
        prepared.recompile()


def _user_frame(error: BaseException) -> str:
    """' (at file:line)' for the deepest traceback frame outside torch, if there is one."""
    tb, found = error.__traceback__, ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "qreport_widgets" not in filename:
            found = f" (at {filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found
