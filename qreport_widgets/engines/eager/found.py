"""GPTQ weights found once, taken by every later run or simulation that asks them of the same float model.

A module's GPTQ weight depends on its float weight, its format and group size, and the inputs the
float model gives it on the calibration batches: not on which run or simulation asked. A size front
simulates the GPTQ points it weighs; the fit's real run then asked the same weights again and
computed them again (on SmolLM2, 50 s), equal to the simulation's bit for bit. ``FoundWeights`` keeps
them, keyed by the float model's fingerprint (SHA-256 over every parameter and buffer: its name,
shape, dtype and bytes; half a second for 135M float32 parameters), the module and the format key.

An engine and the engines renewed from it (a rotated twin's) share one store, and they calibrate on
their session's batches: the batches are the same for every entry. A rotated run's fresh copy of the
rotated model has the twin's fingerprint, so it takes the twin's weights. The entries of the
``MODELS_KEPT`` float models last asked are kept (the model as given and one rotation of it).

AWQ is not kept: its scale for one module is searched together with the other Linears asked AWQ that
read its input, so it depends on more than the module.

May import: ``core``, ``engines.settings``.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

MODELS_KEPT = 2  # float models whose weights are kept: the model as given and one rotation of it

Key = tuple[str, tuple[str, int, str]]  # (module, (format, group size, algorithm))


class FoundWeights:
    """The GPTQ weights found on each float model (by fingerprint), for whoever asks them next."""

    def __init__(self) -> None:
        self._kept: OrderedDict[str, dict[Key, Any]] = OrderedDict()  # fingerprint -> its weights, the latest last
        self._fingerprints: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

    def fingerprint(self, float_model: nn.Module) -> str:
        """SHA-256 of ``float_model``'s parameters and buffers (once per model object: a float model never changes)."""
        found = self._fingerprints.get(float_model)
        if found is None:
            digest = hashlib.sha256()
            for name, tensor in float_model.state_dict(keep_vars=False).items():
                digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
                digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
            found = self._fingerprints[float_model] = digest.hexdigest()
        return found

    def taken_for(self, float_model: nn.Module, wanted: list[Key]) -> dict[Key, Any]:
        """The weights of ``wanted`` found before on ``float_model``."""
        kept = self._kept.get(self.fingerprint(float_model), {})
        return {key: kept[key] for key in wanted if key in kept}

    def keep(self, float_model: nn.Module, found: dict[Key, Any]) -> None:
        """Keep ``found`` (GPTQ weights computed on ``float_model``) for later askers."""
        if not found:
            return
        fingerprint = self.fingerprint(float_model)
        self._kept.setdefault(fingerprint, {}).update(found)
        self._kept.move_to_end(fingerprint)
        while len(self._kept) > MODELS_KEPT:
            self._kept.popitem(last=False)
