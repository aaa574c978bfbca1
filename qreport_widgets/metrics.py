"""Numbers that compare a quantized model's outputs with its float original, whatever made it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """10 log10(signal power / noise power); inf for an exact match, NaN for an all-zero signal."""
    reference, approximation = reference.double(), approximation.double()
    signal = float(reference.pow(2).sum())
    noise = float((reference - approximation).pow(2).sum())
    if noise == 0:
        return math.inf if signal > 0 else math.nan
    return 10 * math.log10(signal / noise) if signal > 0 else math.nan


def output_tensor(output: Any) -> torch.Tensor:
    """A model's output as one float tensor: tensors, or tuples, lists, dicts or dataclasses of them."""
    if isinstance(output, torch.Tensor):
        return output.detach().float()
    if isinstance(output, (tuple, list)):
        return torch.cat([output_tensor(o).flatten() for o in output if isinstance(o, (torch.Tensor, tuple, list))])
    if isinstance(output, dict):
        return torch.cat([output_tensor(v).flatten() for v in output.values()])
    if dataclasses.is_dataclass(output):  # model-output classes of transformer libraries, say
        fields = [getattr(output, f.name) for f in dataclasses.fields(output)]
        return torch.cat([output_tensor(v).flatten() for v in fields if isinstance(v, (torch.Tensor, tuple, list, dict))])
    raise TypeError(
        f"cannot compare model outputs of type {type(output).__name__}: return tensors, or tuples, lists, dicts "
        "or dataclasses of them"
    )
