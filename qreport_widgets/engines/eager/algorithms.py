"""How an int4 weight's values are chosen: the weight algorithms behind ``ModuleSettings.algorithm``.

Every algorithm produces torchao's own int4 layout (``IntxUnpackedToInt8Tensor``: int8 storage of
values in [-8, 7], one float scale per row and group of ``group_size`` inputs, zero points 0), so a
run's size, kernel and saved model are those of round-to-nearest; only the values differ.

- ``rtn``: round to nearest with each group's absolute maximum over 7.5 as its scale (torchao's
  ``IntxWeightOnlyConfig``, as it is).
- ``hqq``: torchao's half-quadratic scale search (``intx_choose_qparams_algorithm="hqq_scale_only"``),
  no data needed.
- ``gptq``: columns quantized one at a time, each one's rounding error spread over the columns not
  yet quantized through the inverse of the input Gram matrix ``H = sum(x^T x)`` on the calibration
  batches (the second-order update of Frantar et al., 2022), in blocks of 128 columns with the rest
  updated once per block; columns in order of decreasing ``diag(H)`` (activation order) with each
  group's scale fixed from the float weights first, so groups stay contiguous as torchao stores them;
  ``damping`` times the mean of ``diag(H)`` added to its diagonal.
- ``awq``: activation-aware scaling (Lin et al., 2023), as published: input channel ``j`` multiplied
  by ``s_j = mean|x_j| ** alpha`` in the weights of every Linear that reads that input (q/k/v after a
  norm, gate/up after the next, down after up, o after v, the head after the final norm), ``alpha``
  searched on a grid for the smallest output error summed over them; then each group's range
  clipped by the ratio with the least error on its part of the output. ``1 / s`` is folded into the
  op that writes the input (``folds``: a norm's scale, a Linear's rows), so the program divides by
  nothing; where the Linears reading one input are not all asked AWQ at one group size, the
  module divides its own input by ``s`` (a buffer and a forward pre-hook: one float per input channel).

GPTQ and AWQ are written here: torchao 0.18's own run on CUDA only (GPTQ) or need a layout with an
activation pre-scale that its CPU int4 layout lacks (AWQ). Both measure their result against
round-to-nearest on the calibration inputs (the output error ``trace(D H D^T)`` for ``D`` the weight
error, exact for the layer's output on those inputs) and keep round-to-nearest where it is no worse,
so neither is ever worse than rounding on the data it saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ...core.calibration import InputsGathered, gathering
from ...core.devices import float64_on, model_device
from ...core.kept import SameInput
from ...core.memory import device_free_bytes, give_back
from ...errors import QReportError
from ..folds import INPUT_SCALE, ROWS, Fold, fold_scale, input_folds, rows_divided
from ..settings import AWQ, GPTQ, HQQ, LEARNED, RTN
from .formats import torchao_eager

QMIN, QMAX = -8, 7  # torchao's int4 values
GPTQ_BLOCK = 128
GPTQ_DAMPINGS = (0.01, 0.1, 1.0)  # times the mean of diag(H), the first that beats rounding on held-out tokens
AWQ_GRID = 20  # alpha in 0, 0.05, ..., 1, as published
CLIP_RATIOS = tuple(1 - step / 20 for step in range(10))  # a group's largest weight times 1, 0.95, ..., 0.55: its range
GPTQ_BATCH_BYTES = 256 * 2**20  # working memory of the weights of one shape solved together
ROWS_AT_ONCE = 4096  # rows of a weight worked on at once: a decoder head's working copies stay small
HELD_EVERY = 4  # about one sequence in 4 of the calibration inputs: what a result is checked on, not fitted to


class AlgorithmError(QReportError, RuntimeError):
    """A weight algorithm could not run (no calibration inputs reached the module)."""


def _intx() -> Any:
    return torchao_eager().IntxUnpackedToInt8Tensor


@dataclass(frozen=True)
class BatchTerms:
    """What one batch of a Linear's input adds to its ``InputStatistics``, in float32."""

    units: int
    tokens: int
    abs_sum: torch.Tensor
    fitted_tokens: int
    fitted_gram: torch.Tensor | None  # the fitted tokens' x^T x, None where every unit is held out
    held: torch.Tensor | None  # the held-out units' tokens (tokens x features), None where none is
    _widened: dict = field(default_factory=dict, compare=False, repr=False)

    def widened(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``fitted_gram`` (``name="fitted"``) or the held-out tokens' x^T x (``"held"``) in the sums'
        ``dtype``, worked out once for all the Linears that read this input (q, k and v)."""
        key = (name, dtype)
        if key not in self._widened:
            gram = self.fitted_gram if name == "fitted" else self.held.T @ self.held  # type: ignore[union-attr]
            self._widened[key] = gram.to(dtype)  # type: ignore[union-attr]
        return self._widened[key]


def batch_terms(x: torch.Tensor) -> BatchTerms:
    """The ``BatchTerms`` of input ``x`` (a batch of a Linear's input, features last)."""
    features = x.shape[-1]
    units = x.detach().float().reshape(-1, x.shape[-2] if x.dim() >= 3 else 1, features)
    held = held_out(units)
    fitted = units[~held].reshape(-1, features)
    return BatchTerms(
        len(units),
        units.shape[0] * units.shape[1],
        units.abs().sum((0, 1)),
        len(fitted),
        fitted.T @ fitted if len(fitted) else None,
        units[held].reshape(-1, features) if bool(held.any()) else None,
    )


@dataclass
class InputStatistics:
    """What GPTQ and AWQ read of a Linear's inputs on the calibration batches.

    The inputs come in units: a sequence of tokens (a 3-d input's rows of one batch element) or a
    row of a 2-d input. About one unit in ``HELD_EVERY`` is held out: a result is fitted to the Gram
    matrix ``sum(x^T x)`` of the other units' tokens (``fit``) and checked on the held-out ones
    (their rows while fewer than the input features, then their Gram matrix). Whole sequences, not
    tokens: a token's neighbours in its sequence share its context, and a fit that saw them passes
    a check on it that it fails on new text. Also the sum of ``|x|`` per input channel and the
    token count.

    Whether a unit is held out depends on its values alone (``held_out``), not on how many came
    before it, and every sum adds one batch's float32 terms into float64: statistics gathered on
    parts of the batches (torch.distributed ranks) and merged (``merge_``) are those of one pass
    over all of them, to float64 rounding.
    """

    fit_sum: torch.Tensor  # float64
    abs_sum: torch.Tensor  # float64
    tokens: int = 0
    fitted_tokens: int = 0
    units: int = 0
    held_rows: list[torch.Tensor] = field(default_factory=list)  # float32, one tensor a batch
    held_gram: torch.Tensor | None = None  # float64

    @classmethod
    def empty(cls, features: int, device: torch.device | str = "cpu") -> InputStatistics:
        """No tokens yet, summed on ``device`` (the Linear's): in float64 where it computes in float64,
        else (Apple's MPS) in float32, a Gram matrix's sums then rounded to float32's 24 bits."""
        device = torch.device(device)
        dtype = torch.float64 if float64_on(device) else torch.float32
        return cls(torch.zeros(features, features, dtype=dtype, device=device), torch.zeros(features, dtype=dtype, device=device))

    def add(self, x: torch.Tensor) -> None:
        self.add_terms(batch_terms(x))

    def add_terms(self, terms: BatchTerms) -> None:
        """Add one batch's ``batch_terms``: those of a batch several Linears read are worked out once."""
        self.units += terms.units
        self.tokens += terms.tokens
        self.abs_sum.add_(terms.abs_sum.to(self.abs_sum.dtype))
        self.fitted_tokens += terms.fitted_tokens
        if terms.fitted_gram is not None:
            self.fit_sum.add_(terms.widened("fitted", self.fit_sum.dtype))
        if terms.held is not None:
            if self.held_gram is None:
                self._hold([terms.held])  # read only: Linears that read one input share it
            else:
                self.held_gram.add_(terms.widened("held", self.held_gram.dtype))

    def _hold(self, batches: list[torch.Tensor]) -> None:
        if self.held_gram is not None:
            self._add_held(batches)
            return
        self.held_rows.extend(batches)
        if sum(len(r) for r in self.held_rows) >= self.fit_sum.shape[0]:  # rows would outweigh their Gram matrix
            self._held_as_gram()

    def _held_as_gram(self) -> None:
        self.held_gram = torch.zeros_like(self.fit_sum)
        rows, self.held_rows = self.held_rows, []
        self._add_held(rows)

    def _add_held(self, batches: list[torch.Tensor]) -> None:
        for rows in batches:
            self.held_gram.add_((rows.T @ rows).to(self.fit_sum.dtype))  # type: ignore[union-attr]

    def merge_(self, other: InputStatistics) -> InputStatistics:
        """Add ``other``'s statistics (another rank's batches) to these; returns self."""
        if other.fit_sum.shape != self.fit_sum.shape:
            raise ValueError(f"input statistics of {other.fit_sum.shape[0]} features cannot merge into {self.fit_sum.shape[0]}")
        self.fit_sum.add_(other.fit_sum.to(self.fit_sum))
        self.abs_sum.add_(other.abs_sum.to(self.abs_sum))
        self.tokens += other.tokens
        self.fitted_tokens += other.fitted_tokens
        self.units += other.units
        if other.held_gram is not None:
            if self.held_gram is None:
                self._held_as_gram()
            self.held_gram.add_(other.held_gram)  # type: ignore[union-attr]
        self._hold(list(other.held_rows))
        return self

    @property
    def has_held_out(self) -> bool:
        """Whether some units are held out while others are fitted (with every unit held out, as can
        happen on a handful of them, all are fitted and none is checked)."""
        return self.fitted_tokens > 0 and (self.held_gram is not None or bool(self.held_rows))

    @property
    def fit(self) -> torch.Tensor:
        """The Gram matrix of the fitted tokens (of every token when none is fitted), float32."""
        return self.fit_sum.float() if self.fitted_tokens else self.gram

    @property
    def gram(self) -> torch.Tensor:
        """The Gram matrix of every token, float32."""
        total = self.fit_sum.clone()
        if self.held_gram is not None:
            total.add_(self.held_gram)
        for rows in self.held_rows:
            total.add_((rows.T @ rows).to(total.dtype))
        return total.float()

    def held_out_error(self, weight: torch.Tensor, approximation: torch.Tensor | QuantizedWeight) -> float:
        """The squared output error of ``approximation`` for ``weight`` summed over the held-out
        tokens (over the fitted ones when none are held out)."""
        if not self.has_held_out:
            return output_error(weight, approximation, self.fit)
        if self.held_gram is not None:
            return output_error(weight, approximation, self.held_gram)
        return rows_error(weight, approximation, torch.cat(self.held_rows))

    @property
    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()


def held_out(units: torch.Tensor) -> torch.Tensor:
    """Which of ``units`` (units x tokens x features, float32) are held out: those whose values'
    bit patterns sum to ``HELD_EVERY - 1`` modulo ``HELD_EVERY``, about one in ``HELD_EVERY`` of
    them (the low bits of float values vary freely) and the same units whichever process, batch
    order or batch position they come in."""
    bits = units.contiguous().reshape(len(units), -1).view(torch.int32)
    return bits.sum(1, dtype=torch.int64).remainder(HELD_EVERY) == HELD_EVERY - 1


class InputRecorder:
    """Forward pre-hooks gathering ``InputStatistics`` for the named Linears of a model while it
    runs (a calibration pass); ``close()`` removes them and returns what they gathered.

    In a calibration pass (``gather_with``) a batch's forward ends once the last of the Linears has
    read its input (``InputsGathered``): what runs after it (a decoder's head, a block's tail) is not
    needed. That last Linear is the one the first batch, run whole, called last; a batch ends there
    only where every Linear was called exactly once by then, as on the first batch (a model whose
    Linears run a varying number of times, a mixture of experts', is run whole)."""

    def __init__(self, model: nn.Module, names: Iterable[str], check: bool = False) -> None:
        self.statistics: dict[str, InputStatistics] = {}
        self._handles = []
        self._last = SameInput(check)  # the input last seen, and its terms (``check``: proved afresh too)
        self._batches = 0
        self._called: list[str] = []  # this batch's Linears, in the order they were called
        self._final: str | None = None  # the Linear after which a batch may end
        for fqn in names:
            module = model.get_submodule(fqn)
            self.statistics[fqn] = InputStatistics.empty(int(module.weight.shape[1]), module.weight.device)
            self._handles.append(module.register_forward_pre_hook(self._hook(fqn)))
        self._handles.append(model.register_forward_pre_hook(self._batch_begins, prepend=True))

    def _each_called_once(self) -> bool:
        return len(self._called) == len(self.statistics) == len(set(self._called))

    def _batch_begins(self, _model: nn.Module, _args: tuple) -> None:
        if self._batches == 1:  # the first batch ran whole
            self._final = self._called[-1] if self._each_called_once() else None
        self._batches += 1
        self._called = []
        self._last.forget()

    def _hook(self, fqn: str) -> Callable:
        statistics = self.statistics[fqn]

        def hook(_module: nn.Module, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
                statistics.add_terms(self._last.of(x, lambda: batch_terms(x)))  # q, k and v read one tensor: its terms once
            self._called.append(fqn)
            if fqn == self._final and gathering() and self._each_called_once():
                raise InputsGathered

        return hook

    def close(self) -> dict[str, InputStatistics]:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._last.forget()
        return self.statistics


@contextlib.contextmanager
def recording(model: nn.Module, names: Iterable[str], check: bool = False) -> Iterator[dict[str, InputStatistics]]:
    """``InputRecorder`` for the duration of a ``with`` block; the statistics fill as it runs."""
    recorder = InputRecorder(model, names, check)
    try:
        yield recorder.statistics
    finally:
        recorder.close()


@dataclass(frozen=True)
class QuantizedWeight:
    """A module's int4 weight as torchao stores it, and for AWQ the scale its input is divided by."""

    tensor: torch.Tensor  # torchao's IntxUnpackedToInt8Tensor
    input_scale: torch.Tensor | None = None
    note: str = ""  # why the algorithm kept round to nearest ("" where it did not)
    full_range: bool = False  # the round to nearest kept was on the full-range grid (``round_to_nearest``)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight the module multiplies its (unscaled) input with (in ``dtype``, else the tensor's)."""
        dtype = dtype or self.tensor.dtype
        weight = self.tensor.dequantize().to(dtype)
        return weight if self.input_scale is None else weight / self.input_scale.to(dtype)

    @property
    def nbytes(self) -> int:
        inner = sum(
            getattr(self.tensor, name).numel() * getattr(self.tensor, name).element_size()
            for name in ("qdata", "scale", "zero_point")
        )
        return inner + (0 if self.input_scale is None else self.input_scale.numel() * 4)

    def compact(self) -> CompactWeight | Recipe:
        """What a simulation keeps of a result it would take seconds to compute again: round to
        nearest kept as a ``Recipe`` (rebuilt from the float weight in milliseconds); GPTQ's and
        AWQ's values packed two per byte (an eighth of the float size), AWQ's input scale with them."""
        if self.note:
            return Recipe(self.tensor.block_size[1], self.note, self.full_range)
        tensor = self.tensor
        values = (tensor.qdata.to(torch.int16) - QMIN).to(torch.uint8)
        packed = values[:, 0::2] | (values[:, 1::2] << 4)
        return CompactWeight(packed, tensor.scale, tensor.block_size[1], tensor.dtype, self.note, self.input_scale)

    def rows_divided(self, scale: torch.Tensor) -> QuantizedWeight:
        """This weight with every row divided by ``scale`` (its group scales divided, its int4 values kept):
        the weight of a Linear whose output a reader's AWQ scale is folded into."""
        return replace(self, tensor=rows_divided(self.tensor, scale))

    def assign(self, module: nn.Module, dynamic_activations: bool = False, divide_input: bool = True) -> None:
        """Give ``module`` this weight (a new Parameter) and, for AWQ, its input scale and the hook
        that divides by it (not with ``divide_input=False``: the scale is folded into the op before,
        ``folds``). ``dynamic_activations``: the module quantizes its input to int8 per token as it
        runs (int8-dynamic-int4-weight, "8da4w"), the same int4 values."""
        tensor = self.tensor
        if dynamic_activations:
            tensor = _intx()(
                tensor.qdata,
                tensor.scale,
                tensor.zero_point,
                tensor.target_dtype,
                tensor.block_size,
                tensor.dtype,
                torchao_eager().PerTokenActivations,
            )
        module.weight = nn.Parameter(tensor, requires_grad=False)
        if self.input_scale is not None and divide_input:
            module.register_buffer(INPUT_SCALE, self.input_scale.clone())
            module.register_forward_pre_hook(_divide_input)


@dataclass(frozen=True)
class CompactWeight:
    """A ``QuantizedWeight`` with its int4 values packed two per byte (``QuantizedWeight.compact``)."""

    packed: torch.Tensor  # uint8, rows x inputs / 2: the even inputs' values in the low 4 bits
    scale: torch.Tensor
    group_size: int
    dtype: torch.dtype
    note: str
    input_scale: torch.Tensor | None = None

    def expand(self, _weight: torch.Tensor) -> QuantizedWeight:
        low, high = self.packed & 0x0F, self.packed >> 4
        values = torch.stack((low, high), dim=-1).reshape(self.packed.shape[0], -1).to(torch.int16) + QMIN
        return QuantizedWeight(int4_tensor(values, self.scale, self.group_size, self.dtype), self.input_scale, self.note)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.input_scale is None else self.input_scale.numel() * 4
        return self.packed.numel() + self.scale.numel() * self.scale.element_size() + extra

    def copied(self) -> CompactWeight:
        """The same weight in tensors of its own."""
        scale = None if self.input_scale is None else self.input_scale.clone()
        return replace(self, packed=self.packed.clone(), scale=self.scale.clone(), input_scale=scale)

    def to(self, device: torch.device) -> CompactWeight:
        """The same weight with its tensors on ``device``."""
        scale = None if self.input_scale is None else self.input_scale.to(device)
        return replace(self, packed=self.packed.to(device), scale=self.scale.to(device), input_scale=scale)


@dataclass(frozen=True)
class Recipe:
    """A ``QuantizedWeight`` that is round to nearest of the float weight (where GPTQ or AWQ kept
    it, ``note`` saying why), rebuilt from the float weight."""

    group_size: int
    note: str
    full_range: bool = False  # on the full-range grid (``round_to_nearest``)

    def expand(self, weight: torch.Tensor) -> QuantizedWeight:
        rounded = round_to_nearest(weight.detach().float(), self.group_size, full_range=self.full_range)
        return QuantizedWeight(rounded, None, self.note)

    @property
    def nbytes(self) -> int:
        return 0

    def to(self, _device: torch.device) -> Recipe:
        return self  # no tensors: rebuilt from the weight where it is

    def copied(self) -> Recipe:
        return self


def _divide_input(module: nn.Module, args: tuple) -> tuple | None:
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    scale = getattr(module, INPUT_SCALE)
    return (args[0] / scale.to(args[0].dtype), *args[1:])


def int4_tensor(values: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """torchao's int4 tensor of int values ``values`` (rows x inputs, in [-8, 7]) and per-group ``scale``."""
    scale = scale.to(dtype).contiguous()
    return _intx()(
        values.to(torch.int8).contiguous(),
        scale,
        torch.zeros(scale.shape, dtype=torch.int8, device=scale.device),
        torch.int4,
        (1, group_size),
        dtype,
        None,
    )


def group_scales(weight: torch.Tensor, group_size: int, full_range: bool = False) -> torch.Tensor:
    """Each row-group's scale as torchao's symmetric int4 chooses it: absolute maximum over 7.5; on
    the ``full_range`` grid, llama.cpp's ``Q4_0`` rule: the group's extreme weight lands on -8 (the
    scale negative where that weight is positive), so all 16 values span the group."""
    rows, inputs = weight.shape
    grouped = weight.reshape(rows, inputs // group_size, group_size)
    amax = grouped.abs().amax(-1)
    if not full_range:
        return (amax / ((QMAX - QMIN) / 2)).clamp_min(torch.finfo(torch.float32).eps)
    return (amax / -QMIN).clamp_min(torch.finfo(torch.float32).eps) * extreme_sign(grouped)


def extreme_sign(grouped: torch.Tensor) -> torch.Tensor:
    """Per group (the last dimension), the sign that puts the group's extreme weight on -8: -1 where
    that weight is positive, 1 elsewhere (the full-range grid's scale sign)."""
    extreme = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(extreme > 0, -1.0, 1.0).to(grouped.dtype)


def round_to_nearest(
    weight: torch.Tensor, group_size: int, input_scale: torch.Tensor | None = None, full_range: bool = False
) -> torch.Tensor:
    """torchao's own round-to-nearest int4 tensor of ``weight`` (rows x inputs), each input channel
    multiplied by ``input_scale`` first when given (AWQ); ``ROWS_AT_ONCE`` rows at a time (each
    row's groups are its own), so a decoder head's scaled copy is never whole. ``full_range``: on
    llama.cpp's grid instead (``group_scales``; the values in [-8, 7] on it)."""
    weight = weight.detach()
    if full_range:
        return _full_range_nearest(weight if input_scale is None else weight * input_scale, group_size)
    if weight.shape[0] <= ROWS_AT_ONCE and input_scale is None:
        return _intx().from_hp(weight, (1, group_size), torch.int4)
    values, scales = [], []
    for first in range(0, weight.shape[0], ROWS_AT_ONCE):
        chunk = weight[first : first + ROWS_AT_ONCE]
        found = _intx().from_hp(chunk if input_scale is None else chunk * input_scale, (1, group_size), torch.int4)
        values.append(found.qdata)
        scales.append(found.scale)
    return int4_tensor(torch.cat(values), torch.cat(scales), group_size, weight.dtype)


def on_full_range(tensor: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``tensor`` (torchao's int4 tensor of float ``weight``, of any format) with round to nearest's
    values and scales on the full-range grid in place of its own (``round_to_nearest``); itself."""
    rounded = round_to_nearest(weight.detach().float(), int(tensor.block_size[1]), full_range=True)
    tensor.qdata, tensor.scale = rounded.qdata.to(tensor.qdata.dtype), rounded.scale.to(tensor.scale.dtype)
    return tensor


def _full_range_nearest(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, inputs = weight.shape
    values, scales = [], []
    for first in range(0, rows, ROWS_AT_ONCE):
        chunk = weight[first : first + ROWS_AT_ONCE].float()
        scale = group_scales(chunk, group_size, full_range=True)
        grouped = chunk.reshape(chunk.shape[0], inputs // group_size, group_size)
        values.append(grouped.div(scale[..., None]).round_().clamp_(QMIN, QMAX).reshape(chunk.shape))
        scales.append(scale)
    return int4_tensor(torch.cat(values), torch.cat(scales).to(weight.dtype), group_size, weight.dtype)


def output_error(weight: torch.Tensor, approximation: torch.Tensor | QuantizedWeight, gram: torch.Tensor) -> float:
    """The squared error a layer's output takes, summed over the calibration tokens, when
    ``approximation`` (a float weight or a ``QuantizedWeight``) replaces ``weight``: ``trace(D H D^T)``
    for ``D`` the difference, ``ROWS_AT_ONCE`` rows at a time."""
    total, gram = 0.0, gram.float()
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        difference = _difference(weight, approximation, start, start + ROWS_AT_ONCE)
        total += float(((difference @ gram) * difference).sum(dtype=torch.float64))
    return total


def rows_error(weight: torch.Tensor, approximation: torch.Tensor | QuantizedWeight, inputs: torch.Tensor) -> float:
    """The squared output error of ``approximation`` for ``weight`` summed over the rows of ``inputs``."""
    total = 0.0
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        error = inputs @ _difference(weight, approximation, start, start + ROWS_AT_ONCE).T
        total += float(error.pow_(2).sum(dtype=torch.float64))
    return total


def _difference(weight: torch.Tensor, approximation: torch.Tensor | QuantizedWeight, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of ``approximation - weight`` in float32."""
    if isinstance(approximation, QuantizedWeight):
        tensor = approximation.tensor
        group = tensor.block_size[1]
        values = tensor.qdata[start:stop].float()
        rows = values.shape[0]
        values = values.view(rows, -1, group).sub_(tensor.zero_point[start:stop, :, None].float())
        found = values.mul_(tensor.scale[start:stop, :, None].float()).view(rows, -1)
        if approximation.input_scale is not None:
            found.div_(approximation.input_scale.float())
    else:
        found = approximation[start:stop].float().clone()
    return found.sub_(weight[start:stop].float())


def gptq(weight: torch.Tensor, statistics: InputStatistics, group_size: int, full_range: bool = False) -> QuantizedWeight:
    """``weight`` (rows x inputs) quantized to int4 by GPTQ on the inputs ``statistics`` describe,
    with the least damping in ``GPTQ_DAMPINGS`` whose fit to the tokens not held out has a lower
    output error than round-to-nearest on the held-out sequences (then fitted again to every token);
    round-to-nearest, with a note saying why, where none has (too few calibration tokens for the
    module's input features: the fit follows those tokens, not the inputs the model will see).
    ``full_range``: the scales, and the round to nearest it is held against, on llama.cpp's grid
    (``group_scales``)."""
    return gptq_many({None: (weight, statistics, group_size)}, full_range)[None]


def gptq_many(
    problems: Mapping[Any, tuple[torch.Tensor, InputStatistics, int]], full_range: bool = False
) -> dict[Any, QuantizedWeight]:
    """``gptq`` of each ``key: (weight, statistics, group size)``, the same values, the weights of one
    shape and group size solved together (``gptq_values_many``): a decoder's Linears in a few
    column loops instead of one a Linear."""
    originals = {key: weight.detach().float() for key, (weight, _, _) in problems.items()}
    inputs = {key: statistics for key, (_, statistics, _) in problems.items()}
    groups = {key: group for key, (_, _, group) in problems.items()}
    if any(statistics.tokens == 0 for statistics in inputs.values()):
        raise AlgorithmError("GPTQ reads the module's inputs on the calibration batches, and none reached it")
    rounded = {key: round_to_nearest(originals[key], groups[key], full_range=full_range) for key in problems}

    def held_out(key: Any, values: torch.Tensor) -> float:
        return inputs[key].held_out_error(originals[key], QuantizedWeight(values))

    least = {key: held_out(key, values) for key, values in rounded.items()}
    found: dict[Any, QuantizedWeight] = {}
    pending = list(problems)
    for damping in GPTQ_DAMPINGS:
        if not pending:
            break
        fits = _values_of({key: (originals[key], inputs[key].fit, groups[key]) for key in pending}, damping, full_range)
        passed = [key for key in pending if held_out(key, fits[key]) < least[key]]
        # the damping that carries over to tokens the fit did not see, fitted again to every token
        again = {key: (originals[key], inputs[key].gram, groups[key]) for key in passed if inputs[key].has_held_out}
        refits = _values_of(again, damping, full_range)
        found.update({key: QuantizedWeight(refits.get(key, fits[key])) for key in passed})
        pending = [key for key in pending if key not in found]
    for key in pending:
        found[key] = QuantizedWeight(
            rounded[key],
            full_range=full_range,
            note=(
                f"GPTQ kept round to nearest: its weights had no lower output error on held-out calibration sequences "
                f"({inputs[key].tokens:,} tokens for {originals[key].shape[1]:,} input features; more calibration data helps)"
            ),
        )
    return {key: found[key] for key in problems}


def _values_of(
    problems: Mapping[Any, tuple[torch.Tensor, torch.Tensor, int]], damping: float, full_range: bool = False
) -> dict[Any, torch.Tensor]:
    """GPTQ's int4 tensor of each ``key: (float weight, Gram matrix, group size)`` at ``damping``:
    weights of one shape, group size and device solved together, ``GPTQ_BATCH_BYTES`` of working
    memory at a time; a weight of more than ``ROWS_AT_ONCE`` rows (a decoder head) alone."""
    alike: dict[tuple, list[Any]] = {}
    for key, (weight, _, group) in problems.items():
        alike.setdefault((tuple(weight.shape), group, weight.device), []).append(key)
    values = {}
    orders = _Orders(damping)  # q, k and v (gate and up) read one input: its factor worked out once
    for (shape, group, _), keys in alike.items():
        rows, inputs = shape
        if rows > ROWS_AT_ONCE:
            values.update(
                {key: gptq_values(problems[key][0], problems[key][1], group, damping, orders, full_range) for key in keys}
            )
            continue
        together = max(1, GPTQ_BATCH_BYTES // (4 * (2 * rows * inputs + 2 * inputs * inputs)))
        for first in range(0, len(keys), together):
            chunk = keys[first : first + together]
            originals, grams = [problems[k][0] for k in chunk], [problems[k][1] for k in chunk]
            found = gptq_values_many(originals, grams, group, damping, orders, full_range)
            values.update(zip(chunk, found, strict=True))
    return values


class _Orders:
    """``_activation_order`` at one damping, worked out once for each distinct Gram matrix: the
    Linears that read one input (q, k and v; gate and up) have equal ones, and the float64
    Cholesky factors were 38% of GPTQ's solve on SmolLM2. Equal matrices give equal factors: the
    values are those of one factor each."""

    def __init__(self, damping: float) -> None:
        self.damping = damping
        self._found: dict[tuple, list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}

    def of(self, gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (tuple(gram.shape), gram.dtype, gram.device, float(gram.diagonal().sum()), float(gram[0].sum()))
        alike = self._found.setdefault(key, [])
        for seen, factor in alike:
            if torch.equal(seen, gram):
                return factor
        factor = _activation_order(gram, self.damping)
        alike.append((gram, factor))
        return factor


TRIANGLE_LEAF = 256  # ``_upper_inverse`` solves blocks of at most this many rows directly


def _activation_order(gram: torch.Tensor, damping: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the input channels in activation order, the upper Cholesky factor of the damped inverse
    Gram matrix in that order, the channels that were always 0) of inputs with Gram matrix ``gram``."""
    hessian = gram.clone()
    dead = hessian.diagonal() == 0  # an input channel that was always 0: its weights do not matter
    hessian[dead, dead] = 1.0
    order = torch.argsort(hessian.diagonal(), descending=True)  # activation order
    hessian = hessian[order][:, order]
    hessian.diagonal().add_(damping * float(hessian.diagonal().mean()))
    precise = hessian.double() if float64_on(hessian.device) else hessian
    return order, _inverse_factor(precise).float(), dead


def _inverse_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor ``U`` of ``hessian``'s inverse (``inverse = U^T U``), from one
    factorization: with the channels' order reversed, ``hessian = R R^T`` for an upper triangular
    ``R`` (the reversed matrix's lower factor, reversed back), so ``inverse = R^-T R^-1`` and
    ``U = R^-1``. A third of the arithmetic of inverting and factorizing again (0.09 s instead of
    0.21 s for SmolLM2's 1,536 features in float64, 2 threads), the same factor to float64's rounding."""
    return _upper_inverse(torch.linalg.cholesky(hessian.flip(0, 1)).flip(0, 1))


def _upper_inverse(upper: torch.Tensor) -> torch.Tensor:
    """The inverse of an upper triangular matrix, by halves: ``[[A, B], [0, C]]`` inverts to
    ``[[A^-1, -A^-1 B C^-1], [0, C^-1]]``, a third of a solve against the identity's arithmetic."""
    size = upper.shape[0]
    if size <= TRIANGLE_LEAF:
        identity = torch.eye(size, dtype=upper.dtype, device=upper.device)
        return torch.linalg.solve_triangular(upper, identity, upper=True)
    half = size // 2
    first, second = _upper_inverse(upper[:half, :half]), _upper_inverse(upper[half:, half:])
    inverse = torch.zeros_like(upper)
    inverse[:half, :half], inverse[half:, half:] = first, second
    inverse[:half, half:] = -(first @ upper[:half, half:]) @ second
    return inverse


def gptq_values(
    original: torch.Tensor,
    gram: torch.Tensor,
    group_size: int,
    damping: float,
    orders: _Orders | None = None,
    full_range: bool = False,
) -> torch.Tensor:
    """GPTQ's int4 tensor of ``original`` (float, rows x inputs) for inputs of Gram matrix ``gram``.
    Rows are independent given the inputs: they go ``ROWS_AT_ONCE`` at a time (a decoder head's
    working copies stay small). ``orders``: factors already worked out at ``damping``."""
    rows, inputs = original.shape
    order, inverse, dead = (orders or _Orders(damping)).of(gram)
    group_of = order // group_size  # each column's group, in the order the columns go
    restore = torch.argsort(order)
    values, scales = [], []
    for first in range(0, rows, ROWS_AT_ONCE):
        work = original[first : first + ROWS_AT_ONCE].clone()
        work[:, dead] = 0.0
        chunk_scales = group_scales(work, group_size, full_range)  # fixed first: the columns go in activation order
        found = _gptq_rows(work[:, order][None], chunk_scales[None], group_of[None], inverse[None])[0]
        values.append(found[:, restore])
        scales.append(chunk_scales)
    return int4_tensor(torch.cat(values), torch.cat(scales), group_size, original.dtype)


def gptq_values_many(
    originals: list[torch.Tensor],
    grams: list[torch.Tensor],
    group_size: int,
    damping: float,
    orders: _Orders | None = None,
    full_range: bool = False,
) -> list[torch.Tensor]:
    """``gptq_values`` of weights of one shape (at most ``ROWS_AT_ONCE`` rows), each with its own
    Gram matrix, in one column loop: the same values, in a loop's steps for all of them."""
    orders = orders or _Orders(damping)
    ordered = [orders.of(gram) for gram in grams]
    works, scales = [], []
    for original, (order, _, dead) in zip(originals, ordered, strict=True):
        work = original.clone()
        work[:, dead] = 0.0
        scales.append(group_scales(work, group_size, full_range))
        works.append(work[:, order])
    orders = torch.stack([order for order, _, _ in ordered])
    found = _gptq_rows(torch.stack(works), torch.stack(scales), orders // group_size, torch.stack([i for _, i, _ in ordered]))
    return [
        int4_tensor(values[:, torch.argsort(order)], scale, group_size, original.dtype)
        for values, order, scale, original in zip(found, orders, scales, originals, strict=True)
    ]


def _gptq_rows(work: torch.Tensor, scales: torch.Tensor, group_of: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The int4 values of each of ``work``'s weights (weights x rows x inputs in each one's
    activation order, changed in place) column by column, each column's rounding error spread over
    the columns after it through the weight's ``inverse`` (the upper Cholesky factor of its damped
    inverse Gram matrix), in blocks of ``GPTQ_BLOCK``. ``scales``: weights x rows x groups;
    ``group_of``: weights x inputs, each column's group. Every weight's arithmetic is the one it
    would have alone."""
    count, rows, inputs = work.shape
    values = torch.empty(count, inputs, rows, dtype=torch.int8, device=work.device)
    spread = torch.empty(count, min(GPTQ_BLOCK, inputs), rows, dtype=work.dtype, device=work.device)  # one column's update
    rounded = torch.empty_like(spread)  # a block's values
    for start in range(0, inputs, GPTQ_BLOCK):
        stop = min(start + GPTQ_BLOCK, inputs)
        # the block's columns as rows (weights x block columns x rows): each column's update runs
        # along memory, over every row of every weight at once
        block = work[:, :, start:stop].transpose(1, 2).contiguous()
        errors = torch.empty_like(block)
        block_inverse = inverse[:, start:stop, start:stop]
        diagonal = block_inverse.diagonal(dim1=1, dim2=2)[..., None]  # weights x block columns x 1
        block_scale = scales.gather(2, group_of[:, None, start:stop].expand(count, rows, stop - start))
        block_scale = block_scale.transpose(1, 2).contiguous()
        for i in range(stop - start):
            column, scale, error = block[:, i], block_scale[:, i], errors[:, i]
            # each step written into a buffer kept for the loop: the same arithmetic as fresh tensors, no allocations
            q = torch.div(column, scale, out=rounded[:, i]).round_().clamp_(QMIN, QMAX)
            torch.sub(column, torch.mul(q, scale, out=error), out=error).div_(diagonal[:, i])
            update = spread[:, : stop - start - i]
            torch.mul(block_inverse[:, i, i:, None], error[:, None, :], out=update)
            block[:, i:].sub_(update)
        values[:, start:stop] = rounded[:, : stop - start]
        for weight in range(count):  # one product a weight, as it would run alone
            work[weight, :, stop:].sub_(errors[weight].T.contiguous() @ inverse[weight, start:stop, stop:])
    return values.transpose(1, 2)


def awq(weight: torch.Tensor, statistics: InputStatistics, group_size: int, *, grid: int = AWQ_GRID) -> QuantizedWeight:
    """``weight`` alone quantized by AWQ (``awq_group`` of a Linear that shares its input with none)."""
    return awq_group({"": weight}, statistics, group_size, grid=grid)[""]


def awq_group(
    weights: Mapping[str, torch.Tensor], statistics: InputStatistics, group_size: int, *, grid: int = AWQ_GRID
) -> dict[str, QuantizedWeight]:
    """The Linears that read one input (``weights``: name -> float weight; ``statistics``: that
    input's) quantized to int4 by AWQ as published: input channel ``j`` scaled by
    ``s_j = mean|x_j| ** alpha`` in every weight (divided in the input, or folded into the op
    before: ``folds``), ``alpha`` on a grid of ``grid`` + 1 values in [0, 1] whose round-to-nearest
    output error, summed over the Linears on the tokens not held out, is smallest; then each group of
    each row clipped to the share of its largest weight (``CLIP_RATIOS``) with the least error on
    that group's own part of the output. Round to nearest for all of them, with a note, where that
    has no lower summed error on the held-out tokens."""
    originals = {name: weight.detach().float() for name, weight in weights.items()}
    if statistics.tokens == 0:
        raise AlgorithmError("AWQ reads the module's inputs on the calibration batches, and none reached it")
    fit = statistics.fit
    magnitude = statistics.mean_abs.clamp_min(1e-8)

    def rounding_error(scale: torch.Tensor | None) -> float:
        return sum(
            output_error(w, QuantizedWeight(round_to_nearest(w, group_size, scale), scale), fit) for w in originals.values()
        )

    chosen, least = None, rounding_error(None)
    for step in range(1, grid + 1):
        scale = magnitude ** (step / grid)
        scale = scale / (scale.max() * scale.min()).sqrt()  # centred on 1: the weights' range kept
        error = rounding_error(scale)
        if error < least:
            chosen, least = scale, error
    found = {name: clipped(w, fit, group_size, chosen) for name, w in originals.items()}
    rounded = {name: QuantizedWeight(round_to_nearest(w, group_size)) for name, w in originals.items()}

    def held_out(results: Mapping[str, QuantizedWeight]) -> float:
        return sum(statistics.held_out_error(originals[name], q) for name, q in results.items())

    if held_out(found) >= held_out(rounded):
        note = "AWQ kept round to nearest: its scales and clipping had no lower output error on held-out calibration sequences"
        return {name: QuantizedWeight(q.tensor, note=note) for name, q in rounded.items()}
    return found


def clipped(
    weight: torch.Tensor, gram: torch.Tensor, group_size: int, input_scale: torch.Tensor | None = None
) -> QuantizedWeight:
    """``weight`` (float, rows x inputs; its input channels multiplied by ``input_scale`` first
    when given) as int4 whose every row-group's scale is its largest weight, times the ratio in
    ``CLIP_RATIOS`` with the least error on the group's part of the output, over 7.5. That error is
    ``d^T H_g d`` for ``d`` the group's weight error and ``H_g`` the group's diagonal block of the
    Gram matrix of the (scaled) input: the groups' errors added, not their cross terms."""
    rows, inputs = weight.shape
    groups = inputs // group_size
    if input_scale is not None:
        gram = gram / (input_scale[:, None] * input_scale[None, :])
    blocks = gram.view(groups, group_size, groups, group_size).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    values, scales = [], []
    for first in range(0, rows, ROWS_AT_ONCE):
        chunk = weight[first : first + ROWS_AT_ONCE]
        work = (chunk * input_scale if input_scale is not None else chunk).reshape(-1, groups, group_size)
        largest = work.abs().amax(-1)
        best_scale = least = None
        for ratio in CLIP_RATIOS:
            scale = (ratio * largest / ((QMAX - QMIN) / 2)).clamp_min(torch.finfo(torch.float32).eps)
            difference = torch.clamp(torch.round(work / scale[..., None]), QMIN, QMAX).mul_(scale[..., None]).sub_(work)
            error = torch.einsum("rgi,gij,rgj->rg", difference, blocks, difference)
            if least is None:
                best_scale, least = scale, error
            else:
                better = error < least
                best_scale, least = torch.where(better, scale, best_scale), torch.where(better, error, least)
        values.append(torch.clamp(torch.round(work / best_scale[..., None]), QMIN, QMAX).reshape(len(chunk), inputs))
        scales.append(best_scale)
    return QuantizedWeight(int4_tensor(torch.cat(values), torch.cat(scales), group_size, weight.dtype), input_scale)


def choose(
    algorithm: str,
    weight: torch.Tensor,
    group_size: int,
    statistics: InputStatistics | None = None,
    full_range: bool = False,
) -> QuantizedWeight:
    """``weight`` as int4 in groups of ``group_size``, its values chosen by ``algorithm``; round to
    nearest and GPTQ on the ``full_range`` grid where asked (``group_scales``)."""
    if algorithm in ("", RTN):
        return QuantizedWeight(round_to_nearest(weight, group_size, full_range=full_range))
    if algorithm == HQQ:
        hqq = torchao_eager().IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY
        return QuantizedWeight(_intx().from_hp(weight.detach(), (1, group_size), torch.int4, intx_choose_qparams_algorithm=hqq))
    if statistics is None:
        raise AlgorithmError(f"{algorithm} reads the module's inputs on the calibration batches: none were gathered")
    if algorithm == GPTQ:
        return gptq(weight, statistics, group_size, full_range)
    if algorithm == AWQ:
        return awq(weight, statistics, group_size)
    if algorithm == LEARNED:
        raise AlgorithmError("learned rounding is learned on a decoder block's output, not on one module's inputs (learned.py)")
    raise ValueError(f"unknown weight algorithm {algorithm!r}")


# the input Gram matrices GPTQ and AWQ read are held at once up to the larger of this share of the
# float weights and GRAM_FREE_SHARE of the memory free on the model's device when they are gathered:
# one calibration pass where memory allows (a 134M decoder's are 0.7 of its float32 weights, 1.0 GB;
# in runs of 15% they took 13 passes), runs of modules where it does not (a 7B decoder's are 44 GB)
GRAM_SHARE = 0.15
GRAM_FREE_SHARE = 0.25


def gram_runs(features: Mapping[str, int], weight_bytes: float, free: float = 0.0) -> list[list[str]]:
    """The modules (name -> input features) in runs whose input Gram matrices (features x features
    float64 sums each) hold at most the larger of ``GRAM_SHARE`` of ``weight_bytes`` and
    ``GRAM_FREE_SHARE`` of ``free`` (the bytes free where they are gathered) together, at least one
    module a run, in order: each run one calibration pass."""
    room = max(GRAM_SHARE * weight_bytes, GRAM_FREE_SHARE * free)
    runs: list[list[str]] = [[]]
    held = 0.0
    for fqn, count in features.items():
        size = 8.0 * count**2  # float64 sums
        if runs[-1] and held + size > room:
            runs.append([])
            held = 0.0
        runs[-1].append(fqn)
        held += size
    return runs


def awq_shares(choices: Mapping[str, tuple[str, int]], folds: Mapping[str, Fold]) -> dict[str, tuple[str, ...]]:
    """The modules asked AWQ whose input's scale is searched with them: for each input (``folds``)
    and group size, the first module asked AWQ that reads it -> every Linear that reads it (the
    module alone where it shares its input with none). The other readers asked AWQ at that group
    size take the weights found with it (``awq_group``)."""
    found: dict[str, tuple[str, ...]] = {}
    seen: set[tuple[str, str, int]] = set()
    for fqn, (algorithm, group_size) in choices.items():
        fold = folds.get(fqn)
        # an input by the op that writes it, a module without one by its own name: never the same key where a
        # module writes the input of another and has no fold itself (up_proj -> down_proj after a norm that takes none)
        key = ("written by", fold.into, group_size) if fold else ("alone", fqn, group_size)
        if algorithm != AWQ or key in seen:
            continue
        seen.add(key)
        found[fqn] = fold.readers if fold else (fqn,)
    return found


def assign_weights(model: nn.Module, chosen: Mapping[str, QuantizedWeight], dynamic: Iterable[str] = ()) -> list[str]:
    """Give each module named in ``chosen`` its weight (``QuantizedWeight.assign``; those in
    ``dynamic`` quantize their input to int8 per token). An AWQ input scale that every Linear reading
    one input takes is folded into the op that writes it (``folds``: no op in the program); another
    is divided by the module's forward pre-hook. Returns the modules left with a pre-hook."""
    dynamic = set(dynamic)
    chosen = dict(chosen)
    folds = input_folds(model)
    folded: set[str] = set()
    shared = {folds[fqn] for fqn, q in chosen.items() if q.input_scale is not None and fqn in folds}
    for fold in sorted(shared, key=lambda f: f.into):
        scales = [chosen[r].input_scale if r in chosen else None for r in fold.readers]
        first = scales[0]
        if first is None or any(s is None or not torch.equal(s, first) for s in scales[1:]):
            continue
        if fold.kind == ROWS and fold.into in chosen:  # the writer's own int4 weight: its rows' scales divided
            chosen[fold.into] = chosen[fold.into].rows_divided(first)
        else:
            fold_scale(model, fold, first)
        folded.update(fold.readers)
    for fqn, quantized in chosen.items():
        quantized.assign(model.get_submodule(fqn), fqn in dynamic, divide_input=fqn not in folded)
    return [fqn for fqn, q in chosen.items() if q.input_scale is not None and fqn not in folded]


def unfolded_awq(choices: Mapping[str, tuple[str, int]], folds: Mapping[str, Fold]) -> dict[str, str]:
    """The modules asked AWQ whose input scale cannot be folded into the op before them, each with why:
    no such op, or another Linear reading the same input not asked AWQ at the same group size."""
    problems = {}
    for fqn, (algorithm, group_size) in choices.items():
        if algorithm != AWQ:
            continue
        fold = folds.get(fqn)
        if fold is None:
            problems[fqn] = "no norm or Linear before it writes its input alone (AWQ folds its scales there)"
            continue
        others = [r for r in fold.readers if r != fqn and choices.get(r) != (AWQ, group_size)]
        if others:
            problems[fqn] = (
                f"AWQ folds its input scale into {fold.into}, which {', '.join(others)} also read: "
                f"ask AWQ with group size {group_size} of all of {', '.join(fold.readers)}"
            )
    return problems


def _failure_words(run: list[str], choices: Mapping[str, tuple[str, int]], error: Exception) -> str:
    named = ", ".join(f"{fqn} ({choices[fqn][0]})" for fqn in run[:3]) + (", ..." if len(run) > 3 else "")
    return f"could not quantize {named}: {type(error).__name__}: {error}"


def weights_in_runs(
    model: nn.Module,
    choices: Mapping[str, tuple[str, int]],
    found: dict[str, CompactWeight | Recipe],
    check: bool = False,
    full_range: bool = False,
) -> Iterator[dict[str, InputStatistics]]:
    """GPTQ / AWQ weights of the named Linears (``fqn: (algorithm, group_size)``; other algorithms
    are left to their own passes: ``learned.learned_weights``), a run of modules
    at a time (``gram_runs``): yields the run's statistics, filling, for the caller to pass the
    calibration batches through ``model`` (float; the caller may replace entries, with statistics
    merged across ranks), then computes that run's weights into ``found`` (packed or as a recipe,
    ``QuantizedWeight.compact``) and frees its statistics. The Linears asked AWQ that read one
    input are found together from one of them's statistics (``awq_shares``). ``check``: the recorder's
    shared inputs proved afresh (``SameInput``). ``full_range``: GPTQ on llama.cpp's grid (``gptq``)."""
    shares = awq_shares(choices, input_folds(model))
    recorded = [fqn for fqn, (algorithm, _) in choices.items() if algorithm == GPTQ or fqn in shares]
    features = {fqn: int(model.get_submodule(fqn).weight.shape[1]) for fqn in recorded}
    if not features:
        return
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for run in gram_runs(features, weights, device_free_bytes(model_device(model))):
        with torch.no_grad(), recording(model, run, check) as statistics:
            yield statistics
        solved = [fqn for fqn in run if choices[fqn][0] == GPTQ]
        try:
            with torch.no_grad():
                problems = {fqn: (model.get_submodule(fqn).weight, statistics.pop(fqn), choices[fqn][1]) for fqn in solved}
                found.update({fqn: weight.compact() for fqn, weight in gptq_many(problems, full_range).items()})
                del problems
                for fqn in (fqn for fqn in run if fqn not in solved):
                    group_size = choices[fqn][1]
                    readers = {r: model.get_submodule(r).weight for r in shares[fqn]}
                    for reader, chosen in awq_group(readers, statistics.pop(fqn), group_size).items():
                        if choices.get(reader) == (AWQ, group_size):
                            found[reader] = chosen.compact()
        except AlgorithmError:
            raise
        except Exception as error:
            raise AlgorithmError(_failure_words(run, choices, error)) from error
        del statistics
        give_back()
