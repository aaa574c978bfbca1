"""torchao's eager API (``quantize_``) as an engine: no graph, no tracing, no calibration.

The analysis hooks observers on the float model's leaf modules (``trace.py``); a run deep-copies
the float model and applies every module's format with one ``quantize_(copy, FqnToConfig(...))``.
The formats (``formats.py``) are what transformers are quantized to today: int8 dynamic activations
with int8 weights, int8 or group-wise int4 weight-only, dynamic int8 with int4 weights.
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pandas as pd
import torch
from torch import nn

from ...core.calibration import call_with
from ...core.devices import CPU, copy_on, model_device, moved
from ...core.memory import give_back, shared_copy
from ...core.metrics import layer_sqnr_db, sqnr_db, token_ids
from ...core.progress import Progress, quiet
from ...core.shortcuts import Shortcut, checking, confirmed, tensors_equal
from ...errors import DecodeSpeedError, InvalidSettingsError, QReportError
from ...observe.graph import OBSERVER_CONTAINER
from ...targets.contract import Deployed
from ...targets.llamacpp.blocks import GgufFormat
from ...targets.llamacpp.program import GgufProgram, gguf_program, refusal, required, tensor_bytes
from ..contract import Engine, Observation, RunNotes, conversion_tables
from ..executorch import (
    DYNAMIC,
    ONLINE_PRODUCT_FAILS,
    RUNTIME_WORDS,
    DecodeSpeed,
    DeployedProgram,
    executorch_api,
    lower,
    program_taps,
)
from ..folds import Fold, input_folds
from ..settings import (
    ALGORITHM_FORMATS,
    AWQ,
    DATA_ALGORITHMS,
    GPTQ,
    GROUPED_FORMATS,
    HQQ,
    RTN,
    SEARCHED_ALGORITHMS,
    ModuleSettings,
    Setting,
    TunableModule,
    module_blocks,
)
from .algorithms import (
    CompactWeight,
    InputStatistics,
    QuantizedWeight,
    Recipe,
    assign_weights,
    on_full_range,
    unfolded_awq,
    weights_in_runs,
)
from .formats import (
    FILE_TARGETS,
    INT4_WEIGHT_ONLY,
    INT8_DYNAMIC,
    INT8_DYNAMIC_INT4,
    INT8_WEIGHT_ONLY,
    LLAMACPP,
    QUANTIZED_FORMATS,
    X86,
    XNNPACK,
    EagerConfig,
    algorithms_offered,
    choice_words,
    deployed_bytes,
    full_range_grid,
    is_quantized_weight,
    offered,
    rows_of,
    torchao_eager,
)
from .found import FoundBefore, FoundWeights
from .learned import BlockInputs, LearnedRounding, block_of, learned_weights
from .options import EagerOptions
from .simulate import EagerSimulation, quantized_weight
from .trace import eager_graph, observed_modules, replay

__all__ = ["EagerConfig", "EagerEngine", "FormatError"]

WEIGHTED = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)  # the modules whose weights a format can take
FORMAT_ONLY = "on engine='eager' the format says it (int8-dynamic quantizes activations per token at run time)"
UNAVAILABLE = {
    Setting.DYNAMIC: FORMAT_ONLY,
    Setting.PER_CHANNEL: "torchao's formats quantize int8 weights per row and int4 weights per group: choose the format",
    Setting.EQUALIZE: "input-weight equalization is FX only",
    Setting.OBSERVER: "torchao's formats observe nothing: weights are quantized as they are, activations per token",
}
INT4_NOTE = (
    "int4 weights: torchao keeps them unpacked in int8 on an x86 CPU (IntxUnpackedToInt8Tensor) and runs a "
    "reference kernel (dequantize, then a float matmul); latency is of that kernel, the size in this process "
    "counts them as int8, 'deployed' as 4 bits"
)
INT8_WEIGHT_ONLY_NOTE = "int8 weight-only: torchao's CPU kernel converts the int8 weights to float on each call"
ALGORITHM_NOTES = {
    HQQ: "hqq: torchao's half-quadratic search for each group's scale (no data)",
    GPTQ: (
        "gptq: int4 values chosen column by column from the calibration batches' inputs to each module "
        "(their Gram matrix), each rounding error spread over the columns not yet chosen; round to nearest "
        "kept for a module where that gave no lower output error on held-out calibration sequences"
    ),
    AWQ: (
        "awq: each input channel scaled by its mean activation to a searched power, one scale for the Linears "
        "that read one input, and each group's range clipped by a searched ratio (as published); the scales "
        "folded into the norm or Linear before, or where the Linears reading one input are not all asked AWQ "
        "at one group size, the module's input divided by them at run time (on x86: a buffer, counted in the size)"
    ),
}
RUNTIME_NOTE = (
    "measured in ExecuTorch's runtime: the quantized model exported, lowered with XNNPACK's dynamically "
    "quantized partitioner (as ExecuTorch's LLM export does), serialised ({size:,} bytes of .pte) and executed on "
    "one thread in a worker process; lowering took {seconds:.1f} s. Per-layer SQNR is of the eager model it was "
    "lowered from"
)
LLAMACPP_NOTE = (
    "measured in llama.cpp: the quantized model written as a GGUF file ({size:,} bytes: {formats}; the int values "
    "as chosen, each scale rounded to fp16 as the file stores it, in {seconds:.1f} s) and run by llama.cpp's CPU "
    "kernels in a worker process (a Q4_0 / Q8_0 matrix times activations it quantizes to 8 bits per block of 32). "
    "Per-layer SQNR is of the eager model it was written from"
)
LLAMACPP_WORDS = "llama.cpp's CPU kernels, the run written as a GGUF file"
TIED_HEAD = (
    "the head's weight is the embedding's: in a GGUF file llama.cpp multiplies by the embedding's tensor "
    "(token_embd), so the embedding's format is the head's; choose it there"
)
ONLINE_GGUF_FAILS = (
    "a GGUF file holds a decoder's own tensors: an online rotation's product (a module added before a Linear) "
    "has no tensor in llama.cpp's layout; rotate with R1 and R2 alone, which fold into the weights"
)
INT8_DYNAMIC_NOTE = (
    "int8 dynamic: torchao's CPU kernel (torch._int_mm on each batch's int8 activations) is written for "
    "torch.compile to fuse; run eagerly, as here, it can be many times slower than int8 weight-only: its "
    "latency here is not a deployed one"
)


class FormatError(QReportError, RuntimeError):
    """torchao could not apply a format to a module."""


SIZE_ROWS = 64  # module_bytes quantizes copies of a Linear's first 64 and 128 rows


class EagerEngine(Engine[EagerConfig]):
    """``quantize_(copy, FqnToConfig({module: config}))`` per run.

    Args:
        format: the starting format of every ``nn.Linear`` (the baseline's); other modules start
            float. Default ``"int8-dynamic"``, torchao's int8 dynamic activation, int8 weight format.
        group_size: the starting group size of an int4 ``format``; default ``DEFAULT_GROUP_SIZE``.
            A Linear whose rows it does not divide starts float.
        algorithms: the int4 weight algorithms the size front weighs; default all four.
        target: ``"x86"`` (the quantized model runs here), or ``"xnnpack"``: every run's model is
            exported, lowered to XNNPACK as ExecuTorch ships decoders and run in ExecuTorch's runtime
            (``executorch.DeployedProgram``), which is what it measures; Linears take
            int8-dynamic ("8da8w") or int8-dynamic-int4-weight ("8da4w"), Embeddings int8 / int4
            weight-only.
    """

    name = "eager"
    options_type = EagerOptions
    options_hint = "with engine='eager' pass format= (the starting format of Linear layers)"

    def __init__(
        self,
        format: str = INT8_DYNAMIC,  # noqa: A002  (the word users know)
        group_size: int | None = None,
        algorithms: tuple[str, ...] | None = None,
        target: str = X86,
        learned_start: str | None = None,
        formats: tuple[str, ...] | None = None,
    ) -> None:
        torchao_eager()  # a clear error naming the extra, before anything else
        # the same ValueError as build_engine for a format, group size or algorithm refused
        options = EagerOptions(format, group_size, algorithms, target, learned_start, formats)
        if target == XNNPACK:
            executorch_api()  # ExecuTorch, or the error naming the extra
        if target == LLAMACPP:
            required()  # gguf and llama-cpp-python, or the error naming the extra
        self.target = target
        self.learned = LearnedRounding(start=learned_start)  # the learned rounding's start (None: LEARNED_START)
        self._example_inputs: tuple[Any, ...] = ()  # what a program is exported with
        self.start_format = format
        self.start_group_size = group_size or 0  # 0: DEFAULT_GROUP_SIZE, as in ModuleSettings
        self.searched_algorithms = options.algorithms or SEARCHED_ALGORITHMS  # what size_choices offers
        self.searched_formats = options.formats  # ... and its formats (None: every one the target runs)
        self._configs: weakref.WeakKeyDictionary[nn.Module, EagerConfig] = weakref.WeakKeyDictionary()
        # the inputs GPTQ / AWQ read, gathered while a prepared model calibrates
        # GPTQ / AWQ weights a run's calibration passes found, until its convert
        self._found: weakref.WeakKeyDictionary[nn.Module, dict[str, CompactWeight | Recipe]] = weakref.WeakKeyDictionary()
        # per converted model, the modules where GPTQ / AWQ kept round to nearest, and why
        self._kept_rounding: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()
        self._learned_notes: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()
        self._sizes: dict[tuple, int] = {}  # module_bytes, per module shape and choice
        # GPTQ weights found before, by float model: shared with the engines renewed from this one
        self.found_before = FoundWeights()
        self._sources: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()  # prepared -> float model
        self._taken: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()  # prepared -> GPTQ weights taken
        self._folds: dict[str, Fold] | None = None  # where each Linear's AWQ scale folds, once a model is observed
        # on llama.cpp, a head whose weight is the embedding's -> the embedding (the file's head is token_embd)
        self._tied: dict[str, str] = {}
        self._tied_weight: torch.Tensor | None = None

    @classmethod
    def from_options(cls, options: EagerOptions) -> EagerEngine:
        return cls(
            options.format or INT8_DYNAMIC,
            options.group_size,
            options.algorithms,
            options.target,
            options.learned_start,
            options.formats,
        )

    def renewed(self) -> EagerEngine:
        engine = EagerEngine(
            self.start_format,
            self.start_group_size or None,
            self.searched_algorithms,
            self.target,
            self.learned.start,
            self.searched_formats,
        )
        engine.found_before = self.found_before  # keyed by float model and calibration data: the weights hold
        engine.checks_shortcuts = self.checks_shortcuts
        return engine

    # ---- observation ----------------------------------------------------------------------------
    def observe(self, float_model: nn.Module, example_inputs: tuple[Any, ...], *, record: bool = False) -> Observation:
        """Observers hooked on a copy's leaf modules (``float_model`` keeps no hook); the tunable
        modules with the starting formats. The pass that maps the modules' dataflow runs the example
        inputs; with ``record`` it keeps what each module read and wrote for the observers (a decoder's
        analysis over 4 batches: one forward pass less, a fifth of its time)."""
        self._example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self._refuse_model(float_model)
        self._folds = input_folds(float_model)
        observed = observed_modules(shared_copy(float_model), _inputs_of(example_inputs), record)  # hooks read, never write
        modules = self._tunable(float_model, self._untied(self.base_config().resolved(float_model)))
        weights = {m.fqn: True for m in modules if not m.current.keep_float}  # int8 per row, int4 per group

        def replayed(instrumented: nn.Module) -> bool:
            return replay(observed, getattr(instrumented, OBSERVER_CONTAINER).feeds)

        return Observation(observed, lambda model: eager_graph(model, weights), modules, replayed if record else None)

    # ---- configuration --------------------------------------------------------------------------
    def base_config(self) -> EagerConfig:
        return EagerConfig(linears=self.start_format, group_size=self.start_group_size, target=self.target)

    def config_for(self, settings: Mapping[str, ModuleSettings], modules: Sequence[TunableModule]) -> EagerConfig:
        config = EagerConfig.of({m.fqn: settings.get(m.fqn, m.current) for m in modules}, self.target)
        if self.target in FILE_TARGETS and self._folds is not None:
            problems = unfolded_awq(config.needs_data, self._folds)
            if problems:
                where = "XNNPACK" if self.target == XNNPACK else "llama.cpp"
                raise InvalidSettingsError(
                    f"on {where}, AWQ's input scales are folded into the op before each Linear (the file has no op "
                    "to divide by them): " + "; ".join(f"{fqn}: {why}" for fqn, why in problems.items())
                )
        return config

    def config_as_code(self, config: EagerConfig) -> str:
        return config.as_code(self.learned.start)

    def calibrates(self, config: EagerConfig) -> bool:
        # formats observe nothing (dynamic ones quantize each batch as it comes); GPTQ and AWQ read
        # the modules' inputs on the calibration batches
        return bool(config.needs_data)

    # ---- the workflow ---------------------------------------------------------------------------
    @property
    def kernel_device(self) -> torch.device:
        return CPU  # every target is a CPU: torchao's x86 kernels, XNNPACK in ExecuTorch's runtime, llama.cpp

    def rotated_front_problem(self) -> str:
        return ""

    def online_transform_problem(self) -> str:
        return {XNNPACK: ONLINE_PRODUCT_FAILS, LLAMACPP: ONLINE_GGUF_FAILS}.get(self.target, "")

    def kernel_words(self) -> str:
        return {XNNPACK: RUNTIME_WORDS, LLAMACPP: LLAMACPP_WORDS}.get(self.target, "torchao's x86 kernels on the CPU")

    def prepare(self, float_model: nn.Module, config: EagerConfig, example_inputs: tuple[Any, ...]) -> nn.Module:
        """A copy of ``float_model`` (sharing its weights: ``quantize_`` assigns new ones); ``convert``
        applies ``config``'s formats to it, and exports a program with ``example_inputs`` (a session
        made without ``analyze`` never observed any)."""
        self._refuse_model(float_model)
        model = shared_copy(float_model).eval()
        self._configs[model] = self._untied(config.resolved(model))
        self._sources[model] = float_model
        self._example_inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        if self._folds is None:
            self._folds = input_folds(float_model)
        return model

    def calibration_passes(
        self, prepared: nn.Module, progress: Progress | None = None, data_key: str | None = None
    ) -> Iterator[dict[str, InputStatistics] | dict[str, BlockInputs] | None]:
        """One pass per run of GPTQ / AWQ modules (``gram_runs``: their input Gram matrices never all
        held at once): the run's inputs gathered on the float model (the item: merged across ranks),
        its weights computed and kept packed (``QuantizedWeight.compact``), its statistics freed;
        then, for the learned rounding, one pass recording the first block's inputs and the blocks
        learned one by one (``learned_weights``; ``progress`` after each block). ``convert`` assigns them.
        GPTQ weights found before on the same float model and calibration data (``data_key``) are taken
        (``FoundWeights``), and computed again to compare in the check mode."""
        config = self._config_of(prepared)
        if not config.needs_data:
            yield None
            return
        found = self._found.setdefault(prepared, {})
        source = self._sources.get(prepared)
        gptq = [(fqn, config.formats[fqn]) for fqn, (algorithm, _) in config.needs_data.items() if algorithm == GPTQ]
        # found before on the same float model and calibration data (the simulation's, a run's)
        key = FoundWeights.key(source, data_key, self._grid) if source is not None and gptq else None
        taken = self.found_before.taken(key, gptq)
        checked = bool(taken) and checking(self.checks_shortcuts)  # computed here too, then compared
        if taken and not checked:
            here = model_device(prepared)  # where this run computes (the store's may be another copy's)
            found.update({fqn: weight.to(here) for (fqn, _), weight in taken.items()})
            self._taken[prepared] = len(taken)
        computing = {fqn: choice for fqn, choice in config.needs_data.items() if fqn not in found}
        yield from weights_in_runs(prepared, computing, found, self.checks_shortcuts, full_range_grid(self.target))
        if checked:
            computed = {(fqn, choice): found[fqn] for fqn, choice in gptq if (fqn, choice) in taken}
            confirmed(Shortcut.FOUND_WEIGHTS, taken, lambda: computed, tensors_equal, f"{len(taken)} modules' GPTQ weights")
        self.found_before.keep(key, {(fqn, choice): found[fqn] for fqn, choice in gptq if (fqn, choice) not in taken})
        notes = self._learned_notes.setdefault(prepared, [])
        yield from learned_weights(
            prepared,
            config.formats,
            found,
            target=self.target,
            quantize=self._quantized,
            options=self.learned,
            progress=progress,
            notes=notes,
        )

    def computes_where_the_model_is(self, config: EagerConfig) -> bool:
        return bool(config.needs_data)  # GPTQ, AWQ and the learned rounding: weights from the calibration batches

    def relocated(self, prepared: nn.Module, device: torch.device) -> nn.Module:
        moved_model = copy_on(prepared, device)
        self._configs[moved_model] = self._configs[prepared]
        if prepared in self._found:
            self._found[moved_model] = {fqn: weight.to(device) for fqn, weight in self._found[prepared].items()}
        if prepared in self._learned_notes:
            self._learned_notes[moved_model] = list(self._learned_notes[prepared])
        if prepared in self._taken:
            self._taken[moved_model] = self._taken[prepared]
        return moved_model

    def _quantized(self, module: nn.Module, key: tuple[str, int, str]) -> QuantizedWeight:
        return quantized_weight(module, key, target=self.target)

    def tunable_modules(self, prepared: nn.Module) -> list[TunableModule]:
        return self._tunable(prepared, self._config_of(prepared))

    def convert(self, prepared: nn.Module, progress: Progress | None = None) -> nn.Module:
        config = self._config_of(prepared)
        if not config.formats:
            raise FormatError("every module is float: the result would be the float model. Choose a format for a Linear layer.")
        found = self._found.pop(prepared, {})
        chosen = {}
        for fqn, (algorithm, _) in config.needs_data.items():  # first: the calibration saw them float
            if fqn not in found:
                raise FormatError(f"{algorithm} reads {fqn}'s inputs on the calibration batches: calibrate before convert")
            with torch.no_grad():
                chosen[fqn] = found.pop(fqn).expand(prepared.get_submodule(fqn).weight)
        with torch.no_grad():
            hooked = assign_weights(prepared, chosen, [f for f in chosen if config.formats[f][0] == INT8_DYNAMIC_INT4])
        if hooked and self.target in FILE_TARGETS:  # refused with the settings (config_for); a last guard
            raise FormatError(f"AWQ's input scales of {', '.join(hooked)} could not be folded into the ops before them")
        self._kept_rounding[prepared] = {fqn: q.note for fqn, q in chosen.items() if q.note}
        nearest = {  # round to nearest on the full-range grid where the target takes it: torchao's tensors, its values
            fqn: prepared.get_submodule(fqn).weight
            for fqn, (name, _, algorithm) in config.formats.items()
            if full_range_grid(self.target) and name in GROUPED_FORMATS and algorithm in ("", RTN)
        }
        try:
            torchao_eager().quantize_(prepared, config.fqn_to_config(), filter_fn=None)
        except Exception as error:  # name the module and format torchao failed on
            raise FormatError(_failure(prepared, config, error)) from error
        with torch.no_grad():
            for fqn, weight in nearest.items():
                on_full_range(prepared.get_submodule(fqn).weight, weight)
            for head, embedding in self._tied.items():  # the head multiplies by the embedding's values, as the file's does
                tied = prepared.get_submodule(embedding).weight
                values = tied.dequantize() if is_quantized_weight(tied) else tied
                prepared.get_submodule(head).weight = nn.Parameter(values.detach(), requires_grad=False)
        if self.target == XNNPACK:
            inputs = moved(self._example_inputs, model_device(prepared))  # where the run's copy is
            return lower(
                prepared, inputs, partitioner=DYNAMIC, fuse_quantized_ops=True, progress=progress, check=self.checks_shortcuts
            )
        if self.target == LLAMACPP:
            return gguf_program(prepared, tied_head=bool(self._tied))
        return prepared

    # ---- what a run measures --------------------------------------------------------------------
    def per_layer_sqnr(self, float_model: nn.Module, quantized: nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at each Linear / Embedding / Conv module's output, quantized against float."""
        quantized = _eager_model(quantized)
        names = [fqn for fqn, module in float_model.named_modules() if isinstance(module, WEIGHTED)]
        expected = module_outputs(float_model, names, batch)
        values = module_outputs(quantized, list(expected), batch, lambda fqn, found: layer_sqnr_db(expected.pop(fqn), found))
        return pd.Series({fqn: values[fqn] for fqn in names if values.get(fqn) is not None}, name="SQNR (dB)", dtype=float)

    def inner_sqnr(self, float_model: nn.Module, quantized: nn.Module, batch: Any) -> pd.Series:
        """For a target's file (an ExecuTorch program, a GGUF): each block's output SQNR as its
        runtime computes it (``block_sqnr``); empty for an eager model (its per-layer SQNR is its own)."""
        if not isinstance(quantized, (DeployedProgram, GgufProgram)):
            return pd.Series(dtype=float, name="SQNR (dB)")
        return self.block_sqnr(float_model, quantized, batch)

    def block_sqnr(self, float_model: nn.Module, quantized: nn.Module, batch: Any) -> pd.Series:
        """SQNR (dB) at each block's output (a decoder's layers, ``module_blocks``) against the float
        model's: an eager model's read by hooks, an ExecuTorch program's as the runtime computes it,
        off the program lowered again with those outputs tapped (``program_taps``), a GGUF's as
        llama.cpp computes it (its graph's ``l_out-N`` read through its evaluation callback)."""
        modules = dict(float_model.named_modules())
        names = [fqn for fqn, module in modules.items() if isinstance(module, WEIGHTED)]
        blocks = [b for b in module_blocks(names) if b in modules and next(modules[b].children(), None) is not None]
        if not blocks:
            return pd.Series(dtype=float, name="SQNR (dB)")
        expected = module_outputs(float_model, blocks, moved(batch, model_device(float_model)), first=True)
        # the batch goes where each model is: a run's copy sits where its kernels are (a program: the CPU)
        there = moved(batch, CPU if isinstance(quantized, Deployed) else model_device(quantized))
        if isinstance(quantized, DeployedProgram):
            found = program_taps(quantized, blocks).outputs(*(there if isinstance(there, tuple) else (there,)))
        elif isinstance(quantized, GgufProgram):
            ids = token_ids(there)
            if ids is None:
                return pd.Series(dtype=float, name="SQNR (dB)")
            computed = quantized.block_outputs(ids)
            found = {block: [computed[int(block.rsplit(".", 1)[-1])]] for block in blocks if _numbered(block, len(computed))}
        else:
            found = {name: [output] for name, output in module_outputs(quantized, blocks, there, first=True).items()}
        values = {}
        for block in blocks:
            same = [t for t in found.get(block, []) if block in expected and t.shape == expected[block].shape]
            if same:  # the value that leaves the block as its output (a block can hand on others, e.g. a mask)
                values[block] = sqnr_db(expected[block], same[-1].to(expected[block]))
        return pd.Series(values, name="SQNR (dB)", dtype=float)

    def conversions(self, prepared: nn.Module, quantized: nn.Module) -> tuple[pd.DataFrame, pd.DataFrame]:
        quantized = _eager_model(quantized)
        config = self._configs.get(prepared) or self._configs.get(quantized) or EagerConfig()
        rows = []
        for fqn, module in quantized.named_modules():
            if not isinstance(module, WEIGHTED):
                continue
            weight = module.weight
            chosen = config.formats.get(fqn)
            described = "float" if chosen is None else choice_words(*chosen)
            converted = f"{type(weight).__name__} ({described})" if is_quantized_weight(weight) else type(module).__name__
            rows.append(
                {
                    "module": fqn,
                    "float type": type(module).__name__,
                    "converted type": converted,
                    "quantized": is_quantized_weight(weight),
                }
            )
        return conversion_tables(rows)

    def deployed_bytes(self, quantized: nn.Module) -> int:
        """The file's bytes on a file target (a ``.pte`` program, a GGUF); else the weights as a
        packed layout stores them, an int4 embedding's values a byte each (as x86 holds them)."""
        if isinstance(quantized, Deployed):
            return quantized.artifact_bytes
        return deployed_bytes(quantized, unpacked_embeddings=self.target == X86)

    def stored_bytes(self, quantized: nn.Module) -> int:
        if isinstance(quantized, Deployed):
            return quantized.artifact_bytes
        return super().stored_bytes(quantized)

    def unbuildable(self, float_module: nn.Module, choice: ModuleSettings) -> str:
        """On XNNPACK, whether ExecuTorch builds a program of ``float_module`` in ``choice``: a few rows
        of the module, as it is otherwise (its kind, width, dtype, padding index, bias and hooks),
        quantized and lowered, once in the process per such kind of module and format (the
        algorithm, the group size and the rows change the values, not the program's ops: a second
        and a half each, a handful a decoder); the reason it failed, else "". On x86, torchao's
        kernels run every choice: ""."""
        if self.target != XNNPACK or choice.keep_float or not isinstance(float_module, (nn.Linear, nn.Embedding)):
            return ""
        weight = float_module.weight
        hooks = (*float_module._forward_hooks.values(), *float_module._forward_pre_hooks.values())
        kind = (
            type(float_module),
            weight.shape[1],
            weight.dtype,
            getattr(float_module, "bias", None) is not None,
            getattr(float_module, "padding_idx", None) is not None,
            tuple(getattr(hook, "__qualname__", repr(hook)) for hook in hooks),
            self.target,
            choice.format,
        )
        probed = functools.partial(_built, float_module, replace(choice, algorithm=""), self.target)
        if kind not in _BUILDABLE:
            _BUILDABLE[kind] = probed()
        elif checking(self.checks_shortcuts):
            confirmed(
                Shortcut.BUILDABLE, _BUILDABLE[kind], probed, operator.eq, f"{type(float_module).__name__} in {choice.format}"
            )
        return _BUILDABLE[kind]

    def size_choices(self, module: TunableModule) -> list[ModuleSettings]:
        """Float and every format the module takes, with each group size its rows divide into and,
        for the int4 format the target ships, each weight algorithm it takes (on x86 int4
        weight-only: its 8da4w layout has the same int4 values, and weighing both doubles the cost).
        Not AWQ on XNNPACK: a module's choice there binds the other Linears that read its input
        (``unfolded_awq``), and the front weighs each module's choices alone. Only the formats of
        ``formats=`` where given (``EagerOptions``)."""
        found = [module.current]
        weighed = ALGORITHM_FORMATS if self.target in FILE_TARGETS else (INT4_WEIGHT_ONLY,)
        searched = [a for a in self.searched_algorithms if not (a == AWQ and self.target in FILE_TARGETS)]
        for name in ("float", *QUANTIZED_FORMATS):
            if not module.format_allowed(name) or (self.searched_formats and name not in ("float", *self.searched_formats)):
                continue
            groups = module.group_sizes if name in GROUPED_FORMATS else (0,)
            algorithms = [""]
            if name in weighed:
                algorithms = [a for a, why in module.algorithms.items() if not why and a in searched]
            found += [
                c
                for g in groups
                for a in algorithms
                if (c := ModuleSettings(format=name, group_size=g, algorithm=a)) != module.current
            ]
        return found if len(found) > 1 else []

    def module_bytes(self, float_module: nn.Module, choice: ModuleSettings) -> int:
        """The module alone quantized by torchao in ``choice`` and counted as ``deployed_bytes``.
        A Linear's or an Embedding's bytes grow by the same amount per row of its weight (every
        format here scales per row or per group of a row), so two few-row copies are quantized and
        counted, and the line through them read at the module's rows: a decoder's head is never
        copied or quantized whole for its size."""
        weight, bias = float_module.weight, getattr(float_module, "bias", None)
        if self.target == LLAMACPP:  # the tensors' bytes in the GGUF file: a function of shape and format alone
            if self._tied_weight is not None and float_module.weight is self._tied_weight and isinstance(float_module, nn.Linear):
                return 0  # a tied head: the file has no tensor of its own for it
            return _gguf_bytes(float_module, choice)
        key = (type(float_module), tuple(weight.shape), weight.dtype, bias is not None, choice)  # all the size depends on
        if key not in self._sizes:
            # GPTQ and AWQ store round-to-nearest's layout (AWQ on x86 one scale per input channel more, counted
            # where it may be left to a pre-hook; on XNNPACK it is always folded into the op before)
            counted = replace(choice, algorithm="") if choice.algorithm in DATA_ALGORITHMS else choice
            extra = weight.shape[1] * weight.element_size() if choice.algorithm == AWQ and self.target not in FILE_TARGETS else 0
            rows = weight.shape[0]
            whole = functools.partial(_quantized_bytes, float_module, counted, self.target)
            if isinstance(float_module, (nn.Linear, nn.Embedding)) and rows > 2 * SIZE_ROWS:
                few, more = (
                    _quantized_bytes(rows_of(float_module, slice(n)), counted, self.target) for n in (SIZE_ROWS, 2 * SIZE_ROWS)
                )
                found = few + (more - few) * (rows - SIZE_ROWS) // SIZE_ROWS + _besides_rows(float_module)
                if checking(self.checks_shortcuts):  # the whole module quantized and counted
                    confirmed(
                        Shortcut.MODULE_BYTES, found, whole, operator.eq, f"{tuple(weight.shape)} in {choice.quantized_format}"
                    )
                self._sizes[key] = found + extra
            else:
                self._sizes[key] = whole() + extra
                give_back()
        return self._sizes[key]

    def run_notes(self, config: EagerConfig, quantized: nn.Module) -> RunNotes:
        """Which kernels torchao ran on this CPU (or what XNNPACK took of the program), and per module
        a format it did not carry out."""
        program = quantized if isinstance(quantized, DeployedProgram) else None
        written = quantized if isinstance(quantized, GgufProgram) else None
        quantized = _eager_model(quantized)
        modules = dict(quantized.named_modules())
        undone = {
            fqn: f"asked {choice_words(*chosen)}, its weight stayed float"
            for fqn, chosen in config.formats.items()
            if not is_quantized_weight(getattr(modules.get(fqn), "weight", None))
        }
        used = {name for name, _, _ in config.formats.values()}
        if program is not None:
            notes = [RUNTIME_NOTE.format(size=len(program.pte), seconds=program.lowering_s), program.delegation.words]
            notes += [program.reused] if program.reused else []
        elif written is not None:
            held = ", ".join(f"{n} {name}" for name, n in written.formats().items())
            notes = [LLAMACPP_NOTE.format(size=written.artifact_bytes, formats=held, seconds=written.written_s)]
        else:
            notes = [INT4_NOTE] if used & {INT4_WEIGHT_ONLY, INT8_DYNAMIC_INT4} else []
            notes += [INT8_WEIGHT_ONLY_NOTE] if INT8_WEIGHT_ONLY in used else []
            notes += [INT8_DYNAMIC_NOTE] if INT8_DYNAMIC in used else []
        algorithms = {algorithm for _, _, algorithm in config.formats.values()}
        notes += [note for name, note in ALGORITHM_NOTES.items() if name in algorithms]
        notes += self._learned_notes.get(quantized, [])
        taken = self._taken.get(quantized, 0)
        if taken:
            notes.append(
                f"gptq: {taken} modules' weights taken as found before on the same float model and calibration batches "
                "(by the simulation or an earlier run), not computed again"
            )
        kept = self._kept_rounding.get(quantized, {})
        if kept:
            notes.append(
                f"{len(kept)} of {len(config.needs_data)} modules asked GPTQ / AWQ kept round to nearest (see each module's note)"
            )
        return RunNotes(tuple(notes), {**kept, **undone})

    def decode_speed(self, quantized: nn.Module, prompt: Sequence[int], new_tokens: int) -> DecodeSpeed:
        """A run's program exported again with a static KV cache (transformers' ExecuTorch
        integration, one token and its cache position a call, the cache as long as the prompt and
        the tokens generated), lowered the same way, and timed generating in the runtime. A GGUF
        file: llama.cpp's own generation (the prompt in one batch, then a token a call)."""
        if isinstance(quantized, GgufProgram):
            speed = quantized.speed(prompt, new_tokens)
            return DecodeSpeed(
                len(prompt),
                new_tokens,
                1000.0 / speed.prefill_tokens_per_s,
                1000.0 / speed.decode_tokens_per_s,
                quantized.artifact_bytes,
                quantized.written_s,
                file_words="GGUF (the prompt in one batch)",
            )
        if not isinstance(quantized, DeployedProgram):
            raise DecodeSpeedError(
                "decode speed is a file's, measured in its runtime: analyze(..., engine='eager', target='xnnpack') "
                "or target='llama.cpp'"
            )
        cached = _with_static_cache(quantized.reference)
        try:
            from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM
        except ImportError as error:
            raise DecodeSpeedError(f"decode speed exports with transformers' ExecuTorch integration ({error})") from error
        length = len(prompt) + new_tokens
        example = (torch.zeros(1, 1, dtype=torch.long, device="cpu"), torch.zeros(1, dtype=torch.long, device="cpu"))
        try:
            with torch.no_grad():
                module = TorchExportableModuleForDecoderOnlyLM(cached, batch_size=1, max_cache_len=length)
                exported = module.export(input_ids=example[0], cache_position=example[1])
        except Exception as error:
            raise DecodeSpeedError(
                f"the decoder could not be exported with a static KV cache ({type(error).__name__}: {str(error)[:300]}): "
                "decode speed needs a Hugging Face causal language model transformers can export for ExecuTorch"
            ) from error
        program = lower(
            module, example, partitioner=DYNAMIC, fuse_quantized_ops=True, reference=quantized.reference, exported=exported
        )
        return program.decode(prompt, new_tokens)

    def per_layer_failure(self, error: Exception) -> str:
        return f"the modules' outputs could not be read ({type(error).__name__}: {error})"

    def simulator(
        self,
        prepared: nn.Module,
        modules: Sequence[TunableModule],
        float_model: nn.Module,
        example_inputs: tuple[Any, ...],
        calibrate: Callable[[nn.Module], None],
        data_key: Callable[[], str | None] | None = None,
    ) -> EagerSimulation:
        found_before = None if data_key is None else FoundBefore(self.found_before, float_model, data_key, self._grid)
        return EagerSimulation(
            prepared, modules, calibrate, self.target, self.learned, found_before, check=self.checks_shortcuts, tied=self._tied
        )

    # ---- helpers --------------------------------------------------------------------------------
    @property
    def _grid(self) -> str:
        """The int4 grid round to nearest and GPTQ choose values on (``full_range_grid``), as the found weights' key has it."""
        return "full range" if full_range_grid(self.target) else ""

    def _refuse_model(self, model: nn.Module) -> None:
        """On llama.cpp, a model that cannot be written as a GGUF file is refused before any work; a
        head tied to the embedding noted (``_tied``)."""
        why = refusal(model) if self.target == LLAMACPP else ""
        if why:
            raise InvalidSettingsError(f"target='llama.cpp': {why}")
        if self.target == LLAMACPP:
            self._tied, self._tied_weight = _tied_head(model)

    def _untied(self, config: EagerConfig) -> EagerConfig:
        """``config`` without a format for a tied head (its format is the embedding's, ``TIED_HEAD``)."""
        if not self._tied:
            return config
        return replace(config, formats={fqn: c for fqn, c in config.formats.items() if fqn not in self._tied})

    def _config_of(self, prepared: nn.Module) -> EagerConfig:
        config = self._configs.get(prepared)
        if config is None:
            raise ValueError("this model was not prepared by this engine (EagerEngine.prepare)")
        return config

    def _tunable(self, model: nn.Module, config: EagerConfig) -> list[TunableModule]:
        modules = []
        folds = input_folds(model)
        for fqn, module in model.named_modules():
            if not fqn or not isinstance(module, WEIGHTED) or next(module.children(), None) is not None:
                continue
            formats, groups = offered(module, self.target)
            if fqn in self._tied:
                formats = {name: why if name == "float" else TIED_HEAD for name, why in formats.items()}
            chosen = config.formats.get(fqn)
            current = (
                ModuleSettings(format="float")
                if chosen is None
                else ModuleSettings(
                    format=chosen[0], group_size=chosen[1] if chosen[0] in GROUPED_FORMATS else 0, algorithm=chosen[2]
                )
            )
            unavailable = dict(UNAVAILABLE)
            if not any(why == "" for name, why in formats.items() if name != "float"):
                unavailable[Setting.MIGRATE] = "no quantized format applies to this module"
            modules.append(
                TunableModule(
                    fqn,
                    type(module).__name__,
                    current,
                    unavailable,
                    native=chosen,
                    formats=formats,
                    group_sizes=groups,
                    algorithms=algorithms_offered(module, self.target, folded=fqn in folds, in_block=block_of(fqn) is not None),
                )
            )
        return modules


