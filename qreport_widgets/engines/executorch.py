"""ExecuTorch as an engine's target: a quantized model exported, lowered to XNNPACK, serialised as a
``.pte`` program and executed by ExecuTorch's runtime, engine-neutral (the PT2E engine lowers its
converted graph, the eager engine its ``quantize_``-d model).

A run's quantized model is then a ``DeployedProgram``: calling it executes the program in the
runtime (what a phone runs, here on x86), so the output SQNR, the metric and the latency of every
run are the deployed program's, its size the ``.pte``'s bytes. It keeps the model it was lowered
from (``reference``), which per-layer SQNR and the conversions read (the runtime's delegated
subgraphs have no layers to read). What XNNPACK left to ExecuTorch's portable kernels, and why, is
counted from the lowered graph and the partitioner's own log.

The runtime is native code: a kernel it lacks, a freed buffer or a partitioner bug can end the
process it runs in. Programs therefore run in a worker process (``RuntimeWorker``, one per Python
process, started when a program first runs); tensors cross to it as their bytes through a socket. A crash
there ends the worker, not the notebook's kernel: the call raises ``RuntimeFailedError`` saying what
was running, and the next call starts a new worker.

May import: ``core``, ``errors``, ``program_reuse`` (the engine packages import this module).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import itertools
import logging
import operator
import os
import sys
import time
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
import torch.fx
import torch.multiprocessing  # noqa: F401  (a tensor of a dtype NumPy lacks crosses to the worker through shared memory)
from torch.utils import _pytree as pytree

from ..core.calibration import batch_rows, torch_warnings_hidden
from ..core.progress import Progress, Stopped, steps
from ..core.shortcuts import Shortcut, ShortcutMismatchError, checking, confirmed
from ..errors import MissingExtraError, QReportError
from ..targets.contract import Deployed
from ..targets.worker import RuntimeFailedError, Worker, answer, serving
from . import program_reuse

INSTALL = "pip install 'qreport-widgets[executorch]'  (executorch==1.5.1, beside torch 2.13 and torchao 0.18)"
# nodes of a lowered graph that are bookkeeping, not ops a kernel runs
BOOKKEEPING = {"getitem", "sym_size", "sym_size.int", "executorch_call_delegate"}
STAGES = 3  # of a lowering, each a step of its progress: export, lowering (or rewriting), serialising
FULL, DYNAMIC = "full", "dynamic"  # XNNPACK's partitioners: every op it takes, or dynamically quantized GEMMs only
X86_HINT = "or quantize for x86 (analyze(...) without target=)"
RUNTIME_WORDS = "XNNPACK in ExecuTorch's runtime on the CPU"  # where a target's real runs are measured
# why a program cannot carry R4's product on down_proj's input, measured: it lands in one XNNPACK partition with the
# dynamically quantized down_proj and its reshapes, and the runtime sizes that partition's output as the product's
# (a tensor bounded at 4,096 elements resized to 8,192). R1's products, between a norm and the residual add, run.
ONLINE_PRODUCT_FAILS = (
    "ExecuTorch's runtime fails to execute the program R4 gives (error 0x10: its Hadamard product on down_proj's "
    "input and down_proj fall in one XNNPACK partition whose output the runtime sizes wrongly): on the XNNPACK "
    "target use Rotation() (R1 + R2)"
)


class LoweringError(QReportError, RuntimeError):
    """ExecuTorch could not export, lower to XNNPACK or serialise the quantized model."""


@functools.cache
def executorch_api() -> types.SimpleNamespace:
    """ExecuTorch's lowering entry points, imported once; a clear error naming the extra when missing."""
    try:
        # ExecuTorch's kernels print what they load and the CPUs they find
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), quiet_runtime():
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
                XnnpackDynamicallyQuantizedPartitioner,
                XnnpackPartitioner,
            )
            from executorch.backends.xnnpack.utils.configs import get_xnnpack_edge_compile_config
            from executorch.exir import EdgeProgramManager, ExecutorchBackendConfig, to_edge_transform_and_lower
            from executorch.exir.backend.compile_spec_schema import CompileSpec
            from executorch.exir.backend.partitioner import DelegationSpec
            from executorch.exir.passes.constant_prop_pass import _DEFAULT_SKIP_TARGETS, constant_prop_pass
            from executorch.exir.passes.quant_fusion_pass import QuantFusionPass
            from executorch.runtime import Runtime  # noqa: F401  (the worker's; missing means no runtime)
    except ImportError as error:
        raise MissingExtraError(f"the XNNPACK target needs ExecuTorch ({error}); install it with: {INSTALL}") from error
    return types.SimpleNamespace(
        XnnpackPartitioner=XnnpackPartitioner,
        XnnpackDynamicallyQuantizedPartitioner=XnnpackDynamicallyQuantizedPartitioner,
        ExecutorchBackendConfig=ExecutorchBackendConfig,
        EdgeProgramManager=EdgeProgramManager,
        to_edge_transform_and_lower=to_edge_transform_and_lower,
        QuantFusionPass=QuantFusionPass,
        constant_prop_pass=constant_prop_pass,
        not_folded=frozenset(_DEFAULT_SKIP_TARGETS),  # what its constant propagation leaves as ops by default
        edge_compile_config=get_xnnpack_edge_compile_config,
        CompileSpec=CompileSpec,
        DelegationSpec=DelegationSpec,
    )


