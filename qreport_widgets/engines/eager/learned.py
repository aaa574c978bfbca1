"""Int4 rounding learned on each block's output: the ``learned`` weight algorithm.

GPTQ and AWQ choose a Linear's int4 values from that Linear's own inputs on the float model. Here
the unit is a decoder block (``model.layers.3``: the numbered containers of ``module_blocks``), and
the block's *output* is what is matched:

1. One calibration pass records the first block's inputs on every batch (its hidden states and the
   keyword arguments the model gives each block: masks, rotary tables; a KV cache is dropped) and
   checks on the first batch that each block reads what the block before it wrote.
2. Block by block, in order: the float block's output on the float inputs is the target; the block
   with its Linears quantized reads the inputs *as the quantized blocks before it wrote them*. For
   every Linear asked ``learned``, each weight's rounding offset ``v`` within half a step of its
   start (0: round to nearest; or GPTQ's values on the block's inputs, ``LearnedRounding.start``)
   and each group's clipping ``c`` in [0.5, 1] (its scale is ``c`` times the group's absolute
   maximum over 7.5) are learned by signed gradient steps on the mean squared error of the block's
   output (the rounding's gradient passed straight through), the step size falling linearly from
   ``1 / steps`` to 0, each step on the next ``LEARNED_BATCHES`` calibration batches; the values
   with the lowest step loss are kept. For int8-dynamic-int4-weight (8da4w) every Linear's input
   is rounded to int8 per token as the kernel does, in the loop.
3. The learned values are kept only where their output error on all calibration batches is lower
   than the start's (``c = 1``): a block never ends worse than where it started.
4. Then the whole model (``tune_scales``): the learned Linears' group scales, their int4 values
   kept, are tuned together by Adam on the divergence of the model's output distribution (a
   decoder's next token: softmax over the output's last dimension) from the float model's, for
   ``LEARNED_EPOCHS`` passes over the calibration batches (the model's own calls, recorded by the
   same pass), every other quantized Linear as the run holds it. Kept only where the divergence
   over all the batches is lower than before; the run's notes say which, with both figures.

The result is torchao's plain int4 layout (values in [-8, 7], one scale per row and group, zero
points 0): the program, its ops and its bytes are round to nearest's. Where the kernels take a
negative scale (x86's dequantize-then-matmul; not XNNPACK's), the grid is the full-range one:
each group's extreme weight lands exactly on -8 (its scale is ``c`` times the group's absolute
maximum over 8, negative where that weight is positive), so all 16 values span the group where
round to nearest's leaves one half unused (``LearnedRounding.full_range``). Linears of the block quantized
by another algorithm take their own weights in the loop; those left float stay float. One block's
activations are held at a time (the float and the quantized inputs and the float outputs of every
calibration batch, and the gradient of one batch through the block); the whole-model stage holds
every quantized Linear's float weight as the run holds it and the gradient of one batch through the
model (its output twice: the float and the quantized).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_leaves

from ...core.metrics import FLOAT_ROUNDOFF_DB, sqnr_db
from ...core.progress import Progress, steps
from ..settings import GPTQ, LEARNED, RTN, module_blocks
from .algorithms import (
    QMAX,
    QMIN,
    AlgorithmError,
    QuantizedWeight,
    choose,
    extreme_sign,
    gptq,
    int4_tensor,
    recording,
    round_to_nearest,
)
from .formats import (
    GROUPED_FORMATS,
    INT8_DYNAMIC,
    INT8_DYNAMIC_INT4,
    X86,
    XNNPACK,
    Rounding,
    fake_quantized_input,
    full_range_grid,
    input_rounding,
)

# signed gradient steps a block, each on this many calibration batches, from round to nearest's
# values (measured on SmolLM2 and the byte decoder, benchmarks/peers.py: one batch a step fits less;
# 100 steps fit the calibration text better and a second text worse than 50)
LEARNED_STEPS = 50
LEARNED_BATCHES = 2
LEARNED_START = RTN
LEARNED_STARTS = (RTN, GPTQ)  # what it can start from (which is better differs by model: README)
# then the whole model: passes over the calibration batches tuning the learned Linears' group scales
# together on the divergence of the model's output from float, Adam's step size (measured on SmolLM2:
# ``benchmarks/peers.py``)
LEARNED_EPOCHS = 4
TUNING_RATE = 2e-3
CLIP_FLOOR = 0.5  # a group's range is at least half its largest weight
CAPTURE = "learned: the first block's inputs"  # the calibration pass item's name
KEPT = "learned rounding kept round to nearest: its values had no lower error on the block's output over the calibration batches"
_SCALE_FLOOR = torch.finfo(torch.float32).eps  # torchao's smallest int4 group scale
TUNED = "learned rounding: its group scales tuned on the whole model's output"
TUNING_KEPT = "learned rounding: the whole model's tuning of its group scales was not kept (no lower divergence)"
DYNAMIC_FORMATS = (INT8_DYNAMIC, INT8_DYNAMIC_INT4)  # the kernel rounds the Linear's input to int8 per token


def decoder_blocks(model: nn.Module, names: list[str]) -> list[str]:
    """The numbered containers (``module_blocks``) the Linears ``names`` sit in, each holding more
    than itself, in the model's own module order."""
    grouped = module_blocks(names)
    order = {name: position for position, (name, _) in enumerate(model.named_modules())}
    return sorted((block for block, members in grouped.items() if block not in members and block in order), key=order.get)


