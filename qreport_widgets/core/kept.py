"""An upstream function's results kept while a context lasts: a call it has answered before (by a
key of its arguments) returns a copy of that answer instead of doing the work again."""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock


@contextlib.contextmanager
def results_kept(
    owner: Any,
    name: str,
    key: Callable[..., Any],
    store: OrderedDict,
    *,
    copied: Callable[[Any], Any] = copy.deepcopy,
    limit: int | None = None,
) -> Iterator[None]:
    """While this lasts, ``owner.name(*args, **kwargs)`` (a module's function or a class's method)
    looks up ``key(*args, **kwargs)`` in ``store`` (None: not kept, called as asked) and returns
    ``copied`` of the first answer; beyond ``limit`` answers the oldest is dropped. Re-entrant: a
    context inside one on the same ``store`` changes nothing."""
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
        else:
            store[found] = work(*args, **kwargs)
            while limit is not None and len(store) > limit:
                store.popitem(last=False)
        return copied(store[found])

    kept.kept_in = store  # type: ignore[attr-defined]
    with mock.patch.object(owner, name, kept):
        yield
