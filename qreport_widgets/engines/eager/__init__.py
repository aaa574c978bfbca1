"""The eager engine: torchao's ``quantize_`` per module, observed by hooks (no graph, no tracing).

Imported by the engine registry when ``engine="eager"`` is first named; needs torchao (the
``[eager]`` extra).
"""

from .engine import EagerEngine, FormatError
from .formats import EagerConfig
from .options import EagerOptions

__all__ = ["EagerConfig", "EagerEngine", "EagerOptions", "FormatError"]