def block_of(fqn: str) -> str | None:
    """The numbered container ``fqn`` sits in, None for a module of its own (``lm_head``)."""
    block = next(iter(module_blocks([fqn])))
    return None if block == fqn else block


def _refuse_outside(learned: Iterable[str], blocks: list[str]) -> None:
    outside = [fqn for fqn in learned if block_of(fqn) not in blocks]
    if outside:
        raise AlgorithmError(f"learned rounding works on a decoder's blocks; {', '.join(outside)} sit in none: choose GPTQ there")


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a KV cache (transformers' ``Cache`` and its kin): state the model writes
    into as it runs, which a block replayed on a batch again must not read or grow."""
    return any(cls.__name__.endswith("Cache") for cls in type(value).__mro__)


def _kept_argument(value: Any) -> Any:
    """A block's keyword argument as it is replayed, kept as given (not copied: a model hands every
    block the same masks and rotary tables; a flex-attention ``BlockMask`` too), a KV cache None.
    ``learn_rounding`` checks the first block replayed with them gives what the model gave."""
    return None if _is_cache(value) else value


class BlockInputs:
    """What a calibration pass records for the learned rounding: the first of ``blocks``' hidden
    states on every batch and each block's keyword arguments; ``merge_`` adds another rank's."""

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        self.blocks = blocks
        self.hidden: list[torch.Tensor] = []  # the first block's input, one tensor a batch
        self.arguments: list[list[dict[str, Any]]] = [[] for _ in blocks]  # block -> its keyword arguments a batch
        self.chained = True  # each block read what the one before it wrote (checked on the first batch)
        self.calls: list[tuple[tuple, dict[str, Any]]] = []  # the model's own inputs a batch (the whole-model stage)
        self._last_output: torch.Tensor | None = None
        self.first_output: torch.Tensor | None = None  # the first block's output on the first batch, as the model ran it
        self.dropped: set[str] = set()  # the keyword arguments not replayed (a KV cache)
        self._handles = [model.register_forward_pre_hook(self._called, with_kwargs=True)]
        for position, name in enumerate(blocks):
            module = model.get_submodule(name)
            self._handles.append(module.register_forward_pre_hook(self._before(position), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after(position)))

    def _called(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        self.calls.append((args, {k: _kept_argument(v) for k, v in kwargs.items()}))

    def _before(self, position: int) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                self.chained = False
                return
            if position == 0:
                self.hidden.append(hidden.detach().clone())
            elif len(self.hidden) == 1 and (self._last_output is None or not torch.equal(self._last_output, hidden)):
                self.chained = False
            rest = {k: _kept_argument(v) for k, v in kwargs.items() if k != "hidden_states"}
            self.dropped.update(k for k, v in kwargs.items() if _is_cache(v))
            rest.update({f"#{i}": a for i, a in enumerate(args[1:], 1)})  # positional ones, by place
            self.arguments[position].append(rest)

        return hook

    def _after(self, position: int) -> Callable:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            if len(self.hidden) == 1:
                self._last_output = _hidden_of(output).detach()
                if position == 0 and self.first_output is None:
                    self.first_output = self._last_output.clone()

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._last_output = None

    def merge_(self, other: BlockInputs) -> BlockInputs:
        """Add ``other``'s batches (another rank's) after these; returns self."""
        self.hidden.extend(other.hidden)
        self.calls.extend(other.calls)
        for mine, theirs in zip(self.arguments, other.arguments, strict=True):
            mine.extend(theirs)
        self.chained = self.chained and other.chained
        self.dropped |= other.dropped
        return self

    def __getstate__(self) -> dict[str, Any]:  # sent across ranks without its hooks
        return {k: v for k, v in self.__dict__.items() if k not in ("_handles", "_last_output")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _handles=[], _last_output=None)


def _hidden_of(output: Any) -> torch.Tensor:
    """A block's output hidden states: the output, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    return next(leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor))


