"""Numbers that compare a quantized model's outputs with its float original, whatever made it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

_CHUNK = 1 << 20  # values per step of sqnr_db's float64 sums


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """10 log10(signal power / noise power); inf for an exact match, NaN for an all-zero signal.

    Summed in float64 a million values at a time: float64 copies of whole activations would cost
    several times their size at once."""
    return sqnr_of(*power_terms(reference, approximation))


def sqnr_of(signal: float, noise: float) -> float:
    """SQNR (dB) from summed signal and noise power (``power_terms``, added over parts)."""
    if noise == 0:
        return math.inf if signal > 0 else math.nan
    return 10 * math.log10(signal / noise) if signal > 0 else math.nan


def power_terms(reference: torch.Tensor, approximation: torch.Tensor) -> tuple[float, float]:
    """(signal power, noise power) summed over the values, in float64: the parts of one SQNR, which
    add over batches, so that an output can be dropped once its terms are taken."""
    reference, approximation = reference.detach().reshape(-1), approximation.detach().reshape(-1)
    if reference.shape != approximation.shape:
        raise ValueError(f"cannot compare {reference.numel()} values with {approximation.numel()}")
    signal = torch.zeros((), dtype=torch.float64, device=reference.device)
    noise = torch.zeros((), dtype=torch.float64, device=reference.device)
    for start in range(0, reference.numel(), _CHUNK):
        part = reference[start : start + _CHUNK].double()
        signal += part.square().sum()
        noise += part.sub_(approximation[start : start + _CHUNK].to(part)).square_().sum()
    return float(signal), float(noise)


def output_tensor(output: Any) -> torch.Tensor:
    """A model's output as the float tensor its SQNR is measured on: the tensor, or the first tensor
    of a tuple, list, dict or dataclass of them (a Hugging Face ``ModelOutput``'s first field, say:
    ``last_hidden_state``, ``logits``). Pass ``output_fn=`` to ``analyze()`` to choose another."""
    found = _first_tensor(output)
    if found is None:
        raise TypeError(
            f"cannot compare model outputs of type {type(output).__name__}: return a tensor, or tuples, lists, "
            "dicts or dataclasses of tensors, or pass output_fn= (the model's output -> the tensor to compare)"
        )
    return found.detach().float()


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):  # a ModelOutput is an ordered dict of the fields that are set
        values = list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        values = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return None
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None
