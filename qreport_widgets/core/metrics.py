"""Numbers that compare a quantized model's outputs with its float original, whatever made it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

_CHUNK = 1 << 20  # values per step of sqnr_db's float64 sums

# An output this close to the float model's is the float model's output: float32 kernels that sum
# in another order (another thread count, SIMD width or CPU) give a model's output at 120 dB or more
# against itself (benchmarks/float_roundoff.py: 17 models, 4 settings), while int8 noise on any one
# tensor lies 40-50 dB below its signal.
FLOAT_ROUNDOFF_DB = 100.0


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """10 log10(signal power / noise power); inf for an exact match, NaN for an all-zero signal.

    Summed in float64 a million values at a time: float64 copies of whole activations would cost
    several times their size at once."""
    return sqnr_of(*power_terms(reference, approximation))


def layer_sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float | None:
    """``sqnr_db`` of one module's output in two runs; None where the runs gave it different numbers
    of rows (a mixture of experts' expert reads the tokens each run's router chose for it)."""
    return sqnr_db(reference, approximation) if reference.shape == approximation.shape else None


def is_float_output(sqnr: float) -> bool:
    """Whether an output SQNR (dB) is the float model's output: exact, or within float round-off."""
    return sqnr >= FLOAT_ROUNDOFF_DB


def sqnr_apart(a: float, b: float) -> float:
    """How many dB output SQNR ``a`` lies above ``b``, each taken no higher than float round-off:
    inf and 136 dB are both the float model's output, 0 dB apart."""
    return min(a, FLOAT_ROUNDOFF_DB) - min(b, FLOAT_ROUNDOFF_DB)


def sqnr_of(signal: float, noise: float) -> float:
    """SQNR (dB) from summed signal and noise power (``power_terms``, added over parts)."""
    if noise == 0:
        return math.inf if signal > 0 else math.nan
    return 10 * math.log10(signal / noise) if signal > 0 else math.nan


def power_terms(reference: torch.Tensor, approximation: torch.Tensor, signal_power: float | None = None) -> tuple[float, float]:
    """(signal power, noise power) summed over the values, in float64: the parts of one SQNR, which
    add over batches, so that an output can be dropped once its terms are taken. ``signal_power``:
    the reference's, known from before (a reference read against many outputs), not summed again."""
    reference, approximation = reference.detach().reshape(-1), approximation.detach().reshape(-1)
    if reference.shape != approximation.shape:
        raise ValueError(f"cannot compare {reference.numel()} values with {approximation.numel()}")
    signal = torch.zeros((), dtype=torch.float64, device=reference.device)
    noise = torch.zeros((), dtype=torch.float64, device=reference.device)
    # squared in the values' precision (float32 at least), summed into float64: a float64 copy of each
    # chunk cost twice as long for the same sums to 1e-9 (a 262k-vocabulary decoder's logits: 0.4 s)
    wide = reference.dtype if reference.dtype in (torch.float32, torch.float64) else torch.float32
    for start in range(0, reference.numel(), _CHUNK):
        part = reference[start : start + _CHUNK].to(wide)
        if signal_power is None:
            signal += part.square().sum(dtype=torch.float64)
        noise += approximation[start : start + _CHUNK].to(wide).sub_(part).square_().sum(dtype=torch.float64)
    return float(signal) if signal_power is None else signal_power, float(noise)


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


