"""The eager engine's simulation: a float copy whose weights are swapped for their quantized-then-
dequantized values and whose dynamic formats fake-quantize each token of the input.

Weight-only formats are exact: torchao's own quantized weight (``quantize_`` on a copy of the
module alone) dequantized, in a float module, is what torchao's CPU kernels multiply with (int4:
they dequantize too; int8 weight-only: they convert the int8 values and scale the output). Dynamic
formats quantize each token of the input as torchao's kernel does (``Int8Tensor.from_hp`` per row:
symmetric for int8-dynamic, asymmetric for int8-dynamic-int4-weight), then multiply in float; the
kernel's integer matmul differs only by float rounding. Nothing needs calibrating.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from ...core.calibration import call_with
from ...core.devices import model_device
from ...core.kept import SameInput
from ...core.memory import device_free_bytes, free_bytes, give_back, tensors_bytes
from ...core.metrics import sqnr_db
from ...core.shortcuts import Shortcut, checking, confirmed, tensors_equal
from ...targets.llamacpp.program import fp16_scaled
from ..contract import Variant, WholePasses
from ..folds import input_folds
from ..settings import (
    AWQ,
    DATA_ALGORITHMS,
    DEFAULT_GROUP_SIZE,
    GPTQ,
    GROUPED_FORMATS,
    HQQ,
    LEARNED,
    RTN,
    ModuleSettings,
    TunableModule,
)
from .algorithms import (
    CompactWeight,
    InputStatistics,
    QuantizedWeight,
    Recipe,
    awq_group,
    awq_shares,
    choose,
    gptq_many,
    gram_runs,
    on_full_range,
    recording,
)
from .formats import (
    INT8_DYNAMIC_INT4,
    LLAMACPP,
    X86,
    Rounding,
    ao_config,
    fake_quantized_input,
    full_range_grid,
    input_rounding,
    rows_of,
    torchao_eager,
)
from .found import FoundBefore
from .learned import LearnedRounding, learned_weights
from .replay import BlockReplay

FormatKey = tuple[str, int, str]  # (format, group size or 0, weight algorithm or "")
# other formats' quantized weights kept (torchao's own int8 / int4-as-int8 tensors, about a quarter
# of the float size each) up to this share of the float weights; beyond, the least recently used is
# quantized again when next needed. The size front tries every format on every module: kept
# dequantized, a decoder's weights would be held once per format
OTHER_FORMATS_SHARE = 0.5
LEARNED_CONFIGURATIONS = 8  # configurations whose learned rounding the simulation keeps (each a learning run)
# the blocks' outputs kept for the next pass: up to the float weights' size, at least this much (a
# small model's activations outweigh its weights), at most a quarter of the memory free
REPLAY_ROOM = 64 << 20
# A Linear of more rows than HEAD_ROWS (a decoder's head over a vocabulary: Gemma 3's 262,144 rows
# are 168M of its 270M parameters) has its choices' own noise (``local_noise``) measured on
# SAMPLED_ROWS of its rows, the same rows for every choice, and scaled up by rows / SAMPLED_ROWS. A
# row's output error is its own for round to nearest, HQQ and GPTQ (they quantize rows apart), so
# the sum over a uniform sample estimates the whole; AWQ's one input scale is chosen on the sample.
# Passes that only rank variants may compute such a head's sample of rows alone (``rows_sampled``):
# its output is then the same sample of the model's output columns (a decoder's logits)
HEAD_ROWS = 32_768
SAMPLED_ROWS = 8_192
# The weight algorithms that cost more than round to nearest (HQQ's iterations, GPTQ's and AWQ's
# solves over the calibration inputs): ``local_noise`` measures each at one group size a module and
# reads its noise at the other sizes off round to nearest's there, times its ratio to round to
# nearest at the size measured (the choices the front points to are simulated whole)
ONE_GROUP_ALGORITHMS = (HQQ, GPTQ, AWQ)


def sampled_rows(rows: int) -> torch.Tensor:
    """The fixed uniform sample of ``SAMPLED_ROWS`` of ``rows`` (all of them where fewer), sorted."""
    return torch.randperm(rows, generator=torch.Generator().manual_seed(0))[:SAMPLED_ROWS].sort().values


def format_key(choice: ModuleSettings) -> FormatKey | None:
    """The (format, group size) a setting quantizes with; None for float."""
    if choice.keep_float or not choice.format:
        return None
    group = (choice.group_size or DEFAULT_GROUP_SIZE) if choice.format in GROUPED_FORMATS else 0
    return choice.format, group, choice.algorithm


def quantized_weight(
    module: nn.Module, key: FormatKey, statistics: InputStatistics | None = None, target: str = X86
) -> QuantizedWeight:
    """``module``'s weight quantized in format ``key`` for ``target``: by torchao, or for GPTQ / AWQ
    from the ``statistics`` of its inputs (``algorithms.choose``) into torchao's int4 layout."""
    name, group, algorithm = key
    if algorithm in DATA_ALGORITHMS:
        with torch.no_grad():
            found = choose(algorithm, module.weight, group, statistics, full_range_grid(target))
    elif algorithm in ("", RTN) and name in GROUPED_FORMATS and full_range_grid(target):
        ao = torchao_eager()  # torchao's tensor of the format (its activations' rounding), llama.cpp's values in it
        holder = nn.Sequential(copy.deepcopy(module))
        ao.quantize_(holder, ao.FqnToConfig({"0": ao_config(*key, target=target)}), filter_fn=None)
        found = QuantizedWeight(on_full_range(holder[0].weight.detach(), module.weight))
    else:
        ao = torchao_eager()
        holder = nn.Sequential(copy.deepcopy(module))
        ao.quantize_(holder, ao.FqnToConfig({"0": ao_config(*key, target=target)}), filter_fn=None)
        found = QuantizedWeight(holder[0].weight.detach())
    if target == LLAMACPP:  # the scales as the GGUF file stores them (the real run rounds them so too)
        fp16_scaled(found.tensor)
    return found


