"""Tune settings as a torchao PT2E quantizer for x86.

One ``X86InductorQuantizer`` cannot hold static and dynamic modules together (it warns and drops
the config), so dynamic modules get a quantizer of their own, composed in front of the static
one. Reading the converted graph back (``numerics.converted_layers``) is how a setting that never
reached the graph is caught instead of trusted.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ...errors import MissingExtraError
from ..settings import ModuleSettings
from .export import WORKFLOW_CODE


@functools.cache
def torchao_pt2e() -> types.SimpleNamespace:
    """torchao's PT2E entry points, imported once; a clear error naming the extra when missing."""
    pytree_log = logging.getLogger("torch.utils._pytree")  # torchao registers an Enum torch now handles
    level = pytree_log.level
    try:
        pytree_log.setLevel(logging.ERROR)
        # torchao prints a line per optional CUDA kernel it cannot load on a CPU machine
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from torchao.quantization import pt2e
            from torchao.quantization.pt2e import quantize_pt2e, quantizer
            from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86
    except ImportError as error:
        raise MissingExtraError(
            f"the PT2E engine needs torchao ({error}); install it with: pip install 'qreport-widgets[pt2e]'"
        ) from error
    finally:
        pytree_log.setLevel(level)
    return types.SimpleNamespace(
        MinMaxObserver=pt2e.MinMaxObserver,
        prepare_pt2e=quantize_pt2e.prepare_pt2e,
        convert_pt2e=quantize_pt2e.convert_pt2e,
        ComposableQuantizer=quantizer.ComposableQuantizer,
        QuantizationConfig=quantizer.QuantizationConfig,
        QuantizationSpec=quantizer.QuantizationSpec,
        X86InductorQuantizer=x86.X86InductorQuantizer,
        get_default_x86_inductor_quantization_config=x86.get_default_x86_inductor_quantization_config,
    )


@functools.cache
def quantization_config(per_channel: bool, dynamic: bool):
    """torchao's x86 default config, with per-tensor symmetric weights when ``per_channel`` is off."""
    ao = torchao_pt2e()
    default = ao.get_default_x86_inductor_quantization_config(is_dynamic=dynamic)
    if per_channel:
        return default
    weight = ao.QuantizationSpec(
        dtype=torch.int8,
        quant_min=-128,
        quant_max=127,
        qscheme=torch.per_tensor_symmetric,
        is_dynamic=False,
        observer_or_fake_quant_ctr=ao.MinMaxObserver.with_args(eps=2**-12),
    )
    return ao.QuantizationConfig(default.input_activation, default.output_activation, weight, default.bias, default.is_qat)


def build_quantizer(settings: Mapping[str, ModuleSettings], base=None):
    """A quantizer for ``settings`` (module name -> settings); other modules as ``base`` annotates
    them (default: torchao's x86 default everywhere).

    keep_float leaves the module unannotated; dynamic modules are quantized by a dynamic
    quantizer placed first (the static one is told to leave them alone). With a ``base`` of your
    own, the modules in ``settings`` are annotated before it runs, and it leaves annotated nodes alone.
    """
    ao = torchao_pt2e()
    static = ao.X86InductorQuantizer()
    if base is None:
        static.set_global(quantization_config(True, dynamic=False))
    dynamic = ao.X86InductorQuantizer()
    has_dynamic = False
    with warnings.catch_warnings():  # torchao warns on every per-module config it accepts
        warnings.filterwarnings("ignore", module=r"torchao(\.|$)")
        for fqn, choice in settings.items():
            if choice.keep_float:
                static.set_module_name_qconfig(fqn, None)
            elif choice.dynamic:
                static.set_module_name_qconfig(fqn, None)
                dynamic.set_module_name_qconfig(fqn, quantization_config(choice.per_channel, dynamic=True))
                has_dynamic = True
            else:
                static.set_module_name_qconfig(fqn, quantization_config(choice.per_channel, dynamic=False))
    parts = [dynamic] if has_dynamic else []
    parts += [static] if base is None or settings else []
    parts += [base] if base is not None else []
    return parts[0] if len(parts) == 1 else ao.ComposableQuantizer(parts)


@dataclass(frozen=True)
class Pt2eConfig:
    """What a PT2E run quantizes with: the modules whose settings differ from the start, on top of
    the starting quantizer (``base``: yours, or the target's default when None: torchao's x86 one,
    or XNNPACK's symmetric per-channel one); ``requested`` is every setting asked for, checked
    against the converted graph."""

    changed: Mapping[str, ModuleSettings] = field(default_factory=dict)
    requested: Mapping[str, ModuleSettings] = field(default_factory=dict)
    base: Any = None
    target: str = "x86"  # "xnnpack": XNNPACK's quantizer, the program lowered and run in ExecuTorch

    def quantizer(self) -> Any:
        if self.target == "xnnpack":
            from .xnnpack import xnnpack_quantizer

            return xnnpack_quantizer(self.changed, self.base)
        return build_quantizer(self.changed, self.base)

    def as_code(self) -> str:
        """Python that builds this quantizer and runs the PT2E workflow with it."""
        if self.target == "xnnpack":
            from .xnnpack import xnnpack_as_code

            return xnnpack_as_code(self.changed, self.base is not None)
        return quantizer_as_code(self)


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
        *WORKFLOW_CODE,
    ]
    return "\n".join(lines) + "\n"


def _config_code(per_channel: bool, dynamic: bool) -> str:
    config = "get_default_x86_inductor_quantization_config(" + ("is_dynamic=True" if dynamic else "") + ")"
    return config if per_channel else f"per_tensor_weights({config})"
