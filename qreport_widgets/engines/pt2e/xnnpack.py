"""ExecuTorch with XNNPACK as the PT2E engine's target: XNNPACK's quantizer instead of x86's; the
converted graph is lowered, serialised and run by ``engines/executorch.py`` (a ``DeployedProgram``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import types
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.fx

from ...core.kept import results_kept
from ...core.shortcuts import Shortcut
from ...errors import MissingExtraError
from ..executorch import (
    INSTALL,
    Delegation,
    DeployedProgram,
    LoweringError,
    RuntimeFailedError,
    lower,
    quiet_runtime,
)
from ..executorch import executorch_api as lowering_api
from ..settings import ModuleSettings
from .export import WORKFLOW_CODE

__all__ = [
    "Delegation",
    "DeployedProgram",
    "LoweringError",
    "RuntimeFailedError",
    "executorch_api",
    "lower",
    "patterns_traced_once",
    "xnnpack_as_code",
    "xnnpack_config",
    "xnnpack_quantizer",
]


@functools.cache
def executorch_api() -> types.SimpleNamespace:
    """XNNPACK's quantizer and torchao's PT2E helpers, imported once; a clear error naming the extra when missing."""
    lowering_api()  # ExecuTorch itself, or the error naming the extra
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), quiet_runtime():
            from executorch.backends.xnnpack.quantizer import xnnpack_quantizer
            from torchao.quantization.pt2e.quantizer import ComposableQuantizer
            from torchao.quantization.pt2e.quantizer import utils as quantizer_utils
    except ImportError as error:
        raise MissingExtraError(f"the XNNPACK target needs ExecuTorch ({error}); install it with: {INSTALL}") from error
    return types.SimpleNamespace(
        XNNPACKQuantizer=xnnpack_quantizer.XNNPACKQuantizer,
        get_symmetric_quantization_config=xnnpack_quantizer.get_symmetric_quantization_config,
        module_name_filter=quantizer_utils.get_module_name_filter,
        ComposableQuantizer=ComposableQuantizer,
    )


# the patterns XNNPACK's quantizer has traced in this process: (the pattern's code, what its closure
# holds, its inputs' shapes and dtypes, on CUDA, keywords) -> the traced graph, copied for each use
_TRACED: OrderedDict[tuple, torch.fx.GraphModule] = OrderedDict()


def patterns_traced_once() -> AbstractContextManager[None]:
    """XNNPACK's quantizer traces its conv-batch-norm patterns (``torch.export`` of a few ops) each
    time it annotates for a config, and once more for every module given a config of its own: a
    second or more a module, the same graphs each time. While this lasts, each pattern is traced
    once in the process and a copy of its graph handed out after (the matcher rewrites the graph
    it is given), so annotations are the same, without the tracing."""
    from executorch.backends.xnnpack.quantizer import xnnpack_quantizer_utils as utils

    return results_kept(
        utils, "_get_aten_graph_module_for_pattern", _pattern_key, _TRACED, shortcut=Shortcut.TRACED_PATTERNS, same=_same_code
    )


def _same_code(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    return a.code == b.code


def _pattern_key(pattern: Any, example_inputs: tuple[Any, ...], is_cuda: bool = False, **kwargs: Any) -> tuple | None:
    function = getattr(pattern, "fn", pattern)  # the pattern as a module wrapping its function
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    try:
        held = tuple(cell.cell_contents for cell in function.__closure__ or ())
        inputs = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        key = (code, held, inputs, is_cuda, tuple(sorted(kwargs.items())))
        hash(key)
    except (TypeError, ValueError):  # an unhashable or empty cell
        return None
    return key


def xnnpack_config(per_channel: bool, dynamic: bool) -> Any:
    """XNNPACK's symmetric int8 config: per-channel or per-tensor weights, static or dynamic activations."""
    return executorch_api().get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=dynamic)