@dataclass(frozen=True)
class DecodeSpeed:
    """A decoder program's speed in ExecuTorch's runtime, one thread, timed inside the worker: the
    prompt fed one token a call (``prefill_ms``, the median per token), then ``new_tokens`` tokens
    generated greedily, each from the one before (``decode_ms``, the median per token)."""

    prompt_tokens: int
    new_tokens: int
    prefill_ms: float
    decode_ms: float
    pte_bytes: int
    lowering_s: float
    generated: tuple[int, ...] = ()
    file_words: str = ".pte with its KV cache"  # what ``pte_bytes`` are the bytes of

    @property
    def words(self) -> str:
        return (
            f"{self.decode_ms:.2f} ms a generated token ({self.new_tokens} after a {self.prompt_tokens}-token prompt, "
            f"{self.prefill_ms:.2f} ms a prompt token), {self.pte_bytes:,} bytes of {self.file_words}"
        )


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


class DeployedProgram(Deployed):
    """An ExecuTorch program lowered to XNNPACK, called like the model: ``forward`` executes it in
    ExecuTorch's runtime (in the ``RuntimeWorker``). ``pte`` is the serialised program
    (``write(path)`` saves it), ``reference`` the quantized model it was lowered from,
    ``delegation`` what XNNPACK took."""

    suffix = ".pte"

    def __init__(self, pte: bytes, reference: torch.nn.Module, out_spec: Any, delegation: Delegation) -> None:
        super().__init__()
        self.pte = pte
        self.delegation = delegation
        self.lowering_s = 0.0
        # what the lowering depended on, and, where an earlier program of the same graph was reused, how
        # (in words) and the seconds that saved ("" and 0: lowered in full)
        self.structure: program_reuse.Structure | None = None
        # a decoder's edge program as its lowering made it, unserialised, with what it holds (``program_reuse.edge_with``)
        self.edge: program_reuse.KeptEdge | None = None
        self.reused = ""
        self.saved_s = 0.0
        self.input_shapes: tuple[tuple[int, ...], ...] | None = None  # set when the program fixes its input shapes
        # the most batch rows one execution takes (its memory is planned for them); None: unknown, as given
        self.batch_limit: int | None = None
        # seconds the runtime spent executing the last call (its chunks summed), timed in the worker:
        # the program's latency without the hand-over between processes
        self.last_call_s = 0.0
        self._out_spec = out_spec
        # the example inputs, partitioner and fusion it was lowered with (None: lowered from a given export)
        self.lowered_as: tuple[tuple[Any, ...], str, bool] | None = None
        self.taps: dict[tuple[str, ...], ProgramTaps] = {}  # programs_taps' twins, per tapped modules
        object.__setattr__(self, "reference", reference)  # not a submodule: its tensors are not the program's
        self._key = runtime_worker().load(pte)  # loaded once now: a program the runtime refuses fails its run here
        weakref.finalize(self, runtime_worker().forget, self._key)

    def forward(self, *inputs: Any) -> Any:
        flat = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in pytree.tree_leaves(inputs)]
        batch = batch_rows(flat)
        limit = self.batch_limit
        self.last_call_s = 0.0
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
            outputs, seconds = runtime_worker().execute(self._key, self.pte, flat)
            self.last_call_s += seconds
            return outputs
        except RuntimeFailedError:
            raise
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
                    f"(the run's notes list the ops left to portable kernels), {X86_HINT}"
                )
            raise RuntimeFailedError(
                f"ExecuTorch's runtime failed to execute the program on inputs of shape {shapes} ({error}): {why}."
            ) from None

    def decode(self, prompt: Sequence[int], new_tokens: int) -> DecodeSpeed:
        """For a program exported one token and its cache position a call (a decoder with a static
        KV cache): the prompt fed, then ``new_tokens`` generated greedily, timed in the runtime."""
        prefill, decode, generated = runtime_worker().decode(self._key, self.pte, [int(t) for t in prompt], new_tokens)
        return DecodeSpeed(
            len(prompt),
            new_tokens,
            _median_ms(prefill),
            _median_ms(decode),
            len(self.pte),
            self.lowering_s,
            tuple(generated),
        )

    @property
    def artifact_bytes(self) -> int:
        return len(self.pte)

    def write(self, path: str | os.PathLike[str]) -> int:
        """Save the program as ``path`` (a ``.pte`` file ExecuTorch's runtime loads); the bytes written."""
        with open(path, "wb") as file:
            return file.write(self.pte)

    def extra_repr(self) -> str:
        return f"{len(self.pte):,} bytes of .pte; {self.delegation.words}"


