"""Calibrate once, then evaluate many per-module variations by forward passes only.

torch's reference conversion (``convert_to_reference_fx``) turns a calibrated prepare_fx model into
float ops between quantize -> dequantize pairs, with weights quantized and dequantized in the
reference modules; on the CPU its outputs equal the converted model's. Here every such pair becomes
a switchable fake-quantize point and every reference module's weight a switchable fake-quantized
copy. Keeping a set of modules float then means: their weights stay float, and a quantize point
stays only where FX would still put one, that is where its producer or one of its consumers is
still a quantized op. Observers always see float activations while calibrating, so the
qparams of every point that stays are the ones a real run with those modules float would compute.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.ao.nn.intrinsic import _FusedModule
from torch.ao.nn.quantized.reference.modules.utils import ReferenceQuantizedModule
from torch.ao.quantization.fake_quantize import FakeQuantizeBase, FixedQParamsFakeQuantize
from torch.ao.quantization.observer import (
    FixedQParamsObserver,
    NoopObserver,
    ObserverBase,
    PlaceholderObserver,
    ReuseInputObserver,
)
from torch.ao.quantization.quantize_fx import convert_to_reference_fx

from ...core.calibration import call_with, torch_warnings_hidden
from ...core.devices import CPU, model_device
from ...core.histograms import searches_kept
from ...core.memory import models_forgotten, shared_copy
from ...core.metrics import sqnr_db
from ..contract import Reduce, Variant, WholePasses
from .lowering import replace_submodule
from .replay import Replay

SIMULATED = "qreport_quant_points"


class QuantPoint(nn.Module):
    """quantize -> dequantize of an activation with fixed qparams, which can be switched off.

    Rounds as torch's fake-quantize op does (``x / scale`` to the nearest even integer, then the
    zero point), which is what the quantized kernels' outputs agree with at ties, but in plain
    tensor ops: that op is some 10x slower on the CPU. ``alternate`` holds the scale and zero point
    FX uses here instead when the producer runs float (the fixed qparams of a consumer such as
    Hardsigmoid, which FX then puts on its input); ``use_alternate`` selects them. ``dynamic`` (with
    ``reduce_range``) quantizes each call's values with their own range instead, as FX does after an op
    that follows a dynamic module's float output when a quantized op reads it.
    """

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        info = torch.iinfo(dtype)
        self.dtype = dtype
        self.quant_min, self.quant_max = int(info.min), int(info.max)
        self.qparams = _qparams(scale, zero_point)
        self.enabled = True
        self.alternate: tuple[torch.Tensor, torch.Tensor, int] | None = None  # from _qparams
        self.use_alternate = False
        self.override: tuple[torch.Tensor, torch.Tensor, int] | None = None  # another observer's qparams
        self.override_key: tuple[str, str] | None = None  # (module, observer) they come from
        self.dynamic = False
        self.reduce_range = True

    def active_qparams(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(scale, its reciprocal, zero point) in use now."""
        if self.use_alternate and self.alternate:
            return self.alternate
        return self.override if self.override is not None else self.qparams

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        if self.dynamic:
            return dynamic_fake_quantized(x, self.reduce_range)
        scale, inverse, zero_point = self.active_qparams()
        q = torch.round(x * inverse).add_(zero_point).clamp_(self.quant_min, self.quant_max)
        return q.sub_(zero_point).mul_(scale)


