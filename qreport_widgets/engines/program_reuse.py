"""A program lowered before, reused for a model whose exported graph is the same and whose weights differ.

Lowering to XNNPACK (``to_edge_transform_and_lower``: decompositions, edge passes, partitioning,
XNNPACK's preprocess) costs minutes on a decoder, and depends on the graph, not on the weights. Two
runs that differ only in the int4 values and scales an algorithm chose (round to nearest against
GPTQ, say) export the same graph. XNNPACK keeps each delegated constant in the program's named data,
its bytes stored once under a key that is the SHA-256 of those bytes (``scale_`` before a group scale's),
the delegate's graph naming the key. So a weight change is, in the ``.pte``, each changed constant's
bytes written in place and its key renamed: the program a fresh lowering gives, byte for byte
(``tests/test_eager_xnnpack.py`` checks it on the trained decoder's GPTQ program).

Every rewrite proves itself on the earlier program first. A changed constant's earlier bytes, in the
form XNNPACK stores them (int4 values two to a byte, offset by 8, the even column in the low nibble;
group scales as bfloat16; other floats as float32; else as they are), must be stored under their key
and found exactly once in the ``.pte``, and the new bytes be as long. No blob may be stored once for a
changed constant and an unchanged one, or for two constants that change apart, and no new key be one
the program has: a fresh lowering would store two blobs where the earlier program has one, or one
where it has two.

A constant that is not delegated (a norm's weight, an embedding ExecuTorch's own kernels read) is the
program's own: the emitter stores it once per distinct value, so a change can merge or split blobs (a
rotation sets every RMSNorm's weight to 1: one blob where there were 61). For those, ``edge_with``
takes the earlier lowering's edge program (kept, unserialised, beside its program, with the constants
it holds: ``KeptEdge``), writes the new values of the constants ExecuTorch's own kernels read into a
copy, and serialises it again (``to_executorch``: seconds, where the lowering before it took minutes);
``rewritten`` then writes the delegated ones into that program as above, from the values the edge
program holds (a program rewritten since holds others: its edge program is still the lowering's). It
proves first that every constant of the edge program outside the delegates is one the export had,
under its name and with the value it holds (none folded from others by the lowering), or a scalar the
lowering lifted from the graph's literals. Anything else this does not find as expected sends the run
to a full lowering. The delegated constants are not read back from the edge program: that its
``holds`` are the delegates' values rests on ``KeptEdge`` being made once, at the lowering, and never
changed; the check mode (``core.shortcuts``) lowers afresh and compares the bytes.

May import: ``core``.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# one leaf of a constant: its path inside the constant ("" for a plain tensor) and the tensor
Leaf = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class Structure:
    """What a lowering depends on besides the weights (``key``), and the exported constants' leaves."""

    key: str
    leaves: dict[str, list[Leaf]]


@dataclass(frozen=True)
class Rewritten:
    """An earlier program with another model's weights written in: its bytes, and how many constants changed."""

    pte: bytes
    constants: int


@dataclass(frozen=True)
class KeptEdge:
    """A lowering's edge program, unserialised, and the constants it holds (``holds``: those of the
    export it was lowered from). A program rewritten from it keeps this value as it is: the delegated
    weights its edge program holds are still the first lowering's, whatever the program's bytes hold."""

    edge: Any
    holds: Structure


@dataclass(frozen=True)
class EdgeWritten:
    """An earlier lowering's edge program (a copy) with new constants outside the delegates written in
    (``edge_with``): the constants the program it serialises to holds, and how many were written."""

    edge: Any
    holds: Structure
    constants: int


def structure(exported: torch.export.ExportedProgram, *lowering: Any) -> Structure:
    """``exported``'s graph, signature, input shapes and constants' types, shapes and dtypes, with the
    lowering's own arguments (``lowering``), as one key; and every constant's tensors."""
    constants = [*exported.state_dict.items(), *exported.constants.items()]
    leaves = {name: list(_leaves(value, "")) for name, value in constants if isinstance(value, torch.Tensor)}
    lines = [repr(lowering), str(exported.graph_signature), repr(sorted(map(str, exported.range_constraints.items())))]
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        shape = (tuple(map(str, value.shape)), str(value.dtype)) if isinstance(value, torch.Tensor) else None
        lines.append(f"{node.op} {node.name} {node.target} {node.args} {node.kwargs} {shape}")
    for name, value in constants:
        context = "" if _is_plain(value) else repr(_plain(value.__tensor_flatten__()[1]))  # block size, dtypes, ...
        lines.append(f"{name} {type(value).__name__} {context}")  # a script object: the same only if of the same kind
        lines.extend(f"{name}{path} {tuple(t.shape)} {t.dtype}" for path, t in leaves.get(name, ()))
    return Structure(hashlib.sha256("\n".join(lines).encode()).hexdigest(), leaves)


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is a plain tensor or parameter (not a subclass that flattens itself), or no tensor."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) or not hasattr(value, "__tensor_flatten__")