def lower(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    partitioner: str = FULL,
    fuse_quantized_ops: bool = False,
    reference: torch.nn.Module | None = None,
    exported: torch.export.ExportedProgram | None = None,
    progress: Progress | None = None,
    check: bool = False,
) -> DeployedProgram:
    """``model`` (a quantized model) exported, lowered to XNNPACK, serialised and loaded in
    ExecuTorch's runtime; the batch size stays free where the graph allows it, up to the example's.

    ``partitioner``: ``FULL`` (XNNPACK takes every op it can) or ``DYNAMIC`` (only dynamically
    quantized Linears, as ExecuTorch's LLM export lowers decoders). ``fuse_quantized_ops``: torchao's
    quantize / dequantize ops outside XNNPACK fused into ExecuTorch's quantized kernels (a grouped
    int4 / int8 embedding becomes ``embedding_4bit`` / ``embedding_byte``). ``reference``: what
    per-layer SQNR reads (default ``model``). ``exported``: ``model`` already exported (on
    ``example_inputs``), as it is. ``progress``: a step a stage (export, lowering, serialising;
    None: a bar naming the stage that runs), a callback that raises stops it between stages.
    ``check``: a program rewritten from one lowered before is also lowered afresh and the two
    compared byte for byte (the check mode, ``core.shortcuts``; on as well where the environment asks)."""
    api = executorch_api()
    start = time.perf_counter()
    checking_s = 0.0  # the check mode's fresh lowering, not counted as the lowering's own time
    step = "torch.export of the quantized model"
    try:
        with (
            torch_warnings_hidden(),
            quiet_runtime(),
            warnings.catch_warnings(),
            steps(STAGES, "lowering: torch.export", "stage", progress) as stage,
        ):
            # ExecuTorch's and torch's own deprecations inside the lowering (copied pytree specs): nothing to act on
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            fixed_rows = None if exported is not None else _fixed_batch(partitioner, example_inputs)
            exported = _fusable_embeddings(exported or _exported(model, example_inputs, free_batch=fixed_rows is None))
            step = "comparing the graph with the programs lowered before"
            shape = program_reuse.structure(exported, partitioner, fuse_quantized_ops)
            earlier = program_reuse.LOWERED.get(shape.key)
            reused = None if earlier is None else program_reuse.rewritten(earlier.pte, earlier.structure, shape)
            kept = earlier.edge if earlier is not None else None  # the first lowering's edge program, as it holds
            # constants outside the delegates changed: the earlier edge program with them written in, serialised again
            written = None if reused is not None or kept is None else program_reuse.edge_with(kept, shape)
            if written is not None:
                stage("lowering: the changed constants written into the edge program lowered before, serialised again")
                step = "to_executorch of the edge program lowered before, with the changed constants written in"
                reused = program_reuse.rewritten(_serialised(written.edge, fuse_quantized_ops, fixed_rows), written.holds, shape)
            elif reused is not None:
                stage("lowering: the changed weights written into the program lowered before")
            if reused is not None:  # the graph lowered before: only its changed constants written in
                pte, delegation = reused.pte, earlier.delegation
                stage()
            else:
                if written is None:  # a rewrite that failed counted this stage already
                    stage("lowering: decompositions, edge passes, XNNPACK (to_edge_transform_and_lower)")
                written = None
                step = "to_edge_transform_and_lower with XNNPACK's partitioner"
                edge, delegation = _lowered_edge(api, exported, partitioner)
                stage("lowering: serialising the program (to_executorch)")
                step = "to_executorch (serialising the program)"
                # a decoder's edge program kept unserialised (serialising changes it) for a later edge_with
                kept = program_reuse.KeptEdge(copy.deepcopy(edge), shape) if partitioner == DYNAMIC else None
                pte = _serialised(edge, fuse_quantized_ops, fixed_rows)
            stage()
            if reused is not None and checking(check):
                step = "lowering the program afresh to check the one rewritten (the check mode)"
                shortcut = Shortcut.EDGE_REWRITE if written is not None else Shortcut.PROGRAM_REWRITE
                afresh = functools.partial(_lowered_afresh, api, exported, partitioner, fuse_quantized_ops, fixed_rows)
                checked = time.perf_counter()
                confirmed(shortcut, pte, afresh, operator.eq, _bytes_differ)
                checking_s = time.perf_counter() - checked
    except (Stopped, ShortcutMismatchError):  # stopped by the caller between stages; a shortcut found wrong
        raise
    except Exception as error:
        raise LoweringError(
            f"ExecuTorch could not lower the quantized model to XNNPACK: {step} failed ({type(error).__name__}: "
            f"{str(error)[:400]}). Keep the modules around the failing op float, {X86_HINT}."
        ) from error
    program = DeployedProgram(pte, model if reference is None else reference, exported.call_spec.out_spec, delegation)
    if reference is None:  # what ``program_taps`` lowers again, with taps
        program.lowered_as = (example_inputs, partitioner, fuse_quantized_ops)
    program.lowering_s = time.perf_counter() - start - checking_s
    program.structure = shape
    program.edge = kept
    if reused is not None:
        full_s = earlier.lowering_s + earlier.saved_s  # what lowering that graph in full took
        before = f"the program's graph is one lowered before ({full_s:.1f} s)"
        program.reused = (
            f"{before}: its {reused.constants} changed weights and scales were written into that program as XNNPACK "
            "stores them, the bytes a lowering gives"
            if reused.constants
            else f"{before}, and its weights are the same: that program reused"
        )
        if written is not None:
            program.reused = (
                f"{before}: its {written.constants} changed constants that ExecuTorch's own kernels read (a norm's weight, an "
                f"embedding) were written into that lowering's edge program, serialised again (to_executorch), and its "
                f"{reused.constants} changed delegated weights and scales written into that program as XNNPACK stores "
                "them, the bytes a lowering gives"
            )
        program.saved_s = max(full_s - program.lowering_s, 0.0)
    program_reuse.LOWERED[shape.key] = program
    program.batch_limit = batch_rows(list(example_inputs))
    if not _batch_free(exported):
        program.input_shapes = tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor))
    return program


