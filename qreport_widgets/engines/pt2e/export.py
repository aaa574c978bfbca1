"""``torch.export`` of a float model for PT2E, the workflow after it as code, and the error of a run that quantized nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from ...core.calibration import torch_warnings_hidden
from ...core.memory import shared_copy
from ...errors import QReportError, UntraceableModelError

# the PT2E workflow after its quantizer is built, in the code ``settings_as_code`` gives (x86 and XNNPACK alike)
WORKFLOW_CODE = (
    "exported = torch.export.export(model.eval(), example_inputs).module()",
    "prepared = prepare_pt2e(exported, quantizer)",
    "for batch in calibration_batches:",
    "    prepared(*batch)",
    "quantized = convert_pt2e(prepared)",
)


class NothingQuantizedError(QReportError, RuntimeError):
    """The quantizer annotated nothing: the "quantized" model is the float model."""


def export_model(model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
    """``torch.export`` of a copy of ``model`` with the batch dimension free (calibration and
    evaluation batches may differ in size); a model that fixes it is exported as it is.

    Ops whose results nothing uses are taken out: a Hugging Face encoder wrapped by a model that
    reads only its hidden states still computes its pooler (Linear -> tanh), and torchao's x86
    quantizer fails on a fused pattern without an output (IndexError in
    ``_get_output_nodes_of_partitions``)."""
    model = shared_copy(model).eval()  # export lifts the weights, it does not change them
    try:
        with torch_warnings_hidden():
            exported = None
            if all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in example_inputs):
                batch = torch.export.Dim("batch", min=1)
                try:
                    exported = torch.export.export(
                        model, example_inputs, dynamic_shapes=tuple({0: batch} for _ in example_inputs)
                    ).module()
                except Exception:  # the model specializes its batch size: export it as given
                    pass
            if exported is None:
                exported = torch.export.export(model, example_inputs).module()
    except Exception as error:
        raise UntraceableModelError(
            f"torch.export could not export the model ({type(error).__name__}: {error}). "
            "analyze(..., engine='eager') quantizes with torchao's quantize_ and needs no graph."
        ) from error
    if exported.graph.eliminate_dead_code():
        exported.recompile()
    return exported


class QuantizerFailedError(QReportError, RuntimeError):
    """torchao's quantizer or its prepare / convert failed on the exported graph."""


def quantizer_failed(step: str, error: Exception) -> QuantizerFailedError:
    """``error`` from torchao's ``step`` explained: where it failed and what to use instead."""
    where = _innermost_torchao_frame(error)
    return QuantizerFailedError(
        f"torchao's {step} failed on this model's exported graph ({type(error).__name__}: {error}{where}). "
        "This is inside torchao, not in your model: its x86 quantizer matches fused patterns "
        "(linear -> unary op, conv -> batch norm -> relu ...) and fails on some graphs. "
        "Use analyze(..., engine='eager'), which quantizes with torchao's quantize_ per module and needs no "
        "graph (the engine for Hugging Face transformers), or engine='fx' if the model traces."
    )


def _innermost_torchao_frame(error: Exception) -> str:
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "torchao" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" in {frame.name}, {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"
