"""Projections that are Linears by another name, made ``nn.Linear`` in the session's copy.

transformers' ``Conv1D`` (GPT-2's attention and MLP projections, and the models built on its
blocks) computes ``x @ weight + bias`` with its weight stored transposed, ``(inputs, outputs)``.
Every quantization step here (the formats, GPTQ / AWQ / learned rounding, the size front, an
ExecuTorch program) takes ``nn.Linear`` modules: left as they are, such projections would stay
float without a word. The session's copy (``memory.WatchedCopy``: its own modules around the
user's weights) holds each as an ``nn.Linear`` whose weight is the transposed *view* of the user's
(the same storage, no copy; an in-place change to the user's weight is still noticed), its bias the
user's own: the same outputs, and the module path unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def is_transposed_linear(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (recognised by its class name and ``nf``: the output width), whose
    2-d weight is ``(inputs, outputs)``; core never imports transformers."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
        and weight.shape[1] == getattr(module, "nf", None)
        and not list(module.children())
    )


def as_linear(module: nn.Module) -> nn.Linear:
    """``module`` (``is_transposed_linear``) as an ``nn.Linear`` sharing its weights."""
    inputs, outputs = module.weight.shape
    bias = getattr(module, "bias", None)
    linear = nn.Linear(inputs, outputs, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=module.weight.requires_grad)
    if bias is not None:
        linear.bias = bias
    linear.train(module.training)
    return linear


def linears_in_place(model: nn.Module) -> list[str]:
    """Replaces, in ``model`` (a copy: its modules are changed), every transposed Linear by an
    ``nn.Linear`` sharing its weights; their paths, in order."""
    return replaced_in_place(model, is_transposed_linear, as_linear)


def replaced_in_place(model: nn.Module, takes: Callable[[nn.Module], bool], made: Callable[[nn.Module], nn.Module]) -> list[str]:
    """Replaces, in ``model`` (a copy), every submodule ``takes`` accepts by ``made(submodule)``, at
    the same path; those paths, in order."""
    found = [name for name, module in model.named_modules() if name and takes(module)]
    for name in found:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, made(holder.get_submodule(child)))
    return found


def transposed_words(names: list[str]) -> str:
    """What a run's notes say of the projections ``linears_in_place`` turned."""
    shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return (
        f"{len(names)} projections stored transposed (transformers' Conv1D: {shown}) are quantized as the nn.Linear "
        "they compute, over the same weights"
    )
