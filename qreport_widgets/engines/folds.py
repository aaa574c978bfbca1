"""Where a Linear's per-input-channel scale can be folded into the op before it, so that the Linear
reads ``x / s`` at no cost in the program (AWQ's scales, as published).

In a decoder of the Llama layout (``rotation``'s), every Linear's input is written by a norm or a
Linear whose output channels are its input channels:

- ``input_layernorm`` feeds ``q/k/v_proj``, ``post_attention_layernorm`` feeds ``gate/up_proj`` and
  the final norm feeds the head: an RMS norm's scale divided by ``s`` divides its output by ``s``
  (Gemma's, which multiplies by ``1 + w``: ``w -> (1 + w) / s - 1``);
- ``up_proj`` feeds ``down_proj`` through ``act(gate) * up``, linear in ``up``: its rows (and bias)
  divided by ``s`` divide ``down_proj``'s input by ``s``;
- ``v_proj`` feeds ``o_proj`` through the attention's mix of values, linear in them, where every
  head has its own values (no grouped-query attention: one ``o_proj`` input channel per value).

The Linears that read one input share its fold, and so one scale: a fold applies when all of them
take the same scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import InvalidSettingsError
from .rotation import _decoder, _rms_scale

INPUT_SCALE = "input_scale"  # the buffer a Linear divides its input by where no op before takes its AWQ scale
NORM, ROWS = "norm", "rows"  # what a fold divides: a norm's scale, or a Linear's rows
OFFSET_NORM = "offset norm"  # a norm whose scale is 1 + its weight (Gemma's)


@dataclass(frozen=True)
class Fold:
    """The op ``into`` (a norm or a Linear, by ``kind``) whose output the Linears ``readers`` read."""

    into: str
    kind: str
    readers: tuple[str, ...]


def input_folds(model: nn.Module) -> dict[str, Fold]:
    """Each Linear of ``model`` whose input scale folds into the op before it -> that fold: an RMS
    norm's readers (``rotation.LAYOUTS``), ``down_proj`` into ``up_proj``'s rows, ``o_proj`` into
    ``v_proj``'s (empty for a model in no layout the rotations know)."""
    try:
        decoder = _decoder(model)
    except InvalidSettingsError:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    folds: list[Fold] = []

    def norm(owner: nn.Module | None, readers: list[nn.Module]) -> None:
        found = _rms_scale(owner) if owner is not None else None  # OLMo 2's Linears read the stream with no norm
        if found is not None and all(isinstance(r, nn.Linear) for r in readers):  # not a router and its experts
            kind = NORM if found[1] == 1.0 else OFFSET_NORM
            folds.append(Fold(names[id(owner)], kind, tuple(names[id(r)] for r in readers)))

    finals = [read for read in decoder.norms if read.owner not in decoder.layers]
    for layer in decoder.layers:
        for read in (read for read in decoder.norms if read.owner is layer):
            norm(read.norm, read.readers)
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        up, down = getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)
        if isinstance(up, nn.Linear) and isinstance(down, nn.Linear):
            folds.append(Fold(names[id(up)], ROWS, (names[id(down)],)))
        v_proj, o_proj = getattr(attention, "v_proj", None), getattr(attention, "o_proj", None)
        if isinstance(v_proj, nn.Linear) and isinstance(o_proj, nn.Linear) and v_proj.out_features == o_proj.in_features:
            folds.append(Fold(names[id(v_proj)], ROWS, (names[id(o_proj)],)))
    for read in finals:
        norm(read.norm, read.readers)
    return {reader: fold for fold in folds for reader in fold.readers}


def fold_scale(model: nn.Module, fold: Fold, scale: torch.Tensor) -> None:
    """Divide the output of ``fold.into`` by ``scale`` (one value per channel): a norm's scale or a
    Linear's rows and bias, as new Parameters (never written into: the weights may be shared)."""
    owner = model.get_submodule(fold.into)
    with torch.no_grad():
        if fold.kind == NORM:
            owner.weight = nn.Parameter(owner.weight.detach() / scale.to(owner.weight), requires_grad=False)
            return
        if fold.kind == OFFSET_NORM:  # (1 + w') = (1 + w) / s
            weight = owner.weight.detach()
            folded = (1 + weight.double()) / scale.to(weight.device).double() - 1
            owner.weight = nn.Parameter(folded.to(weight.dtype), requires_grad=False)
            return
        weight = owner.weight
        if type(weight) is nn.Parameter or type(weight) is torch.Tensor:
            owner.weight = nn.Parameter(weight.detach() / scale.to(weight)[:, None], requires_grad=False)
        else:  # an int4 / int8 weight of torchao's: its per-row (and per-group) scales divided
            owner.weight = nn.Parameter(rows_divided(weight.detach(), scale), requires_grad=False)
        if owner.bias is not None:
            owner.bias = nn.Parameter(owner.bias.detach() / scale.to(owner.bias), requires_grad=False)


def rows_divided(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torchao's quantized ``weight`` (rows x inputs) with every row's values divided by ``scale``:
    its scales (one per row, or per row and group) divided, the integer values kept."""
    flatten = getattr(weight, "__tensor_flatten__", None)
    if flatten is None or not hasattr(weight, "scale"):
        raise TypeError(f"cannot divide the rows of a {type(weight).__name__}")
    names, context = weight.__tensor_flatten__()
    inner = {name: getattr(weight, name) for name in names}
    found = inner["scale"]
    divisor = scale.to(found.dtype).reshape(-1, *([1] * (found.dim() - 1)))
    inner["scale"] = found / divisor
    return type(weight).__tensor_unflatten__(inner, context, weight.shape, weight.stride())