# ops a module's last node can be that carry no value of its own (a shape check torch.export inserts)
_NOT_TAPPED = ("aten._assert_tensor_metadata.default",)


class ProgramTaps:
    """A program's twin, lowered as it was, that also returns the outputs of some of its modules
    (ExecuTorch's intermediate-output taps, which pass through XNNPACK's delegates): what the
    runtime computes inside the program, module by module (``outputs``)."""

    def __init__(self, pte: bytes, taps: dict[int, str], batch_limit: int | None) -> None:
        self.pte = pte
        self.tapped = taps  # output index -> module
        self.batch_limit = batch_limit
        self._key = runtime_worker().load(pte)
        weakref.finalize(self, runtime_worker().forget, self._key)

    def outputs(self, *inputs: Any) -> dict[str, list[torch.Tensor]]:
        """Each tapped module's outputs in the runtime on ``inputs`` (a module can have several:
        every value that leaves it), run ``batch_limit`` rows at a time and joined along the batch."""
        flat = [x.contiguous() if isinstance(x, torch.Tensor) else x for x in pytree.tree_leaves(inputs)]
        rows, limit = batch_rows(flat), self.batch_limit
        starts = range(0, rows, limit) if rows and limit and rows > limit else [None]
        pieces: dict[int, list[torch.Tensor]] = {index: [] for index in self.tapped}
        for start in starts:
            chunk = flat if start is None else [x[start : start + limit] if isinstance(x, torch.Tensor) else x for x in flat]
            found, _ = runtime_worker().execute(self._key, self.pte, chunk)
            for index in self.tapped:
                pieces[index].append(found[index])
        joined: dict[str, list[torch.Tensor]] = {}
        for index, name in self.tapped.items():
            parts = pieces[index]
            joined.setdefault(name, []).append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return joined


