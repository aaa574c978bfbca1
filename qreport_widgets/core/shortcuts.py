"""Every memo and reuse proved against the answer computed afresh, when asked (the check mode).

The package answers fast by reusing work: a program lowered before gets new weights written in, GPTQ
weights found once are taken by later runs, the Linears that read one input quantize it once, a
simulation keeps the variants it measured, a fit halves along its front. Each such shortcut is keyed on
everything its answer depends on; the check mode is how that is shown. With the environment variable
``QREPORT_CHECK_SHORTCUTS=1`` (the whole process) or ``analyze(..., check_shortcuts=True)`` (one
session, through its engine), every shortcut that is taken also computes its answer afresh and raises
``ShortcutMismatchError`` naming the shortcut where the two differ; the shortcut's answer is used
otherwise. It costs what the shortcuts save, and more: for tests and for a doubt, not for daily use.

``CHECKED`` counts the checks made in this process by shortcut, so a run in the check mode can say
what it checked (the test suite prints it).
"""

from __future__ import annotations

import enum
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import QReportError

ENVIRONMENT = "QREPORT_CHECK_SHORTCUTS"

T = TypeVar("T")


class Shortcut(str, enum.Enum):
    """The shortcuts the check mode proves, as their errors and the count name them."""

    PROGRAM_REWRITE = "program rewrite (changed delegated weights written into a program lowered before)"
    EDGE_REWRITE = "edge rewrite (changed constants written into an edge program lowered before, serialised again)"
    FOUND_WEIGHTS = "found GPTQ weights (computed once per float model and calibration data, taken by later runs)"
    SHARED_INPUT = "shared input (what was worked out of a tensor, given back to the next reader of that tensor)"
    KNOWN_VARIANTS = "known variants (a simulation's results kept until the simulation changes)"
    BLOCK_REPLAY = "block replay (a simulated pass started at the first block whose formats changed)"
    HALVING = "halving (a fit's chain of points halved towards the smallest meeting its target)"
    HISTOGRAM_SEARCHES = "histogram searches (a histogram observer's range search kept by what it reads)"
    TRACED_PATTERNS = "traced patterns (XNNPACK's quantizer's patterns traced once, a copy handed out)"
    BUILDABLE = "buildable (whether a target builds a module in a format, found once per kind of module and format)"
    MODULE_BYTES = "module bytes (a module's size read off two quantized copies of its first rows)"


class ShortcutMismatchError(QReportError, AssertionError):
    """A shortcut's answer differs from the answer computed afresh (the check mode): a bug to report,
    with the message; the answer computed afresh is the true one."""


CHECKED: Counter[Shortcut] = Counter()


def checking(asked: bool = False) -> bool:
    """Whether shortcuts are checked: ``asked`` (a session's option) or the environment's ``QREPORT_CHECK_SHORTCUTS``."""
    return asked or os.environ.get(ENVIRONMENT, "").strip() not in ("", "0", "false", "False", "no")


def confirmed(
    shortcut: Shortcut,
    taken: T,
    fresh: Callable[[], T],
    same: Callable[[T, T], bool],
    what: Callable[[T, T], str] | str = "",
) -> T:
    """``taken`` (the shortcut's answer) once ``fresh()`` (the answer computed afresh) is ``same`` as it;
    ``ShortcutMismatchError`` naming ``shortcut`` and ``what`` differs otherwise. Call it only when ``checking``."""
    found = fresh()
    CHECKED[shortcut] += 1
    if not same(taken, found):
        said = what(taken, found) if callable(what) else what
        raise ShortcutMismatchError(
            f"the {shortcut.value} gave another answer than computing it afresh{': ' + said if said else ''}. "
            "The shortcut is wrong here; please report it. Meanwhile the answer computed afresh is the true one"
        )
    return taken


def counted() -> str:
    """The checks made in this process, in words."""
    if not CHECKED:
        return "no shortcut was taken, so none was checked"
    return "; ".join(f"{shortcut.name.lower()}: {count}" for shortcut, count in sorted(CHECKED.items(), key=lambda i: i[0].name))


def tensors_equal(a: Any, b: Any) -> bool:
    """Whether two answers hold the same values, bit for bit: tensors (shape, dtype, values), plain
    values, and dataclasses, dicts, lists and tuples of them (a dataclass's fields that take no part in
    its equality left out); any other object (a KV cache a block hands on) by its type alone."""
    import dataclasses
    import math

    import torch

    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            tensors_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a) if f.compare
        )
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(tensors_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    if a is None or b is None or isinstance(a, (bool, int, float, str, bytes)):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return type(a) is type(b) and a == b
    return type(a) is type(b)
