"""torchao's PT2E workflow (torch.export -> prepare_pt2e -> calibrate -> convert_pt2e) as an engine of
the session, with what the FX engine measures: per-layer SQNR, conversions, the set-up as code,
and a simulation for the sensitivity ranking.

A run's settings are checked against the converted graph (``run_notes``): a setting torchao's
quantizer accepted but never carried out is said, per module, instead of trusted.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.fx

from ..metrics import sqnr_db
from ..run import conversion_tables
from ..settings import ModuleSettings, TunableModule
from .export import NothingQuantizedError, export_model
from .numerics import (
    ConvertedLayer,
    convert,
    converted_layers,
    eval_only,
    layer_outputs,
    observers_paused,
    pt2e_warnings_hidden,
    weighted_ops,
)  # fmt: skip
from .quantizer import build_quantizer, torchao_pt2e
from .simulate import Pt2eSimulation

__all__ = ["Pt2eConfig", "Pt2eEngine"]

FX_ONLY = {
    "equalize": "input-weight equalization is FX only: torchao's PT2E quantizers have none",
    "observer": "the PT2E engine keeps the quantizer's activation observers (choosing one is FX only)",
}
LATENCY_NOTE = (
    "latency: of convert_pt2e's graph (quantize / dequantize around float ops), not of int8 kernels; "
    "torchao's lower_pt2e_quantized_to_x86 compiles those for deployment"
)
DYNAMIC_LINEAR_ONLY = "dynamic activations: torchao's x86 quantizer quantizes only Linear layers dynamically"


@dataclass(frozen=True)
class Pt2eConfig:
    """What a PT2E run quantizes with: the modules whose settings differ from the start, on top of
    the starting quantizer (``base``: yours, or torchao's x86 default when None); ``requested`` is
    every setting asked for, checked against the converted graph."""

    changed: Mapping[str, ModuleSettings] = field(default_factory=dict)
    requested: Mapping[str, ModuleSettings] = field(default_factory=dict)
    base: Any = None

    def quantizer(self) -> Any:
        return build_quantizer(self.changed, self.base)


class Pt2eEngine:
    """``torch.export`` -> ``prepare_pt2e`` -> calibrate -> ``convert_pt2e``.

    Args:
        quantizer: the starting quantizer (the baseline's); default: torchao's
            ``X86InductorQuantizer`` with its default config everywhere. Tune settings are applied
            by a quantizer placed in front of it, for the modules they change.
    """

    name = "pt2e"

    def __init__(self, quantizer: Any = None) -> None:
        torchao_pt2e()  # a clear error naming the extra, before anything else
        self.quantizer = quantizer
        self._exports: dict[int, tuple[weakref.ref, tuple, torch.fx.GraphModule]] = {}
        self._references: dict[int, tuple[weakref.ref, torch.fx.GraphModule]] = {}

    # ---- configuration --------------------------------------------------------------------------
    def base_config(self) -> Pt2eConfig:
        return Pt2eConfig(base=self.quantizer)

    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> Pt2eConfig:
        current = {m.fqn: m.current for m in modules}
        changed = {fqn: choice for fqn, choice in settings.items() if choice != current.get(fqn)}
        return Pt2eConfig(changed, dict(settings), self.quantizer)

    # ---- the workflow ---------------------------------------------------------------------------
    def export(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        """``torch.export`` of ``float_model`` (batch size free), made once per model object and kept."""
        shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else type(x) for x in example_inputs)
        kept = self._exports.get(id(float_model))
        if kept is not None and kept[0]() is float_model and kept[1] == shapes:
            return kept[2]
        exported = export_model(float_model, example_inputs)
        self._exports = {key: value for key, value in self._exports.items() if value[0]() is not None}
        self._exports[id(float_model)] = (weakref.ref(float_model), shapes, exported)
        return exported

    def prepare(self, float_model: torch.nn.Module, config: Pt2eConfig, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        ao = torchao_pt2e()
        with pt2e_warnings_hidden():
            exported = copy.deepcopy(self.export(float_model, example_inputs))
            prepared = ao.prepare_pt2e(exported, config.quantizer())
        eval_only(prepared)  # calibration puts the model in eval mode
        return prepared

    def observers_paused(self, prepared: torch.nn.Module) -> AbstractContextManager[None]:
        return observers_paused(prepared)

    def tunable_modules(self, prepared: torch.nn.Module) -> list[TunableModule]:
        modules: dict[str, TunableModule] = {}
        for fqn, node in weighted_ops(prepared, last=False).items():
            weight = _observer_of(prepared, node.args[1] if len(node.args) > 1 else None)
            activation = _observer_of(prepared, node.args[0])
            if weight is None:
                current = ModuleSettings(keep_float=True)
            else:
                per_channel = getattr(weight, "qscheme", None) in (torch.per_channel_symmetric, torch.per_channel_affine)
                current = ModuleSettings(dynamic=bool(getattr(activation, "is_dynamic", False)), per_channel=per_channel)
            unavailable = dict(FX_ONLY)
            if not str(node.target).startswith("aten.linear"):
                unavailable["dynamic"] = DYNAMIC_LINEAR_ONLY
            modules[fqn] = TunableModule(fqn, _type_name(node), current, unavailable, native=current)
        return list(modules.values())

    def convert(self, prepared: torch.nn.Module) -> torch.fx.GraphModule:
        converted = _without_unused_tensors(convert(prepared))
        layers = converted_layers(converted)
        if not any(layer.weight != "float" or layer.activation != "float" for layer in layers.values()):
            raise NothingQuantizedError(
                "the PT2E quantizer quantized no Linear or Conv layer: the result would be the float model. "
                "Check the settings (every module kept float?) and that the model has Linear / Conv layers."
            )
        return converted

    # ---- what a run measures --------------------------------------------------------------------
    def per_layer_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at each Linear / Conv op's output (batch norms folded in), quantized against float."""
        expected = layer_outputs(self.float_reference(float_model, _example_of(batch)), batch)
        found = layer_outputs(quantized, batch)
        values = {fqn: sqnr_db(expected[fqn], found[fqn]) for fqn in found if fqn in expected}
        return pd.Series(values, name="SQNR (dB)", dtype=float)

    def float_reference(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        """``float_model`` exported with its batch norms folded as prepare_pt2e folds them, no observers."""
        kept = self._references.get(id(float_model))
        if kept is not None and kept[0]() is float_model:
            return kept[1]
        ao = torchao_pt2e()
        with pt2e_warnings_hidden():
            exported = copy.deepcopy(self.export(float_model, example_inputs))
            reference = ao.prepare_pt2e(exported, _Nothing())
        eval_only(reference)
        self._references = {key: value for key, value in self._references.items() if value[0]() is not None}
        self._references[id(float_model)] = (weakref.ref(float_model), reference)
        return reference

    def conversions(self, prepared: torch.nn.Module, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        types = {fqn: _type_name(node) for fqn, node in weighted_ops(quantized).items()}
        rows = [
            {"module": fqn, "float type": types.get(fqn, "?"), "converted type": _described(layer),
             "quantized": layer.weight != "float"}
            for fqn, layer in converted_layers(quantized).items()
        ]  # fmt: skip
        return conversion_tables(rows)

    def run_notes(self, config: Pt2eConfig, quantized: torch.nn.Module) -> list[str]:
        """One line per requested setting the converted graph did not carry out, and what its
        latency is of."""
        layers = converted_layers(quantized)
        notes = []
        for fqn, choice in config.requested.items():
            layer = layers.get(fqn)
            if layer is None:
                notes.append(f"{fqn}: no Linear / Conv op of it in the converted graph; its settings did nothing")
            elif not layer.matches(choice):
                notes.append(f"{fqn}: asked {_asked(choice)}, the converted graph has {_described(layer)}")
        return notes + [LATENCY_NOTE]

    def config_as_code(self, config: Pt2eConfig) -> str:
        return quantizer_as_code(config)

    def simulator(
        self,
        prepared: torch.nn.Module,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None] | None = None,
    ) -> Any:
        return Pt2eSimulation(self, prepared, modules, float_model, example_inputs, calibrate)


def _without_unused_tensors(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``model`` without the parameters and buffers its graph no longer reads: convert_pt2e keeps
    the float weights it replaced by int8 copies, which would count in the model's size."""
    used = {str(node.target) for node in model.graph.nodes if node.op == "get_attr"}
    unused = [name for name, _ in (*model.named_parameters(), *model.named_buffers()) if name not in used]
    for name in unused:
        owner, _, attribute = name.rpartition(".")
        delattr(model.get_submodule(owner) if owner else model, attribute)
    return model


class _Nothing:
    """A quantizer that annotates nothing: prepare_pt2e then only folds batch norms."""

    def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return model

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        return None

    def prepare_obs_or_fq_callback(self, model: torch.fx.GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        return None


def _observer_of(prepared: torch.nn.Module, arg: Any) -> torch.nn.Module | None:
    if isinstance(arg, torch.fx.Node) and arg.op == "call_module" and str(arg.target).startswith("activation_post_process"):
        return prepared.get_submodule(str(arg.target))
    return None


def _type_name(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    entry = list(stack.values())[-1] if stack else ("", "")
    kind = entry[1] if isinstance(entry[1], str) else getattr(entry[1], "__name__", str(entry[1]))
    return kind.rsplit(".", 1)[-1] or str(node.target)


def _example_of(batch: Any) -> tuple[Any, ...]:
    return batch if isinstance(batch, tuple) else (batch,)


def _asked(choice: ModuleSettings) -> str:
    if choice.keep_float:
        return "float"
    weights = "per-channel" if choice.per_channel else "per-tensor"
    return f"{'dynamic' if choice.dynamic else 'static'} activations, {weights} weights"


def _described(layer: ConvertedLayer) -> str:
    if layer.weight == "float" and layer.activation == "float":
        return "float"
    return f"{layer.activation} activations, {layer.weight} weights"


def quantizer_as_code(config: Pt2eConfig) -> str:
    """Python that builds the quantizer of ``config`` and runs the PT2E workflow with it."""
    changed = config.changed
    per_tensor = any(not c.keep_float and not c.per_channel for c in changed.values())
    dynamic = {fqn: c for fqn, c in changed.items() if c.dynamic and not c.keep_float}
    lines = [
        "import torch",
        "from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e",
        "from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (",
        "    X86InductorQuantizer,",
        "    get_default_x86_inductor_quantization_config,",
        ")",
    ]
    if dynamic or config.base is not None:
        lines.append("from torchao.quantization.pt2e.quantizer import ComposableQuantizer")
    if per_tensor:
        lines += [
            "import dataclasses",
            "from torchao.quantization.pt2e import MinMaxObserver",
            "from torchao.quantization.pt2e.quantizer import QuantizationSpec",
            "",
            "",
            "def per_tensor_weights(config):",
            '    """The config with symmetric per-tensor int8 weights (min/max observed)."""',
            "    weight = QuantizationSpec(",
            "        dtype=torch.int8, quant_min=-128, quant_max=127, qscheme=torch.per_tensor_symmetric,",
            "        is_dynamic=False, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12),",
            "    )",
            "    return dataclasses.replace(config, weight=weight)",
        ]
    lines += ["", "", "static = X86InductorQuantizer()"]
    if config.base is None:
        lines.append("static.set_global(get_default_x86_inductor_quantization_config())")
    for fqn, choice in changed.items():
        if choice.keep_float or choice.dynamic:
            why = "keep float" if choice.keep_float else "dynamic: quantized by the quantizer below"
            lines.append(f"static.set_module_name_qconfig({fqn!r}, None)  # {why}")
        else:
            lines.append(f"static.set_module_name_qconfig({fqn!r}, {_config_code(choice.per_channel, False)})")
    parts = ["static"]
    if dynamic:
        lines.append("dynamic = X86InductorQuantizer()")
        for fqn, choice in dynamic.items():
            lines.append(f"dynamic.set_module_name_qconfig({fqn!r}, {_config_code(choice.per_channel, True)})")
        parts.insert(0, "dynamic")
    if config.base is not None:
        parts.append("base_quantizer")
        lines.append(f"# base_quantizer: the quantizer you started from ({type(config.base).__name__})")
    quantizer = parts[0] if len(parts) == 1 else f"ComposableQuantizer([{', '.join(parts)}])"
    lines += [
        f"quantizer = {quantizer}",
        "",
        "exported = torch.export.export(model.eval(), example_inputs).module()",
        "prepared = prepare_pt2e(exported, quantizer)",
        "for batch in calibration_batches:",
        "    prepared(*batch)",
        "quantized = convert_pt2e(prepared)",
    ]
    return "\n".join(lines) + "\n"


def _config_code(per_channel: bool, dynamic: bool) -> str:
    config = "get_default_x86_inductor_quantization_config(" + ("is_dynamic=True" if dynamic else "") + ")"
    return config if per_channel else f"per_tensor_weights({config})"
