"""Trained demo weights, made once: a seeded model trained, or loaded from where it was saved."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

try:
    import fcntl
except ImportError:  # Windows: no lock; two processes training at once each train, the file stays whole
    fcntl = None

CACHE_VARIABLE = "QREPORT_WIDGETS_CACHE"
USER_CACHE = "user"  # a cache_dir that means cache_folder()


def cache_folder() -> Path:
    """Where trained demo weights are kept between runs: ``$QREPORT_WIDGETS_CACHE``, else
    ``~/.cache/qreport_widgets`` (``$XDG_CACHE_HOME`` when set)."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qreport_widgets"


def cached_file(cache_dir: str | Path | None, name: str) -> Path | None:
    """``name`` in ``cache_dir`` (``USER_CACHE``: ``cache_folder()``; None: not cached)."""
    if cache_dir is None:
        return None
    return (cache_folder() if cache_dir == USER_CACHE else Path(cache_dir)) / name


def recipe_tag(*parts: object) -> str:
    """Eight hex digits that change with any of ``parts`` (a training function's source, its settings,
    the bytes of its data): a cached file named with them is never the weights of another recipe."""
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else repr(part).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:8]


def trained_once(build: Callable[[], nn.Module], train: Callable[[nn.Module], None], cached: Path | None) -> nn.Module:
    """``build()`` after seeding torch's generator (the same initial weights every time), then its
    weights loaded from ``cached`` when that file exists, else ``train(model)`` and saved there
    (``cached`` None: always trained, never saved). In eval mode. Processes asking for the same
    file at once train it once: the others wait for it and load it."""
    torch.manual_seed(0)
    model = build()
    if cached is None:
        return _trained(model, train)
    cached.parent.mkdir(parents=True, exist_ok=True)
    with _held(cached.with_name(cached.name + ".lock")):
        if cached.exists():
            model.load_state_dict(torch.load(cached, weights_only=True))
            return model.eval()
        _trained(model, train)
        written = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
        torch.save(model.state_dict(), written)
        os.replace(written, cached)  # never a half-written file under the cached name
    return model


def _trained(model: nn.Module, train: Callable[[nn.Module], None]) -> nn.Module:
    model.train()
    train(model)
    return model.eval()


@contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file ``lock`` (created when missing) while the block runs."""
    if fcntl is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
