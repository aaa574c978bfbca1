"""Running calibration data through a model: one loop, a progress bar, errors that name the batch."""

from __future__ import annotations

import contextvars
import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Union

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only
from tqdm.auto import tqdm

from ..errors import CalibrationError, NotCalibratedError
from .devices import device_mismatch, tensors_in

CalibrationData = Union[Iterable[Any], Callable[[torch.nn.Module], Any]]


@contextmanager
def torch_warnings_hidden() -> Iterator[None]:
    """torch's own warnings hidden for the duration (its observers warn "Please use quant_min and
    quant_max" hundreds of times per run); the package's own warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"torch(\.|$)")
        yield


def call_with(model: torch.nn.Module, batch: Any) -> Any:
    """A batch is a tuple of positional inputs, a dict of keyword inputs, or one input."""
    if isinstance(batch, tuple):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


def batch_rows(batch: Any) -> int | None:
    """The rows of ``batch`` (or of a call's inputs, flat): the first dimension every tensor in it
    shares; None where they do not, where one has no dimension, or where there is no tensor."""
    tensors = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or any(t.dim() == 0 for t in tensors) or len({t.shape[0] for t in tensors}) != 1:
        return None
    return int(tensors[0].shape[0])


def leading_rows(batch: Any, rows: int) -> Any | None:
    """``batch`` cut to its first ``rows`` rows (every tensor in it sliced along its first dimension,
    a view), or None where that is not a cut of its rows: no ``batch_rows``, or no more than ``rows``."""
    found = batch_rows(batch)
    if found is None or found <= rows:
        return None
    return tree_map_only(torch.Tensor, lambda tensor: tensor[:rows], batch)


def sequence_shape(batch: Any) -> tuple[int, int] | None:
    """(rows, positions a row) of a batch of token ids: its first tensor is integers, ``(rows,
    length)``; None for any other batch (an image batch's second dimension is its channels, not
    positions)."""
    leaves = [leaf for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not leaves or leaves[0].dim() != 2 or leaves[0].is_floating_point() or leaves[0].is_complex():
        return None
    return int(leaves[0].shape[0]), int(leaves[0].shape[1])


def rows_holding(batch: Any, positions: int) -> int | None:
    """How many of ``batch``'s first rows hold at least ``positions`` positions (``sequence_shape``),
    or None where it has no rows of positions or all its rows hold fewer."""
    shape = sequence_shape(batch)
    if shape is None or shape[1] == 0:
        return None
    rows = -(-positions // shape[1])
    return rows if rows < shape[0] else None


class InputsGathered(Exception):
    """Raised from a hook once a calibration pass has recorded everything it reads of a batch: the
    rest of that batch's forward (a decoder's head, say) is not run. Only inside ``gather_with``."""


_GATHERING = contextvars.ContextVar("gathering", default=False)


def gathering() -> bool:
    """Whether the forward running now is a calibration pass's (``gather_with``), whose output nobody
    reads: a hook may then end it early with ``InputsGathered``."""
    return _GATHERING.get()


def gather_with(model: torch.nn.Module, batch: Any) -> None:
    """``call_with`` for a calibration pass: its output is dropped, and a recording hook may end the
    forward once it has all it needs (``InputsGathered``)."""
    token = _GATHERING.set(True)
    try:
        call_with(model, batch)
    except InputsGathered:
        pass
    finally:
        _GATHERING.reset(token)


def calibrate(
    model: torch.nn.Module,
    data: CalibrationData,
    *,
    desc: str = "calibrating",
    progress: bool = True,
    on_batch: Callable[[int, int | None], None] | None = None,
    keep: list[Any] | None = None,
    first: int = 0,
) -> int:
    """Run every batch through ``model`` without gradients; return how many batches ran.

    ``on_batch(done, total)`` is called after each batch (a widget's progress bar, say); each
    batch that ran is appended to ``keep`` when one is given (for data that can be read once);
    ``first``: the number errors give the first batch (the batches before it ran elsewhere).
    """
    model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if callable(data):
            try:
                data(model)
            except Exception as error:  # user code: re-raise with the step named
                raise CalibrationError(f"{desc}: the calibration callable raised {type(error).__name__}: {error}") from error
            return -1
        try:
            total = len(data)  # type: ignore[arg-type]
        except TypeError:
            total = None
        count = 0
        iterator = iter(data)
        bar = tqdm(total=total, desc=desc, unit="batch", disable=not progress, leave=False)
        try:
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                except Exception as error:
                    raise CalibrationError(
                        f"{desc}: the calibration data iterator raised {type(error).__name__} while producing "
                        f"batch {count}: {error}"
                    ) from error
                try:
                    gather_with(model, batch)
                except Exception as error:
                    index = first + count
                    hints = _labels_hint(batch, index) + _non_finite_hint(batch, index) + _device_hint(model, batch, index)
                    raise CalibrationError(
                        f"{desc}: batch {index} failed in the model's forward ({type(error).__name__}: {error}). "
                        f"{hints}Check that batch {index} has the shape and dtype the model expects; a tuple is "
                        "passed as positional inputs, a dict as keyword inputs."
                    ) from error
                count += 1
                if keep is not None:
                    keep.append(batch)
                bar.update()
                if on_batch is not None:
                    on_batch(count, total)
        finally:
            bar.close()
    if count == 0:
        raise NotCalibratedError(f"{desc}: the calibration data produced no batch; pass a non-empty iterable")
    return count


def _labels_hint(batch: Any, count: int) -> str:
    """A DataLoader of a labelled data set yields [inputs, labels]: say so, and how to drop the labels."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2 or not all(isinstance(b, torch.Tensor) for b in batch):
        return ""
    inputs, labels = batch
    if labels.is_floating_point() or labels.dim() > 1 or (labels.dim() == 1 and len(labels) != len(inputs)):
        return ""
    kind = "list" if isinstance(batch, list) else "tuple"
    return (
        f"Batch {count} looks like (inputs, labels): a {kind} of a {tuple(inputs.shape)} tensor and "
        f"{tuple(labels.shape)} integer labels, and the whole {kind} reaches the model. Pass the inputs only, "
        "e.g. `[(images,) for images, _labels in loader]`. "
    )


def data_fingerprint(data: CalibrationData) -> str | None:
    """SHA-256 of calibration batches: each batch's structure (its pytree spec, the values that are no
    tensor) and every tensor's shape, dtype and bytes; None for a calibration callable, whose data it
    cannot see, or for a tensor whose bytes cannot be read (a meta tensor). Computed again on every call,
    so a batch written into in place since gives another fingerprint."""
    if callable(data):
        return None
    digest = hashlib.sha256()
    for batch in data:
        leaves, spec = tree_flatten(batch)
        digest.update(str(spec).encode())
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                digest.update(f"{type(leaf).__name__} {leaf!r}".encode())
                continue
            if leaf.is_meta or leaf.layout != torch.strided:
                return None
            digest.update(f"tensor {tuple(leaf.shape)} {leaf.dtype}".encode())
            digest.update(leaf.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def outside_inference_mode(batch: Any) -> Any:
    """``batch`` with each tensor made under ``torch.inference_mode`` copied into an ordinary tensor
    (the others as they are): an inference tensor has no version counter for a memo to read, cannot be
    exported by ``torch.export`` nor saved for the learned rounding's gradients."""
    if not any(isinstance(leaf, torch.Tensor) and leaf.is_inference() for leaf in tree_leaves(batch)):
        return batch
    return tree_map_only(torch.Tensor, lambda tensor: tensor.clone() if tensor.is_inference() else tensor, batch)


def data_outside_inference_mode(data: Any) -> Any:
    """Calibration or evaluation data with every batch ``outside_inference_mode``: a list's batches
    now, an iterator's as they are read; a calibration callable as it is (it makes its own tensors)."""
    if data is None or callable(data):
        return data
    if is_one_shot(data):
        return (outside_inference_mode(batch) for batch in data)
    return [outside_inference_mode(batch) for batch in data]


def is_one_shot(data: Any) -> bool:
    """Whether ``data`` is an iterator (a generator, say) that is used up by reading it once."""
    return not callable(data) and iter(data) is data


def _device_hint(model: torch.nn.Module, batch: Any, index: int) -> str:
    return device_mismatch(model, batch, f"Batch {index}")


def _non_finite_hint(batch: Any, index: int) -> str:
    for value in tensors_in(batch):
        if value.is_floating_point() and not value.is_meta and not bool(torch.isfinite(value).all()):
            return (
                f"Batch {index} contains NaN or inf values, which torch's quantization observers cannot take; "
                "qreport_widgets.analyze() reports on such data, but quantizing needs finite calibration data. "
            )
    return ""