def _leaves(value: torch.Tensor, path: str) -> Iterator[Leaf]:
    """A tensor subclass's inner tensors (torchao's quantized weights: values, scales, zero points), as
    it flattens itself; a plain tensor as itself."""
    if _is_plain(value):
        yield path, value.detach()
        return
    names, _ = value.__tensor_flatten__()
    for name in names:
        yield from _leaves(getattr(value, name), f"{path}.{name}")


def _plain(value: Any) -> Any:
    """``value`` with each enum member as its value: torchao gives a weight's activation quantization
    as a string or as the string enum member, depending on how the weight was made, for the same graph."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


# the programs lowered in this process, by structure key, held weakly: a program the session has let
# go of is not kept alive for reuse
LOWERED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def rewritten(pte: bytes, before: Structure, after: Structure) -> Rewritten | None:
    """The program ``pte`` (lowered from constants ``before``) with the constants ``after`` written in
    its place, or None where that cannot be done as a fresh lowering would do it (module docstring)."""
    if before.key != after.key:
        return None
    keys = _keys_in(pte)
    writes: dict[bytes, bytes] = {}  # a changed constant's stored bytes, earlier -> now
    kept: set[bytes] = set()  # the keys of the stored bytes of constants that did not change
    changed = 0
    for name, leaves in after.leaves.items():
        for (_, earlier), (_, now) in zip(before.leaves[name], leaves, strict=True):
            earlier, now = earlier.detach().cpu(), now.detach().cpu()
            form, stored = _stored(keys, earlier)
            if torch.equal(earlier, now):
                if stored is not None:
                    kept.add(_key(stored))
                continue
            changed += 1
            replacement = None if form is None else form(now)
            if stored is None or replacement is None or len(replacement) != len(stored):
                return None  # not a constant XNNPACK stores, or not as this reads it
            if writes.setdefault(stored, replacement) != replacement:
                return None  # one stored blob asked to become two
    if any(_key(stored) in kept for stored in writes):
        return None  # stored once for a changed constant and an unchanged one: a lowering now stores two
    return _written(pte, keys, {stored: now for stored, now in writes.items() if now != stored}, changed)


def edge_with(kept: KeptEdge, after: Structure) -> EdgeWritten | None:
    """A copy of ``kept``'s edge program (lowered, not serialised) with ``after``'s new values of the
    constants outside the delegates written in, and the constants the program it serialises to holds
    (``kept.holds``, those replaced): ``rewritten`` of that program, from those, writes the delegated
    ones. None where none of the changed constants is outside the delegates, or where the edge program
    holds a constant the export did not have (but a scalar: the lowering lifts the graph's literals, as
    ``_lifted_tensor_constant``), or had with another value (one the lowering folded from others,
    which the new values would not reach)."""
    before = kept.holds
    if before.key != after.key:
        return None
    program = kept.edge.exported_program()
    held = {**program.state_dict, **program.constants}
    tensors = {name: value for name, value in held.items() if isinstance(value, torch.Tensor)}
    for name, value in tensors.items():
        earlier = before.leaves.get(name)
        if earlier is None and value.dim() == 0:  # a scalar the lowering lifted from the graph's literals
            continue
        if earlier is None or len(earlier) != 1 or not _is_plain(value) or not _equal(value, earlier[0][1]):
            return None
    changed = [
        name
        for name, leaves in after.leaves.items()
        if any(not _equal(a, b) for (_, a), (_, b) in zip(before.leaves[name], leaves, strict=True))
    ]
    outside = [name for name in changed if name in tensors]
    if not outside:
        return None
    copied = copy.deepcopy(kept.edge)
    written = copied.exported_program()
    for name in outside:
        place = written.state_dict if name in written.state_dict else written.constants
        value = after.leaves[name][0][1].detach().to(tensors[name].device).clone()
        if isinstance(place[name], torch.nn.Parameter):
            value = torch.nn.Parameter(value, requires_grad=place[name].requires_grad)
        place[name] = value
    leaves = {**before.leaves, **{name: after.leaves[name] for name in outside}}
    return EdgeWritten(copied, Structure(before.key, leaves), len(outside))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().cpu(), b.detach().cpu())


Keys = dict[bytes, list[int]]  # each named-data key in the program, and where it occurs


def _keys_in(pte: bytes) -> Keys:
    """Where each named-data key (64 hex digits, alone) occurs in the program: the runs of exactly 64
    lowercase hex digits, found a window at a time (a decoder's program is hundreds of MB)."""
    found: Keys = {}
    data = np.frombuffer(pte, dtype=np.uint8)
    for start in range(0, len(data), _WINDOW):
        # a byte before the window (a run must not start earlier) and a key's length plus one after it
        low, high = max(start - 1, 0), min(start + _WINDOW + _KEY_LENGTH + 1, len(data))
        hex_digit = _HEX_DIGIT[data[low:high]].view(np.int8)
        edges = np.diff(hex_digit, prepend=np.int8(0), append=np.int8(0))
        begins, ends = np.flatnonzero(edges == 1) + low, np.flatnonzero(edges == -1) + low
        ours = (begins >= start) & (begins < start + _WINDOW)
        closed = (ends < high) | (high == len(data))  # the byte after it seen, or the program's end
        for at in begins[ours & closed & (ends - begins == _KEY_LENGTH)].tolist():
            found.setdefault(pte[at : at + _KEY_LENGTH], []).append(at)
    return found


_KEY_LENGTH = 64
_WINDOW = 1 << 24
_HEX_DIGIT = np.zeros(256, dtype=bool)
_HEX_DIGIT[np.frombuffer(b"0123456789abcdef", dtype=np.uint8)] = True


def _stored(keys: Keys, tensor: torch.Tensor) -> tuple[Callable[[torch.Tensor], bytes | None] | None, bytes | None]:
    """The form of ``_FORMS`` in which the program stores ``tensor`` under its key, and those bytes;
    (None, None) where it stores it in none (not a constant XNNPACK keeps)."""
    for form in _FORMS:
        stored = form(tensor)
        if stored is not None and _key(stored) in keys:
            return form, stored
    return None, None


def _written(pte: bytes, keys: Keys, writes: dict[bytes, bytes], changed: int) -> Rewritten | None:
    renames = {_key(earlier): _key(now) for earlier, now in writes.items()}
    if len(set(renames.values())) != len(renames) or any(key in keys for key in renames.values()):
        return None  # two constants now alike, or like one the program has: a fresh lowering stores them once
    program = bytearray(pte)
    for earlier, now in writes.items():
        at = pte.find(earlier)
        if at < 0 or pte.find(earlier, at + 1) >= 0:
            return None  # the bytes are elsewhere in the program too (a constant outside XNNPACK alike)
        program[at : at + len(earlier)] = now
    for earlier_key, key in renames.items():
        for at in keys[earlier_key]:
            program[at : at + len(key)] = key
    return Rewritten(bytes(program), changed)


def _key(stored: bytes) -> bytes:
    return hashlib.sha256(stored).hexdigest().encode()


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _int4_pairs(tensor: torch.Tensor) -> bytes | None:
    """int4 values (in int8, -8..7) as XNNPACK's 4-bit weights store them: each shifted by 8 to 0..15,
    two to a byte along the row, the even column in the low nibble, an odd row length padded with 0."""
    if tensor.dtype not in (torch.int8, torch.int16, torch.int32) or tensor.dim() != 2:
        return None
    if tensor.numel() and (int(tensor.min()) < -8 or int(tensor.max()) > 7):
        return None
    nibbles = (tensor.to(torch.int16) + 8).to(torch.uint8)
    if nibbles.shape[1] % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1), value=8)
    pairs = nibbles.reshape(nibbles.shape[0], -1, 2)
    return _bytes(pairs[..., 0] | (pairs[..., 1] << 4))


def _as(dtype: torch.dtype) -> Callable[[torch.Tensor], bytes | None]:
    def stored(tensor: torch.Tensor) -> bytes | None:
        return _bytes(tensor.to(dtype)) if tensor.is_floating_point() else None

    return stored


_FORMS: tuple[Callable[[torch.Tensor], bytes | None], ...] = (_int4_pairs, _as(torch.bfloat16), _as(torch.float32), _bytes)