def module_outputs(
    model: nn.Module,
    names: Sequence[str],
    batch: Any,
    reduce: Callable[[str, torch.Tensor], Any] | None = None,
    first: bool = False,
) -> dict[str, Any]:
    """The first output of each named module on ``batch``, or what ``reduce(name, output)`` keeps of
    it (computed as the output appears: the outputs are not held). ``first``: a module returning a
    tuple gives its first element (a decoder block's hidden states)."""
    found: dict[str, Any] = {}
    modules = dict(model.named_modules())

    def keep(name: str) -> Callable:
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            if first and isinstance(output, tuple) and output:
                output = output[0]
            if isinstance(output, torch.Tensor) and name not in found:
                found[name] = output.detach() if reduce is None else reduce(name, output.detach())

        return hook

    handles = [modules[n].register_forward_hook(keep(n)) for n in names if n in modules]
    try:
        with torch.no_grad():
            call_with(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _failure(prepared: nn.Module, config: EagerConfig, error: Exception) -> str:
    """Which module's format torchao failed on, tried one at a time on copies of the modules it had
    not quantized yet."""
    ao = torchao_eager()
    modules = dict(prepared.named_modules())
    for fqn, chosen in config.formats.items():
        if is_quantized_weight(modules[fqn].weight):
            continue
        single = nn.Sequential(copy.deepcopy(modules[fqn]))
        try:
            ao.quantize_(single, EagerConfig({"0": chosen}, target=config.target).fqn_to_config(), filter_fn=None)
        except Exception as cause:
            return (
                f"torchao could not apply {choice_words(*chosen)} to {fqn} ({type(modules[fqn]).__name__}): "
                f"{type(cause).__name__}: {cause}. Choose another format for it, or keep it float."
            )
    return f"torchao's quantize_ failed ({type(error).__name__}: {error}); every format applies to its module alone"


def _with_static_cache(model: nn.Module) -> nn.Module:
    """``model`` (a Hugging Face causal LM) as transformers exports it with a static KV cache: a
    shallow copy (the same modules and weights) with its own configuration saying so."""
    config, generation = getattr(model, "config", None), getattr(model, "generation_config", None)
    if config is None or generation is None:
        raise DecodeSpeedError(
            f"decode speed is measured on Hugging Face causal language models (a config and a generation config); "
            f"this is a {type(model).__name__}"
        )
    cached = copy.copy(model)
    cached.config = copy.deepcopy(config)
    cached.config.use_cache = True
    cached.generation_config = copy.deepcopy(generation)
    cached.generation_config.use_cache = True
    cached.generation_config.cache_implementation = "static"
    return cached


def _eager_model(quantized: nn.Module) -> nn.Module:
    """The eager quantized model: itself, or the one a target's file was made from."""
    return quantized.reference if isinstance(quantized, Deployed) else quantized


def _tied_head(model: nn.Module) -> tuple[dict[str, str], torch.Tensor | None]:
    """{head: embedding} where ``model``'s head weight is its embedding's (a transformers model's
    tied embeddings), and that weight; else ({}, None)."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return {}, None
    names = {id(module): fqn for fqn, module in model.named_modules()}
    return {names[id(head)]: names[id(embedding)]}, embedding.weight


def _numbered(block: str, count: int) -> bool:
    """Whether ``block`` (``model.layers.3``) ends in the number of one of ``count`` blocks."""
    number = block.rsplit(".", 1)[-1]
    return number.isdigit() and int(number) < count


def _gguf_bytes(module: nn.Module, choice: ModuleSettings) -> int:
    """``module``'s tensors in a GGUF file in ``choice``: an int4 format's weight ``Q4_0``, an int8
    one's ``Q8_0``, a float matrix F16 (the writer's default), a bias F32."""
    weight, bias = module.weight, getattr(module, "bias", None)
    if choice.keep_float or not choice.format or choice.format == "float":
        kind = GgufFormat.F16 if weight.dim() >= 2 else GgufFormat.F32
    else:
        kind = GgufFormat.Q4_0 if choice.format in GROUPED_FORMATS else GgufFormat.Q8_0
    extra = 0 if bias is None else tensor_bytes(bias.shape, GgufFormat.F32)
    return tensor_bytes(weight.shape, kind) + extra + _besides_rows(module)


def _inputs_of(example_inputs: Any) -> Any:
    """One example batch as ``call_with`` takes it: a tuple of positional inputs, or a dict."""
    if isinstance(example_inputs, tuple) and len(example_inputs) == 1 and isinstance(example_inputs[0], Mapping):
        return example_inputs[0]
    return example_inputs


def _quantized_bytes(module: nn.Module, choice: ModuleSettings, target: str = X86) -> int:
    """``module`` (a copy of it is quantized) in ``choice``, counted as ``deployed_bytes``."""
    holder = nn.Sequential(copy.deepcopy(module))
    if not choice.keep_float:
        torchao_eager().quantize_(holder, EagerConfig.of({"0": choice}, target).fqn_to_config(), filter_fn=None)
    return deployed_bytes(holder, unpacked_embeddings=target == X86)


# ``EagerEngine.unbuildable`` per kind of module and format in this process ("" where a program was built)
_BUILDABLE: dict[tuple, str] = {}


def _built(float_module: nn.Linear | nn.Embedding, choice: ModuleSettings, target: str) -> str:
    """Why a few rows of ``float_module`` in ``choice`` do not lower to a program, "" where they do."""
    rows = max(2 * max(choice.group_size, 32), (getattr(float_module, "padding_idx", None) or 0) + 1)
    rows = min(rows, float_module.weight.shape[0])
    probe = copy.copy(float_module)  # the module's own forward, attributes and hooks, a few rows of its weight
    probe._parameters, probe._buffers = dict(float_module._parameters), {k: v.to(CPU) for k, v in float_module._buffers.items()}
    probe._forward_hooks, probe._forward_pre_hooks = (
        copy.copy(float_module._forward_hooks),
        copy.copy(float_module._forward_pre_hooks),
    )
    probe.weight = nn.Parameter(float_module.weight.detach()[:rows].to(CPU, copy=True), requires_grad=False)
    if isinstance(probe, nn.Embedding):
        probe.num_embeddings = rows
        inputs: tuple[torch.Tensor, ...] = (torch.arange(8)[None] % rows,)
    else:
        probe.out_features = rows
        if probe.bias is not None:
            probe.bias = nn.Parameter(float_module.bias.detach()[:rows].to(CPU, copy=True), requires_grad=False)
        inputs = (torch.randn(1, 8, probe.in_features, dtype=probe.weight.dtype),)
    holder = nn.Sequential(probe).eval()
    try:
        torchao_eager().quantize_(holder, EagerConfig.of({"0": choice}, target).fqn_to_config(), filter_fn=None)
        lower(holder, inputs, partitioner=DYNAMIC, fuse_quantized_ops=True, progress=quiet)
    except Exception as error:  # the target's own words: what it could not build
        cause = error.__cause__ or error
        return f"{type(cause).__name__}: {' '.join(str(cause).split())[:200]}"
    return ""


def _besides_rows(module: nn.Module) -> int:
    """The bytes of what a Linear or Embedding subclass holds besides its weight and bias (Gemma's
    scaled embedding: its scale), which no format quantizes: stored as they are."""
    held = (*module.named_parameters(), *module.named_buffers())
    return sum(tensor.numel() * tensor.element_size() for name, tensor in held if name not in ("weight", "bias"))
