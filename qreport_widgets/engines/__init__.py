"""The engine registry: the one place that names every engine package.

``engine_named("fx", options)`` builds an engine; a new engine is a package beside ``fx/``,
``pt2e/`` and ``eager/`` with an ``Engine`` subclass, and one entry in ``ENGINES``. Engines are imported when
first named, so an engine whose extra is not installed costs nothing until it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable

from .contract import Engine, EngineOptions


def _fx() -> type[Engine]:
    from .fx.engine import FxEngine

    return FxEngine


def _pt2e() -> type[Engine]:
    from .pt2e.engine import Pt2eEngine

    return Pt2eEngine


def _eager() -> type[Engine]:
    from .eager.engine import EagerEngine

    return EagerEngine


ENGINES: dict[str, Callable[[], type[Engine]]] = {
    "fx": _fx,  # FX graph mode: prepare_fx / convert_fx (torch)
    "pt2e": _pt2e,  # torch.export -> prepare_pt2e / convert_pt2e (torchao, the [pt2e] extra)
    "eager": _eager,  # torchao's quantize_ per module, no graph: transformers, weight-only formats (the [eager] extra)
}


def engine_named(name: str, options: EngineOptions | None = None) -> Engine:
    """The engine registered as ``name``, built from ``options``."""
    if name not in ENGINES:
        known = " or ".join(repr(n) for n in ENGINES)
        raise ValueError(f"engine must be {known}, got {name!r}")
    return ENGINES[name]().from_options(options or EngineOptions())