def _qparams(scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scale, its float32 reciprocal (as fake-quantize computes it) and the zero point as an int."""
    scale = torch.as_tensor(scale).detach().float().reshape(())
    return scale, 1.0 / scale, int(torch.as_tensor(zero_point))


class RealKernel(nn.Module):
    """A module of the simulation that runs the real model's quantized kernel instead of its
    reference: for a module whose kernel computes something else than the reference (see
    ``kernels.py``), so the simulation stays true to the real model. The input is quantized with
    the qparams of the quantize point before it (exact: that point has just rounded it); kept
    float (``active`` False), the reference module runs.
    """

    def __init__(self, reference: nn.Module, kernel: nn.Module, before: QuantPoint) -> None:
        super().__init__()
        self.reference, self.kernel, self.before = reference, kernel, before
        self.active = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.reference(x)
        scale, _, zero_point = self.before.active_qparams()
        with torch_warnings_hidden():  # torch's quantized kernels are the CPU's: a simulation elsewhere visits it
            q = torch.quantize_per_tensor(x.to(CPU), float(scale), zero_point, self.before.dtype)
            return self.kernel(q).dequantize().to(x.device)


def dynamic_fake_quantized(x: torch.Tensor, reduce_range: bool) -> torch.Tensor:
    """``x`` quantized per tensor to quint8 with the range of its own values, as torch's dynamic
    Linear kernel does on each call (fbgemm: 7 bits, ``reduce_range``), then dequantized."""
    scale, zero_point = torch._choose_qparams_per_tensor(x, reduce_range)
    high = 127 if reduce_range else 255
    return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, 0, high)


class _Point:
    """One quantize point: its module, its node, the node that produces its input and the nodes that read it."""

    def __init__(self, module: QuantPoint, node: torch.fx.Node, producer: torch.fx.Node, consumers: list[torch.fx.Node]) -> None:
        self.module, self.node, self.producer, self.consumers = module, node, producer, consumers

    def state(self) -> tuple[bool, bool, tuple[str, str] | None, bool]:
        return self.module.enabled, self.module.use_alternate, self.module.override_key, self.module.dynamic


class Simulator(WholePasses):
    """A calibrated model whose modules can be kept float, one set at a time, without recalibrating
    (``outputs`` as whole passes; ``outputs_each`` recomputes only what each variant changes).

    Args:
        prepared: a calibrated ``prepare_fx`` model (it is copied, not changed).
        tunable: the names of the modules that may be kept float.
        float_producer_qparams: producer node name -> (scale, zero point) that FX puts after it
            when it runs float, where that differs from the calibrated ones (see
            ``fixed_qparams_after_float``).
        other_weight_observers: module name -> the weight observer a real run uses when that
            module's weight scheme is switched (``Variant.other_weights``).
        functional: tunable name -> the prepared graph's node of a functional op (an add, a mul)
            that may be kept float.
        calibrated_with: module -> activation observer name: the start prepared with those modules'
            output observers changed and calibrated (one calibration for every observer a set of
            variants asks for: observers only watch the float activations, so each one's qparams
            are those a run with it alone computes).
        dynamic_reduce_range: whether torch's dynamic Linear quantizes its input to 7 bits (fbgemm,
            x86) for ``Variant.dynamic``.
    """

    def __init__(
        self,
        prepared: torch.fx.GraphModule,
        tunable: Iterable[str],
        float_producer_qparams: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
        other_weight_observers: Mapping[str, Callable[[], nn.Module]] | None = None,
        functional: Mapping[str, str] | None = None,
        calibrated_with: Callable[[Mapping[str, str]], torch.fx.GraphModule] | None = None,
        dynamic_reduce_range: bool = True,
    ) -> None:
        with torch_warnings_hidden(), models_forgotten(), searches_kept():
            reference = convert_to_reference_fx(shared_copy(prepared))
        self.model = reference
        self._points = _insert_points(reference)
        for point in self._points:
            alternate = (float_producer_qparams or {}).get(point.producer.name)
            point.module.alternate = _qparams(*alternate) if alternate is not None else None
        self._weights = _cache_weights(reference)
        self._node_of = {str(n.target): n for n in reference.graph.nodes if n.op == "call_module"}
        by_name = {n.name: n for n in reference.graph.nodes}  # an add, a mul ...: its node keeps its name
        self._node_of.update({op: by_name[node] for op, node in (functional or {}).items() if node in by_name})
        self._names = [name for name in tunable if name in self._node_of]  # what a Variant may keep float
        self._kernels: dict[str, RealKernel] = {}  # modules that run the real model's kernel
        self._follows = _followers(self._points)  # a reshape, a pool: quantized where its input is
        self._points_at: dict[torch.fx.Node, list[_Point]] = {}  # the points a node's state decides
        for point in self._points:
            for node in (point.producer, *point.consumers):
                self._points_at.setdefault(node, []).append(point)
                while node in self._follows:  # ... and the state of the op a follower follows
                    node = self._follows[node]
                    self._points_at.setdefault(node, []).append(point)
        self._other_observers = dict(other_weight_observers or {})
        self._other_weights: dict[str, torch.Tensor] = {}  # computed on first use
        self._calibrated_with = calibrated_with
        self._weighted = {self._node_of[name] for name in self._weights}
        self._readers = self._direct_readers()
        # ops whose quantized output FX drops when only dynamic modules read it (GELU, a division; measured:
        # a normalization keeps its quantized kernel and output, a weighted module its quantized output)
        self._loose = {
            n
            for n in self._readers
            if n.op in ("call_function", "call_method")
            or (n.op == "call_module" and n not in self._weighted and not isinstance(_module_at(reference, n), _NORMS))
        }
        self._overrides: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor, int]]] = {}
        self._reduce_range = dynamic_reduce_range
        self._dynamic_now: frozenset[str] = frozenset()
        self._dynamic_hooked: set[str] = set()
        self._state = Variant(frozenset(self._weights))
        self._set(Variant(), changed=set(self._weights), points=self._points)
        self._replay = Replay(reference)

    @property
    def tunable(self) -> list[str]:
        """The modules diagnosis ranks: those with weights, and those that run a real kernel (keeping
        any other op float changes nothing here: its reference is a float op already)."""
        return [name for name in self._names if name in self._weights or name in self._kernels]

    @property
    def others(self) -> list[str]:
        """The other ops a Variant may keep float (a PReLU, a pooling, an add whose kernel agrees):
        keeping one float drops the quantize / dequantize around it."""
        ranked = set(self.tunable)
        return [name for name in self._names if name not in ranked]

    def run_real_kernels(self, quantized: nn.Module, names: Iterable[str]) -> list[str]:
        """Run ``quantized``'s kernels (copied) for the modules ``names`` instead of their reference;
        the names it could (a module with one quantize point before it), in forward order."""
        before = {consumer: p for p in self._points for consumer in p.consumers}
        for name in names:
            node = self._node_of.get(name)
            point = before.get(node) if node is not None else None
            if point is None or name in self._kernels or name not in self._names:
                continue
            with torch_warnings_hidden():  # copying quantized weights touches torch's deprecated storages
                kernel = copy.deepcopy(quantized.get_submodule(name))
            wrapper = RealKernel(self.model.get_submodule(name), kernel, point.module)
            wrapper.active = name not in self._state.float_modules
            replace_submodule(self.model, name, wrapper)
            self._kernels[name] = wrapper
        return [name for name in self._names if name in self._kernels]

    @property
    def state(self) -> Variant:
        """The configuration last set."""
        return self._state

    def configure(self, variant: Variant | Iterable[str] = ()) -> None:
        """Set ``variant`` (or keep the modules named float), everything else as the starting configuration."""
        variant = Variant.of(variant)
        observed = {fqn for fqn, _ in variant.observers}
        unknown = (variant.float_modules | variant.dynamic | observed) - set(self._names)
        unknown |= variant.other_weights - set(self._weights)
        if variant.settings:
            raise KeyError("the FX simulation has no formats (Variant.settings)")
        if unknown:
            raise KeyError(f"no quantized module named {', '.join(sorted(unknown))} in the simulation")
        no_scheme = variant.other_weights - set(self._other_observers)
        if no_scheme:
            raise KeyError(f"no other weight scheme for {', '.join(sorted(no_scheme))}")
        self.prepare_observers([variant])
        changed = (variant.float_modules ^ self._state.float_modules) | (variant.other_weights ^ self._state.other_weights)
        changed &= set(self._weights)
        moved = {self._node_of[name] for name in variant.float_modules ^ self._state.float_modules}
        switched = {self._node_of[name] for name in variant.dynamic ^ self._state.dynamic}
        moved |= switched | {node for node, readers in self._readers.items() if readers & switched}  # and what feeds them
        points = {id(p): p for node in moved for p in self._points_at.get(node, ())}
        for pair in variant.observers ^ self._state.observers:
            points.update({id(self._points[i]): self._points[i] for i in self._overrides[pair]})
        self._set(variant, changed, points.values())

    def prepare_observers(self, variants: Iterable[Variant]) -> None:
        """The qparams of every (module, observer) the ``variants`` ask for and the simulation has not
        seen, from as few calibrations as can tell them apart (``calibrated_with``).

        A module's activation observer gives qparams to the quantize points around it: after it (and
        after the ops that share its qparams, such as a transpose), and before it, where FX then gives
        the module an input observer of its own. Modules whose points do not meet are calibrated
        together: observers only watch the float activations, so each one's qparams are those a run
        with it alone computes."""
        wanted = sorted({pair for variant in variants for pair in variant.observers} - set(self._overrides))
        if not wanted:
            return
        if self._calibrated_with is None:
            raise KeyError("this simulation cannot change activation observers")
        groups: list[tuple[dict[str, str], set[int]]] = []
        for fqn, name in wanted:
            touched = self._touched(fqn)
            group = next((g for g in groups if fqn not in g[0] and not touched & g[1]), None)
            if group is None:
                group = ({}, set())
                groups.append(group)
            group[0][fqn] = name
            group[1].update(touched)
        for observers, _ in groups:
            self._read_overrides(observers)

    def _direct_readers(self) -> dict[torch.fx.Node, set[torch.fx.Node]]:
        """Node -> the ops that read its quantized output directly."""
        found: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        for point in self._points:
            found.setdefault(point.producer, set()).update(point.consumers)
        return found

    def _source(self, node: torch.fx.Node) -> torch.fx.Node:
        """``node``, or for an op that shares its input's qparams, the op it follows."""
        while node in self._follows:
            node = self._follows[node]
        return node

    def _touched(self, fqn: str) -> set[int]:
        """The quantize points next to module ``fqn``: after it (through the ops that share its
        qparams) and before it."""
        node, found = self._node_of[fqn], set()
        for i, point in enumerate(self._points):
            if self._source(point.producer) is node or node in point.consumers:
                found.add(i)
        return found

    def _read_overrides(self, observers: Mapping[str, str]) -> None:
        with torch_warnings_hidden(), models_forgotten(), searches_kept():
            other = convert_to_reference_fx(self._calibrated_with(observers))
        points = _insert_points(other)
        if [p.producer.name for p in points] != [p.producer.name for p in self._points]:
            raise RuntimeError("another activation observer changed where FX quantizes; its effect cannot be simulated")
        for fqn, name in observers.items():
            self._overrides[fqn, name] = {
                i: points[i].module.qparams
                for i in self._touched(fqn)
                if not _same_qparams(self._points[i].module, points[i].module)
            }

    def _dynamic_hook(self, name: str) -> None:
        """Quantize the input of module ``name`` per call while it is in ``_dynamic_now``."""
        if name in self._dynamic_hooked:
            return

        def hook(_module: nn.Module, args: tuple) -> tuple | None:
            if name not in self._dynamic_now or not args or not isinstance(args[0], torch.Tensor):
                return None
            return (dynamic_fake_quantized(args[0], self._reduce_range), *args[1:])

        self.model.get_submodule(name).register_forward_pre_hook(hook)
        self._dynamic_hooked.add(name)

    def _is_quantized(self, node: torch.fx.Node, float_nodes: set[torch.fx.Node]) -> bool:
        """Whether ``node`` runs quantized: an op not kept float (inputs and outputs are not ops); an
        op that follows its input's qparams, where that input is quantized."""
        node = self._source(node)
        return node.op in ("call_module", "call_function", "call_method") and node not in float_nodes

    def _set(self, variant: Variant, changed: Iterable[str], points: Iterable[_Point]) -> None:
        """Switch the weights of the ``changed`` modules and the quantize ``points`` beside them (only
        those can differ from the last configuration)."""
        for name, wrapper in self._kernels.items():
            wrapper.active = name not in variant.float_modules
        for name in (name for name in changed if name in self._weights):
            module, quantized = self._weights[name]
            if name in variant.float_modules:
                module.get_weight = lambda w=module.weight: w
            elif name in variant.other_weights:
                other = self._other_weight(name)
                module.get_weight = lambda w=other: w
            else:
                module.get_weight = quantized
        float_nodes = {self._node_of[name] for name in variant.float_modules}
        dynamic = variant.dynamic - variant.float_modules
        dynamic_nodes = {self._node_of[name] for name in dynamic}
        # no static qparams around these; an op without weights read by dynamic modules alone runs float in FX
        feeding = {n for n, readers in self._readers.items() if n in self._loose and readers and readers <= dynamic_nodes}
        static = float_nodes | dynamic_nodes | feeding
        for name in variant.dynamic:
            self._dynamic_hook(name)
        self._dynamic_now = dynamic
        chosen = {index: (pair, qparams) for pair in variant.observers for index, qparams in self._overrides[pair].items()}
        index_of = {id(point): i for i, point in enumerate(self._points)}
        for point in points:
            # a dynamic module's output stays float: FX gives the ops reading it float inputs, except after an op
            # that follows it (a transpose) where a quantized op reads it: there FX quantizes each batch's range
            after_dynamic = self._source(point.producer) in dynamic_nodes
            read_quantized = any(self._is_quantized(c, static) for c in point.consumers)
            moving = after_dynamic and point.producer in self._follows and read_quantized
            enabled = moving or (not after_dynamic and (self._is_quantized(point.producer, static) or read_quantized))
            alternate = point.producer in float_nodes
            key, qparams = chosen.get(index_of[id(point)], (None, None))
            if point.state() != (enabled, alternate, key, moving):
                point.module.enabled, point.module.use_alternate, point.module.dynamic = enabled, alternate, moving
                point.module.reduce_range = self._reduce_range
                point.module.override_key, point.module.override = key, qparams
        self._state = variant

    def _other_weight(self, name: str) -> torch.Tensor:
        """The module's float weight quantized and dequantized as a real run with its scheme switched would."""
        if name not in self._other_weights:
            module = self._weights[name][0]
            observer = self._other_observers[name]().to(module.weight.device)  # torch makes its observers on the CPU
            with torch.no_grad():
                observer(module.weight.detach())
                self._other_weights[name] = _dequantized(module.weight.detach(), observer)
        return self._other_weights[name]

    def outputs_each(
        self,
        batches: Sequence[Any],
        variants: Sequence[Variant | Iterable[str]],
        step: Callable[[], None] | None = None,
        reduce: Reduce | None = None,
    ) -> list[list[Any]]:
        """``outputs(batches, v)`` for each ``v`` in ``variants``, computed per batch from one run of
        the starting configuration: each variant is computed from the first node it changes on,
        with the values that run holds there (see ``replay.py``). ``step()`` is called after each
        variant on each batch (a progress bar; raising stops the work)."""
        previous, variants = self._state, [Variant.of(v) for v in variants]
        self.prepare_observers(variants)  # one calibration for every observer they ask for
        found: list[list[Any]] = [[] for _ in variants]

        def configure(i: int | None) -> None:
            self.configure(() if i is None else variants[i])

        try:
            with torch.no_grad():
                if batches and self._replay.exact:
                    self.configure(())
                    self._replay.learn(batches[0])
                plans = [self._replay.plan(self._changed_by(v)) for v in variants] if self._replay.exact else []
                for index, batch in enumerate(batches if self._replay.exact else ()):
                    keep = None if reduce is None else functools.partial(reduce, index)
                    outputs = self._replay.outputs(batch, plans, configure, step, keep)
                    if not self._replay.exact:
                        break
                    for i, output in enumerate(outputs):
                        found[i].append(output)
        finally:
            self.configure(previous)
        if self._replay.exact:
            return found
        found = []  # an in-place op the replay cannot follow: whole forward passes instead
        for variant in variants:
            outputs = self.outputs(batches, variant)
            found.append(outputs if reduce is None else [reduce(i, output) for i, output in enumerate(outputs)])
            for _ in batches if step is not None else ():
                step()
        self.configure(previous)
        return found

    def _changed_by(self, variant: Variant) -> set[torch.fx.Node]:
        """The nodes that compute differently in ``variant`` than in the starting configuration."""
        previous = self._state
        self.configure(())
        before = [point.state() for point in self._points]
        self.configure(variant)
        seeds = {self._node_of[name] for name in variant.float_modules | variant.other_weights | variant.dynamic}
        seeds |= {point.node for point, state in zip(self._points, before, strict=True) if point.state() != state}
        self.configure(previous)
        return seeds

    def local_sqnr(self, batch: Any) -> dict[str, float]:
        """Each tunable module's own error: its quantized output (input quantized, weight quantized,
        output quantized where the starting configuration does so) against its float output, both
        computed from the inputs the float model gives it on ``batch``."""
        previous = self._state
        self.configure(self.tunable)
        for point in self._points:
            point.module.enabled = False
        before = {consumer: p for p in self._points for consumer in p.consumers}  # a module reads one point
        after = {p.producer: p for p in self._points}
        result: dict[str, float] = {}
        busy: set[str] = set()

        def measure(module: nn.Module, args: tuple, name: str) -> None:
            """On the float model's input to the module, as the forward pass reaches it (nothing is kept)."""
            if name in busy or not args or not isinstance(args[0], torch.Tensor):
                return
            busy.add(name)
            try:
                x, node = args[0].detach(), self._node_of[name]
                expected = module(x.clone())
                with self._quantized(name):
                    y = _through(after.get(node), module(_through(before.get(node), x.clone())))
                result[name] = sqnr_db(expected, y)
            finally:
                busy.discard(name)

        hooks = [
            self.model.get_submodule(name).register_forward_pre_hook(lambda module, args, name=name: measure(module, args, name))
            for name in self.tunable
        ]
        try:
            with torch.no_grad():
                call_with(self.model, batch)
        finally:
            for hook in hooks:
                hook.remove()
            self._set(previous, changed=set(self._weights), points=self._points)  # every point was switched off
        return result

    @contextlib.contextmanager
    def _quantized(self, name: str) -> Iterator[None]:
        """Module ``name`` computes as a quantized module (its quantized weight, or its real kernel)
        while kept float otherwise."""
        weighted, quantized = self._weights.get(name, (None, None))
        kernel = self._kernels.get(name)
        if weighted is not None:
            weighted.get_weight = quantized
        if kernel is not None:
            kernel.active = True
        try:
            yield
        finally:
            if weighted is not None:
                weighted.get_weight = lambda w=weighted.weight: w
            if kernel is not None:
                kernel.active = False


