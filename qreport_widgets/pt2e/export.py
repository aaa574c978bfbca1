"""``torch.export`` of a float model for the PT2E engine, and the error of a run that quantized nothing."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.fx

from ..calibration import torch_warnings_hidden
from ..errors import QReportError, UntraceableModelError


class NothingQuantizedError(QReportError, RuntimeError):
    """The quantizer annotated nothing: the "quantized" model is the float model."""


def export_model(model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
    """``torch.export`` of a copy of ``model`` with the batch dimension free (calibration and
    evaluation batches may differ in size); a model that fixes it is exported as it is."""
    model = copy.deepcopy(model).eval()
    try:
        with torch_warnings_hidden():
            if all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in example_inputs):
                batch = torch.export.Dim("batch", min=1)
                try:
                    return torch.export.export(
                        model, example_inputs, dynamic_shapes=tuple({0: batch} for _ in example_inputs)
                    ).module()
                except Exception:  # the model specializes its batch size: export it as given
                    pass
            return torch.export.export(model, example_inputs).module()
    except Exception as error:
        raise UntraceableModelError(f"torch.export could not export the model ({type(error).__name__}: {error})") from error
