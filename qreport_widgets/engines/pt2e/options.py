"""What the PT2E engine is built from: ``build_engine("pt2e", ...)`` or ``engine_named("pt2e", Pt2eOptions(...))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Pt2eOptions:
    """The PT2E engine's options.

    Args:
        backend: the quantized engine the caller named; the default start is torchao's x86
            quantizer whatever it says (a quantizer of your own targets what it targets).
        quantizer: the starting torchao quantizer (the baseline's); default: torchao's
            ``X86InductorQuantizer`` with its default config everywhere.
    """

    backend: str = "x86"
    quantizer: Any = None
