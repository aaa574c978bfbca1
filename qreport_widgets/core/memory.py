"""Keeping the process's memory to what a step needs: copies that share the weights they only
read, weights equal across prepares held once, and no model kept alive by torch's own caches."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import FloatModelChangedError, NotEnoughMemoryError
from .experts import experts_in_place
from .linears import linears_in_place

# What a step allocates beyond what the session holds, as a multiple of the float weights of the
# modules it quantizes, measured at its peak (benchmarks/llm_scale.py, a 134M decoder, eager int4):
# building the simulation holds a dequantized copy of them (1.0x); a real run, the quantized copy,
# the reference conversion its kernel check reads and the calibrating copy at once (1.1x); the size
# front, other formats' quantized weights (OTHER_FORMATS_SHARE, 0.5x) beside one point's dequantized
# weights (1.0x). Each also holds a few outputs per batch: ``OUTPUTS_HELD`` of the largest.
STEP_WEIGHTS = {"simulation": 1.0, "run": 1.1, "size front": 1.5}
OUTPUTS_HELD = 4
ROOM = 1.1  # refuse a step when its estimate and a tenth more exceed the memory free

# functools caches keyed by a module, in torch's FX quantization and in torchao's PT2E: every model
# prepared or converted would stay alive, weights and all, for the life of the process (measured on
# a ResNet-50: one baseline run and the simulation left six models' worth of weights held)
_MODEL_CACHES = (
    ("torch.ao.quantization.fx.utils", "assert_and_get_unique_device"),
    ("torchao.utils", "_assert_and_get_unique_device"),
)


@contextlib.contextmanager
def models_forgotten() -> Iterator[None]:
    """Makes torch's and torchao's prepare and convert forget the models they saw in the block."""
    try:
        yield
    finally:
        forget_models()


def forget_models() -> None:
    """Empties the caches that keep prepared and converted models alive (those already imported)."""
    for module_name, function in _MODEL_CACHES:
        module = sys.modules.get(module_name)
        clear = getattr(getattr(module, function, None), "cache_clear", None)
        if clear is not None:
            clear()


def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are the original's own tensors.

    For a step that builds a new model around the weights without writing to them (``prepare_fx``
    and ``convert_fx``, ``torch.export``, torchao's ``quantize_``: each assigns new tensors where it
    changes a weight): the modules are new, so attributes set on them (a qconfig, a replaced child,
    a new weight) leave ``model`` alone, and the weights are not held twice. Nothing may write into
    the copy's weights in place (``weight.data = ...``, ``weight.mul_()``): that would change ``model``.
    """
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