@dataclasses.dataclass(frozen=True)
class Metric:
    """What the session's ``eval_fn`` measures: its name, and whether a higher value is better.

    Targets on it (``fit`` / ``reach``'s ``target_metric``) are met at or above them when higher is
    better (accuracy), at or below them when lower is (perplexity, a loss).

    A metric that needs only the model's outputs on the evaluation batches says so with
    ``batch_terms(batch, output) -> tuple of floats`` (what one batch adds) and ``combine(terms of
    every batch) -> float``: every simulated variant then gives its output SQNR and its metric from
    one pass, and no ``eval_fn`` is needed (``metric="perplexity"`` is one such)."""

    name: str = "metric"
    higher_is_better: bool = True
    batch_terms: Callable[[Any, Any], Sequence[float]] | None = dataclasses.field(default=None, compare=False, repr=False)
    combine: Callable[[Sequence[Sequence[float]]], float] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.batch_terms is None) != (self.combine is None):
            raise ValueError("a Metric read from the outputs needs both batch_terms= and combine= (or neither)")

    @property
    def from_outputs(self) -> bool:
        """Whether the metric is computed from the model's outputs on the evaluation batches alone."""
        return self.batch_terms is not None

    def of_outputs(self, batches: Sequence[Any], outputs: Sequence[Any]) -> float:
        """The metric of ``outputs``, the model's outputs on ``batches`` (``from_outputs`` metrics only)."""
        if self.batch_terms is None or self.combine is None:
            raise ValueError(f"the metric {self.name!r} is not computed from outputs; call its eval_fn")
        return float(self.combine([tuple(self.batch_terms(b, o)) for b, o in zip(batches, outputs, strict=True)]))

    def of_model(self, model: torch.nn.Module, batches: Sequence[Any]) -> float:
        """The metric of ``model`` (a module, or any callable) on ``batches``: one pass (``from_outputs``
        metrics only), a module's batches moved to its device (a real run's CPU copy of a model that
        lives on a GPU)."""
        from .calibration import call_with
        from .devices import model_device, moved

        if isinstance(model, torch.nn.Module):
            device = model_device(model)
            batches = [moved(batch, device) for batch in batches]
        with torch.no_grad():
            return self.of_outputs(batches, [call_with(model, batch) for batch in batches])

    @property
    def label(self) -> str:
        """Its name and direction ("perplexity (lower is better)"); "metric" when unnamed."""
        if self.name == Metric.name:
            return self.name
        return f"{self.name} ({'higher' if self.higher_is_better else 'lower'} is better)"

    @property
    def column(self) -> str:
        """Its column in the runs table."""
        return "your metric" if self.name == Metric.name else self.label

    def meets(self, value: float | None, target: float) -> bool:
        if value is None or math.isnan(value):
            return False
        return value >= target if self.higher_is_better else value <= target

    def gain(self, new: float, old: float) -> float:
        """How much better ``new`` is than ``old`` (negative when it is worse)."""
        return new - old if self.higher_is_better else old - new

    def stricter(self, target: float, by: float) -> float:
        """``target`` made harder to meet by ``by`` (>= 0)."""
        return target + by if self.higher_is_better else target - by

    def allowing(self, reference: float, *, loss: float | None = None, gap: float | None = None) -> float:
        """The target that lets the metric move from ``reference`` (the float model's) in its worse
        direction by at most ``loss`` (a fraction of ``|reference|``) or ``gap`` (in its own units)."""
        by = gap if gap is not None else (loss or 0.0) * abs(reference)
        return reference - by if self.higher_is_better else reference + by

    def words(self, target: float) -> str:
        return f"{self.name} {'>=' if self.higher_is_better else '<='} {target:g}"


def token_ids(batch: Any) -> torch.Tensor | None:
    """A language model's batch's token ids (an integer tensor, batch x tokens): the batch itself,
    the first element of a tuple, or a dict's ``input_ids``; None when it holds none."""
    ids = _first_input(batch)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    return ids


def _first_input(batch: Any) -> Any:
    return batch.get("input_ids") if isinstance(batch, Mapping) else batch[0] if isinstance(batch, (tuple, list)) else batch


def perplexity(model: torch.nn.Module, batches: Any) -> float:
    """exp(mean negative log-likelihood of each next token) of a causal language model on ``batches``.

    A batch is token ids (an integer tensor, batch x tokens), a tuple whose first element they are,
    or a dict with ``input_ids``; the model returns logits (batch x tokens x vocabulary), as a
    tensor or as a Hugging Face output's ``logits``. Every token after the first of each sequence is
    predicted from those before it."""
    batches = list(batches)
    for batch in batches:  # said before the model is called with what it cannot take
        _ids_of(batch)
    return PERPLEXITY.of_model(model, batches)


def _ids_of(batch: Any) -> torch.Tensor:
    ids = token_ids(batch)
    if ids is None:
        raise ValueError(
            f"perplexity needs batches of token ids (an integer tensor of batch x tokens, first in a tuple, or "
            f"input_ids in a dict); a batch gives {_described(_first_input(batch))}. Pass your own eval_fn= for other data."
        )
    return ids


def perplexity_terms(batch: Any, output: Any) -> tuple[float, int]:
    """(summed negative log-likelihood, tokens predicted) of one batch's next tokens, from the
    model's ``output`` on it: what perplexity adds over batches."""
    ids = _ids_of(batch)
    logits = getattr(output, "logits", None)
    logits = logits if isinstance(logits, torch.Tensor) else _first_tensor(output)
    if logits is None or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(
            f"perplexity needs a causal language model's logits (batch x tokens x vocabulary) for token ids of "
            f"shape {tuple(ids.shape)}; the model returned {_described(logits)}. A model whose output has no "
            "logits needs its own eval_fn= (and metric=Metric(name, higher_is_better=...))."
        )
    predicted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    targets = ids[:, 1:].reshape(-1).to(predicted.device)
    total = float(torch.nn.functional.cross_entropy(predicted, targets, reduction="sum"))
    return total, ids[:, 1:].numel()


def _perplexity_of(terms: Sequence[Sequence[float]]) -> float:
    count = sum(t[1] for t in terms)
    if count == 0:
        raise ValueError("perplexity needs sequences of at least two tokens")
    return math.exp(sum(t[0] for t in terms) / count)


PERPLEXITY = Metric("perplexity", higher_is_better=False, batch_terms=perplexity_terms, combine=_perplexity_of)


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "no tensor" if value is None else f"a {type(value).__name__}"
