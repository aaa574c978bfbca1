"""An upstream function's results kept while a context lasts: a call it has answered before (by a
key of its arguments) returns a copy of that answer instead of doing the work again; and what was
worked out of the tensor a hook was last given (``SameInput``)."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from unittest import mock

from .shortcuts import Shortcut, checking, confirmed, tensors_equal

T = TypeVar("T")


@contextlib.contextmanager
def results_kept(
    owner: Any,
    name: str,
    key: Callable[..., Any],
    store: OrderedDict,
    *,
    copied: Callable[[Any], Any] = copy.deepcopy,
    limit: int | None = None,
    shortcut: Shortcut | None = None,
    same: Callable[[Any, Any], bool] = tensors_equal,
) -> Iterator[None]:
    """While this lasts, ``owner.name(*args, **kwargs)`` (a module's function or a class's method)
    looks up ``key(*args, **kwargs)`` in ``store`` (None: not kept, called as asked) and returns
    ``copied`` of the first answer; beyond ``limit`` answers the oldest is dropped. Re-entrant: a
    context inside one on the same ``store`` changes nothing. In the check mode (``core.shortcuts``)
    an answer looked up is also worked out again and compared (``same``), the error naming ``shortcut``."""
    work = getattr(owner, name)
    if getattr(work, "kept_in", None) is store:
        yield
        return

    def kept(*args: Any, **kwargs: Any) -> Any:
        found = key(*args, **kwargs)
        if found is None:
            return work(*args, **kwargs)
        if found in store:
            store.move_to_end(found)
            if shortcut is not None and checking():
                return confirmed(shortcut, copied(store[found]), lambda: work(*args, **kwargs), same)
        else:
            store[found] = work(*args, **kwargs)
            while limit is not None and len(store) > limit:
                store.popitem(last=False)
        return copied(store[found])

    kept.kept_in = store  # type: ignore[attr-defined]
    with mock.patch.object(owner, name, kept):
        yield


class SameInput:
    """What was worked out of the tensor last given, given back while it is that tensor, unchanged
    since (its version), asked the same way (``how``, compared by identity): the Linears that read
    one input (q / k / v, gate / up) work it out once a pass. A tensor made under
    ``torch.inference_mode`` has no version to show a write into it, so nothing is kept for it: it is
    worked out for each reader. ``check``: every answer given back is also worked out afresh and the
    two compared (the check mode, ``core.shortcuts``; on as well where the environment asks)."""

    def __init__(self, check: bool = False) -> None:
        self._last: tuple[Any, int, tuple[Any, ...], Any] | None = None
        self._check = check

    def of(self, x: Any, work: Callable[[], T], *how: Any) -> T:
        """``work()``'s answer for ``x`` asked ``how``, worked out only where ``x`` is not the last tensor."""
        if x.is_inference():
            self._last = None
            return work()
        last, version = self._last, x._version
        if last is not None and last[0] is x and last[1] == version and len(last[2]) == len(how):
            if all(a is b for a, b in zip(last[2], how, strict=True)):
                if checking(self._check):
                    return confirmed(Shortcut.SHARED_INPUT, last[3], work, tensors_equal, "for one input tensor")
                return last[3]
        found = work()
        self._last = (x, version, how, found)
        return found

    def forget(self) -> None:
        """Drop the last tensor and its answer."""
        self._last = None
