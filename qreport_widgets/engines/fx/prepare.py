"""prepare_fx on a copy, with errors that say what to try; torch observers that cannot run are taken out."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.quantize_fx import prepare_fx

from ...core.calibration import torch_warnings_hidden
from ...core.memory import models_forgotten, shared_copy
from ...errors import QReportWarning, UntraceableModelError
from ...observe.graph import OBSERVER_CONTAINER, is_quantization_observer


def prepare(
    float_model: torch.nn.Module, qconfig_mapping: QConfigMapping, example_inputs: tuple[Any, ...], **kwargs: Any
) -> torch.fx.GraphModule:
    """``prepare_fx`` on a deep copy, with tracing failures turned into an error that says what to try.

    ``kwargs`` go to ``prepare_fx`` (``prepare_custom_config``, ``_equalization_config``, ...).
    Observers prepare_fx puts on integer or bool tensors (a padding mask, token ids) are taken out:
    torch's observers cannot run on them, and such tensors are never quantized.
    """
    model = shared_copy(float_model).eval()  # prepare_fx changes modules, never weights: they are shared
    try:
        with torch_warnings_hidden(), models_forgotten():  # its observers warn hundreds of times ("Please use quant_min ...")
            warnings.simplefilter("ignore", DeprecationWarning)
            prepared = prepare_fx(model, qconfig_mapping, example_inputs, **kwargs)
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError, RuntimeError, AttributeError) as error:
        where, culprit = _user_frame(error, model)
        raise UntraceableModelError(
            f"torch.fx could not trace {type(float_model).__name__}{culprit}: {type(error).__name__}: {error}{where}\n"
            "FX traces with symbolic values, so Python control flow that depends on tensor values "
            "(if x.sum() > 0, loops over x.shape[0] ...) cannot be traced. Options: pass "
            "prepare_custom_config=PrepareCustomConfig().set_non_traceable_module_names([...]) or "
            ".set_non_traceable_module_classes([...]) (to analyze() or prepare_fx) to keep the offending "
            "submodule as one opaque call, fix input-dependent arguments with concrete_args, or move the "
            "branch out of forward(). Or use another engine: analyze(..., engine='eager') needs no graph at "
            "all (torchao's quantize_; the engine for Hugging Face transformers, whose FX support ended in "
            "transformers 5), and engine='pt2e' traces with torch.export, which follows more Python."
        ) from error
    _drop_observers_on_non_float(prepared, example_inputs)
    return prepared


@contextlib.contextmanager
def torch_observers_paused(model: torch.fx.GraphModule) -> Iterator[None]:
    """prepare_fx's own observers pass tensors through untouched for the duration.

    For an analysis pass, whose detectors read only the report's observers: it saves the cost of
    torch's histogram observers and lets data they cannot take (NaN, inf) reach the report.
    """
    paused = [
        module
        for name, module in model.named_modules()
        if is_quantization_observer(module) and not name.startswith(OBSERVER_CONTAINER)
    ]
    for module in paused:
        module.forward = _pass_through
    try:
        yield
    finally:
        for module in paused:
            del module.forward


def _pass_through(x: Any, *args: Any, **kwargs: Any) -> Any:
    return x


class _DtypeProbe(torch.fx.Interpreter):
    """Runs the prepared graph on the example inputs without calling torch's observers, noting the
    dtype that reaches each of them."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        super().__init__(module)
        self.dtypes: dict[torch.fx.Node, torch.dtype] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        if node.op == "call_module" and is_quantization_observer(self.module.get_submodule(node.target)):
            value = self.env[node.args[0]] if isinstance(node.args[0], torch.fx.Node) else None
            if isinstance(value, torch.Tensor):
                self.dtypes[node] = value.dtype
            return value
        return super().run_node(node)


def _drop_observers_on_non_float(prepared: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> None:
    probe = _DtypeProbe(prepared)
    # dtypes do not depend on the batch size, so one sample is enough (and about 8x cheaper on a
    # batch of 8); a model that needs the full batch gets it
    for inputs in (_one_sample(example_inputs), example_inputs):
        try:
            with torch.no_grad():
                probe.run(*inputs)
            break
        except Exception:
            probe.dtypes.clear()
    else:  # the example inputs do not run: calibration will say which batch and why
        return
    removed = [node for node, dtype in probe.dtypes.items() if not (dtype.is_floating_point or dtype.is_complex)]
    for node in removed:
        source = node.args[0]
        node.replace_all_uses_with(source)
        prepared.graph.erase_node(node)
        delattr(prepared, node.target)
        warnings.warn(
            f"{source.name}: prepare_fx put an observer on a {str(probe.dtypes[node]).removeprefix('torch.')} tensor "
            "(produced by this node); it was removed, since such tensors are not quantized",
            QReportWarning,
            stacklevel=4,
        )
    if removed:
        prepared.recompile()


def _one_sample(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x[:1] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] > 1 else x for x in inputs)


def _user_frame(error: BaseException, model: torch.nn.Module) -> tuple[str, str]:
    """(' (at file:line)', ' in submodule name (Type)') for the deepest traceback frame outside torch."""
    tb, where, culprit = error.__traceback__, "", ""
    names = {id(module): name for name, module in model.named_modules()}
    while tb is not None:
        frame = tb.tb_frame
        filename = frame.f_code.co_filename
        if "/torch/" not in filename and "qreport_widgets" not in filename:
            where = f" (at {filename}:{tb.tb_lineno})"
            owner = frame.f_locals.get("self")
            culprit = ""
            if isinstance(owner, torch.nn.Module) and names.get(id(owner)):
                culprit = f", in submodule {names[id(owner)]} ({type(owner).__name__}.{frame.f_code.co_name})"
        tb = tb.tb_next
    return where, culprit