def _call(block: nn.Module, hidden: torch.Tensor, arguments: Mapping[str, Any]) -> torch.Tensor:
    positional = [arguments[k] for k in sorted((k for k in arguments if k.startswith("#")), key=lambda k: int(k[1:]))]
    named = {k: v for k, v in arguments.items() if not k.startswith("#")}
    return _hidden_of(block(hidden, *positional, **named))


@dataclass
class _Rounding:
    """One Linear's learnable rounding: its float weight in groups, each group's largest weight,
    the offsets (``start`` to begin with, kept within half a step of it) and the clipping."""

    weight: torch.Tensor  # float32, rows x groups x group size
    largest: torch.Tensor  # rows x groups: each group's absolute maximum
    start: torch.Tensor  # the offsets of the starting values (0: round to nearest), like weight
    offset: torch.Tensor  # v, like weight, in start -/+ 0.5
    clip: torch.Tensor  # c, rows x groups, in [CLIP_FLOOR, 1]
    sign: torch.Tensor | None = None  # the full-range grid's scale signs, rows x groups; None: positive scales

    @classmethod
    def of(cls, weight: torch.Tensor, group_size: int, values: torch.Tensor | None = None, signed: bool = False) -> _Rounding:
        """``weight``'s rounding, starting from round to nearest, or from int4 ``values`` (rows x
        inputs, on round to nearest's scales: GPTQ's) where given. ``signed``: on the full-range
        grid (the module's notes) instead of round to nearest's."""
        rows, inputs = weight.shape
        grouped = weight.detach().float().reshape(rows, inputs // group_size, group_size)
        largest = grouped.abs().amax(-1)
        start = torch.zeros_like(grouped)
        if values is not None:  # the offset that rounds each weight to its starting value
            exact = grouped / (largest / ((QMAX - QMIN) / 2)).clamp_min(_SCALE_FLOOR)[..., None]
            start = values.reshape(grouped.shape).float() - exact
        sign = None
        if signed:  # the group's extreme weight lands on QMIN: a negative scale where that weight is positive
            sign = extreme_sign(grouped)
        clip = torch.ones(grouped.shape[:2], dtype=grouped.dtype, device=grouped.device)
        return cls(grouped, largest, start, start.clone().requires_grad_(True), clip.requires_grad_(True), sign)

    def scale(self, clip: torch.Tensor | None = None) -> torch.Tensor:
        clip = self.clip if clip is None else clip
        if self.sign is None:
            return (self.largest * clip / ((QMAX - QMIN) / 2)).clamp_min(_SCALE_FLOOR)
        return (self.largest * clip / -QMIN).clamp_min(_SCALE_FLOOR) * self.sign

    def values(self, offset: torch.Tensor | None = None, clip: torch.Tensor | None = None, straight: bool = False) -> tuple:
        """(int4 values, scales) for ``offset`` and ``clip`` (the learned ones by default);
        ``straight``: the rounding's gradient passed straight through."""
        offset = self.offset if offset is None else offset
        scale = self.scale(clip)
        x = self.weight / scale[..., None] + offset
        rounded = torch.round(x)
        if straight:
            rounded = x + (rounded - x).detach()
        return torch.clamp(rounded, QMIN, QMAX), scale

    def dequantized(self, offset: torch.Tensor | None = None, clip: torch.Tensor | None = None) -> torch.Tensor:
        straight = offset is None and clip is None
        values, scale = self.values(offset, clip, straight)
        return (values * scale[..., None]).reshape(self.weight.shape[0], -1)

    def step(self, rate: float) -> None:
        """One signed gradient step of size ``rate``, then both kept in their ranges."""
        with torch.no_grad():
            if self.offset.grad is not None:
                self.offset.sub_(rate * torch.sign(self.offset.grad))
                self.offset.copy_(torch.minimum(torch.maximum(self.offset, self.start - 0.5), self.start + 0.5))
                self.offset.grad = None
            if self.clip.grad is not None:
                self.clip.sub_(rate * torch.sign(self.clip.grad)).clamp_(CLIP_FLOOR, 1.0)
                self.clip.grad = None

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.offset.detach().clone(), self.clip.detach().clone()

    @property
    def beginning(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The starting offsets and clipping."""
        return self.start, torch.ones_like(self.largest)

    def result(self, group_size: int, dtype: torch.dtype, chosen: tuple[torch.Tensor, torch.Tensor]) -> QuantizedWeight:
        """The int4 weight of ``chosen`` (offsets, clipping), checked to lie on the int4 grid: whole
        values in [-8, 7] and finite, non-zero group scales (in ``dtype``, as the run stores them)."""
        with torch.no_grad():
            values, scale = self.values(*chosen)
        stored = scale.to(dtype)
        if not (torch.equal(values, values.round()) and bool(((values >= QMIN) & (values <= QMAX)).all())):
            raise AlgorithmError("learned rounding: its values left the int4 grid (whole numbers in [-8, 7]); please report it")
        if not bool((torch.isfinite(stored) & (stored != 0)).all()):
            raise AlgorithmError(f"learned rounding: a group scale is zero or not finite in {dtype}; please report it")
        return QuantizedWeight(int4_tensor(values.reshape(self.weight.shape[0], -1), scale, group_size, dtype))


def _constant(weight: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: weight


@contextlib.contextmanager
def _linears_as(
    block: nn.Module, prefix: str, weights: Mapping[str, Callable[[], torch.Tensor]], dynamic: Mapping[str, Rounding]
) -> Iterator[None]:
    """Within: each named Linear of ``block`` multiplies by ``weights[fqn]()``, its input first
    rounded to int8 where ``dynamic`` names it (as its kernel rounds it: ``fake_quantized_input``),
    the rounding's gradient passed straight through."""
    replaced = []
    for fqn, weight_of in weights.items():
        module = block.get_submodule(fqn[len(prefix) + 1 :] if prefix else fqn)

        def forward(
            x: torch.Tensor,
            module: nn.Module = module,
            weight_of: Callable = weight_of,
            rounding: str | None = dynamic.get(fqn),
        ) -> torch.Tensor:
            if rounding is not None:
                x = x + (fake_quantized_input(x.detach().float(), rounding).to(x.dtype) - x).detach()
            return F.linear(x, weight_of().to(x.dtype), module.bias)

        module.forward = forward
        replaced.append(module)
    try:
        yield
    finally:
        for module in replaced:
            del module.forward


def _or(given: Any, default: Any) -> Any:
    """``given``, else the module's default (read when the rounding runs, so a changed default counts)."""
    return default if given is None else given


@dataclass(frozen=True)
class LearnedRounding:
    """How the learned rounding runs: ``steps`` signed gradient steps a block, each on the gradient
    of ``batches`` calibration batches (the next ones in turn), the step size falling linearly from
    ``rate`` (None: ``1 / steps``) to 0, from ``start``'s values (``"rtn"``: round to nearest's,
    ``"gptq"``: GPTQ's on the block's inputs), on the full-range grid (``full_range``; None: where
    the target's kernels take negative scales and the start is round to nearest's); then ``epochs``
    passes of the whole-model stage at Adam's step size ``tuning_rate`` (0 epochs: none). None: the
    module's defaults (``LEARNED_STEPS``, ``LEARNED_BATCHES``, ``LEARNED_START``, ``LEARNED_EPOCHS``,
    ``TUNING_RATE``), read when it runs."""

    steps: int | None = None
    batches: int | None = None
    rate: float | None = None
    start: str | None = None
    full_range: bool | None = None
    epochs: int | None = None
    tuning_rate: float | None = None

    def __post_init__(self) -> None:
        if self.start is not None and self.start not in LEARNED_STARTS:
            raise ValueError(f"learned_start must be {' or '.join(map(repr, LEARNED_STARTS))}, got {self.start!r}")

    @property
    def step_count(self) -> int:
        return _or(self.steps, LEARNED_STEPS)

    @property
    def batch_count(self) -> int:
        return _or(self.batches, LEARNED_BATCHES)

    @property
    def epoch_count(self) -> int:
        return _or(self.epochs, LEARNED_EPOCHS)

    @property
    def rate_of_tuning(self) -> float:
        return _or(self.tuning_rate, TUNING_RATE)

    @property
    def starts_from(self) -> str:
        return _or(self.start, LEARNED_START)

    def signed(self, target: str) -> bool:
        """Whether the rounding is learned on the full-range grid for ``target``."""
        if self.full_range is None:
            return target != XNNPACK and self.starts_from == RTN
        if self.full_range and self.starts_from != RTN:
            raise AlgorithmError("the learned rounding's full-range grid starts from round to nearest: start='rtn'")
        if self.full_range and target == XNNPACK:
            raise AlgorithmError("XNNPACK's int4 kernels take positive scales only: full_range=False there")
        return self.full_range

    def step_size(self, step: int) -> float:
        count = self.step_count
        return (1.0 - step / count) * (self.rate if self.rate is not None else 1.0 / count)


def learn_rounding(
    model: nn.Module,
    inputs: BlockInputs,
    learned: Mapping[str, int],
    fixed: Mapping[str, torch.Tensor] | None = None,
    dynamic: Mapping[str, Rounding] | None = None,
    *,
    options: LearnedRounding = LearnedRounding(),
    target: str = X86,
    progress: Progress | None = None,
) -> dict[str, QuantizedWeight]:
    """The int4 weights of the Linears ``learned`` names (fqn -> group size) of ``model`` (float;
    never changed), learned block by block on the calibration batches ``inputs`` recorded. ``fixed``:
    the other quantized Linears' weights (dequantized) as the run will hold them; ``dynamic``: the
    Linears whose input the kernel rounds to int8 -> how (``formats.input_rounding``);
    ``target``: the kernels' (``LearnedRounding.signed``). ``progress`` is called after each block (it
    may raise to stop)."""
    fixed, dynamic = dict(fixed or {}), dict(dynamic or {})
    if not inputs.hidden:
        raise AlgorithmError(
            "learned rounding reads each block's inputs on the calibration batches, and none reached the first block"
        )
    if not inputs.chained:
        raise AlgorithmError(
            "learned rounding replays the model block by block, and here a block does not read what the block before it "
            "wrote (blocks: " + ", ".join(inputs.blocks[:3]) + ", ...): choose GPTQ for these Linears"
        )
    _refuse_outside(learned, inputs.blocks)
    _check_replay(model, inputs)
    signed = options.signed(target)
    found: dict[str, QuantizedWeight] = {}
    float_in = list(inputs.hidden)
    quant_in = list(inputs.hidden)
    last = max(inputs.blocks.index(block_of(fqn)) for fqn in learned)
    with steps(last + 1, "learned rounding", "block", progress) as step:
        for position, name in enumerate(inputs.blocks[: last + 1]):
            block = model.get_submodule(name)
            arguments = inputs.arguments[position]
            with torch.no_grad():
                float_out = [_call(block, h, a) for h, a in zip(float_in, arguments, strict=True)]
            own = {fqn: group for fqn, group in learned.items() if block_of(fqn) == name}
            others = {fqn: w for fqn, w in fixed.items() if block_of(fqn) == name}
            found.update(
                _learn_block(
                    block, name, own, others, dynamic, quant_in, float_out, arguments, options, signed, full_range_grid(target)
                )
            )
            settled = {fqn: _constant(q.dequantize(torch.float32)) for fqn, q in found.items() if fqn in own}
            settled.update({fqn: _constant(w) for fqn, w in others.items()})
            with torch.no_grad(), _linears_as(block, name, settled, dynamic):
                quant_in = [_call(block, h, a) for h, a in zip(quant_in, arguments, strict=True)]
            float_in = float_out
            step()
    return found


def _check_replay(model: nn.Module, inputs: BlockInputs) -> None:
    """The first block called alone on the first batch with the arguments recorded gives what it gave
    inside the model (to float round-off); AlgorithmError naming what was not replayed otherwise."""
    if inputs.first_output is None:
        return
    with torch.no_grad():
        replayed = _call(model.get_submodule(inputs.blocks[0]), inputs.hidden[0], inputs.arguments[0][0])
    found = sqnr_db(inputs.first_output.float(), replayed.float())
    if found < FLOAT_ROUNDOFF_DB:
        dropped = f" (not replayed: {', '.join(sorted(inputs.dropped))})" if inputs.dropped else ""
        raise AlgorithmError(
            f"learned rounding replays the model block by block with the arguments the model gave each block{dropped}, "
            f"and {inputs.blocks[0]} replayed gives another output than in the model ({found:.1f} dB): choose GPTQ for "
            "these Linears"
        )


def _learn_block(
    block: nn.Module,
    name: str,
    own: Mapping[str, int],
    others: Mapping[str, torch.Tensor],
    dynamic: Mapping[str, Rounding],
    quant_in: list[torch.Tensor],
    float_out: list[torch.Tensor],
    arguments: list[dict[str, Any]],
    options: LearnedRounding,
    signed: bool = False,
    full_range: bool = False,
) -> dict[str, QuantizedWeight]:
    if not own:
        return {}
    floats = {fqn: block.get_submodule(fqn[len(name) + 1 :]).weight for fqn in own}
    starts = _gptq_starts(block, name, own, quant_in, arguments) if options.starts_from == GPTQ else {}
    roundings = {fqn: _Rounding.of(floats[fqn], group, starts.get(fqn), signed) for fqn, group in own.items()}
    weights: dict[str, Callable[[], torch.Tensor]] = {fqn: r.dequantized for fqn, r in roundings.items()}
    weights.update({fqn: _constant(w) for fqn, w in others.items()})
    parameters = {p for p in block.parameters() if p.requires_grad}
    for p in parameters:
        p.requires_grad_(False)  # only the rounding learns
    best, least = None, float("inf")
    try:
        with _linears_as(block, name, weights, dynamic):
            for step in range(options.step_count):
                total = 0.0
                for part in range(options.batch_count):
                    index = (step * options.batch_count + part) % len(quant_in)
                    output = _call(block, quant_in[index], arguments[index])
                    loss = F.mse_loss(output.float(), float_out[index].float()) / options.batch_count
                    loss.backward()
                    total += float(loss.detach())
                if total < least:  # the values this step's gradient was taken at
                    best, least = {fqn: r.snapshot() for fqn, r in roundings.items()}, total
                for rounding in roundings.values():
                    rounding.step(options.step_size(step))
    finally:
        for p in parameters:
            p.requires_grad_(True)
    # torchao's round to nearest (what the run gives without the learned rounding), the start (GPTQ's
    # values, or the full-range grid before any step), the best step's values and the last step's: each
    # as the run would hold it, judged on the block's output error summed over every calibration batch
    nearest = {
        fqn: QuantizedWeight(round_to_nearest(floats[fqn], group, full_range=full_range), None, KEPT, full_range)
        for fqn, group in own.items()
    }
    candidates = {"round to nearest": nearest}
    for key, chosen in (("start", {fqn: r.beginning for fqn, r in roundings.items()}), ("learned", best)):
        if chosen is not None and (key != "start" or starts or signed):  # an unsigned start is round to nearest
            candidates[key] = {fqn: r.result(own[fqn], floats[fqn].dtype, chosen[fqn]) for fqn, r in roundings.items()}
    candidates["last"] = {fqn: r.result(own[fqn], floats[fqn].dtype, r.snapshot()) for fqn, r in roundings.items()}
    errors = {
        key: _block_error(block, name, {**others, **{fqn: q.dequantize(torch.float32) for fqn, q in found.items()}}, dynamic,
                          quant_in, float_out, arguments)
        for key, found in candidates.items()
    }  # fmt: skip
    return candidates[min(errors, key=errors.get)]  # round to nearest on a tie


def _gptq_starts(
    block: nn.Module, name: str, own: Mapping[str, int], quant_in: list[torch.Tensor], arguments: list[dict[str, Any]]
) -> dict[str, torch.Tensor]:
    """GPTQ's int4 values of the block's Linears ``own`` on the inputs the quantized blocks before
    it give (each Linear's input statistics gathered on the float block); none where GPTQ kept
    round to nearest."""
    local = {fqn[len(name) + 1 :]: fqn for fqn in own}
    with torch.no_grad(), recording(block, list(local)) as statistics:
        for hidden, argument in zip(quant_in, arguments, strict=True):
            _call(block, hidden, argument)
    starts = {}
    for inner, fqn in local.items():
        found = gptq(block.get_submodule(inner).weight, statistics[inner], own[fqn])
        if not found.note:
            starts[fqn] = found.tensor.qdata
    return starts


def _block_error(
    block: nn.Module,
    name: str,
    weights: Mapping[str, torch.Tensor],
    dynamic: Mapping[str, Rounding],
    quant_in: list[torch.Tensor],
    float_out: list[torch.Tensor],
    arguments: list[dict[str, Any]],
) -> float:
    """The block's squared output error summed over every batch, its Linears ``weights`` names
    multiplying by those (dequantized) weights, their inputs rounded where ``dynamic`` says."""
    total = 0.0
    with torch.no_grad(), _linears_as(block, name, {fqn: _constant(w) for fqn, w in weights.items()}, dynamic):
        for hidden, target, argument in zip(quant_in, float_out, arguments, strict=True):
            total += float((_call(block, hidden, argument).float() - target.float()).pow(2).sum(dtype=torch.float64))
    return total


@dataclass
class _Scales:
    """One Linear's int4 values, fixed, and its group scales, learnable: each the start's times
    ``exp(log)`` (the sign kept: the full-range grid's negative scales stay negative)."""

    values: torch.Tensor  # float32, rows x groups x group size
    start: torch.Tensor  # rows x groups
    log: torch.Tensor  # rows x groups, 0 to begin with

    @classmethod
    def of(cls, weight: QuantizedWeight) -> _Scales:
        tensor = weight.tensor
        rows, inputs = tensor.qdata.shape
        scale = tensor.scale.detach().float()
        values = tensor.qdata.float().reshape(rows, scale.shape[1], inputs // scale.shape[1])
        return cls(values, scale, torch.zeros_like(scale, requires_grad=True))

    def dequantized(self) -> torch.Tensor:
        return (self.values * (self.start * torch.exp(self.log))[..., None]).reshape(self.values.shape[0], -1)

    def result(self, weight: QuantizedWeight, keep_start: bool) -> QuantizedWeight:
        if keep_start:
            return weight
        tensor = weight.tensor
        with torch.no_grad():
            scale = self.start * torch.exp(self.log)
        # tuned, not round to nearest's any more (a note would make ``compact`` rebuild it as such)
        return replace(weight, tensor=int4_tensor(tensor.qdata, scale, tensor.block_size[1], tensor.dtype), note="")


def _log_scores(output: Any) -> torch.Tensor:
    """The model output's first tensor (a decoder's logits) as log-probabilities over its last dimension."""
    return F.log_softmax(_hidden_of(output).float(), dim=-1)


def tune_scales(
    model: nn.Module,
    calls: list[tuple[tuple, dict[str, Any]]],
    learned: Mapping[str, QuantizedWeight],
    fixed: Mapping[str, torch.Tensor] | None = None,
    dynamic: Mapping[str, Rounding] | None = None,
    *,
    options: LearnedRounding = LearnedRounding(),
    progress: Progress | None = None,
) -> tuple[dict[str, QuantizedWeight], str]:
    """The whole-model stage: the group scales of the ``learned`` int4 weights (their values kept)
    tuned together so that ``model``'s output with them (``fixed``, ``dynamic`` as ``learn_rounding``
    takes them) matches the float model's on the batches ``calls`` recorded: the divergence of its
    output's distribution over the last dimension (a decoder's next token) from the float output's,
    by Adam (``LearnedRounding.tuning_rate``, warmed up over the first epoch, then falling
    linearly to 0), ``LearnedRounding.epoch_count`` passes over the batches. The tuned scales are
    kept only where their divergence over all the batches is lower than the start's. Returns the
    weights and a note saying which it kept."""
    fixed, dynamic = dict(fixed or {}), dict(dynamic or {})
    epochs = options.epoch_count
    if not epochs or not calls or not learned:
        return dict(learned), ""
    tuned = {fqn: _Scales.of(weight) for fqn, weight in learned.items()}
    weights: dict[str, Callable[[], torch.Tensor]] = {fqn: t.dequantized for fqn, t in tuned.items()}
    weights.update({fqn: _constant(w) for fqn, w in fixed.items()})
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # only the scales learn
    optimizer = torch.optim.Adam([t.log for t in tuned.values()], lr=options.rate_of_tuning)
    warm, total = len(calls), epochs * len(calls)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: (k + 1) / (warm + 1) if k < warm else (total - k) / (total - warm + 1)
    )

    def divergence(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            target = _log_scores(model(*args, **kwargs))
        with _linears_as(model, "", weights, dynamic):
            output = _log_scores(model(*args, **kwargs))
        return F.kl_div(output, target, log_target=True, reduction="none").sum(-1).mean()

    def over_all() -> float:
        with torch.no_grad():
            return sum(float(divergence(*call)) for call in calls)

    try:
        with steps(total + 2, "learned rounding: whole model", "batch", progress) as step:
            before = over_all()
            step()
            for k in range(total):
                loss = divergence(*calls[k % len(calls)])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
                step()
            after = over_all()
            step()
    finally:
        for p in frozen:
            p.requires_grad_(True)
    keep = not after < before
    found = {fqn: tuned[fqn].result(weight, keep) for fqn, weight in learned.items()}
    words = f"the divergence of the model's output from float on the calibration batches: {before:.4g} before, {after:.4g} after"
    return found, (TUNING_KEPT if keep else TUNED) + f" ({words})"


def learned_weights(
    model: nn.Module,
    formats: Mapping[str, tuple[str, int, str]],
    found: dict[str, Any],
    *,
    target: str,
    quantize: Callable[[nn.Module, tuple[str, int, str]], QuantizedWeight] | None = None,
    options: LearnedRounding = LearnedRounding(),
    progress: Progress | None = None,
    notes: list[str] | None = None,
) -> Iterator[dict[str, BlockInputs]]:
    """The learned weights of the modules ``formats`` (fqn -> (format, group size, algorithm)) asks
    ``learned`` of, into ``found`` (packed, ``QuantizedWeight.compact``): yields once, an item that
    records the first block's inputs while the caller passes the calibration batches through
    ``model`` (float; the caller may replace the item by every rank's merged), then learns block by
    block (``learn_rounding``). The block's other quantized Linears take their own weights in the
    loop: from ``found`` (GPTQ / AWQ, found first), else their int4 values chosen here (round to
    nearest, HQQ), else ``quantize(module, format)`` (int8 formats; without it they stay float there);
    every quantized Linear outside them too for the whole-model stage (``tune_scales``), whose note
    is appended to ``notes``."""
    learned = {fqn: group for fqn, (_, group, algorithm) in formats.items() if algorithm == LEARNED}
    if not learned:
        return
    linears = [fqn for fqn, module in model.named_modules() if isinstance(module, nn.Linear)]
    blocks = decoder_blocks(model, linears)
    _refuse_outside(learned, blocks)
    gathered = {CAPTURE: BlockInputs(model, blocks)}
    try:
        yield gathered
    finally:
        gathered[CAPTURE].close()
    whole = options.epoch_count > 0  # the whole-model stage reads every quantized Linear as the run holds it
    touched = {block_of(fqn) for fqn in learned}
    fixed, dynamic = {}, {}
    with torch.no_grad():
        for fqn, (name, group, algorithm) in formats.items():
            if name in DYNAMIC_FORMATS:
                dynamic[fqn] = input_rounding(name, target)
            if fqn in learned or not isinstance(model.get_submodule(fqn), nn.Linear):
                continue
            if block_of(fqn) not in touched and not whole:
                continue
            module = model.get_submodule(fqn)
            if fqn in found:
                fixed[fqn] = found[fqn].expand(module.weight).dequantize(torch.float32)
            elif name in GROUPED_FORMATS:
                fixed[fqn] = choose(algorithm, module.weight, group, full_range=full_range_grid(target)).dequantize(torch.float32)
            elif quantize is not None:
                fixed[fqn] = quantize(module, (name, group, algorithm)).dequantize(torch.float32)
    inputs = gathered[CAPTURE]
    results = learn_rounding(model, inputs, learned, fixed, dynamic, options=options, target=target, progress=progress)
    results, note = tune_scales(model, inputs.calls, results, fixed, dynamic, options=options, progress=progress)
    if notes is not None and note:
        notes.append(note)
    found.update({fqn: weight.compact() for fqn, weight in results.items()})
