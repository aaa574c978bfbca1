"""One PT2E quantization of a model with Tune settings: torch.export -> prepare_pt2e -> calibrate ->
convert_pt2e on a copy, with every setting checked against the converted graph."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..calibration import calibrate, torch_warnings_hidden
from ..errors import QReportError, UntraceableModelError
from ..settings import ModuleSettings
from .quantizer import ConvertedLayer, build_quantizer, converted_layers, torchao_pt2e


class NothingQuantizedError(QReportError, RuntimeError):
    """The quantizer annotated nothing: the "quantized" model is the float model."""


@dataclass(frozen=True)
class Pt2eRun:
    """A converted model, how each weighted module was converted, and the settings it ignored."""

    converted: torch.fx.GraphModule
    layers: Mapping[str, ConvertedLayer]
    notes: tuple[str, ...]


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


def quantize(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    calibration_data: Iterable[Any],
    settings: Mapping[str, ModuleSettings],
    *,
    progress: bool = False,
) -> Pt2eRun:
    """Quantize a copy of ``model`` (left as it was) the PT2E way with ``settings`` per module."""
    ao = torchao_pt2e()
    exported = export_model(model, tuple(example_inputs))
    with torch_warnings_hidden():
        prepared = ao.prepare_pt2e(exported, build_quantizer(settings))
        ao.allow_exported_model_train_eval(prepared)  # calibration puts the model in eval mode
        calibrate(prepared, calibration_data, desc="pt2e: calibrating", progress=progress)
        converted = ao.convert_pt2e(prepared)
    layers = converted_layers(converted)
    if not any(layer.weight != "float" or layer.activation != "float" for layer in layers.values()):
        raise NothingQuantizedError(
            "the PT2E quantizer quantized no linear or conv layer: the result would be the float model. "
            "Check the settings (every module kept float?) and that the model has Linear / Conv layers."
        )
    notes = []
    for fqn, choice in settings.items():
        unsupported = [name for name in ("equalize", "migrate") if getattr(choice, name)]
        unsupported += ["observer"] if choice.observer else []
        if unsupported:
            notes.append(f"{fqn}: {', '.join(unsupported)} not carried out by the PT2E engine (FX only for now)")
        layer = layers.get(fqn)
        if layer is None:
            notes.append(f"{fqn}: not found as a linear / conv op in the exported graph; its settings did nothing")
        elif not layer.matches(choice):
            notes.append(
                f"{fqn}: the converted graph has {layer.activation} activations and {layer.weight} weights, "
                "not what its settings asked"
            )
    return Pt2eRun(converted=converted, layers=layers, notes=tuple(notes))