def _dequantized(weight: torch.Tensor, observer: nn.Module) -> torch.Tensor:
    """``weight`` quantized with the qparams ``observer`` computed from it, and dequantized."""
    scale, zero_point = observer.calculate_qparams()
    with torch_warnings_hidden():
        if observer.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine):
            quantized = torch.quantize_per_channel(weight, scale.double(), zero_point.long(), observer.ch_axis, observer.dtype)
        else:
            quantized = torch.quantize_per_tensor(weight, float(scale), int(zero_point), observer.dtype)
    return quantized.dequantize()


_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.modules.batchnorm._BatchNorm)


def _module_at(model: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    try:
        return model.get_submodule(str(node.target))
    except AttributeError:
        return None


def _same_qparams(a: QuantPoint, b: QuantPoint) -> bool:
    return bool(a.qparams[0] == b.qparams[0]) and a.qparams[2] == b.qparams[2]


def _through(point: _Point | None, x: torch.Tensor) -> torch.Tensor:
    if point is None:
        return x
    enabled, point.module.enabled = point.module.enabled, True
    try:
        return point.module(x)
    finally:
        point.module.enabled = enabled


def _followers(points: Sequence[_Point]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Ops that share their input's qparams (FX's shape ops: flatten, reshape, pooling; one quantize
    point before and one after, with the same scale and zero point) -> their input's producer. FX
    quantizes such an op only where its input is quantized: between two float modules it runs float."""
    before: dict[torch.fx.Node, list[_Point]] = {}
    for point in points:
        for consumer in point.consumers:
            before.setdefault(consumer, []).append(point)
    found = {}
    for point in points:
        node, inputs = point.producer, before.get(point.producer, [])
        if node.op in ("call_function", "call_method") and len(inputs) == 1:
            (scale, _, zero_point), (scale_in, _, zero_point_in) = point.module.qparams, inputs[0].module.qparams
            if bool(scale == scale_in) and zero_point == zero_point_in:
                found[node] = inputs[0].producer
    return found


def _insert_points(model: torch.fx.GraphModule) -> list[_Point]:
    """Replace each ``quantize_per_tensor`` whose users all dequantize by one QuantPoint call."""
    graph, points = model.graph, []
    container = nn.Module()
    model.add_module(SIMULATED, container)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.quantize_per_tensor:
            continue
        users = list(node.users)
        if not users or not all(u.op == "call_method" and u.target == "dequantize" for u in users):
            continue
        source, scale, zero_point, dtype = (*node.args, *([None] * 4))[:4]
        scale, zero_point = _constant(model, scale), _constant(model, zero_point)
        if not isinstance(source, torch.fx.Node) or scale is None or zero_point is None or dtype is None:
            continue
        name = f"p{len(points)}"
        module = QuantPoint(torch.as_tensor(scale), torch.as_tensor(zero_point), dtype)
        container.add_module(name, module)
        with graph.inserting_before(node):
            call = graph.call_module(f"{SIMULATED}.{name}", (source,))
        for user in users:
            user.replace_all_uses_with(call)
            graph.erase_node(user)
        graph.erase_node(node)
        points.append(_Point(module, call, source, list(call.users)))
    graph.eliminate_dead_code()
    model.recompile()
    return points


def _constant(model: torch.fx.GraphModule, value: Any) -> Any:
    if isinstance(value, torch.fx.Node) and value.op == "get_attr":
        return _attribute(model, str(value.target))
    return value


def _attribute(model: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


class _QuantizedWeight:
    """A reference module's quantized weight, kept as its integers (a quarter of the float weight's
    memory) and dequantized when a forward pass asks: what ``get_weight()`` computes, exactly."""

    def __init__(self, module: ReferenceQuantizedModule) -> None:
        expected = module.get_weight().detach()
        quantized = module.get_quantized_weight().detach()
        exact = quantized.is_quantized and torch.equal(quantized.dequantize(), expected)
        self._stored = quantized if exact else expected  # a layout dequantize() does not match: as floats

    def __call__(self) -> torch.Tensor:
        return self._stored.dequantize() if self._stored.is_quantized else self._stored


def _cache_weights(model: torch.fx.GraphModule) -> dict[str, tuple[nn.Module, _QuantizedWeight]]:
    """Each called reference module (a fused module's weighted first child) with its weight quantized once."""
    found = {}
    for node in model.graph.nodes:
        if node.op != "call_module" or str(node.target).startswith(SIMULATED):
            continue
        module = model.get_submodule(str(node.target))
        if isinstance(module, _FusedModule):
            module = module[0]
        if isinstance(module, ReferenceQuantizedModule):
            with torch.no_grad(), torch_warnings_hidden():  # quantized tensors are deprecated in torch
                found[str(node.target)] = (module, _QuantizedWeight(module))
    return found


def qparams_after_float(
    prepared: torch.fx.GraphModule, prepared_all_float: torch.fx.GraphModule, calibrate: Callable[[nn.Module], None]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The qparams FX puts after a module's output when that module runs float, where they differ
    from those after it in ``prepared``; keyed by the producing node's name. ``prepared_all_float``
    is the model prepared with the tunable modules float; it runs the calibration data only when an
    observer other than the module's own is needed.

    A float module's output is quantized by the observer its reader asks for, not by the module's
    own output observer: the input of a fixed-qparams op (Hardsigmoid, Sigmoid, Tanh, ...) gets that
    op's fixed output qparams (a squeeze-excitation gate whose conv stays float is then quantized to
    [0, 1) in steps of 1/256); the input of an op under another qconfig gets that qconfig's observer
    (x86: a PReLU's output observer uses 8 bits, the global one 7, so a float PReLU's output is
    quantized with twice the step). Keeping such a module float in the simulation does the same.
    """
    found: dict[str, nn.Module] = {
        name: observer
        for name, observer in _observers_after(prepared_all_float)
        if isinstance(observer, (FixedQParamsObserver, FixedQParamsFakeQuantize))
    }
    attributes = prepared.meta.get("_observed_graph_module_attrs")
    qconfigs = getattr(attributes, "node_name_to_qconfig", None) or {}
    modules = {n.name: str(n.target) for n in prepared_all_float.graph.nodes if n.op == "call_module"}
    other: dict[str, nn.Module] = {}
    for node in prepared.graph.nodes:
        observer = _observer_at(prepared, node)
        if observer is None or node.args[0].name in found or node.args[0].name not in modules:
            continue
        qconfig = next((qconfigs.get(user.name) for user in node.users if qconfigs.get(user.name) is not None), None)
        if qconfig is not None and qconfig.activation is not None:
            theirs = qconfig.activation().to(model_device(prepared_all_float))  # made on the CPU by torch
            if _computes_qparams(theirs) and _recipe(theirs) != _recipe(observer):
                other[node.args[0].name] = theirs
    if other:

        def observe(name: str) -> Callable[..., None]:
            def hook(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
                other[name](output.detach())

            return hook

        hooks = [prepared_all_float.get_submodule(modules[name]).register_forward_hook(observe(name)) for name in other]
        try:
            calibrate(prepared_all_float)
        finally:
            for hook in hooks:
                hook.remove()
        found.update(other)
    return {
        name: (torch.as_tensor(scale).float().reshape(()), torch.as_tensor(zero_point).reshape(()).to(torch.int32))
        for name, (scale, zero_point) in ((name, observer.calculate_qparams()) for name, observer in found.items())
    }


def _observer_at(prepared: torch.fx.GraphModule, node: torch.fx.Node) -> nn.Module | None:
    """The activation observer ``node`` calls, if it calls one on another node's value."""
    if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    module = prepared.get_submodule(str(node.target))
    return module if isinstance(module, (ObserverBase, FakeQuantizeBase)) else None


def _observers_after(prepared: torch.fx.GraphModule) -> Iterator[tuple[str, nn.Module]]:
    """(the name of the node it observes, the activation observer) for each observer in the graph."""
    for node in prepared.graph.nodes:
        observer = _observer_at(prepared, node)
        if observer is not None:
            yield node.args[0].name, observer


def _computes_qparams(observer: nn.Module) -> bool:
    """Whether the observer gives static integer qparams of its own (not one that reuses its input's,
    marks a dynamic or float value, or observes nothing)."""
    if isinstance(observer, (ReuseInputObserver, PlaceholderObserver, NoopObserver)):
        return False
    return getattr(observer, "dtype", None) in (torch.quint8, torch.qint8, torch.uint8, torch.int8)


def _recipe(observer: nn.Module) -> tuple[Any, ...]:
    """What decides an observer's qparams besides the values it sees."""
    fields = ("dtype", "qscheme", "quant_min", "quant_max", "reduce_range", "bins", "eps", "averaging_constant")
    return (type(observer), *(repr(getattr(observer, field, None)) for field in fields))