def program_taps(program: DeployedProgram, names: Sequence[str]) -> ProgramTaps:
    """``program`` lowered again, as it was, from the model it was lowered from, with the outputs of
    the modules ``names`` returned too; kept on the program for the next call."""
    names = tuple(names)
    if names in program.taps:
        return program.taps[names]
    if program.lowered_as is None:
        raise LoweringError("this program was lowered from a given export: it cannot be lowered again with taps")
    example_inputs, partitioner, fuse = program.lowered_as
    api = executorch_api()
    from executorch.devtools.intermediate_output_tap import (
        FULL_TENSOR,
        select_all,
        select_by_module_path,
        select_by_op_type,
        select_not,
        strip_taps_,
        tap_intermediate_outputs_,
    )

    wanted = {f"model.{name}": name for name in names}  # inside the wrapper that exports the model (``_ProgramOutputs``)
    rule = (select_all(select_by_module_path(*wanted), select_not(select_by_op_type(*_NOT_TAPPED))), FULL_TENSOR)
    try:
        with torch_warnings_hidden(), quiet_runtime(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fixed_rows = _fixed_batch(partitioner, example_inputs)
            untapped = _fusable_embeddings(_exported(program.reference, example_inputs, free_batch=fixed_rows is None))
            exported, specs = tap_intermediate_outputs_(untapped, rules=[rule])
            chosen = _dynamic_partitioner(api) if partitioner == DYNAMIC else api.XnnpackPartitioner()
            edge = api.to_edge_transform_and_lower(exported, partitioner=[chosen], compile_config=api.edge_compile_config())
            strip_taps_(edge)
            pte = _serialised(edge, fuse, fixed_rows)
    except Exception as error:
        raise LoweringError(
            "the program could not be lowered again with its modules' outputs tapped "
            f"({type(error).__name__}: {str(error)[:300]})"
        ) from error
    taps = {spec.output_index: wanted[spec.module_path] for spec in specs if spec.module_path in wanted}
    program.taps[names] = found = ProgramTaps(pte, taps, program.batch_limit)
    return found


def _dynamic_partitioner(api: types.SimpleNamespace) -> Any:
    """XNNPACK's dynamically quantized partitioner, its partitions (dynamically quantized Linears
    only) marked as such for XNNPACK's preprocess (the ``dqlinear_partitioner`` compile spec): it
    then runs the one pass such a partition needs (to ``linear``) instead of its whole pass list,
    once per partition. The same program's outputs; a third to a half less lowering time on a decoder."""
    chosen = api.XnnpackDynamicallyQuantizedPartitioner()
    spec = chosen.delegation_spec
    marked = [*spec.compile_specs, api.CompileSpec("dqlinear_partitioner", b"")]
    chosen.delegation_spec = api.DelegationSpec(spec.backend_id, marked)
    return chosen


class _ProgramOutputs(torch.nn.Module):
    """``model`` returning what a program can: its output without the values no program returns (a
    transformers cache object, which a decoder left at ``use_cache=True``, as ``from_pretrained`` gives
    it, puts beside its logits). The session measures the rest; the model's configuration is not
    touched."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: Any) -> Any:
        return _program_output(self.model(*inputs))


def _program_output(output: Any) -> Any:
    """``output`` without the fields torch.export cannot return: a dict-like output (a Hugging Face
    ``ModelOutput``) keeps its tensors and containers of them, of the same type."""
    if not isinstance(output, Mapping):
        return output
    kept = {name: value for name, value in output.items() if _returnable(value)}
    if len(kept) == len(output):
        return output
    try:
        return type(output)(**kept)
    except TypeError:  # a mapping type not built from its fields
        return kept


def _returnable(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or value is None:
        return True
    if isinstance(value, (tuple, list)):
        return all(_returnable(v) for v in value)
    if isinstance(value, Mapping):
        return all(_returnable(v) for v in value.values())
    return isinstance(value, (int, float, bool))


# transformers' experts implementations that reach a program as a custom op without an out variant,
# which ExecuTorch cannot serialise ("Missing out variants: transformers::grouped_mm_fallback"), and the
# implementation exported in their place (a batched matmul over the chosen experts' weights: plain ops)
_UNSERIALISABLE_EXPERTS = ("grouped_mm",)
_EXPORTED_EXPERTS = "batched_mm"


@contextlib.contextmanager
def _exportable_experts(model: torch.nn.Module) -> Iterator[None]:
    """Within: every module of ``model`` whose transformers configuration asks an experts
    implementation a program cannot serialise reads a copy of it asking ``_EXPORTED_EXPERTS``; the
    modules' own configurations are given back after (the user's are never written)."""
    swapped: dict[int, Any] = {}
    held: list[tuple[torch.nn.Module, Any]] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) not in _UNSERIALISABLE_EXPERTS:
            continue
        if id(config) not in swapped:
            changed = copy.copy(config)
            changed._experts_implementation = _EXPORTED_EXPERTS
            swapped[id(config)] = changed
        held.append((module, config))
        module.config = swapped[id(config)]
    try:
        yield
    finally:
        for module, config in held:
            module.config = config


def _fixed_batch(partitioner: str, example_inputs: tuple[Any, ...]) -> int | None:
    """The batch a program lowered with ``partitioner`` is exported at (a decoder's, ``DYNAMIC``: the
    example's rows, ``_exported_as_is``); None where the batch is left free."""
    return batch_rows(list(example_inputs)) if partitioner == DYNAMIC else None


def _fusable_embeddings(exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``exported`` (changed in place) with each quantized embedding's lookup called on its weight and
    indices alone. An ``nn.Embedding`` with a ``padding_idx`` (a Hugging Face decoder whose config names a
    pad token: ``LlamaModel`` passes it on) exports ``aten.embedding(weight, ids, padding_idx)``, which
    ExecuTorch's fusion of torchao's dequantize-then-embedding into ``embedding_4bit`` / ``embedding_byte``
    does not match (its pattern has two arguments): ``dequantize_affine`` was left in the program, which
    then failed to serialise ("Missing out variants"). The padding index, like ``scale_grad_by_freq``
    and ``sparse``, shapes only the gradient: the lookup's values are the same."""
    changed = False
    for node in exported.graph.nodes:
        weight = node.args[0] if node.target is torch.ops.aten.embedding.default else None
        if isinstance(weight, torch.fx.Node) and len(node.args) > 2 and weight.target is _dequantize_affine():
            node.args = node.args[:2]
            changed = True
    if changed:
        exported.graph_module.recompile()
    return exported


def _dequantize_affine() -> Any:
    ops = getattr(torch.ops, "torchao", None)
    return getattr(getattr(ops, "dequantize_affine", None), "default", None)


def _exported(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, free_batch: bool) -> torch.export.ExportedProgram:
    with _exportable_experts(model):
        return _exported_as_is(model, example_inputs, free_batch=free_batch)


def _exported_as_is(model: torch.nn.Module, example_inputs: tuple[Any, ...], *, free_batch: bool) -> torch.export.ExportedProgram:
    """``model`` exported for ``example_inputs``; with ``free_batch``, its batch size free up to the
    example's where the model allows it. A decoder's program (the dynamically quantized partitioner)
    keeps the example's batch, as ExecuTorch's LLM export keeps its shapes: its lowering takes half
    the time (26.0 s against 52.5 s for the byte decoder's 8da4w program, 2 threads,
    ``benchmarks/xnnpack_llm.py``), symbolic sizes being the other half; a smaller batch runs padded
    (``DeployedProgram``), and ``_serialised`` leaves what the batch made constant as ops."""
    model = _ProgramOutputs(model)
    rows = batch_rows(list(example_inputs))
    if free_batch and rows is not None and rows > 1:
        # ExecuTorch plans the program's memory for the bound: the example's batch, stated (larger ones run in chunks)
        batch = torch.export.Dim("batch", min=1, max=rows)
        try:
            shapes = {"inputs": tuple({0: batch} for _ in example_inputs)}  # the wrapper takes them as *inputs
            return torch.export.export(model, example_inputs, dynamic_shapes=shapes)
        except Exception:  # the model fixes its batch size: exported as given
            pass
    return torch.export.export(model, example_inputs)


def _lowered_edge(api: types.SimpleNamespace, exported: torch.export.ExportedProgram, partitioner: str) -> tuple[Any, Delegation]:
    """``exported`` lowered (``to_edge_transform_and_lower``) with the partitioner named, and what XNNPACK took."""
    chosen = _dynamic_partitioner(api) if partitioner == DYNAMIC else api.XnnpackPartitioner()
    with _reasons() as reasons:
        # XNNPACK's own edge config: the edge IR is not validated again over fake tensors
        edge = api.to_edge_transform_and_lower(exported, partitioner=[chosen], compile_config=api.edge_compile_config())
    return edge, _delegation(edge.exported_program().graph_module, reasons)


def _lowered_afresh(
    api: types.SimpleNamespace, exported: torch.export.ExportedProgram, partitioner: str, fuse: bool, rows: int | None
) -> bytes:
    """The ``.pte`` a full lowering of ``exported`` gives, whatever was lowered before (the check mode)."""
    edge, _ = _lowered_edge(api, exported, partitioner)
    return _serialised(edge, fuse, rows)


def _bytes_differ(taken: bytes, fresh: bytes) -> str:
    if len(taken) != len(fresh):
        return f"the rewritten program has {len(taken):,} bytes, a fresh lowering {len(fresh):,}"
    differ = numpy.flatnonzero(numpy.frombuffer(taken, numpy.uint8) != numpy.frombuffer(fresh, numpy.uint8))
    differing, at = len(differ), int(differ[0])
    return f"both have {len(taken):,} bytes; {differing:,} of them differ, the first at byte {at:,}"


def _serialised(edge: Any, fuse_quantized_ops: bool, rows: int | None) -> bytes:
    """The ``.pte`` bytes of a lowered program (``to_executorch``). ``fuse_quantized_ops``: torchao's
    quantize / dequantize ops outside XNNPACK fused into ExecuTorch's quantized kernels, then the
    constants propagated, as ``do_quant_fusion_and_const_prop`` does. ``rows``: the batch the export
    fixed (None: the batch is free, or was fixed by the caller's export). The propagation then stores
    no value the batch introduced: an op whose result leads with the batch's rows while none of its
    inputs does (transformers' attention mask broadcast to the batch, an ``arange`` over its rows)
    stays an op, as a program whose batch is free computes it, and with it what is computed from it.
    Folded, the byte decoder's mask (as ``from_pretrained`` gives it, ``use_cache=True``) is stored once
    per block at 4 x 1 x 128 x 128 bools (1,016,832 bytes of ``.pte``); left, 772,096, against the
    batch-free program's 780,800 (its size ops gone)."""
    api = executorch_api()
    if fuse_quantized_ops and rows is not None and rows > 1:
        program = edge.exported_program()
        api.QuantFusionPass(_fix_node_meta_val=True, node_value_dict=_stored_tensors(program))(program.graph_module)
        with _unfolded(_batch_introduced(program.graph, rows)) as kept:
            folded = api.constant_prop_pass(program, custom_skip_targets=set(api.not_folded) | kept)
        edge = api.EdgeProgramManager(folded, compile_config=api.edge_compile_config())
        fuse_quantized_ops = False  # done above
    config = api.ExecutorchBackendConfig(do_quant_fusion_and_const_prop=fuse_quantized_ops)
    return bytes(edge.to_executorch(config).buffer)


def _batch_introduced(graph: torch.fx.Graph, rows: int) -> list[torch.fx.Node]:
    """The ops of ``graph`` whose result leads with ``rows`` while none of their inputs' does."""

    def leading(node: torch.fx.Node) -> bool:
        value = node.meta.get("val")
        return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows

    return [n for n in graph.nodes if n.op == "call_function" and leading(n) and not any(map(leading, n.all_input_nodes))]


@contextlib.contextmanager
def _unfolded(nodes: Sequence[torch.fx.Node]) -> Iterator[set[Any]]:
    """Within: each of ``nodes`` calls its op through a function of its own, the set of which is
    given, for ExecuTorch's constant propagation to skip (it skips by op, not by node); the ops are
    put back after."""
    kept: dict[Any, Any] = {}
    for node in nodes:
        op = node.target

        def own(*args: Any, _op: Any = op, **kwargs: Any) -> Any:
            return _op(*args, **kwargs)

        own.__name__ = f"kept_{getattr(op, '__name__', 'op')}".replace(".", "_")
        kept[own] = op
        node.target = own
    try:
        yield set(kept)
    finally:
        for node in nodes:
            if node.target in kept:
                node.target = kept[node.target]
        if nodes:
            nodes[0].graph.owning_module.recompile()


def _stored_tensors(program: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The values of ``program``'s parameters and buffers, by the names of the graph inputs that
    read them (what the quantized-op fusion's patterns check weights with)."""
    from torch.export.graph_signature import InputKind, TensorArgument

    stored = (InputKind.PARAMETER, InputKind.BUFFER)
    return {
        spec.arg.name: program.state_dict[spec.target]
        for spec in program.graph_signature.input_specs
        if spec.kind in stored and isinstance(spec.arg, TensorArgument) and spec.target in program.state_dict
    }


def _median_ms(seconds: Sequence[float]) -> float:
    ordered = sorted(seconds)
    return ordered[len(ordered) // 2] * 1000 if ordered else float("nan")


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
def quiet_runtime() -> Iterator[None]:
    """ExecuTorch's C++ code logs what it reads of the CPU to stderr's file descriptor: kept out
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


# ---- the worker process the runtime executes in ---------------------------------------------------
class RuntimeWorker(Worker):
    """ExecuTorch's runtime in a process of its own (``targets.worker.Worker``), holding the
    programs it was given; a program the current worker does not hold (it started after a crash)
    is loaded again from its bytes when first run."""

    runtime = "ExecuTorch's runtime"
    module = __name__
    hint = (
        "It was a native crash (a kernel the runtime lacks, a partitioner or runtime bug): keep the modules around the "
        f"ops left to portable kernels float, {X86_HINT}."
    )

    def __init__(self) -> None:
        super().__init__()
        self._loaded: set[int] = set()  # the programs the current worker holds
        self._forgotten: list[int] = []  # programs dropped by the caller, to drop in the worker at the next call
        self._keys = itertools.count(1)

    def load(self, pte: bytes) -> int:
        """Load ``pte`` in the worker; the key that runs it (``execute``)."""
        key = next(self._keys)
        with self._lock:
            self._holding(key, pte)
        return key

    def execute(self, key: int, pte: bytes, flat: Sequence[Any]) -> tuple[list[Any], float]:
        """The outputs of program ``key`` (``pte``, loaded again if this worker does not hold it) on
        ``flat``, and the seconds the runtime took to execute it (timed in the worker)."""

        def doing() -> str:  # said only when the worker crashed
            shapes = tuple(tuple(x.shape) for x in flat if isinstance(x, torch.Tensor))
            return f"executing the program on inputs of shape {shapes}"

        with self._lock:
            self._holding(key, pte)
            outputs, seconds = self._ask(("run", key, _as_arrays(flat)), doing)
            return _as_tensors(outputs), seconds

    def decode(self, key: int, pte: bytes, prompt: list[int], new_tokens: int) -> tuple[list[float], list[float], list[int]]:
        """Program ``key`` fed ``prompt`` a token a call, then ``new_tokens`` generated greedily (a
        fresh method: its KV cache empty): the seconds of each prompt call, of each generated token's
        call, and the tokens generated."""
        with self._lock:
            self._holding(key, pte)
            return self._ask(
                ("decode", key, prompt, new_tokens), lambda: f"generating {new_tokens} tokens after a prompt of {len(prompt)}"
            )

    def _holding(self, key: int, pte: bytes) -> None:
        """Program ``key`` loaded in the current worker (again, in a worker started since it was)."""
        if key not in self._loaded or self._process is None:
            self._ask(("load", key, pte), lambda: f"loading a program of {len(pte):,} bytes")
            self._loaded.add(key)

    def forget(self, key: int) -> None:
        """Program ``key`` is no longer needed (its worker drops it at the next call)."""
        self._forgotten.append(key)

    def _before(self, request: tuple) -> None:
        if self._forgotten:
            dropped, self._forgotten = [k for k in self._forgotten if k in self._loaded], []
            self._loaded -= set(dropped)
            self._connection.send(("forget", dropped))
            self._connection.recv()

    def _ended(self) -> None:
        super()._ended()
        self._loaded = set()


def runtime_worker() -> RuntimeWorker:
    """The process's one ``RuntimeWorker``."""
    return RuntimeWorker.shared()


def serve() -> None:  # pragma: no cover - runs in the worker process
    """The worker's loop: load, run and forget programs until told to stop or the pipe closes."""
    connection = serving()
    try:
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        with contextlib.suppress(ImportError):
            import executorch.kernels.quantized  # noqa: F401  (embedding_4bit / embedding_byte kernels)
        # one thread, as runs time PyTorch models: the latency of a program, the same on every machine
        if portable_lib._threadpool_get_thread_count() != 1:
            portable_lib._unsafe_reset_threadpool(1)
        runtime = Runtime.get()
    except Exception as error:
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", None))
    # the bytes stay beside their program: the runtime reads them while a method runs
    programs: dict[int, tuple[bytes, Any, Any]] = {}

    def handle(request: tuple) -> Any:
        kind = request[0]
        if kind == "forget":
            for key in request[1]:
                programs.pop(key, None)
            return None
        if kind == "load":
            _, key, pte = request
            program = runtime.load_program(pte)
            programs[key] = (pte, program, program.load_method("forward"))
            return None
        if kind == "decode":
            _, key, prompt, new_tokens = request
            return _generated(programs[key][1].load_method("forward"), prompt, new_tokens)
        _, key, flat = request
        inputs = _as_tensors(flat)
        start = time.perf_counter()
        outputs = programs[key][2].execute(inputs)
        return (_as_arrays(outputs), time.perf_counter() - start)

    answer(connection, handle)


def _as_arrays(values: Sequence[Any]) -> list[Any]:
    """Tensors as NumPy arrays for the pipe (pickled as their bytes: for the inputs and outputs of a
    call, one copy through the socket costs less than a shared-memory segment per tensor, whose file
    descriptor is handed over by a connection of its own); a dtype NumPy lacks stays a tensor."""
    return [x.detach().numpy() if isinstance(x, torch.Tensor) and x.dtype in _NUMPY_DTYPES else x for x in values]


def _as_tensors(values: Sequence[Any]) -> list[Any]:
    return [torch.from_numpy(x) if isinstance(x, numpy.ndarray) else x for x in values]


_NUMPY_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


def _generated(method: Any, prompt: list[int], new_tokens: int) -> tuple[list[float], list[float], list[int]]:  # pragma: no cover
    """The worker's greedy generation: each call one token id (1 x 1) and its cache position (1,)."""

    def step(token: int, position: int) -> tuple[int, float]:
        inputs = [
            torch.tensor([[token]], dtype=torch.long, device="cpu"),
            torch.tensor([position], dtype=torch.long, device="cpu"),
        ]
        start = time.perf_counter()
        logits = method.execute(inputs)[0]
        seconds = time.perf_counter() - start
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax()), seconds

    prefill, decode, generated = [], [], []
    for position, token in enumerate(prompt):
        following, seconds = step(token, position)
        prefill.append(seconds)
    for position in range(len(prompt), len(prompt) + new_tokens):
        generated.append(following)
        following, seconds = step(generated[-1], position)
        decode.append(seconds)
    return prefill, decode, generated
