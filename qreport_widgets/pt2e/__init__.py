"""The PT2E engine's pieces (torchao: torch.export -> prepare_pt2e -> convert_pt2e).

Needs the ``[pt2e]`` extra (torchao); ``torchao_pt2e()`` says so when it is missing.
"""

from __future__ import annotations

from .quantizer import MissingExtraError, build_quantizer, converted_layers, torchao_pt2e
from .run import NothingQuantizedError, Pt2eRun, export_model, quantize

__all__ = [
    "MissingExtraError", "NothingQuantizedError", "Pt2eRun", "build_quantizer", "converted_layers", "export_model",
    "quantize", "torchao_pt2e",
]  # fmt: skip
