"""Passes of the eager simulation that start where a variant first differs from the pass before it.

A model's blocks (``model.layers.3``, ``encoder.layer.1``: the numbered containers its modules sit
in) are each called once a batch, one after the other, each from what the blocks before it gave.
After a pass, every block's output on every batch is kept. The next pass over the same batches
finds the first module, in call order, whose format differs from that pass's; every block that
ended before that module was called gives back its kept output instead of computing it (the same
inputs, the same weights: the same values, bit for bit). Only the blocks from there on run.

Simulations that go through variants one module at a time, in forward order (sensitivity, format
sensitivity, a block's variants) then cost a third to two fifths less on a 12-block decoder
(``benchmarks/eager_replay.py``). A block called more than once a batch, a batch list other than the last
pass's, or kept outputs beyond ``room`` bytes turn it off: every pass is whole, as before.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from ...core.memory import tensors_bytes
from ...core.shortcuts import Shortcut, checking, confirmed, tensors_equal
from ..settings import module_blocks


class BlockReplay:
    """Kept block outputs of ``model``'s last pass over a list of batches, and passes that use them.

    Args:
        model: the simulated model (its modules' formats change between passes).
        modules: the names of the modules whose formats change, in any order.
        room: the most bytes of block outputs kept; beyond, replay is off for this model.
        check: every output given back is also computed from the block's inputs and compared (the
            check mode, ``core.shortcuts``; on as well where the environment asks).
    """

    def __init__(self, model: nn.Module, modules: Sequence[str], room: int, check: bool = False) -> None:
        self.room = room
        self._check = check  # each output given back also computed and compared (``core.shortcuts``)
        self._confirmed: dict[int, Any] = {}  # kept outputs the check mode found as computed (held: ids stay theirs)
        found = {}
        for block, members in module_blocks(modules).items():
            if block in members:  # a module of its own (no numbered part): nothing to skip
                continue
            with contextlib.suppress(AttributeError):
                found[block] = model.get_submodule(block)
        self._blocks: dict[str, nn.Module] = found
        self._modules = {name: model.get_submodule(name) for name in modules}
        self._first_call: dict[str, int] = {}  # module -> its first call's position in a pass
        self._block_end: dict[str, int] = {}  # block -> the position its call ended at
        self._batches: tuple[Any, ...] = ()
        self._formats: dict[str, Hashable] | None = None  # each module's format in the kept pass
        self._kept: dict[str, list[Any]] = {}  # block -> its output on each batch of the kept pass
        self.on = bool(found)
        self.skipped = 0  # block calls given back instead of computed, over the simulation's life

    def forget(self) -> None:
        """Drop the kept outputs (the next pass runs whole)."""
        self._kept, self._formats, self._batches = {}, None, ()
        self._confirmed = {}

    @contextlib.contextmanager
    def passes(self, batches: Sequence[Any], formats: Mapping[str, Hashable]) -> Iterator[Callable[[int], None]]:
        """Within: the passes over ``batches`` of the model configured as ``formats`` says (module ->
        its format), one per batch, in order; before each, the caller says which batch it is. Blocks
        before the first module whose format changed since the kept pass give back their outputs."""
        if not self.on:
            yield lambda index: None
            return
        same_batches = len(batches) == len(self._batches) and all(a is b for a, b in zip(batches, self._batches, strict=True))
        skip = self._skippable(formats) if same_batches and self._formats is not None else []
        learning = not self._first_call
        index = [0]
        recorded: dict[str, list[Any]] = {name: [None] * len(batches) for name in self._blocks if name not in skip}
        calls: dict[str, int] = dict.fromkeys(self._blocks, 0)
        handles = []
        position = [0]

        def record(name: str) -> Callable:
            def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
                calls[name] += 1
                if learning and index[0] == 0:
                    self._block_end.setdefault(name, position[0])
                recorded[name][index[0]] = _copied(output)  # what follows may write into the output

            return hook

        def first_call(name: str) -> Callable:
            def hook(_module: nn.Module, _args: tuple) -> None:
                if index[0] == 0:
                    self._first_call.setdefault(name, position[0])
                    position[0] += 1

            return hook

        checked = checking(self._check)

        def given_back(name: str) -> Callable:
            block = self._blocks[name]

            def forward(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                self.skipped += 1
                held = self._kept[name][index[0]]
                kept = _copied(held)
                if checked and id(held) not in self._confirmed:  # its own forward on its inputs, once a kept output
                    self._confirmed[id(held)] = held
                    computed = functools.partial(type(block).forward, block, *args, **kwargs)
                    return confirmed(Shortcut.BLOCK_REPLAY, kept, computed, tensors_equal, f"{name}'s output on batch {index[0]}")
                return kept

            return forward

        for name, block in self._blocks.items():
            if name in skip:
                block.forward = given_back(name)
            else:
                handles.append(block.register_forward_hook(record(name)))
        if learning:
            handles += [module.register_forward_pre_hook(first_call(name)) for name, module in self._modules.items()]

        def at(batch_index: int) -> None:
            index[0] = batch_index
            position[0] = 0

        try:
            yield at
        except BaseException:  # a pass that failed keeps nothing, nor what it was learning
            self.forget()
            if learning:
                self._first_call, self._block_end = {}, {}
            raise
        finally:
            for handle in handles:
                handle.remove()
            for name in skip:
                del self._blocks[name].forward
        if any(count != len(batches) for count in calls.values()):  # a block called twice a batch, or never
            self.on = False
            self.forget()
            return
        kept = {name: self._kept[name] if name in skip else recorded[name] for name in self._blocks}
        if tensors_bytes([leaf for leaf in tree_leaves(kept) if isinstance(leaf, torch.Tensor)]) > self.room:
            self.on = False
            self.forget()
            return
        self._kept, self._formats, self._batches = kept, dict(formats), tuple(batches)
        live = {id(output) for outputs in kept.values() for output in outputs}
        self._confirmed = {at: output for at, output in self._confirmed.items() if at in live}

    def order(self, variants: Sequence[Mapping[str, Hashable]]) -> list[int]:
        """Positions of ``variants`` (each module's format) in the order to run them: their formats
        in call order, compared as strings, so that each shares with the next the longest run of
        modules, hence of blocks, it can skip (their own order until a pass has shown the call order)."""
        if not self.on or not self._first_call:
            return list(range(len(variants)))
        called = sorted(self._first_call, key=self._first_call.__getitem__)
        keys = [tuple(repr(formats.get(name)) for name in called) for formats in variants]
        return sorted(range(len(variants)), key=keys.__getitem__)

    def _skippable(self, formats: Mapping[str, Hashable]) -> list[str]:
        """The blocks that end before the first call of any module whose format changed."""
        kept = self._formats or {}
        changed = [name for name, key in formats.items() if name not in kept or kept[name] != key]
        first = min((self._first_call.get(name, -1) for name in changed), default=math.inf)
        if first < 0:  # a module never seen called: nothing is known to come before it
            return []
        return [name for name in self._blocks if self._block_end.get(name, math.inf) <= first]


def _copied(value: Any) -> Any:
    """A fresh copy of a kept output (its tensors cloned): what follows may write into it."""
    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), value)