def _input_rounding(key: FormatKey | None, target: str) -> Rounding:
    """How format ``key``'s kernel on ``target`` rounds a module's input; None: it leaves it float."""
    return None if key is None else input_rounding(key[0], target)


def _input_quantized(x: torch.Tensor, rounding: Rounding, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as a dynamic format's kernel rounds it, dequantized (``x`` where ``rounding`` is None).
    With an AWQ weight the kernel quantizes ``x / s`` (``s`` folded into the op before, or divided
    by a pre-hook) and its weight carries ``s``: here ``quantized(x / s) * s`` meets the weight
    ``W_q / s`` the simulation holds."""
    if rounding is None:
        return x
    if scale is None:
        return fake_quantized_input(x, rounding)
    scale = scale.to(x)
    return fake_quantized_input(x / scale, rounding) * scale


def _packable(quantized: QuantizedWeight) -> bool:
    """Whether ``quantized`` is int4 values and group scales alone (no zero points), which
    ``QuantizedWeight.compact`` packs and ``expand`` gives back as they were."""
    zero_point = getattr(quantized.tensor, "zero_point", None)
    return zero_point is not None and not bool(zero_point.any()) and getattr(quantized.tensor, "qdata", None) is not None


def _reads_data(choice: ModuleSettings) -> bool:
    key = format_key(choice)
    return key is not None and key[2] in DATA_ALGORITHMS


def dequantized_weight(module: nn.Module, key: FormatKey) -> torch.Tensor:
    """``module``'s weight as torchao quantizes it in format ``key``, dequantized to float."""
    return quantized_weight(module, key).dequantize(module.weight.dtype)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` holds (a tensor subclass's inner tensors summed)."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = tensor.__tensor_flatten__()
    return sum(tensor_bytes(getattr(tensor, name)) for name in names)


def one_group_estimates(
    options: Sequence[ModuleSettings], start: ModuleSettings
) -> dict[ModuleSettings, tuple[ModuleSettings, ModuleSettings, ModuleSettings]]:
    """The choices of ``options`` whose own noise ``local_noise`` reads off others: a costly
    algorithm (``ONE_GROUP_ALGORITHMS``) at a group size other than the one it is measured at (the
    start's where it is offered, else the default, else the middle one), each -> (round to nearest
    at its size, the algorithm at the size measured, round to nearest there). Only where those are
    offered too."""
    found: dict[ModuleSettings, tuple[ModuleSettings, ModuleSettings, ModuleSettings]] = {}
    costly: dict[tuple[str, str], dict[int, ModuleSettings]] = {}
    rounded: dict[str, dict[int, ModuleSettings]] = {}
    for choice in options:
        if choice.keep_float or choice.format not in GROUPED_FORMATS:
            continue
        group = choice.group_size or DEFAULT_GROUP_SIZE
        if choice.algorithm in ONE_GROUP_ALGORITHMS:
            costly.setdefault((choice.format, choice.algorithm), {})[group] = choice
        elif choice.algorithm in ("", RTN):
            rounded.setdefault(choice.format, {}).setdefault(group, choice)
    for (name, _), offered in costly.items():
        groups = sorted(g for g in offered if g in rounded.get(name, {}))
        if len(groups) < 2:
            continue
        started = (start.group_size or DEFAULT_GROUP_SIZE) if start.format == name else None
        at = started if started in groups else DEFAULT_GROUP_SIZE if DEFAULT_GROUP_SIZE in groups else groups[len(groups) // 2]
        for group in groups:
            if group != at:
                found[offered[group]] = (rounded[name][group], offered[at], rounded[name][at])
    return found


class EagerSimulation(WholePasses):
    """The starting formats on a float copy; a Variant keeps modules float or gives them other
    formats (``Variant.settings``), by swapping weights and input fake-quantization, no calibration."""

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[TunableModule],
        calibrate: Callable[[nn.Module, dict[str, InputStatistics]], None] | None = None,
        target: str = X86,
        learned: LearnedRounding | None = None,
        found_before: FoundBefore | None = None,
        check: bool = False,
        tied: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model.eval()
        # head -> embedding, where the head multiplies by the embedding's values in whatever format it
        # takes (a GGUF's tied head), its input then rounded as a quantized matrix's
        self._tied = dict(tied or {})
        self._found_before = found_before  # GPTQ weights found before on the float model and calibration data
        self._check = check  # every shortcut also computed afresh and compared (``core.shortcuts``)
        self._learned = learned or LearnedRounding()  # how the learned rounding runs (its start)
        self._target = target  # whose torchao configs the formats are (x86's int8 dynamic quantizes tokens symmetrically)
        self._calibrate = calibrate  # runs a model over the calibration batches (what GPTQ / AWQ read)
        self._start = {m.fqn: m.current for m in modules}
        self.tunable = [m.fqn for m in modules if not m.current.keep_float]
        self.others: list[str] = []  # every quantized module is ranked
        self.sampled: dict[str, tuple[int, int]] = {}  # module -> (rows, of rows) the last local_noise measured
        self.read_off = 0  # choices the last local_noise read off others (``one_group_estimates``)
        self._modules = {fqn: model.get_submodule(fqn) for fqn in self._start}
        self._float = {fqn: module.weight.detach() for fqn, module in self._modules.items()}  # the shared float weights
        # quantized weights, dequantized when a module takes them (the model holds one float weight
        # per module, whichever its variant gives it): the starting format's, kept ...
        self._starting: dict[str, QuantizedWeight] = {}
        self._others: OrderedDict[tuple[str, FormatKey], QuantizedWeight] = OrderedDict()  # ... other formats', a few
        self._others_held = 0
        # GPTQ, AWQ and HQQ results, packed: seconds a module to compute again (GPTQ and AWQ: from its inputs' statistics)
        self._found: dict[tuple[str, FormatKey], CompactWeight | Recipe] = {}
        self._others_room = OTHER_FORMATS_SHARE * sum(tensor_bytes(w) for w in self._float.values())
        self._keeping = True  # whether other formats' weights are kept for the next pass
        self._float_numel = sum(w.numel() for w in self._float.values())
        self._inputs: dict[str, bool | None] = dict.fromkeys(self._modules)  # fqn -> symmetric, or None: float input
        # fqn -> the AWQ scale its weight's input channels were multiplied by: a dynamic format quantizes x / s
        self._input_scales: dict[str, torch.Tensor | None] = dict.fromkeys(self._modules)
        self._last_input = SameInput(check)  # the input last quantized, and how (``_quantized_input``)
        self._folds = input_folds(model)
        for fqn, module in self._modules.items():
            module.register_forward_pre_hook(self._input_hook(fqn))
        self._configured: dict[str, FormatKey | None] | None = None
        # the learned rounding's weights per configuration (every module's format) they were learned in
        self._learned_runs: OrderedDict[frozenset, dict[str, CompactWeight | Recipe]] = OrderedDict()
        self._learned_in: dict[str, frozenset | None] = {}  # module -> the configuration of the learned weight it holds
        self._context: frozenset | None = None  # the configuration _apply sets now
        self._rows: dict[str, torch.Tensor] = {}  # module -> the rows it computes alone (``rows_sampled``)
        self.configure(())
        # each pass starts at the block where its formats first differ from the pass before
        room = min(max(tensors_bytes(list(self._float.values())), REPLAY_ROOM), free_bytes() // 4)
        self._replay = BlockReplay(model, list(self._modules), room, check)

    def _input_hook(self, fqn: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> tuple | None:
            if self._inputs[fqn] is None or not args or not isinstance(args[0], torch.Tensor):
                return None
            return (self._quantized_input(fqn, args[0]), *args[1:])

        return hook

    def _quantized_input(self, fqn: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` as module ``fqn``'s dynamic format quantizes it, dequantized (``_input_quantized``).
        The Linears that read one input (q / k / v, gate / up) take the first one's result while the
        input is the same tensor, unchanged since, quantized the same way."""
        rounding, scale = self._inputs[fqn], self._input_scales[fqn]
        return self._last_input.of(x, lambda: _input_quantized(x, rounding, scale), rounding, scale)

    def _tie(self, head: str, embedding: str, key: FormatKey | None) -> None:
        """The head multiplies by the embedding's weight as it is now (format ``key``), its input
        rounded as llama.cpp rounds a quantized matrix's (float where the embedding is)."""
        weight = self._modules[embedding].weight.detach()
        if head in self._rows:
            weight = weight[self._rows[head]]
        self._modules[head].weight = nn.Parameter(weight, requires_grad=False)
        self._inputs[head] = None if key is None else input_rounding(INT8_DYNAMIC_INT4, self._target)

    def weight(self, fqn: str, key: FormatKey | None) -> torch.Tensor:
        """Module ``fqn``'s weight in format ``key`` (float for None), dequantized from its quantized form."""
        if key is None:
            return self._float[fqn]
        dtype = self._float[fqn].dtype
        if key[2] == LEARNED:  # learned by _apply for the configuration it sets
            found = self._learned_runs[self._context][fqn].expand(self._float[fqn])
            self._learned_in[fqn] = self._context
            return found.dequantize(dtype)
        if key[2] in DATA_ALGORITHMS:  # found by _apply before it switches (a pass's hooks never gather)
            found = self._found[fqn, key].expand(self._float[fqn])
            self._input_scales[fqn] = found.input_scale
            return found.dequantize(dtype)
        if key == format_key(self._start[fqn]):
            if fqn not in self._starting:
                self._starting[fqn] = self._quantized(fqn, key)
            return self._starting[fqn].dequantize(dtype)
        if key[2] == HQQ:  # seconds a module (a decoder head's: half a minute): kept packed, as GPTQ's are
            kept = self._found.get((fqn, key))
            if kept is None:
                quantized = self._quantized(fqn, key)
                if not _packable(quantized):
                    return quantized.dequantize(dtype)
                kept = self._found[fqn, key] = quantized.compact()
            return kept.expand(self._float[fqn]).dequantize(dtype)
        quantized = self._others.pop((fqn, key), None)
        if quantized is None:
            quantized = self._quantized(fqn, key)
            if not self._keeping:  # a pass that takes each weight once (local_noise)
                return quantized.dequantize(dtype)
            self._others_held += quantized.nbytes
        self._others[fqn, key] = quantized  # the most recently used last
        while self._others_held > self._others_room and len(self._others) > 1:
            self._others_held -= self._others.popitem(last=False)[1].nbytes
        return quantized.dequantize(dtype)

    def _quantized(self, fqn: str, key: FormatKey) -> QuantizedWeight:
        return quantized_weight(self._float_module(fqn), key, target=self._target)

    def find_data_weights(
        self, chosen: Iterable[tuple[str, FormatKey | None]], statistics_of: Sequence[str] = ()
    ) -> dict[str, InputStatistics]:
        """Each GPTQ / AWQ weight in ``chosen`` (module, format pairs) not found yet: the calibration
        batches' inputs to those modules gathered in float passes (one per run of modules,
        ``gram_runs``), each weight computed and kept packed or as a recipe
        (``QuantizedWeight.compact``), the inputs' statistics dropped. Called before a pass, never
        inside one (a pass's hooks take what was found). ``statistics_of``: modules whose inputs'
        statistics the caller wants (a head's, for its sampled rows), gathered in the first of
        those passes, or in one of their own where none runs, and returned."""
        # the learned rounding's weights depend on every module's format: ``_apply`` learns them per configuration
        missing = list(
            dict.fromkeys(
                (fqn, key) for fqn, key in chosen if key is not None and key[2] in DATA_ALGORITHMS and key[2] != LEARNED
            )
        )
        missing = [pair for pair in missing if pair not in self._found]
        gptq = [pair for pair in missing if pair[1][2] == GPTQ]
        store_key, taken = None, {}
        if self._found_before is not None and gptq:  # found before on the same float model and data (a run's)
            store_key = self._found_before.key()
            taken = self._found_before.store.taken(store_key, gptq)
        checked = bool(taken) and checking(self._check)  # computed here too, then compared
        if taken and not checked:
            self._found.update({(fqn, key): weight.to(self._float[fqn].device) for (fqn, key), weight in taken.items()})
            missing = [pair for pair in missing if pair not in self._found]
        wanted = list(dict.fromkeys(statistics_of))
        if not missing and not wanted:
            return {}
        self._calibrator()  # refused before anything is configured
        before = dict(self._configured or {})
        self.configure(Variant(frozenset(self._modules)))
        asked: dict[str, InputStatistics] = {}
        try:
            choices = {fqn: (key[2], key[1]) for fqn, key in missing}
            shares = awq_shares(choices, self._folds)
            recorded = [(fqn, key) for fqn, key in missing if key[2] != AWQ or fqn in shares]
            features = {fqn: int(self._float[fqn].shape[1]) for fqn, _ in recorded}
            held = sum(tensor_bytes(w) for w in self._float.values())
            free = device_free_bytes(model_device(self.model))
            for modules in gram_runs(features, held, free) if features else ():
                gathered = self._float_statistics([*modules, *(fqn for fqn in wanted if fqn not in asked)])
                asked |= {fqn: gathered.pop(fqn) for fqn in wanted if fqn not in asked and fqn not in modules}
                solved = [(fqn, key) for fqn, key in recorded if fqn in modules and key[2] != AWQ]
                problems = {(fqn, key): (self._float[fqn], gathered[fqn], key[1]) for fqn, key in solved}
                with torch.no_grad():  # GPTQ: the weights of one shape solved together
                    found = gptq_many(problems, full_range_grid(self._target))
                    computed = {pair: weight.compact() for pair, weight in found.items()}
                self._found.update(computed)
                if self._found_before is not None:
                    self._found_before.store.keep(store_key, {pair: w for pair, w in computed.items() if pair not in taken})
                del problems, computed
                for fqn in modules:
                    statistics = gathered.pop(fqn)  # freed once the module's results are found
                    for key in (key for other, key in recorded if other == fqn and key[2] == AWQ):
                        readers = {reader: self._float[reader] for reader in shares[fqn]}
                        with torch.no_grad():  # every reader of the input: one scale, whichever of them asks next
                            for reader, found in awq_group(readers, statistics, key[1]).items():
                                self._found[reader, key] = found.compact()
                del gathered
                give_back()
            if checked:
                computed = {pair: self._found[pair] for pair in taken}
                confirmed(Shortcut.FOUND_WEIGHTS, taken, lambda: computed, tensors_equal, f"{len(taken)} modules' GPTQ weights")
            if any(fqn not in asked for fqn in wanted):  # no pass ran for the weights: one for these alone
                asked |= self._float_statistics([fqn for fqn in wanted if fqn not in asked])
        finally:
            self._apply(before)
        return asked

    def _learn_in(self, configuration: Mapping[str, FormatKey | None], context: frozenset) -> None:
        """The learned rounding's weights of the modules ``configuration`` asks it of, learned as a real
        run of that configuration learns them (``learned_weights``: block by block with every other
        Linear in its own format, GPTQ's and AWQ's values found first, then the whole model's scales),
        kept under ``context`` (the configuration, every module's format) for the
        ``LEARNED_CONFIGURATIONS`` configurations last asked."""
        if context in self._learned_runs:
            self._learned_runs.move_to_end(context)
            return
        formats = {fqn: key for fqn, key in configuration.items() if key is not None}
        data = [(fqn, key) for fqn, key in formats.items() if key[2] in DATA_ALGORITHMS and key[2] != LEARNED]
        self.find_data_weights(data)  # what the learned blocks' other Linears take
        found: dict[str, CompactWeight | Recipe] = {fqn: self._found[fqn, key] for fqn, key in data}
        before, rows = dict(self._configured or {}), self._rows
        self._rows = {}  # the whole model, a head's rows all there (the whole-model stage reads its output)
        for fqn in rows:
            self._apply_again(fqn)
        self.configure(Variant(frozenset(self._modules)))  # the calibration pass reads the float model
        try:
            passes = learned_weights(
                self.model, formats, found, target=self._target, quantize=self._quantized_module, options=self._learned
            )
            for gathered in passes:
                with torch.no_grad():
                    self._calibrator()(self.model, gathered)  # merged across ranks, if any
        finally:
            self._rows = rows
            self._apply(before)
            for fqn in rows:
                self._apply_again(fqn)
        self._learned_runs[context] = {fqn: found[fqn] for fqn, key in formats.items() if key[2] == LEARNED}
        while len(self._learned_runs) > LEARNED_CONFIGURATIONS:
            self._learned_runs.popitem(last=False)
        give_back()

    def _quantized_module(self, module: nn.Module, key: FormatKey) -> QuantizedWeight:
        return quantized_weight(module, key, target=self._target)

    def _float_module(self, fqn: str) -> nn.Module:
        """A shallow copy of module ``fqn`` holding its float weight (whatever the model holds now)."""
        float_module = copy.copy(self._modules[fqn])
        float_module.weight = nn.Parameter(self._float[fqn], requires_grad=False)
        return float_module

    def formats_of(self, variant: Variant | Iterable[str] = ()) -> dict[str, FormatKey | None]:
        """Each module's format under ``variant`` (None: float)."""
        variant = Variant.of(variant)
        chosen = {fqn: format_key(choice) for fqn, choice in self._start.items()}
        for fqn, choice in variant.settings:
            chosen[fqn] = format_key(choice)
        for fqn in variant.float_modules:
            chosen[fqn] = None
        return chosen

    def configure(self, variant: Variant | Iterable[str] = ()) -> None:
        variant = Variant.of(variant)
        if variant.observers or variant.dynamic or variant.other_weights:
            raise KeyError("the eager simulation takes formats (Variant.settings) and float modules only")
        self._apply(self.formats_of(variant))

    def before_passes(self, variants: Sequence[Variant | Iterable[str]]) -> None:
        """The GPTQ / AWQ weights every variant takes, found together (``find_data_weights``: one
        calibration run for all of them, not one a variant); then the learned rounding of each
        configuration that asks it (``_learn_in``: a learning each)."""
        configurations = [self.formats_of(variant) for variant in variants]
        self.find_data_weights((fqn, key) for formats in configurations for fqn, key in formats.items())
        for formats in configurations:
            if any(key is not None and key[2] == LEARNED for key in formats.values()):
                self._learn_in(formats, frozenset(formats.items()))

    def pass_order(self, variants: Sequence[Variant | Iterable[str]]) -> list[int]:
        """The variants sorted so that neighbours share the longest unchanged prefix (``BlockReplay.order``)."""
        return self._replay.order([self.formats_of(variant) for variant in variants])

    def passes(self, batches: Sequence[Any]) -> AbstractContextManager[Callable[[int], None]]:
        """Each pass starts at the first block whose formats changed since the pass before (``BlockReplay``)."""
        return self._replay.passes(batches, dict(self._configured or {}))

    def local_sqnr(self, batch: Any) -> dict[str, float]:
        """Each quantized module's own error: its starting format on the float model's input to it."""
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(fqn: str) -> Callable:
            def hook(_module: nn.Module, args: tuple, output: Any) -> None:
                if fqn not in seen and args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                    seen[fqn] = (args[0].detach(), output.detach())

            return hook

        self.find_data_weights((fqn, format_key(self._start[fqn])) for fqn in self.tunable)
        self._float_pass(batch, {fqn: keep(fqn) for fqn in self.tunable})
        local = {}
        with torch.no_grad():
            for fqn, (given, expected) in seen.items():
                self._apply({**dict.fromkeys(self._modules), fqn: format_key(self._start[fqn])})
                local[fqn] = sqnr_db(expected, self._modules[fqn](given))
        self.configure(())
        return local

    def rest(self) -> None:
        """Every module back on the float weights it shares with the float model, other formats'
        weights forgotten: the simulation then holds the starting formats' quantized weights only
        (about a quarter of the float size); the next ``configure`` dequantizes again."""
        self._others.clear()
        self._others_held = 0
        self._found.clear()
        self._learned_runs.clear()
        self._learned_in.clear()
        self._replay.forget()
        self._apply(dict.fromkeys(self._modules))
        give_back()

    def head_sample(self, columns: int) -> tuple[str, torch.Tensor] | None:
        """The one module that may give a model output of ``columns`` columns from as many rows, a
        Linear of more than ``HEAD_ROWS`` rows (a decoder's head), and the rows (``sampled_rows``)
        a pass that only ranks variants may compute alone (``rows_sampled``); None where there is
        no such module, or more than one."""
        found = [
            fqn
            for fqn, module in self._modules.items()
            if type(module) is nn.Linear and self._float[fqn].shape[0] == columns > HEAD_ROWS
        ]
        return (found[0], sampled_rows(columns)) if len(found) == 1 else None

    @contextmanager
    def rows_sampled(self, fqn: str, rows: torch.Tensor) -> Iterator[None]:
        """Within: Linear ``fqn`` computes ``rows`` of its output alone, its weight (in whatever format
        a variant gives it) and bias sliced alike; every row's output is its own, so each is what the
        whole module gives there."""
        module = self._modules[fqn]
        bias = module.bias
        rows = rows.to(self._float[fqn].device)
        self._rows[fqn] = rows
        try:
            if bias is not None:
                module.bias = nn.Parameter(bias.detach()[rows], requires_grad=False)
            self._apply_again(fqn)
            yield
        finally:
            del self._rows[fqn]
            module.bias = bias
            self._apply_again(fqn)

    def _apply_again(self, fqn: str) -> None:
        """Module ``fqn``'s weight set again in the format it has (its rows changed)."""
        key = (self._configured or {}).pop(fqn, None)  # forgotten, so that _apply sets it
        self._apply({fqn: key})

    def local_noise(self, batch: Any, choices: Mapping[str, Sequence[ModuleSettings]]) -> dict[tuple[str, ModuleSettings], float]:
        """Per module and choice, the noise power the choice puts on the module's own output (the
        squared difference to its float output, summed), on the float model's input to it in one
        pass over ``batch``; computed inside the pass, so no module's input is kept but a head's
        (``_row_sampled``): its choices are measured on a sample of its rows after the pass
        (``HEAD_ROWS``), and ``self.sampled`` says which (module -> (rows measured, rows))."""
        found: dict[tuple[str, ModuleSettings], float] = {}
        read_off = {fqn: one_group_estimates(options, self._start[fqn]) for fqn, options in choices.items()}
        choices = {fqn: [c for c in options if c not in read_off[fqn]] for fqn, options in choices.items()}
        sampled = [fqn for fqn in choices if self._row_sampled(fqn, choices[fqn])]
        heads_inputs: dict[str, torch.Tensor] = {}

        def keep_input(fqn: str) -> Callable:
            def hook(_module: nn.Module, args: tuple, _output: Any) -> None:
                if args and isinstance(args[0], torch.Tensor):
                    heads_inputs[fqn] = args[0].detach()

            return hook

        def measure(fqn: str) -> Callable:
            def hook(module: nn.Module, args: tuple, output: Any) -> None:
                if not args or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                    return
                for choice in choices[fqn]:
                    key = format_key(choice)
                    if key is None:
                        found[fqn, choice] = 0.0
                        continue
                    self._apply({fqn: key})
                    given = self._quantized_input(fqn, args[0])
                    # squared in place, summed in float64: a decoder head's 256 x 32,000 error is not copied twice
                    error = torch.sub(module.forward(given, *args[1:]), output).pow_(2)
                    found[fqn, choice] = float(error.sum(dtype=torch.float64))
                self._apply({fqn: None})

            return hook

        whole = {fqn: options for fqn, options in choices.items() if fqn not in sampled}
        alone = dict.fromkeys(self._modules)  # each choice measured alone, every other module float
        for fqn, options in whole.items():  # learned before the pass (a pass's hooks never calibrate)
            for key in (format_key(c) for c in options):
                if key is not None and key[2] == LEARNED:
                    self._learn_in({**alone, fqn: key}, frozenset({**alone, fqn: key}.items()))
        statistics = self.find_data_weights(  # the heads' inputs to GPTQ / AWQ gathered in the same passes
            ((fqn, format_key(c)) for fqn, options in whole.items() for c in options),
            statistics_of=[fqn for fqn in sampled if any(_reads_data(c) for c in choices[fqn])],
        )
        self._keeping = False  # every choice of every module taken once: none kept for later (half the weights' size)
        try:
            self._float_pass(batch, {fqn: keep_input(fqn) if fqn in sampled else measure(fqn) for fqn in choices})
            for fqn in sampled:
                if fqn in heads_inputs:
                    found |= self._sampled_noise(fqn, heads_inputs.pop(fqn), choices[fqn], statistics.get(fqn))
        finally:
            self._keeping = True
            self.configure(())
            give_back()
        self.sampled = {fqn: (min(SAMPLED_ROWS, self._float[fqn].shape[0]), self._float[fqn].shape[0]) for fqn in sampled}
        self.read_off = 0
        for fqn, estimates in read_off.items():
            for choice, (rounded, measured, rounded_there) in estimates.items():
                known = [found.get((fqn, c)) for c in (rounded, measured, rounded_there)]
                if None not in known:
                    here, ratio = known[0], (known[1] / known[2] if known[2] else 1.0)
                    found[fqn, choice] = here * ratio
                    self.read_off += 1
        return found

    def _row_sampled(self, fqn: str, options: Sequence[ModuleSettings] = ()) -> bool:
        """Whether ``local_noise`` measures module ``fqn``'s ``options`` on a sample of its rows: a
        Linear of more than ``HEAD_ROWS`` rows, none of its options learned on its block's output."""
        module = self._modules[fqn]
        return (
            type(module) is nn.Linear
            and self._float[fqn].shape[0] > HEAD_ROWS
            and not any(c.algorithm == LEARNED and format_key(c) is not None for c in options)
        )

    def _float_statistics(self, modules: Sequence[str]) -> dict[str, InputStatistics]:
        """The calibration batches' inputs to ``modules`` (what GPTQ and AWQ read), in passes of the
        model as it is configured (float, where they are asked)."""
        if not modules:
            return {}
        with torch.no_grad(), recording(self.model, modules) as gathered:
            self._calibrator()(self.model, gathered)  # merged across ranks, if any
        return gathered

    def _calibrator(self) -> Callable[[nn.Module, dict[str, InputStatistics]], None]:
        """What runs a model over the calibration batches; a clear error where there are none."""
        if self._calibrate is None:
            raise ValueError("this simulation was built without calibration data: GPTQ and AWQ cannot be simulated")
        return self._calibrate

    def _sampled_noise(
        self, fqn: str, given: torch.Tensor, options: Sequence[ModuleSettings], statistics: InputStatistics | None
    ) -> dict[tuple[str, ModuleSettings], float]:
        """``local_noise`` of module ``fqn``'s ``options`` on ``SAMPLED_ROWS`` of its rows (a fixed
        uniform sample, sorted), each quantized as the whole module would be, scaled to every row."""
        rows = self._float[fqn].shape[0]
        picked = sampled_rows(rows)
        sample = rows_of(self._float_module(fqn), picked.to(self._float[fqn].device))
        with torch.no_grad():
            expected = sample(given)
        share = rows / len(picked)
        found: dict[tuple[str, ModuleSettings], float] = {}
        for choice in options:
            key = format_key(choice)
            if key is None:
                found[fqn, choice] = 0.0
                continue
            with torch.no_grad():
                quantized = quantized_weight(sample, key, statistics, target=self._target)
                x = _input_quantized(given, _input_rounding(key, self._target), quantized.input_scale)
                output = nn.functional.linear(x, quantized.dequantize(sample.weight.dtype), sample.bias)
                found[fqn, choice] = share * float(output.sub_(expected).pow_(2).sum(dtype=torch.float64))
        return found

    def _float_pass(self, batch: Any, hooks: Mapping[str, Callable]) -> None:
        """One pass over ``batch`` with every module float, ``hooks[fqn]`` on module ``fqn``'s output."""
        self.configure(Variant(frozenset(self._modules)))
        modules = self._modules
        handles = [modules[fqn].register_forward_hook(hook) for fqn, hook in hooks.items() if fqn in modules]
        try:
            with torch.no_grad():
                call_with(self.model, batch)
        finally:
            for handle in handles:
                handle.remove()

    def _apply(self, chosen: dict[str, FormatKey | None]) -> None:
        """Each module's weight and input quantization as ``chosen`` says (only what changed). A
        learned module's weight is the one learned in the whole configuration this sets: set again
        where another module's format changed, learned first where this configuration is new."""
        current = self._configured or {}
        configuration = {**current, **chosen}
        context = (
            frozenset(configuration.items()) if any(k is not None and k[2] == LEARNED for k in configuration.values()) else None
        )
        if context is not None:
            self._learn_in(configuration, context)
            current = self._configured or {}  # as it was: learning put it back
            stale = {
                f: k for f, k in configuration.items() if k is not None and k[2] == LEARNED and self._learned_in.get(f) != context
            }
            chosen = {**chosen, **stale}
        self.find_data_weights((fqn, key) for fqn, key in chosen.items() if current.get(fqn, ()) != key)
        self._context = context
        replaced = 0  # elements of the weights replaced since memory was last handed back
        with torch.no_grad():
            for fqn, key in chosen.items():
                learned_here = key is not None and key[2] == LEARNED and self._learned_in.get(fqn) != context
                if self._configured is not None and self._configured.get(fqn, ()) == key and not learned_here:
                    continue
                replaced += self._float[fqn].numel()
                if replaced * 8 > self._float_numel:  # the weights dropped so far (and the quantization's
                    give_back()  # temporaries) handed back as it goes, not kept resident to the end
                    replaced = 0
                # a new Parameter, never written into: the model's float weights may be the session's own
                self._input_scales[fqn] = None  # until an AWQ weight sets it
                weight = self.weight(fqn, key)
                if fqn in self._rows:
                    weight = weight[self._rows[fqn]]
                self._modules[fqn].weight = nn.Parameter(weight, requires_grad=False)
                self._inputs[fqn] = _input_rounding(key, self._target)
            for head, embedding in self._tied.items():
                if head in chosen or embedding in chosen:
                    self._tie(head, embedding, configuration.get(embedding))
        self._configured = {**(self._configured or {}), **chosen}

    def run_real_kernels(self, quantized: nn.Module, names: Iterable[str]) -> list[str]:
        """The simulation multiplies with torchao's own dequantized weights: no kernel to adopt."""
        return []
