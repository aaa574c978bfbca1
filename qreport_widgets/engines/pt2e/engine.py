"""torchao's PT2E workflow (torch.export -> prepare_pt2e -> calibrate -> convert_pt2e) as an engine of
the session, with what the FX engine measures: per-layer SQNR, conversions, the set-up as code,
and a simulation for the sensitivity ranking.

A run's settings are checked against the converted graph (``run_notes``): a setting torchao's
quantizer accepted but never carried out is said, per module, instead of trusted.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import pandas as pd
import torch
import torch.fx

from ...core.devices import CPU
from ...core.memory import models_forgotten
from ...core.metrics import sqnr_db
from ...core.progress import Progress
from ..contract import Engine, Observation, RunNotes, conversion_tables
from ..executorch import ONLINE_PRODUCT_FAILS, RUNTIME_WORDS
from ..settings import ModuleSettings, Setting, TunableModule
from .export import NothingQuantizedError, export_model, quantizer_failed
from .graph import exported_graph
from .numerics import (
    ConvertedLayer,
    convert,
    converted_layers,
    eval_only,
    layer_outputs,
    observers_paused,
    pt2e_warnings_hidden,
    weighted_ops,
)
from .options import Pt2eOptions
from .quantizer import Pt2eConfig, torchao_pt2e
from .simulate import Pt2eSimulation
from .xnnpack import DeployedProgram, executorch_api, lower, patterns_traced_once

__all__ = ["Pt2eConfig", "Pt2eEngine"]

FX_ONLY = {
    Setting.EQUALIZE: "input-weight equalization is FX only: torchao's PT2E quantizers have none",
    Setting.OBSERVER: "the PT2E engine keeps the quantizer's activation observers (choosing one is FX only)",
}
LATENCY_NOTE = (
    "latency: of convert_pt2e's graph (quantize / dequantize around float ops), not of int8 kernels; "
    "torchao's lower_pt2e_quantized_to_x86 compiles those for deployment"
)
DYNAMIC_LINEAR_ONLY = "dynamic activations: torchao's x86 quantizer quantizes only Linear layers dynamically"
DYNAMIC_GEMM_ONLY = "dynamic activations: XNNPACK's quantizer quantizes only Linear and Conv layers dynamically"
RUNTIME_NOTE = (
    "measured in ExecuTorch's runtime: the program lowered to XNNPACK ({size:,} bytes of .pte, lowered in {seconds:.1f} s); "
    "per-layer SQNR is of the reference-quantized graph it was lowered from"
)


class Pt2eEngine(Engine[Pt2eConfig]):
    """``torch.export`` -> ``prepare_pt2e`` -> calibrate -> ``convert_pt2e``.

    Args:
        quantizer: the starting quantizer (the baseline's); default: the target's, torchao's
            ``X86InductorQuantizer`` with its default config everywhere or XNNPACK's symmetric
            per-channel one. Tune settings are applied by a quantizer placed in front of it, for
            the modules they change.
        target: ``"x86"``, or ``"xnnpack"``: every run's converted graph is lowered to XNNPACK and
            run in ExecuTorch's runtime (``xnnpack.DeployedProgram``), which is what it measures.
    """

    name = "pt2e"
    options_type = Pt2eOptions
    options_hint = "with PT2E pass quantizer="

    def __init__(self, quantizer: Any = None, target: str = "x86") -> None:
        torchao_pt2e()  # a clear error naming the extra, before anything else
        if target == "xnnpack":
            executorch_api()
        self.quantizer, self.target = quantizer, target
        self._example_inputs: tuple[Any, ...] = ()  # what a lowering exports the converted graph with
        self._exports: dict[int, tuple[weakref.ref, tuple, torch.fx.GraphModule]] = {}
        self._references: dict[int, tuple[weakref.ref, torch.fx.GraphModule]] = {}

    @classmethod
    def from_options(cls, options: Pt2eOptions) -> Pt2eEngine:
        return cls(options.quantizer, options.target)

    # ---- observation ----------------------------------------------------------------------------
    def observe(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...], *, record: bool = False) -> Observation:
        """The float graph with batch norms folded, as every PT2E run folds them (prepared with a
        quantizer that annotates nothing); the tunable modules and how the starting quantizer
        treats each module's weights are read from one ``prepare_pt2e`` with it."""
        modules = self.tunable_modules(self.prepare(float_model, self.base_config(), example_inputs))
        weights = {m.fqn: m.current.per_channel for m in modules if not m.current.keep_float}
        with pt2e_warnings_hidden():
            observed = copy.deepcopy(self.float_reference(float_model, example_inputs))
        return Observation(observed, lambda model: exported_graph(model, float_model, weights), modules)

    # ---- configuration --------------------------------------------------------------------------
    def base_config(self) -> Pt2eConfig:
        return Pt2eConfig(base=self.quantizer, target=self.target)

    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> Pt2eConfig:
        current = {m.fqn: m.current for m in modules}
        changed = {fqn: choice for fqn, choice in settings.items() if choice != current.get(fqn)}
        return Pt2eConfig(changed, dict(settings), self.quantizer, self.target)

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

    @property
    def kernel_device(self) -> torch.device:
        return CPU  # torch's x86 int8 kernels and ExecuTorch's XNNPACK programs run on the CPU

    def online_transform_problem(self) -> str:
        return ONLINE_PRODUCT_FAILS if self.target == "xnnpack" else ""

    def kernel_words(self) -> str:
        return RUNTIME_WORDS if self.target == "xnnpack" else "torch's x86 int8 kernels on the CPU"

    def prepare(self, float_model: torch.nn.Module, config: Pt2eConfig, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        ao = torchao_pt2e()
        self._example_inputs = example_inputs
        with pt2e_warnings_hidden(), models_forgotten():
            exported = copy.deepcopy(self.export(float_model, example_inputs))
            try:
                with patterns_traced_once() if self.target == "xnnpack" else contextlib.nullcontext():
                    prepared = ao.prepare_pt2e(exported, config.quantizer())
            except Exception as error:  # inside torchao's quantizer: explained, never passed on raw
                raise quantizer_failed("prepare_pt2e (its quantizer's annotate)", error) from error
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
            if self.target == "xnnpack" and not str(node.target).startswith(("aten.linear", "aten.conv")):
                unavailable[Setting.DYNAMIC] = DYNAMIC_GEMM_ONLY
            elif self.target != "xnnpack" and not str(node.target).startswith("aten.linear"):
                unavailable[Setting.DYNAMIC] = DYNAMIC_LINEAR_ONLY
            modules[fqn] = TunableModule(fqn, _type_name(node), current, unavailable, native=current)
        return list(modules.values())

    def convert(self, prepared: torch.nn.Module, progress: Progress | None = None) -> torch.nn.Module:
        """convert_pt2e's graph; for the XNNPACK target, that graph lowered and loaded in ExecuTorch's
        runtime (a ``DeployedProgram``, called like the model)."""
        converted = _without_unused_tensors(convert(prepared))
        layers = converted_layers(converted)
        if not any(layer.weight != "float" or layer.activation != "float" for layer in layers.values()):
            raise NothingQuantizedError(
                "the PT2E quantizer quantized no Linear or Conv layer: the result would be the float model. "
                "Check the settings (every module kept float?) and that the model has Linear / Conv layers."
            )
        if self.target == "xnnpack":
            return lower(converted, self._example_inputs, progress=progress, check=self.checks_shortcuts)
        return converted

    # ---- what a run measures --------------------------------------------------------------------
    def per_layer_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at each Linear / Conv op's output (batch norms folded in), quantized against float."""
        expected = layer_outputs(self.float_reference(float_model, _example_of(batch)), batch)
        found = layer_outputs(_graph_of(quantized), batch)
        values = {fqn: sqnr_db(expected[fqn], found[fqn]) for fqn in found if fqn in expected}
        return pd.Series(values, name="SQNR (dB)", dtype=float)

    def float_reference(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        """``float_model`` exported with its batch norms folded as prepare_pt2e folds them, no observers."""
        kept = self._references.get(id(float_model))
        if kept is not None and kept[0]() is float_model:
            return kept[1]
        ao = torchao_pt2e()
        with pt2e_warnings_hidden(), models_forgotten():
            exported = copy.deepcopy(self.export(float_model, example_inputs))
            reference = ao.prepare_pt2e(exported, _Nothing())
        eval_only(reference)
        self._references = {key: value for key, value in self._references.items() if value[0]() is not None}
        self._references[id(float_model)] = (weakref.ref(float_model), reference)
        return reference

    def conversions(self, prepared: torch.nn.Module, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        quantized = _graph_of(quantized)
        types = {fqn: _type_name(node) for fqn, node in weighted_ops(quantized).items()}
        rows = [
            {
                "module": fqn,
                "float type": types.get(fqn, "?"),
                "converted type": _described(layer),
                "quantized": layer.weight != "float",
            }
            for fqn, layer in converted_layers(quantized).items()
        ]
        return conversion_tables(rows)

    def run_notes(self, config: Pt2eConfig, quantized: torch.nn.Module) -> RunNotes:
        """Per module, a requested setting the converted graph did not carry out; and what the
        run's latency is of."""
        program = quantized if isinstance(quantized, DeployedProgram) else None
        layers = converted_layers(_graph_of(quantized))
        undone = {}
        for fqn, choice in config.requested.items():
            layer = layers.get(fqn)
            if layer is None:
                undone[fqn] = "no Linear / Conv op of it in the converted graph; its settings did nothing"
            elif not layer.matches(choice):
                undone[fqn] = f"asked {_asked(choice)}, the converted graph has {_described(layer)}"
        if program is None:
            return RunNotes((LATENCY_NOTE,), undone)
        runtime = RUNTIME_NOTE.format(size=len(program.pte), seconds=program.lowering_s)
        return RunNotes((runtime, program.delegation.words, *([program.reused] if program.reused else [])), undone)

    def deployed_bytes(self, quantized: torch.nn.Module) -> int:
        """The ``.pte`` program's bytes for the XNNPACK target; else as every engine counts them."""
        if isinstance(quantized, DeployedProgram):
            return len(quantized.pte)
        return super().deployed_bytes(quantized)

    def stored_bytes(self, quantized: torch.nn.Module) -> int:
        if isinstance(quantized, DeployedProgram):
            return len(quantized.pte)
        return super().stored_bytes(quantized)

    def per_layer_failure(self, error: Exception) -> str:
        return f"the Linear / Conv ops could not be read from the graphs ({type(error).__name__})"

    def config_as_code(self, config: Pt2eConfig) -> str:
        return config.as_code()

    def simulator(
        self,
        prepared: torch.nn.Module,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None],
        data_key: Callable[[], str | None] | None = None,
    ) -> Pt2eSimulation:
        return Pt2eSimulation(self, prepared, modules, float_model, example_inputs, calibrate)


def _graph_of(quantized: torch.nn.Module) -> torch.fx.GraphModule:
    """The reference-quantized graph of a run: the model itself, or what a deployed program was lowered from."""
    return quantized.reference if isinstance(quantized, DeployedProgram) else quantized


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
