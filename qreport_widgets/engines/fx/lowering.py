"""``convert_fx`` that keeps float what the QConfigMapping keeps float.

torch lowers its reference model by pattern: any module of a type it knows (PReLU, LayerNorm,
Softmax, Hardswish, ReLU, pooling, ...) that sits between a dequantize and a quantize is replaced by
its quantized kernel or made to run on the quantized tensor, whatever its qconfig says. So a
``set_module_name("prelu", None)`` between two quantized convs is not kept float: LayerNorm and
Softmax are quantized anyway, and PReLU fails in ``PReLU.from_reference`` on the missing qconfig.
Hiding such modules behind a type the lowering does not know, for the length of the conversion,
keeps them float; they are put back unchanged afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.ao.quantization.quantize_fx import convert_fx

from ...core.calibration import torch_warnings_hidden
from ...core.histograms import searches_kept
from ...core.memory import models_forgotten

__all__ = ["convert_fx_keeping_float", "float_by_mapping", "replace_submodule"]


class _KeptFloat(nn.Module):
    """A float module the lowering must not recognise; calls it unchanged."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def float_by_mapping(prepared: torch.fx.GraphModule) -> list[str]:
    """The modules ``prepared`` calls whose qconfig is None: the mapping keeps them float."""
    found = []
    for node in prepared.graph.nodes:
        if node.op != "call_module":
            continue
        module = prepared.get_submodule(str(node.target))
        if hasattr(module, "qconfig") and module.qconfig is None and str(node.target) not in found:
            found.append(str(node.target))
    return found


def convert_fx_keeping_float(prepared: torch.fx.GraphModule, **kwargs: Any) -> torch.fx.GraphModule:
    """``convert_fx(prepared, **kwargs)`` with every module whose qconfig is None left float.

    Use it instead of ``convert_fx`` when a QConfigMapping sets a PReLU, LayerNorm, Softmax or
    another element-wise module to None: plain ``convert_fx`` quantizes those anyway (or fails).
    Like ``convert_fx`` it converts ``prepared`` in place and returns the quantized model.
    """
    hidden = float_by_mapping(prepared)
    for name in hidden:
        replace_submodule(prepared, name, _KeptFloat(prepared.get_submodule(name)))
    with torch_warnings_hidden(), models_forgotten(), searches_kept():
        quantized = convert_fx(prepared, **kwargs)
    for model in {id(prepared): prepared, id(quantized): quantized}.values():  # convert_fx may return a new module
        for name in hidden:
            wrapper = model.get_submodule(name)
            if isinstance(wrapper, _KeptFloat):
                replace_submodule(model, name, wrapper.module)
    return quantized


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``name`` of ``model``."""
    owner, _, child = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, child, module)
