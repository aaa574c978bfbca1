"""Whether torch's quantized kernels compute what their reference says, module by module.

``convert_fx`` lowers the reference quantized model (float ops between quantize and dequantize) to
torch's int8 kernels; the simulation and every estimate built on it follow the reference. Most
kernels agree with it to a rounding step. Some do not: torch's quantized PReLU applies the slope
to positive inputs too, so a PReLU model converts to garbage while its reference is fine. Here each
quantized module's real output is compared with its reference module on the very same quantized
input (not the error accumulated from earlier layers), which names the module whose kernel differs.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.ao.quantization.quantize_fx import convert_to_reference_fx

from ...core.calibration import call_with, torch_warnings_hidden
from ...core.histograms import searches_kept
from ...core.memory import models_forgotten, shared_copy
from ...core.metrics import sqnr_db

_KERNEL_NAMESPACES = ("torch.ao.nn.quantized.modules", "torch.ao.nn.intrinsic.quantized.modules")


def reference_model(prepared: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The reference quantized model of a calibrated ``prepare_fx`` model (which is not changed)."""
    with torch_warnings_hidden(), models_forgotten(), searches_kept():
        return convert_to_reference_fx(shared_copy(prepared))


def kernel_sqnr(reference: torch.fx.GraphModule, quantized: nn.Module, batch: Any) -> pd.Series:
    """SQNR (dB) of each quantized module's kernel against its reference module, both on the
    quantized input the kernel received on ``batch``, the reference's output quantized with the
    kernel's output qparams. A kernel that agrees scores 35-60 dB (rounding); one that differs, far less."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if len(args) == 1 and _quantized(args[0]) and _quantized(output):
                seen.setdefault(name, (args[0], output))

        return hook

    hooks = [
        module.register_forward_hook(record(name))
        for name, module in quantized.named_modules()
        if name and type(module).__module__.startswith(_KERNEL_NAMESPACES)
    ]
    try:
        with torch.no_grad(), torch_warnings_hidden():
            call_with(quantized, batch)
    finally:
        for hook in hooks:
            hook.remove()
    values = {}
    with torch.no_grad(), torch_warnings_hidden():
        for name, (x, y) in seen.items():
            try:
                module = reference.get_submodule(name)
            except AttributeError:
                continue
            expected = module(x.dequantize())
            if not isinstance(expected, torch.Tensor) or expected.shape != y.shape:
                continue
            expected = torch.quantize_per_tensor(expected, y.q_scale(), y.q_zero_point(), y.dtype).dequantize()
            values[name] = sqnr_db(expected, y.dequantize())
    return pd.Series(values, name="kernel SQNR (dB)", dtype=float)


def _quantized(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_quantized and value.qscheme() == torch.per_tensor_affine
