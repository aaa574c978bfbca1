"""llama.cpp as a target: GGUF files written tensor by tensor (``gguf_file``, ``blocks``) and run by
llama.cpp itself in a worker process (``runtime``)."""

from .blocks import GgufFormat, GgufFormatError, Packed, packed_weight, rounded_to_nearest
from .gguf_file import FAMILIES, GgufFile, GgufWriteError, importance_matrix, tensor_names, write_gguf
from .runtime import LlamaCppError, LlamaCppModel, Speed, quantize

__all__ = [
    "FAMILIES",
    "GgufFile",
    "GgufFormat",
    "GgufFormatError",
    "GgufWriteError",
    "LlamaCppError",
    "LlamaCppModel",
    "Packed",
    "Speed",
    "packed_weight",
    "quantize",
    "rounded_to_nearest",
    "importance_matrix",
    "tensor_names",
    "write_gguf",
]
