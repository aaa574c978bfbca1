"""llama.cpp as a target: GGUF files written tensor by tensor (``gguf_file``, ``blocks``) and run by
llama.cpp itself in a worker process (``runtime``)."""

from .blocks import GgufFormat, GgufFormatError, Packed, packed_weight, rounded_to_nearest
from .gguf_file import FAMILIES, GgufFile, GgufWriteError, write_gguf

__all__ = [
    "FAMILIES",
    "GgufFile",
    "GgufFormat",
    "GgufFormatError",
    "GgufWriteError",
    "Packed",
    "packed_weight",
    "rounded_to_nearest",
    "write_gguf",
]
