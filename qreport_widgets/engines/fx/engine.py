"""FX graph mode quantization (``prepare_fx`` / ``convert_fx``) as an engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import pandas as pd
import torch
from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping

from ...core.calibration import call_with, torch_warnings_hidden
from ...core.devices import CPU, model_device
from ...core.memory import models_forgotten
from ...core.metrics import output_tensor
from ...core.progress import Progress
from ...observe.graph import ModelGraph
from ..contract import Engine, Observation
from ..settings import ModuleSettings, Setting, TunableModule
from .kernels import kernel_sqnr, reference_model
from .lowering import convert_fx_keeping_float
from .numeric_suite import per_layer_sqnr, quantization_summary
from .options import FxOptions
from .prepare import prepare, torch_observers_paused
from .qconfig import FunctionalOp, FxConfig, build_equalization_mapping, build_qconfig_mapping, qconfig_for, tunable_modules
from .simulate import Simulator, qparams_after_float

__all__ = ["FxEngine"]


# convert_fx swaps each quantized module for a new one: a forward pre-hook on the float module (R4's
# product on down_proj's input) does not follow it, and the quantized model runs without the product
ONLINE_PRODUCT_DROPPED = (
    "convert_fx replaces each quantized Linear by a new module and drops its forward pre-hooks, so R4's Hadamard "
    "on down_proj's input would be lost from the quantized model: use Rotation() (R1 + R2, folded into the weights), "
    "or the eager or PT2E engine for R4"
)
ONLINE_ROTATION_DROPPED = (
    "its products run as forward hooks on the embedding and on norms, and convert_fx puts a new module in the place "
    "of each module it quantizes (an Embedding with a float_qparams qconfig) without its hooks: use the eager or "
    "PT2E engine, or Rotation(residual=False) (R2 alone)"
)


class FxEngine(Engine[FxConfig]):
    """``prepare_fx`` -> calibrate -> ``convert_fx``, starting from ``qconfig_mapping``.

    Args:
        backend: the quantized engine; the default starting mapping is its default.
        qconfig_mapping: the starting mapping (the baseline's); settings are layered on top of it.
        prepare_custom_config: passed to every ``prepare_fx`` (non-traceable modules, ...).
    """

    name = "fx"
    options_type = FxOptions
    options_hint = "FX starts from qconfig_mapping="

    def __init__(
        self, backend: str = "x86", qconfig_mapping: QConfigMapping | None = None, prepare_custom_config: Any = None
    ) -> None:
        self.backend = backend
        self.qconfig_mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping(backend)
        self.prepare_custom_config = prepare_custom_config

    @classmethod
    def from_options(cls, options: FxOptions) -> FxEngine:
        return cls(options.backend, options.qconfig_mapping, options.prepare_custom_config)

    # ---- observation ----------------------------------------------------------------------------
    def observe(self, float_model: torch.nn.Module, example_inputs: tuple[Any, ...], *, record: bool = False) -> Observation:
        """The starting configuration's ``prepare_fx`` model: the report observes its modules (its
        own observers rest while the analysis calibrates), and it says what each module does now."""
        prepared = self.prepare(float_model, self.base_config(), example_inputs)
        return Observation(prepared, ModelGraph.of, self.tunable_modules(prepared))

    # ---- configuration --------------------------------------------------------------------------
    def base_config(self) -> FxConfig:
        return FxConfig(self.qconfig_mapping)

    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> FxConfig:
        current = {m.fqn: m.native for m in modules}
        ops = {m.fqn: m.current for m in modules if not m.weighted}  # an op gets an entry only when it changes
        settings = {fqn: choice for fqn, choice in settings.items() if fqn not in ops or choice != ops[fqn]}
        equalization = build_equalization_mapping(settings)
        return FxConfig(
            build_qconfig_mapping(settings, self.qconfig_mapping, current),
            equalization if equalization.module_name_qconfigs else None,
        )

    def config_as_code(self, config: FxConfig) -> str:
        return config.as_code()

    def config_of_mapping(self, qconfig_mapping: Any, equalization_mapping: Any = None) -> FxConfig:
        return FxConfig(qconfig_mapping, equalization_mapping)

    def qconfig_mapping_of(self, config: FxConfig) -> QConfigMapping:
        return config.qconfig_mapping

    def equalization_mapping_of(self, config: FxConfig) -> QConfigMapping | None:
        return config.equalization_mapping

    # ---- the workflow ---------------------------------------------------------------------------
    @property
    def kernel_device(self) -> torch.device:
        return CPU  # torch's quantized int8 kernels (fbgemm, oneDNN, qnnpack) exist on the CPU only

    def kernel_words(self) -> str:
        return f"torch's {self.backend} int8 kernels on the CPU"

    def online_transform_problem(self) -> str:
        return ONLINE_PRODUCT_DROPPED

    def online_rotation_problem(self) -> str:
        return ONLINE_ROTATION_DROPPED

    def prepare(self, float_model: torch.nn.Module, config: FxConfig, example_inputs: tuple[Any, ...]) -> torch.fx.GraphModule:
        extra: dict[str, Any] = {}
        if config.equalization_mapping is not None:
            extra["_equalization_config"] = config.equalization_mapping
        if self.prepare_custom_config is not None:
            extra["prepare_custom_config"] = self.prepare_custom_config
        return prepare(float_model, config.qconfig_mapping, example_inputs, **extra)

    def observers_paused(self, prepared: torch.nn.Module) -> AbstractContextManager[None]:
        return torch_observers_paused(prepared)

    def tunable_modules(self, prepared: torch.nn.Module) -> list[TunableModule]:
        return tunable_modules(ModelGraph.of(prepared))

    def convert(self, prepared: torch.nn.Module, progress: Progress | None = None) -> torch.nn.Module:
        return convert_fx_keeping_float(prepared)  # one step: nothing to report  # convert_fx would quantize a float PReLU anyway

    # ---- what a run measures --------------------------------------------------------------------
    def per_layer_sqnr(self, float_model: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        return per_layer_sqnr(float_model, quantized, batch)

    def reference_model(self, prepared: torch.nn.Module) -> torch.nn.Module:
        return reference_model(prepared)

    def kernel_sqnr(self, reference: torch.nn.Module, quantized: torch.nn.Module, batch: Any) -> pd.Series:
        return kernel_sqnr(reference, quantized, batch)

    def per_layer_failure(self, error: Exception) -> str:
        return f"Numeric Suite could not match the two graphs ({type(error).__name__})"

    def conversions(self, prepared: torch.nn.Module, quantized: torch.nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        return quantization_summary(prepared, quantized)

    def equalization_float_error(
        self,
        float_model: torch.nn.Module,
        config: FxConfig,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None],
        batch: Any,
    ) -> float:
        """prepared with ``config``, calibrated, with the equalization scales applied and nothing
        quantized: the float output's relative change on ``batch``."""
        from torch.ao.quantization.fx._equalize import _convert_equalization_ref

        with torch_warnings_hidden(), models_forgotten():
            prepared = self.prepare(float_model, config, example_inputs)
            calibrate(prepared)
            _weight_observers_on(prepared, model_device(float_model))
            equalized = _convert_equalization_ref(prepared)
            with torch.no_grad(), torch_observers_paused(equalized):
                expected, found = output_tensor(call_with(float_model, batch)), output_tensor(call_with(equalized, batch))
        return float((found - expected).norm() / expected.norm().clamp_min(1e-12))

    # ---- the simulation -------------------------------------------------------------------------
    def simulator(
        self,
        prepared: torch.nn.Module,
        modules: Sequence[TunableModule],
        float_model: torch.nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[torch.nn.Module], None],
        data_key: Callable[[], str | None] | None = None,
    ) -> Simulator:
        # where FX places other qparams after a float module, read from one prepare with them all float
        all_float = self.config_for({m.fqn: ModuleSettings(keep_float=True) for m in modules}, modules)
        with torch_warnings_hidden():
            float_prepared = self.prepare(float_model, all_float, example_inputs)
        # the weight observer a real run uses with a module's weight scheme switched
        other_weights = {
            m.fqn: qconfig_for(ModuleSettings(per_channel=not m.current.per_channel), m.native).weight
            for m in modules
            if m.native is not None and not m.current.dynamic and m.allows(Setting.PER_CHANNEL)
        }
        functional = {m.fqn: m.native.node_name for m in modules if isinstance(m.native, FunctionalOp)}
        current = {m.fqn: m.current for m in modules}

        def calibrated_with(observers: Mapping[str, str]) -> torch.fx.GraphModule:
            """The start with other activation observers on some modules' outputs, calibrated."""
            settings = {fqn: replace(current[fqn], observer=name, dynamic=False) for fqn, name in observers.items()}
            with torch_warnings_hidden():
                other = self.prepare(float_model, self.config_for(settings, modules), example_inputs)
            calibrate(other)
            return other

        alternate = qparams_after_float(prepared, float_prepared, calibrate)
        return Simulator(
            prepared,
            list(current),
            alternate,
            other_weights,
            functional,
            calibrated_with,
            dynamic_reduce_range=self.backend != "qnnpack",
        )


def _weight_observers_on(prepared: torch.nn.Module, device: torch.device) -> None:
    """Have the weight equalization observers that converting makes from ``prepared``'s equalization
    qconfigs made on ``device``. torch makes each with CPU buffers and fills them by copying, so on a
    model elsewhere (a GPU) the equalization scale mixes devices and fails; the input observers are
    already where the model is."""
    attributes = getattr(prepared, "meta", {}).get("_observed_graph_module_attrs")
    table = getattr(attributes, "equalization_node_name_to_qconfig", None)
    if not table or device == CPU:
        return

    def placed(qconfig: Any) -> Any:
        make = qconfig.weight
        return qconfig._replace(weight=lambda: make().to(device))

    attributes.equalization_node_name_to_qconfig = {
        name: qconfig if qconfig is None else placed(qconfig) for name, qconfig in table.items()
    }
