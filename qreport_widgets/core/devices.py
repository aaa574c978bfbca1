"""Where a model lives, and what the tool makes there.

Everything the tool creates for a model (observers, statistics, simulated weights, Gram matrices)
is made on the model's device and stays there; only a run whose kernels exist elsewhere (torch's x86
int8 kernels, an ExecuTorch program) works on a copy on that device, made here without touching the
user's model, and its batches follow it one at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

CPU = torch.device("cpu")


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s weights: its first parameter's, else its first buffer's, else the CPU
    (a model without weights runs wherever its inputs are)."""
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return CPU


def devices_of(model: nn.Module) -> set[torch.device]:
    """Every device ``model``'s parameters are on (more than one for a model split across devices);
    its buffers' where it has no parameters. (Buffers alone can mislead: an observer's state follows
    the tensors it observed.)"""
    return {t.device for t in model.parameters()} or {t.device for t in model.buffers()}


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a batch or output (tensors, tuples, lists, dicts, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def device_mismatch(model: nn.Module, batch: Any, what: str) -> str:
    """What to say when ``batch``'s tensors are on another device than ``model``'s weights ("" when
    they are not, or the model is split across devices, where each part places its own inputs)."""
    weights, inputs = devices_of(model), {t.device for t in tensors_in(batch)}
    if len(weights) != 1 or not inputs or inputs == weights:
        return ""
    (device,) = weights
    on = ", ".join(sorted(str(d) for d in inputs))
    return (
        f"{what} is on {on} but the model is on {device}; move it there with .to('{device}'), or pass "
        "move_batches=True to analyze() to have every batch moved as it is read. "
    )


def moved(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it on ``device``: a batch (a tensor, a tuple or list of inputs,
    a dict of keyword inputs, nested) or a model output. Tensors already there are returned as they
    are (no copy); other values pass through."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple keeps its type
        return type(value)(*(moved(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(moved(v, device) for v in value)
    if isinstance(value, Mapping):
        items = {k: moved(v, device) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    return value


class MovedBatches:
    """An iterable of batches moved to ``device`` one at a time as they are read, so a copy of the data
    on the other device never exists as a whole; its length is the source's where it has one."""

    def __init__(self, batches: Iterable[Any], device: torch.device) -> None:
        self._batches, self._device = batches, device

    def __iter__(self) -> Iterator[Any]:
        return (moved(batch, self._device) for batch in self._batches)

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]


def copy_on(model: nn.Module, device: torch.device) -> nn.Module:
    """A deep copy of ``model`` with its weights on ``device``; ``model`` is left as it is (unlike
    ``model.to(device)``, which moves the weights of the very modules it is given). Weights already on
    ``device`` are shared, not copied: only what has to move takes memory."""

    def there(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        placed = tensor.detach().to(device)
        return nn.Parameter(placed, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else placed

    memo: dict[int, Any] = {id(t): there(t) for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def float64_on(device: torch.device) -> bool:
    """Whether ``device`` computes in float64 (Apple's MPS does not); where not, statistics that want
    its precision are kept in float32."""
    return device.type != "mps"
