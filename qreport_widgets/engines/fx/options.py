"""What the FX engine is built from: ``build_engine("fx", ...)`` or ``engine_named("fx", FxOptions(...))``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.ao.quantization import QConfigMapping
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig


@dataclass(frozen=True)
class FxOptions:
    """The FX engine's options.

    Args:
        backend: the quantized engine (``x86``, ``fbgemm``, ``qnnpack``, ``onednn``); its default
            QConfigMapping is the start when ``qconfig_mapping`` is None.
        qconfig_mapping: the starting mapping (the baseline's); settings are layered on top of it.
        prepare_custom_config: passed to every ``prepare_fx`` (non-traceable modules, ...).
    """

    backend: str = "x86"
    qconfig_mapping: QConfigMapping | None = None
    prepare_custom_config: PrepareCustomConfig | dict[str, Any] | None = None
