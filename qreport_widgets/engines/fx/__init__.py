"""FX graph mode quantization (``prepare_fx`` / ``convert_fx``) behind the engine contract."""

from __future__ import annotations

from .engine import FxEngine
from .options import FxOptions
from .qconfig import FxConfig

__all__ = ["FxConfig", "FxEngine", "FxOptions"]
