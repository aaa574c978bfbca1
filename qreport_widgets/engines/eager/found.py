"""GPTQ weights found once, taken by every later run or simulation that asks them of the same float
model on the same calibration data.

A module's GPTQ weight depends on its float weight, its format and group size, and the inputs the
float model gives it on the calibration batches: not on which run or simulation asked. A size front
simulates the GPTQ points it weighs; the fit's real run then asked the same weights again and
computed them again (on SmolLM2, 50 s), equal to the simulation's bit for bit. ``FoundWeights`` keeps
them under a key of everything they depend on (``key``): the float model's fingerprint (SHA-256 over
every parameter and buffer: its name, shape, dtype and bytes; half a second for 135M float32
parameters, computed again at every ask, so a weight written into in place or assigned anew since
gives another key) and the calibration data's (``core.calibration.data_fingerprint``, across the
ranks of a torch.distributed group), then the module and the format key. Calibration by a callable,
whose data cannot be seen, has no key: its weights are computed every time and never kept.

An engine and the engines renewed from it (a rotated twin's) share one store; a session given
another session's engine shares it too, and the key keeps their weights apart. A rotated run's fresh
copy of the rotated model has the twin's fingerprint, so it takes the twin's weights. The entries of
the ``MODELS_KEPT`` keys last asked are kept (the model as given and one rotation of it). A weight
is copied going in and coming out: nothing a run does to its model reaches the store.

AWQ is not kept: its scale for one module is searched together with the other Linears asked AWQ that
read its input, so it depends on more than the module.

May import: ``core``, ``engines.settings``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MODELS_KEPT = 2  # (float model, calibration data) keys whose weights are kept: the model as given and one rotation of it

Key = tuple[str, tuple[str, int, str]]  # (module, (format, group size, algorithm))


def model_fingerprint(float_model: nn.Module) -> str:
    """SHA-256 of ``float_model``'s parameters and buffers: names, shapes, dtypes and bytes."""
    digest = hashlib.sha256()
    tensors = [*float_model.named_parameters(remove_duplicate=False), *float_model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if tensor is None:
            continue
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class FoundWeights:
    """The GPTQ weights found on each (float model, calibration data), for whoever asks them next."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, dict[Key, Any]] = OrderedDict()  # key -> its weights, the latest last

    @staticmethod
    def key(float_model: nn.Module, data: str | None, grid: str = "") -> str | None:
        """What the weights found on ``float_model`` with calibration data fingerprinted ``data``
        on int4 grid ``grid`` ("full range" or "") depend on, as one key; None where the data has no
        fingerprint (nothing kept or taken)."""
        if data is None:
            return None
        return hashlib.sha256(f"{model_fingerprint(float_model)} {data} {grid}".encode()).hexdigest()

    def taken(self, key: str | None, wanted: list[Key]) -> dict[Key, Any]:
        """Copies of the weights of ``wanted`` found before under ``key``."""
        kept = self._kept.get(key, {}) if key is not None else {}
        return {pair: kept[pair].copied() for pair in wanted if pair in kept}

    def keep(self, key: str | None, found: dict[Key, Any]) -> None:
        """Keep copies of ``found`` (GPTQ weights computed under ``key``) for later askers."""
        if not found or key is None:
            return
        self._kept.setdefault(key, {}).update({pair: weight.copied() for pair, weight in found.items()})
        self._kept.move_to_end(key)
        while len(self._kept) > MODELS_KEPT:
            self._kept.popitem(last=False)


@dataclass(frozen=True)
class FoundBefore:
    """A simulation's way to the store: the store, the float model it simulates and its calibration
    data's fingerprint (asked when needed: ``data_key()``), as one key."""

    store: FoundWeights
    float_model: nn.Module
    data_key: Callable[[], str | None]
    grid: str = ""

    def key(self) -> str | None:
        return FoundWeights.key(self.float_model, self.data_key(), self.grid)
