"""How many bytes a quantized model, or one module in one choice, takes as a deployed layout stores it.

A deployed (packed) layout keeps each int8 weight in one byte, each scale in four, a zero point
only where it is not zero, and float tensors as they are. The serialized state dict adds pickling
and torch's own metadata, which for small layers weighs as much as the weights; a size budget is
about the weights, so runs and the size front count them this way on every engine.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .rotation import state_read
from .settings import ModuleSettings

SCALE_BYTES = 4  # a float32 scale (torch stores per-channel scales as float64; a packed layout as float32)


def packed_bytes(model: nn.Module) -> int:
    """``model``'s state as a packed layout stores it (see the module's docstring); a tensor shared
    by two names counts once."""
    seen: set[tuple[int, int]] = set()
    with state_read():  # a rotated model's, counted
        return sum(_tensor_bytes(t, seen) for t in _tensors(model.state_dict().values()))


def weight_bytes(module: nn.Module, choice: ModuleSettings) -> int:
    """``module``'s weight as an int8 engine (FX, PT2E) deploys it with ``choice``: float32 as it
    is when kept float, else one byte per value and a scale per output channel (per-channel) or one
    (per-tensor); symmetric weights have no zero points. 0 for a module without a weight."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return 0
    if choice.keep_float:
        return weight.numel() * weight.element_size()
    scales = weight.shape[0] if choice.per_channel and weight.dim() else 1
    return weight.numel() + SCALE_BYTES * scales


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):  # FX's quantized Linear keeps (weight, bias) packed in a tuple
            yield from _tensors(value)


def _tensor_bytes(tensor: torch.Tensor, seen: set[tuple[int, int]]) -> int:
    key = (tensor.data_ptr(), tensor.numel()) if not tensor.is_quantized else (id(tensor), 0)
    if key in seen and key[0]:
        return 0
    seen.add(key)
    if not tensor.is_quantized:
        return tensor.numel() * tensor.element_size()
    values = tensor.numel() * tensor.element_size()
    if tensor.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams):
        zero_points = tensor.q_per_channel_zero_points()
        return values + SCALE_BYTES * zero_points.numel() + (4 * zero_points.numel() if bool(zero_points.any()) else 0)
    return values + SCALE_BYTES + (4 if tensor.q_zero_point() else 0)


class _Counted(io.RawIOBase):
    """A write-only stream that keeps nothing and counts the bytes written to it."""

    def __init__(self) -> None:
        self.count = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.count += size
        return size


def saved_bytes(model: nn.Module) -> int:
    """The bytes ``torch.save`` writes for the state dict (counted as written, not held)."""
    counted = _Counted()
    with state_read():  # a rotated model's, counted
        torch.save(model.state_dict(), counted)
    return counted.count
