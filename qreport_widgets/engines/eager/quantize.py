"""``quantize_weights``: the int4 weight algorithms on a user's own model, as settings as code call them.

The algorithms themselves are in ``algorithms.py`` (round to nearest, HQQ, GPTQ, AWQ) and
``learned.py`` (the rounding learned on each block's output, which builds on the first).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ...core.calibration import gather_with
from ...errors import InvalidSettingsError
from ..settings import ALGORITHMS, DATA_ALGORITHMS, GROUPED_FORMATS
from .algorithms import CompactWeight, Recipe, assign_weights, choose, weights_in_runs
from .formats import full_range_grid
from .learned import LearnedRounding, learned_weights


def quantize_weights(
    model: nn.Module, choices: Mapping[str, tuple], batches: Iterable[Any], target: str = "x86", learned_start: str | None = None
) -> nn.Module:
    """Quantize the named Linears of ``model`` to int4 in place, each ``fqn: (algorithm, group_size)``
    with ``algorithm`` one of ``"rtn"``, ``"hqq"``, ``"gptq"``, ``"awq"``, ``"learned"`` (and a third element
    ``"int8-dynamic-int4-weight"`` for a Linear that quantizes its input to int8 per token as it
    runs, "8da4w"; default ``"int4-weight-only"``): one pass over ``batches``
    (the calibration data: a tensor, a tuple of inputs or a dict per batch; one pass per run of
    modules, ``gram_runs``) gathers what GPTQ and AWQ read of each module's input on the float
    model, then each module's weight is replaced. Returns ``model``.

    ``learned_start``: the values the learned rounding starts from (``EagerOptions.learned_start``).

    What a session's settings as code call for the modules whose algorithm needs data.
    """
    learning = LearnedRounding(start=learned_start)  # a start it does not take: the ValueError, before any work
    modules = dict(model.named_modules())
    formats = {fqn: chosen[2] if len(chosen) > 2 else GROUPED_FORMATS[0] for fqn, chosen in choices.items()}
    choices = {fqn: (chosen[0], chosen[1]) for fqn, chosen in choices.items()}
    for fqn, (algorithm, group_size) in choices.items():
        module = modules.get(fqn)
        if formats[fqn] not in GROUPED_FORMATS:
            raise InvalidSettingsError(f"{fqn}: the format must be one of {', '.join(GROUPED_FORMATS)}, got {formats[fqn]!r}")
        if not isinstance(module, nn.Linear):
            found = type(module).__name__ if module is not None else "no module of that name"
            raise InvalidSettingsError(f"{fqn}: quantize_weights takes Linear modules, found {found}")
        if algorithm not in ALGORITHMS:
            raise InvalidSettingsError(f"{fqn}: unknown weight algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        if module.in_features % group_size:
            raise InvalidSettingsError(f"{fqn}: group size {group_size} does not divide its {module.in_features} input features")
    data = {fqn: chosen for fqn, chosen in choices.items() if chosen[0] in DATA_ALGORITHMS}
    found: dict[str, CompactWeight | Recipe] = {}
    if data:
        batches = list(batches)
        everything = {fqn: (formats[fqn], group, algorithm) for fqn, (algorithm, group) in choices.items()}
        learned = learned_weights(model, everything, found, target=target, options=learning)
        passes = itertools.chain(weights_in_runs(model, data, found, full_range=full_range_grid(target)), learned)
        for _ in passes:  # assigned after every run: the inputs stay float
            with torch.no_grad():
                for batch in batches:
                    gather_with(model, batch)
    with torch.no_grad():
        chosen = {
            fqn: found.pop(fqn).expand(modules[fqn].weight)
            if fqn in found
            else choose(algorithm, modules[fqn].weight, group, full_range=full_range_grid(target))
            for fqn, (algorithm, group) in choices.items()
        }
        assign_weights(model, chosen, [fqn for fqn in chosen if formats[fqn] == GROUPED_FORMATS[1]])
    return model