class WatchedCopy:
    """A shared copy of the user's float model (``shared_copy``: its own modules, the user's
    weights) that notices when those weights are changed in place afterwards.

    Holding a deep copy for the session would cost the model's size again for its whole life. The
    weights are shared instead, and each one's version counter (every in-place write, an optimizer
    step or a batch norm's running statistics in training mode, moves it) is checked whenever the
    session reads the model: a changed weight raises ``FloatModelChangedError`` naming it, rather
    than tuning a model that is no longer the one analyzed. Assigning a new tensor to the user's
    module (``module.weight = ...``) leaves the copy as it was.

    Projections that are Linears stored transposed (transformers' ``Conv1D``) are ``nn.Linear`` in
    the copy, over the same weights (``linears.py``); ``as_linears`` names them. A mixture of experts'
    3-d expert weights are one ``nn.Linear`` an expert there (``experts.py``); ``experts`` names them.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = shared_copy(model).eval()
        self.as_linears = linears_in_place(self._model)
        self.experts = experts_in_place(self._model)
        self._versions = {name: tensor._version for name, tensor in _weights(self._model)}

    @property
    def model(self) -> nn.Module:
        """The copy, after ``check()``."""
        self.check()
        return self._model

    def check(self) -> None:
        """Raises ``FloatModelChangedError`` if a weight was changed in place since the copy was made."""
        changed = [name for name, tensor in _weights(self._model) if self._versions.get(name) != tensor._version]
        if changed:
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise FloatModelChangedError(
                f"the float model's weights were changed in place after it was analyzed ({shown}); the session "
                "shares them rather than holding a copy. Run analyze() again on the model as it is now, or, to "
                "keep tuning the model as it was, analyze a copy of it (analyze(copy.deepcopy(model), ...)) "
                "before changing it"
            )


def _weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from ((name, b) for name, b in model.named_buffers(remove_duplicate=False) if b is not None)


class WeightPool:
    """Weights held once: a model added to the pool has each parameter replaced by an equal one
    (same name, shape, dtype and values) that an earlier model already holds.

    Each ``prepare_fx`` folds batch norms into new conv weights, equal from one prepare to the
    next: the report's model, the simulation's and each run's would otherwise hold a copy each.
    The pool refers to the weights weakly: it keeps nothing alive by itself.
    """

    def __init__(self) -> None:
        self._by_name: weakref.WeakValueDictionary[str, nn.Parameter] = weakref.WeakValueDictionary()

    def share(self, model: nn.Module) -> nn.Module:
        """Replace ``model``'s parameters by the pool's equal ones, and add the others; returns ``model``."""
        with torch.no_grad():
            for prefix, module in model.named_modules(remove_duplicate=False):
                for name, parameter in list(module._parameters.items()):
                    if parameter is None:
                        continue
                    key = f"{prefix}.{name}" if prefix else name
                    held = self._by_name.get(key)
                    if held is parameter:
                        continue
                    if held is not None and _same(held, parameter):
                        module._parameters[name] = held
                    else:
                        self._by_name[key] = parameter
        return model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))


def free_bytes() -> int:
    """The memory the machine has available now (free, and what the system would give back from caches)."""
    import psutil

    return int(psutil.virtual_memory().available)


def device_free_bytes(device: torch.device) -> int:
    """The memory free on ``device``: a CUDA device's own, else the machine's (``free_bytes``)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return free_bytes()


def ensure_room(step: str, weights: int, output: int, doing: str) -> None:
    """Refuses ``doing`` (a step of kind ``step``, see ``STEP_WEIGHTS``) with ``NotEnoughMemoryError``
    when what it is estimated to allocate, for ``weights`` bytes of quantized modules' float weights
    and an output of ``output`` bytes per batch, exceeds the memory free."""
    needed = STEP_WEIGHTS[step] * weights + OUTPUTS_HELD * output
    free = free_bytes()
    if needed * ROOM <= free:
        return
    raise NotEnoughMemoryError(
        f"{doing} would need about {_gb(needed)} more memory ({STEP_WEIGHTS[step]:.1f}x the {_gb(weights)} "
        f"of float weights it quantizes, and outputs), and {_gb(free)} is free: nothing was started. Free "
        "memory first (delete reports, sessions or models you no longer need and run gc.collect(); close "
        "other notebooks), measure on fewer or shorter eval batches, or run on a machine with more memory"
    )


def tensors_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """The bytes the distinct ``tensors`` hold."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        seen.setdefault(id(tensor), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def _gb(size: float) -> str:
    if size >= 2**30:
        return f"{size / 2**30:.1f} GB"
    return f"{size / 2**20:.0f} MB" if size >= 2**20 else f"{size / 2**10:.0f} KB"


try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 (glibc's; another C library has none)
except (OSError, AttributeError):
    _LIBC = None


def give_back() -> None:
    """Hands the memory the C allocator holds freed back to the system (glibc's ``malloc_trim``;
    elsewhere nothing). Tensors of a few MB (a decoder layer's weight or activations) are allocated
    from the allocator's heap, not mapped on their own, and freed ones stay resident: a step that
    dequantizes weight after weight would otherwise keep every freed one counted against the machine."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
