"""ExecuTorch with XNNPACK as the PT2E engine's target: XNNPACK's quantizer instead of x86's, and a
converted model lowered to XNNPACK, serialised to a ``.pte`` program and run in ExecuTorch's runtime.

A run's quantized model is then a ``DeployedProgram``: calling it executes the program in the runtime
(what a phone runs, here on x86), so the output SQNR, the metric and the latency of every run are
the deployed program's, its size the ``.pte``'s bytes. It keeps the reference-quantized graph it was
lowered from, which per-layer SQNR and the conversions read (the runtime's delegated subgraphs
have no layers to read). What XNNPACK left to ExecuTorch's portable kernels, and why, is counted
from the lowered graph and the partitioner's own log.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ...core.calibration import torch_warnings_hidden
from ...errors import MissingExtraError, QReportError
from ..settings import ModuleSettings
from .export import WORKFLOW_CODE

INSTALL = "pip install 'qreport-widgets[executorch]'  (executorch==1.5.1, beside torch 2.13 and torchao 0.18)"
# nodes of a lowered graph that are bookkeeping, not ops a kernel runs
BOOKKEEPING = {"getitem", "sym_size", "sym_size.int", "executorch_call_delegate"}


class LoweringError(QReportError, RuntimeError):
    """ExecuTorch could not export, lower to XNNPACK or serialise the quantized model."""


class RuntimeFailedError(QReportError, RuntimeError):
    """ExecuTorch's runtime could not load or execute the program."""


@functools.cache
def executorch_api() -> types.SimpleNamespace:
    """ExecuTorch's entry points, imported once; a clear error naming the extra when missing."""
    try:
        # ExecuTorch's kernels print what they load and the CPUs they find
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), _quiet_runtime():
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            from executorch.backends.xnnpack.quantizer import xnnpack_quantizer
            from executorch.backends.xnnpack.utils.configs import get_xnnpack_edge_compile_config
            from executorch.exir import to_edge_transform_and_lower
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime
            from torchao.quantization.pt2e.quantizer import ComposableQuantizer
            from torchao.quantization.pt2e.quantizer import utils as quantizer_utils
    except ImportError as error:
        raise MissingExtraError(f"the XNNPACK target needs ExecuTorch ({error}); install it with: {INSTALL}") from error
    # one thread, as runs time PyTorch models: the latency of a program, the same on every machine
    with _quiet_runtime():  # the thread pool logs the CPUs it finds when first asked
        if portable_lib._threadpool_get_thread_count() != 1:
            portable_lib._unsafe_reset_threadpool(1)
    return types.SimpleNamespace(
        XNNPACKQuantizer=xnnpack_quantizer.XNNPACKQuantizer,
        get_symmetric_quantization_config=xnnpack_quantizer.get_symmetric_quantization_config,
        module_name_filter=quantizer_utils.get_module_name_filter,
        ComposableQuantizer=ComposableQuantizer,
        XnnpackPartitioner=XnnpackPartitioner,
        to_edge_transform_and_lower=to_edge_transform_and_lower,
        edge_compile_config=get_xnnpack_edge_compile_config,
        Runtime=Runtime,
    )


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
        'method = Runtime.get().load_program(program.buffer).load_method("forward")',
        "outputs = method.execute(list(example_inputs))",
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Delegation:
    """What XNNPACK took: ops in its delegated subgraphs, ops left to ExecuTorch's portable kernels
    (op name -> count) and the partitioner's reason per op left out, where it gave one."""

    subgraphs: int
    delegated: int
    left: Mapping[str, int] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)

    @property
    def words(self) -> str:
        """In a run's notes: "XNNPACK runs 28 of 29 ops (2 subgraphs); left to ExecuTorch's portable kernels: ..."."""
        total = self.delegated + sum(self.left.values())
        said = f"XNNPACK runs {self.delegated} of {total} ops ({self.subgraphs} delegated subgraphs)"
        if not self.left:
            return said + "; nothing left to ExecuTorch's portable kernels"
        each = ", ".join(
            f"{op} x{count}" + (f" ({self.reasons[op]})" if op in self.reasons else "") for op, count in self.left.items()
        )
        return f"{said}; left to ExecuTorch's portable kernels: {each}"


