"""The torch steps every run shares: prepare_fx on a copy, with errors that say what to try."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch.ao.quantization import QConfigMapping
from torch.ao.quantization.quantize_fx import prepare_fx

from .errors import UntraceableModelError


def prepare(
    float_model: torch.nn.Module, qconfig_mapping: QConfigMapping, example_inputs: tuple[Any, ...], **kwargs: Any
) -> torch.fx.GraphModule:
    """``prepare_fx`` on a deep copy, with tracing failures turned into an error that says what to try."""
    model = copy.deepcopy(float_model).eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return prepare_fx(model, qconfig_mapping, example_inputs, **kwargs)
    except (torch.fx.proxy.TraceError, TypeError, NotImplementedError, RuntimeError, AttributeError) as error:
        where = _user_frame(error)
        raise UntraceableModelError(
            f"torch.fx could not trace {type(float_model).__name__}: {type(error).__name__}: {error}{where}\n"
            "FX traces with symbolic values, so Python control flow that depends on tensor values "
            "(if x.sum() > 0, loops over x.shape[0] ...) cannot be traced. Options: pass "
            "prepare_custom_config=PrepareCustomConfig().set_non_traceable_module_names([...]) or "
            ".set_non_traceable_module_classes([...]) to keep the offending submodule as one opaque call, "
            "fix input-dependent arguments with concrete_args, or move the branch out of forward()."
        ) from error


def _user_frame(error: BaseException) -> str:
    """' (at file:line)' for the deepest traceback frame outside torch, if there is one."""
    tb, found = error.__traceback__, ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "/torch/" not in filename and "qreport_widgets" not in filename:
            found = f" (at {filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return found
