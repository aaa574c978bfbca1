"""The PT2E engine's pieces (torchao: torch.export -> prepare_pt2e -> convert_pt2e).

Needs the ``[pt2e]`` extra (torchao); ``torchao_pt2e()`` says so when it is missing.
"""

from __future__ import annotations

from .quantizer import MissingExtraError, build_quantizer, converted_layers, torchao_pt2e

__all__ = ["MissingExtraError", "build_quantizer", "converted_layers", "torchao_pt2e"]