def xnnpack_quantizer(settings: Mapping[str, ModuleSettings], base: Any = None) -> Any:
    """XNNPACK's quantizer for ``settings`` (module name -> settings); other modules as ``base``
    annotates them (default: XNNPACK's symmetric per-channel static config everywhere).

    A module kept float is left out by the quantizer's node filter (XNNPACK's quantizer takes no
    "None" config per module); a module with other settings gets its own config, which the global
    one then leaves alone. With a ``base`` of your own, the modules in ``settings`` are annotated
    first, it annotates the rest, and what it annotates in a module kept float is taken back."""
    api = executorch_api()
    ours = api.XNNPACKQuantizer()
    if base is None:
        ours.set_global(xnnpack_config(True, dynamic=False))
    for fqn, choice in settings.items():
        if not choice.keep_float:
            ours.set_module_name(fqn, xnnpack_config(choice.per_channel, choice.dynamic))
    floats = [api.module_name_filter(fqn) for fqn, choice in settings.items() if choice.keep_float]
    if floats:
        ours.set_filter_function(lambda node: not any(inside(node) for inside in floats))
    if base is None:
        return ours
    if not settings:
        return base
    return api.ComposableQuantizer([ours, _KeepingFloat(base, floats) if floats else base])


class _KeepingFloat:
    """``base`` (a quantizer of the user's), whose annotations of the modules kept float are taken
    back as soon as it made them (it has no way to leave a module out)."""

    def __init__(self, base: Any, floats: list[Any]) -> None:
        self.base, self.floats = base, floats

    def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return self.base.transform_for_annotation(model)

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        self.base.annotate(model)
        for node in model.graph.nodes:
            if any(inside(node) for inside in self.floats):
                node.meta.pop("quantization_annotation", None)
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        self.base.validate(model)

    def prepare_obs_or_fq_callback(self, model: torch.fx.GraphModule, edge_or_node_to_obs_or_fq: dict) -> None:
        callback = getattr(self.base, "prepare_obs_or_fq_callback", None)
        if callback is not None:
            callback(model, edge_or_node_to_obs_or_fq)


def xnnpack_as_code(changed: Mapping[str, ModuleSettings], has_base: bool) -> str:
    """Python that builds the XNNPACK quantizer of ``changed``, quantizes, lowers and runs the program."""
    lines = [
        "import torch",
        "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner",
        "from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (",
        "    XNNPACKQuantizer,",
        "    get_symmetric_quantization_config,",
        ")",
        "from executorch.exir import to_edge_transform_and_lower",
        "from executorch.runtime import Runtime",
        "from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e",
    ]
    floats = [fqn for fqn, choice in changed.items() if choice.keep_float]
    if floats:
        lines.append("from torchao.quantization.pt2e.quantizer.utils import get_module_name_filter")
    if has_base:
        lines.append("from torchao.quantization.pt2e.quantizer import ComposableQuantizer")
    lines += ["", "", "quantizer = XNNPACKQuantizer()"]
    if not has_base:
        lines.append("quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))")
    for fqn, choice in changed.items():
        if not choice.keep_float:
            arguments = f"is_per_channel={choice.per_channel}" + (", is_dynamic=True" if choice.dynamic else "")
            lines.append(f"quantizer.set_module_name({fqn!r}, get_symmetric_quantization_config({arguments}))")
    if floats:
        lines += [
            f"kept_float = [get_module_name_filter(name) for name in {floats!r}]",
            "quantizer.set_filter_function(lambda node: not any(inside(node) for inside in kept_float))",
        ]
    if has_base:
        lines += [
            "# base_quantizer: the quantizer you started from",
            "quantizer = ComposableQuantizer([quantizer, base_quantizer])" if changed else "quantizer = base_quantizer",
        ]
    lines += [
        "",
        *WORKFLOW_CODE,
        "program = to_edge_transform_and_lower(",
        "    torch.export.export(quantized, example_inputs), partitioner=[XnnpackPartitioner()]",
        ").to_executorch()",
        'with open("model.pte", "wb") as file:',
        "    file.write(program.buffer)",
        "loaded = Runtime.get().load_program(program.buffer)  # keep it: its method executes from it",
        'method = loaded.load_method("forward")',
        "outputs = method.execute(list(example_inputs))",
    ]
    return "\n".join(lines) + "\n"