class DeployedProgram(torch.nn.Module):
    """An ExecuTorch program lowered to XNNPACK, called like the model: ``forward`` executes it in
    ExecuTorch's runtime. ``pte`` is the serialised program (``write(path)`` saves it), ``reference``
    the reference-quantized graph it was lowered from, ``delegation`` what XNNPACK took."""

    def __init__(self, pte: bytes, reference: torch.fx.GraphModule, out_spec: Any, delegation: Delegation) -> None:
        super().__init__()
        self.pte = pte
        self.delegation = delegation
        self.lowering_s = 0.0
        self.input_shapes: tuple[tuple[int, ...], ...] | None = None  # set when the program fixes its input shapes
        # the most batch rows one execution takes (its memory is planned for them); None: unknown, as given
        self.batch_limit: int | None = None
        self._out_spec = out_spec
        object.__setattr__(self, "reference", reference)  # not a submodule: its tensors are not the program's
        try:
            with _quiet_runtime():
                self._method = executorch_api().Runtime.get().load_program(pte).load_method("forward")
        except Exception as error:
            raise RuntimeFailedError(
                f"ExecuTorch's runtime could not load the program ({type(error).__name__}: {error}). "
                "Quantize for x86 (analyze(..., engine='pt2e') without target) or report the model to ExecuTorch."
            ) from error

    def forward(self, *inputs: Any) -> Any:
        flat = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in pytree.tree_leaves(inputs)]
        batch = _batch_rows(flat)
        limit = self.batch_limit
        if batch is not None and limit and (batch > limit or (self.input_shapes is not None and batch != limit)):
            return self._in_chunks(flat, batch, limit)
        return pytree.tree_unflatten(self._executed(flat), self._out_spec)

    def _in_chunks(self, flat: list[Any], batch: int, limit: int) -> Any:
        """A batch the program's planned memory does not hold (or, for a program fixed to its batch
        size, of another size) run ``limit`` rows at a time, the last chunk padded with copies of its
        last row where the size is fixed; the outputs joined along their batch dimension."""
        pieces = []
        for start in range(0, batch, limit):
            rows = min(limit, batch - start)
            chunk = [x[start : start + rows] if isinstance(x, torch.Tensor) else x for x in flat]
            if self.input_shapes is not None and rows < limit:
                chunk = [_padded(x, limit) if isinstance(x, torch.Tensor) else x for x in chunk]
            outputs = self._executed(chunk)
            if not all(isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == len(chunk[0]) for o in outputs):
                raise RuntimeFailedError(
                    f"a batch of {batch} rows does not fit the program (it runs at most {limit} at once) and its "
                    "outputs have no batch dimension to join chunks along: give batches of at most "
                    f"{limit} rows, or export with example inputs of the largest batch"
                )
            pieces.append([o[:rows] for o in outputs])
        return pytree.tree_unflatten([torch.cat(parts) for parts in zip(*pieces, strict=True)], self._out_spec)

    def _executed(self, flat: list[Any]) -> list[Any]:
        try:
            outputs = self._method.execute(flat)
        except Exception as error:
            shapes = tuple(tuple(x.shape) for x in flat if isinstance(x, torch.Tensor))
            if self.input_shapes is not None and shapes != self.input_shapes:
                why = (
                    f"the model fixes its batch size, so the program was exported for inputs of shape {self.input_shapes} "
                    "only: give evaluation batches of the example inputs' size"
                )
            else:
                why = (
                    "an op the runtime has no kernel for, or a kernel that failed: keep the modules around it float "
                    "(the run's notes list the ops left to portable kernels), or quantize for x86"
                )
            raise RuntimeFailedError(
                f"ExecuTorch's runtime failed to execute the program on inputs of shape {shapes} "
                f"({type(error).__name__}: {error}): {why}."
            ) from error
        return list(outputs)

    def write(self, path: str | os.PathLike[str]) -> int:
        """Save the program as ``path`` (a ``.pte`` file ExecuTorch's runtime loads); the bytes written."""
        with open(path, "wb") as file:
            return file.write(self.pte)

    def extra_repr(self) -> str:
        return f"{len(self.pte):,} bytes of .pte; {self.delegation.words}"


