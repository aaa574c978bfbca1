"""The PT2E engine (torchao: torch.export -> prepare_pt2e -> convert_pt2e) behind the engine contract.

Needs the ``[pt2e]`` extra (torchao); ``torchao_pt2e()`` says so when it is missing.
"""

from __future__ import annotations

from .engine import Pt2eEngine
from .export import NothingQuantizedError, export_model
from .numerics import ConvertedLayer, converted_layers
from .options import Pt2eOptions
from .quantizer import MissingExtraError, Pt2eConfig, build_quantizer, torchao_pt2e

__all__ = [
    "ConvertedLayer",
    "MissingExtraError",
    "NothingQuantizedError",
    "Pt2eConfig",
    "Pt2eEngine",
    "Pt2eOptions",
    "build_quantizer",
    "converted_layers",
    "export_model",
    "torchao_pt2e",
]
