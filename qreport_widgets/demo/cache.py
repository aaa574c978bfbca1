"""Trained demo weights, made once: a seeded model trained, or loaded from where it was saved."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

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


def trained_once(build: Callable[[], nn.Module], train: Callable[[nn.Module], None], cached: Path | None) -> nn.Module:
    """``build()`` after seeding torch's generator (the same initial weights every time), then its
    weights loaded from ``cached`` when that file exists, else ``train(model)`` and saved there
    (``cached`` None: always trained, never saved). In eval mode."""
    torch.manual_seed(0)
    model = build()
    if cached is not None and cached.exists():
        model.load_state_dict(torch.load(cached, weights_only=True))
        return model.eval()
    model.train()
    train(model)
    model.eval()
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), cached)
    return model