def lower(converted: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> DeployedProgram:
    """``converted`` (convert_pt2e's graph) exported, lowered to XNNPACK, serialised and loaded in
    ExecuTorch's runtime; the batch size stays free where the graph allows it."""
    api = executorch_api()
    start = time.perf_counter()
    step = "torch.export of the quantized graph"
    try:
        with torch_warnings_hidden(), _quiet_runtime(), warnings.catch_warnings():
            # ExecuTorch's and torch's own deprecations inside the lowering (copied pytree specs): nothing to act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            exported = _exported(converted, example_inputs)
            step = "to_edge_transform_and_lower with XNNPACK's partitioner"
            with _reasons() as reasons:
                # XNNPACK's own edge config: the edge IR is not validated again over fake tensors
                edge = api.to_edge_transform_and_lower(
                    exported, partitioner=[api.XnnpackPartitioner()], compile_config=api.edge_compile_config()
                )
            delegation = _delegation(edge.exported_program().graph_module, reasons)
            step = "to_executorch (serialising the program)"
            pte = bytes(edge.to_executorch().buffer)
    except Exception as error:
        raise LoweringError(
            f"ExecuTorch could not lower the quantized model to XNNPACK: {step} failed ({type(error).__name__}: "
            f"{str(error)[:400]}). Keep the modules around the failing op float, or quantize for x86 "
            "(analyze(..., engine='pt2e') without target)."
        ) from error
    program = DeployedProgram(pte, converted, exported.call_spec.out_spec, delegation)
    program.lowering_s = time.perf_counter() - start
    program.batch_limit = _batch_rows(list(example_inputs))
    if not _batch_free(exported):
        program.input_shapes = tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor))
    return program


def _exported(model: torch.fx.GraphModule, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    rows = _batch_rows(list(example_inputs))
    if rows is not None and rows > 1:
        # ExecuTorch plans the program's memory for the bound: the example's batch, stated (larger ones run in chunks)
        batch = torch.export.Dim("batch", min=1, max=rows)
        try:
            return torch.export.export(model, example_inputs, dynamic_shapes=tuple({0: batch} for _ in example_inputs))
        except Exception:  # the graph fixes its batch size: exported as given
            pass
    return torch.export.export(model, example_inputs)


def _batch_rows(flat: list[Any]) -> int | None:
    """The batch size of a call's inputs: the first dimension every tensor input shares (None when they do not)."""
    tensors = [x for x in flat if isinstance(x, torch.Tensor)]
    if not tensors or any(x.dim() == 0 for x in tensors) or len({x.shape[0] for x in tensors}) != 1:
        return None
    return int(tensors[0].shape[0])


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with copies of its last row appended up to ``rows`` rows."""
    return torch.cat([x, x[-1:].expand(rows - len(x), *x.shape[1:])]).contiguous()


def _batch_free(exported: torch.export.ExportedProgram) -> bool:
    """Whether a user input of ``exported`` has a symbolic (free) size."""
    inputs = set(exported.graph_signature.user_inputs)
    values = [node.meta.get("val") for node in exported.graph.nodes if node.op == "placeholder" and node.name in inputs]
    return any(isinstance(size, torch.SymInt) for value in values for size in getattr(value, "shape", ()))


def _delegation(lowered: torch.fx.GraphModule, reasons: Mapping[str, str]) -> Delegation:
    subgraphs, delegated, left = 0, 0, Counter()
    for node in lowered.graph.nodes:
        if node.op == "get_attr" and str(node.target).startswith("lowered_module"):
            subgraphs += 1
            inner = getattr(lowered, str(node.target)).original_module.graph_module.graph
            delegated += sum(1 for n in inner.nodes if n.op == "call_function" and _op_name(n) not in BOOKKEEPING)
        elif node.op == "call_function" and _op_name(node) not in BOOKKEEPING:
            left[_op_name(node)] += 1
    return Delegation(subgraphs, delegated, dict(left), {op: why for op, why in reasons.items() if op in left})


def _op_name(node: torch.fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return name.removesuffix(".default")


class _Reasons(logging.Handler):
    """The partitioner's "why not delegated" records, first reason per op."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.found: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        node, reason = getattr(record.msg, "node", None), getattr(record.msg, "reason", None)
        if isinstance(node, torch.fx.Node) and reason:
            self.found.setdefault(_op_name(node), str(reason))


@contextlib.contextmanager
def _reasons() -> Iterator[dict[str, str]]:
    logger = logging.getLogger("executorch.backends.xnnpack")
    handler, level, propagate = _Reasons(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the debug records are read here, not printed
    try:
        yield handler.found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


@contextlib.contextmanager
def _quiet_runtime() -> Iterator[None]:
    """ExecuTorch's C++ runtime logs what it reads of the CPU to stderr's file descriptor: kept out
    of the notebook."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (some notebook front ends)
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
