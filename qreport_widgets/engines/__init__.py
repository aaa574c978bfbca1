"""Engines: the contract every quantization workflow implements, and the registry that names them.

``contract`` (``Engine``, ``Observation``, ``Simulation``, ``Variant``), ``settings`` (what a module
can be set to, engine-neutral), ``sizes`` (deployed bytes), ``rotation`` (rotations folded into a
decoder's float weights), and one package per engine: ``fx/``
(FX graph mode), ``pt2e/`` (torchao's PT2E), ``eager/`` (torchao's ``quantize_``), each owning its
options (``FxOptions``, ``Pt2eOptions``, ``EagerOptions``) and configuration. This module is the
registry: the one place that names every engine package. ``build_engine(name, ...)`` builds an
engine from ``analyze()``'s and the session's arguments, ``engine_named(name, options)`` from its
own options. Engines are imported when first named, so an engine whose extra is not installed
costs nothing until it is asked for; a new engine is a package here with an ``Engine`` subclass,
its options type, and one entry in ``ENGINES`` (and a keyword of ``build_engine`` for each new
option).

May import: ``targets``, ``observe``, ``core``, ``errors``. Nothing outside an engine's package names its workflow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from .contract import Engine


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


def build_engine(
    name: str,
    *,
    backend: str = "x86",
    qconfig_mapping: Any = None,
    prepare_custom_config: Any = None,
    quantizer: Any = None,
    format: str | None = None,  # noqa: A002  (the word users know)
    group_size: int | None = None,
    algorithms: tuple[str, ...] | None = None,
    target: str | None = None,
    learned_start: str | None = None,
    formats: tuple[str, ...] | None = None,
) -> Engine:
    """The engine registered as ``name``, built from its own options among these arguments.

    ``backend`` goes to the engines whose options have one; any other argument given (not None)
    must be one of the engine's options, else a ValueError names it, the engine and what the
    engine takes instead.
    """
    engine = _engine_class(name)
    arguments = {
        "qconfig_mapping": qconfig_mapping,
        "prepare_custom_config": prepare_custom_config,
        "quantizer": quantizer,
        "format": format,
        "group_size": group_size,
        "algorithms": algorithms,
        "target": target,
        "learned_start": learned_start,
        "formats": formats,
    }
    given = {key: value for key, value in arguments.items() if value is not None}
    own = {option.name for option in fields(engine.options_type)}
    foreign = sorted(set(given) - own)
    if foreign:
        names = " and ".join(f"{key}=" for key in foreign)
        raise ValueError(f"{names} {'is' if len(foreign) == 1 else 'are'} not for engine={name!r}; {engine.options_hint}")
    if "backend" in own:
        given["backend"] = backend
    return engine.from_options(engine.options_type(**given))


def engine_named(name: str, options: Any = None) -> Engine:
    """The engine registered as ``name``, built from ``options``: an instance of its
    ``options_type`` (``FxOptions``, ``Pt2eOptions``, ``EagerOptions``), or None for its defaults."""
    engine = _engine_class(name)
    if options is None:
        options = engine.options_type()
    elif not isinstance(options, engine.options_type):
        kind = type(options).__name__
        owner = next((other for other, load in ENGINES.items() if load().options_type is type(options)), None)
        whose = f" (the options of engine={owner!r})" if owner else ""
        raise TypeError(f"engine={name!r} takes {engine.options_type.__name__}, not {kind}{whose}")
    return engine.from_options(options)


def _engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        known = " or ".join(repr(n) for n in ENGINES)
        raise ValueError(f"engine must be {known}, got {name!r}")
    return ENGINES[name]()


def quantize_weights(model: Any, choices: Any, batches: Any, target: str = "x86", learned_start: str | None = None) -> Any:
    """Quantize Linears of ``model`` to int4 in place, ``{fqn: (algorithm, group_size)}`` with
    ``algorithm`` one of ``"rtn"``, ``"hqq"``, ``"gptq"``, ``"awq"``, ``"learned"``: GPTQ and AWQ
    reading one pass of ``model`` over ``batches`` (your calibration data), the learned rounding
    one more, then learning block by block from ``learned_start``'s values (``"rtn"``, default, or
    ``"gptq"``). What the eager engine's settings as code call for them; returns ``model``. Needs
    torchao (the ``[eager]`` extra)."""
    from .eager.quantize import quantize_weights as on_torchao

    return on_torchao(model, choices, batches, target, learned_start)
