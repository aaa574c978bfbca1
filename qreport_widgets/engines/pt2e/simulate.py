"""The PT2E simulation: any set of modules kept float (or with the other weight scheme) without
calibrating again.

Observers see float tensors while calibrating, so an activation observer of a variant sees exactly
what the same observer saw in the starting configuration's calibration. A variant is therefore
prepared (no calibration), given copies of the starting configuration's calibrated observers
(matched by the tensor they watch and their kind), its weight observers fed the weights, and
converted: the model a real run of that variant converts, from one calibration.

x86's quantizer annotates fused patterns (conv -> add -> relu) as a whole, so keeping one module of
such a pattern float can make a tensor quantized that the starting configuration never observed (the
float conv's output, now the input of a quantized add). Such a variant is calibrated again with
only those new observers recording.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx

from ...core.metrics import sqnr_db
from ..contract import Engine, Variant, WholePasses
from ..settings import ModuleSettings, TunableModule
from .numerics import (
    convert,
    layer_inputs_and_outputs,
    observer_nodes,
    observers_paused,
    op_on,
    weighted_ops,
)


class Pt2eSimulation(WholePasses):
    """Variants of the starting configuration, each converted from one calibration.

    Args:
        engine: prepares and converts.
        prepared: the starting configuration, prepared and calibrated (kept as it is).
        modules: the tunable modules (``tunable``: their names).
    """

    def __init__(
        self,
        engine: Engine,
        prepared: torch.fx.GraphModule,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        self.engine, self.prepared, self.modules = engine, prepared, list(modules)
        self.tunable = [m.fqn for m in self.modules]
        self.others: list[str] = []  # every module is ranked
        self.float_model, self.example_inputs, self._calibrate = float_model, example_inputs, calibrate
        self.recalibrated = 0  # variants that needed a calibration of their own
        self._observers = {_key(prepared, node): prepared.get_submodule(str(node.target)) for node in observer_nodes(prepared)}
        # a fresh prepare given the calibrated observers, not a deep copy of ``prepared``: torchao's convert
        # cannot place a dynamic quantization's choose_qparams in a copied graph (its annotations are copies)
        start = engine.prepare(float_model, engine.base_config(), example_inputs)
        self._calibrated(start)
        self._start = convert(start)
        self._built: tuple[Variant, torch.fx.GraphModule] = (Variant(), self._start)
        self.model: torch.nn.Module = self._start

    def configure(self, variant: Variant | Iterable[str] = ()) -> None:
        self.model = self._model(Variant.of(variant))

    def local_sqnr(self, batch: Any) -> dict[str, float]:
        """Each quantized Linear / Conv op's own error: its quantize ops, quantized weight and op on
        the float model's input to it, against the float op's output (batch norms folded in)."""
        with observers_paused(self.prepared):
            inputs, outputs = layer_inputs_and_outputs(self.prepared, batch)
        local = {}
        for fqn, node in weighted_ops(self._start).items():
            if fqn not in inputs or fqn not in outputs:
                continue
            try:
                local[fqn] = sqnr_db(outputs[fqn], op_on(self._start, node, inputs[fqn]))
            except LookupError:
                local[fqn] = math.nan
        return local

    def run_real_kernels(self, quantized: torch.nn.Module, names: Iterable[str]) -> list[str]:
        """Nothing to swap: every variant is converted as a real run converts it (reference ops)."""
        return []

    # ---- variants ---------------------------------------------------------------------------
    def _model(self, variant: Variant) -> torch.fx.GraphModule:
        if variant.observers or variant.settings:
            raise KeyError("the PT2E simulation keeps the quantizer's observers and has no formats")
        if not variant.float_modules and not variant.other_weights and not variant.dynamic:
            return self._start
        if self._built[0] == variant:
            return self._built[1]
        current = {m.fqn: m.current for m in self.modules}
        settings = {fqn: ModuleSettings(keep_float=True) for fqn in variant.float_modules}
        for fqn in variant.other_weights - variant.float_modules:
            settings[fqn] = replace(current[fqn], per_channel=not current[fqn].per_channel)
        for fqn in variant.dynamic - variant.float_modules:  # converted as a real run converts it
            settings[fqn] = replace(settings.get(fqn, current[fqn]), dynamic=True)
        prepared = self.engine.prepare(self.float_model, self.engine.config_for(settings, self.modules), self.example_inputs)
        self._calibrated(prepared)
        model = convert(prepared)
        self._built = (variant, model)
        return model

    def _calibrated(self, prepared: torch.fx.GraphModule) -> None:
        """Give ``prepared`` the starting configuration's calibrated activation observers, weight
        observers their weights, and calibrate whatever observer is new (with the others paused)."""
        new = []
        for node in observer_nodes(prepared):
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and source.op == "get_attr":
                observer = prepared.get_submodule(str(node.target))
                with torch.no_grad():
                    observer(_attr(prepared, str(source.target)))
                continue
            calibrated = self._observers.get(_key(prepared, node))
            if calibrated is None:
                new.append(str(node.target))
            else:
                setattr(prepared, str(node.target), copy.deepcopy(calibrated))
        if not new:
            return
        if self._calibrate is None:
            raise RuntimeError(f"this variant observes {len(new)} new tensor(s) and the simulation has no calibration data")
        self.recalibrated += 1
        with observers_paused(prepared, keep=set(new)):
            self._calibrate(prepared)


def _key(model: torch.fx.GraphModule, node: torch.fx.Node) -> tuple:
    observer = model.get_submodule(str(node.target))
    source = node.args[0]
    return (
        getattr(source, "name", str(source)),
        type(observer).__name__,
        getattr(observer, "dtype", None),
        getattr(observer, "qscheme", None),
        bool(getattr(observer, "is_dynamic", False)),
    )


def _attr(model: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)
