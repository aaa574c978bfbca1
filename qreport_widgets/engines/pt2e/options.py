"""What the PT2E engine is built from: ``build_engine("pt2e", ...)`` or ``engine_named("pt2e", Pt2eOptions(...))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TARGETS = ("x86", "xnnpack")


@dataclass(frozen=True)
class Pt2eOptions:
    """The PT2E engine's options.

    Args:
        backend: the quantized engine the caller named; the default start is torchao's x86
            quantizer whatever it says (a quantizer of your own targets what it targets).
        quantizer: the starting torchao quantizer (the baseline's); default: torchao's
            ``X86InductorQuantizer`` with its default config everywhere.
        target: where the quantized model runs: ``"x86"`` (convert_pt2e's graph, measured in
            PyTorch), or ``"xnnpack"`` (XNNPACK's quantizer; every run lowered to XNNPACK, serialised
            as an ExecuTorch ``.pte`` program and measured in ExecuTorch's runtime; the
            ``[executorch]`` extra).
    """

    backend: str = "x86"
    quantizer: Any = None
    target: str = "x86"

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            known = " or ".join(repr(t) for t in TARGETS)
            raise ValueError(f"target must be {known}, got {self.target!r}")
