"""Counting steps of long work: a tqdm bar in a notebook or terminal, or a caller's callback (a widget)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

Progress = Callable[[int, "int | None"], None]


class Stopped(Exception):
    """Raised by a progress callback to stop the work it reports on (a widget's Cancel): a run
    stopped so is not recorded as a failed run, the exception goes on to the caller."""


@contextmanager
def steps(total: int, desc: str, unit: str, progress: Progress | None) -> Iterator[Callable[..., None]]:
    """A ``step()`` to call after each of ``total`` steps: it advances a tqdm bar when ``progress``
    is None, else calls ``progress(done, total)`` (which may raise to stop the work);
    ``step(next_desc)`` also names what runs next on the bar (work in stages)."""
    bar = tqdm(total=total, desc=desc, unit=unit, disable=progress is not None, leave=False)
    done = 0

    def step(next_desc: str | None = None) -> None:
        nonlocal done
        done += 1
        if next_desc is not None:
            bar.set_description(next_desc, refresh=False)
        bar.update()
        if progress is not None:
            progress(done, total)

    try:
        yield step
    finally:
        bar.close()


def quiet(done: int, total: int | None) -> None:
    """A progress callback that shows nothing (work run as part of something with its own bar)."""


def shown(progress: Progress | bool | None) -> Progress | None:
    """A session method's ``progress=`` as the work takes it: None or True, a tqdm bar; False,
    nothing shown (as ``analyze(progress=False)``); a callback ``(done, total)`` as it is."""
    if progress is None or progress is True:
        return None
    if progress is False:
        return quiet
    if not callable(progress):
        raise TypeError(f"progress= takes True, False or a callback (done, total), got {type(progress).__name__}")
    return progress
