"""Trained demo weights, made once: a seeded model trained, or loaded from where it was saved."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


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
