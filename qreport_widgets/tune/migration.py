"""Outlier channels, and moving their scale from the activation into the next layer's weights.

A few channels of an activation with a range many times that of the others (as LayerNorm outputs
in transformers have) leave per-tensor activation quantization a few levels for all the rest.
Dividing those channels by ``s`` where they are produced (a LayerNorm's or BatchNorm's affine
parameters, a Linear's or Conv's output rows) and multiplying the matching input columns of the
Linear or Conv that reads them by ``s`` leaves the float model's output as it was, and the
activation's range with it (the SmoothQuant idea, for the channels that need it). It is applied to
a copy of the float model before quantization, checked to be exact in float, and written out as
code to paste.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.fx
from torch import nn

from ..core.calibration import call_with
from ..core.metrics import output_tensor
from ..engines.settings import ModuleSettings
from ..errors import InvalidSettingsError

if TYPE_CHECKING:
    from ..observe.frame import ReportFrame
    from .runner import Runner

OUTLIER_RATIO = 6.0  # a channel whose range is this many times the median channel's is an outlier
EXACT = 1e-5  # relative output error a migrated float model may show (float rounding)
_PRODUCERS = (nn.LayerNorm, nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONSUMERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class Migration:
    """Divide ``channels`` of ``producer``'s output by ``scales``; multiply ``consumer``'s matching input columns."""

    producer: str
    consumer: str
    channels: tuple[int, ...]
    scales: tuple[float, ...]
    typical_range: float  # the median channel's range at the consumer's input
    largest_range: float

    @property
    def summary(self) -> str:
        return (
            f"{len(self.channels)} input channel(s) of {self.consumer} reach {self.largest_range:.3g}, "
            f"{self.largest_range / self.typical_range:.0f}x the typical channel ({self.typical_range:.3g}); "
            f"scale moved into its weights from {self.producer}"
        )

    def apply(self, model: nn.Module) -> None:
        """Change ``model`` in place (pass a copy)."""
        producer, consumer = model.get_submodule(self.producer), model.get_submodule(self.consumer)
        device = consumer.weight.device
        index = torch.tensor(self.channels, dtype=torch.long, device=device)
        scale = torch.tensor(self.scales, dtype=torch.float32, device=device)
        with torch.no_grad():
            for name in ("weight", "bias"):
                tensor = getattr(producer, name, None)
                if tensor is not None:
                    shape = (-1,) + (1,) * (tensor.dim() - 1)
                    tensor[index] /= scale.reshape(shape).to(tensor.dtype)
            weight = consumer.weight
            shape = (1, -1) + (1,) * (weight.dim() - 2)
            weight[:, index] *= scale.reshape(shape).to(weight.dtype)

    def as_code(self, model_name: str = "model") -> str:
        channels = list(self.channels)
        scales = ", ".join(repr(s) for s in self.scales)
        producer, consumer = f"{model_name}.get_submodule({self.producer!r})", f"{model_name}.get_submodule({self.consumer!r})"
        lines = [
            f"# {self.summary}",
            "with torch.no_grad():",
            f"    producer, consumer = {producer}, {consumer}",
            f"    channels = torch.tensor({channels}, device=consumer.weight.device)",
            f"    scale = torch.tensor([{scales}], device=consumer.weight.device)",
            "    for tensor in (producer.weight, producer.bias):",
            "        if tensor is not None:",
            "            tensor[channels] /= scale.reshape((-1,) + (1,) * (tensor.dim() - 1))",
            "    consumer.weight[:, channels] *= scale.reshape((1, -1) + (1,) * (consumer.weight.dim() - 2))",
        ]
        return "\n".join(lines) + "\n"


def find_migrations(
    model: nn.Module,
    batches: Sequence[Any],
    consumers: Iterable[str],
    ratio: float = OUTLIER_RATIO,
    known_ranges: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Migration]:
    """Consumer name -> the migration for its outlier input channels, for every Linear / Conv in
    ``consumers`` that reads one producer's output alone, measured on ``batches``; each checked
    to leave the float output as it was (within ``EXACT``) on the first batch. ``known_ranges``
    (consumer -> max |x| per input channel, as the analysis observed them) saves a pass over the
    batches for the consumers it has."""
    producers = _direct_producers(model, consumers)
    if not producers:
        return {}
    known = {name: span for name, span in (known_ranges or {}).items() if name in producers}
    missing = [name for name in producers if name not in known]
    ranges = {**known, **(_input_channel_ranges(model, batches, missing) if missing else {})}
    found = {}
    for consumer, producer in producers.items():
        span = ranges.get(consumer)
        if span is None or span.numel() < 8:
            continue
        typical = float(span.median())
        outliers = torch.nonzero(span > ratio * typical).flatten()
        if typical <= 0 or not len(outliers):
            continue
        scales = [round(float(s), 3) for s in span[outliers] / typical]  # short enough to paste exactly
        migration = Migration(producer, consumer, tuple(outliers.tolist()), tuple(scales), typical, float(span.max()))
        if float_error(model, [migration], batches[0]) <= EXACT:
            found[consumer] = migration
    return found


def observed_input_ranges(frame: ReportFrame) -> dict[str, torch.Tensor]:
    """Module -> max |x| per input channel (a Linear's last dimension, a Conv's dim 1), from the
    report's per-channel input minima and maxima (the equalization detector's), where it has them."""
    found = {}
    wanted = ("input_activation_per_channel_min", "input_activation_per_channel_max")
    for module in frame.module_names:
        channel_features, _ = frame.features_of(module)
        if not all(feature in channel_features for feature in wanted):
            continue
        low, high = (frame.channel_values(module, feature) for feature in wanted)
        span = np.maximum(np.abs(low), np.abs(high))
        if len(span) and np.isfinite(span).all():
            found[module] = torch.from_numpy(span).float()
    return found


def migrated(model: nn.Module, migrations: Iterable[Migration]) -> nn.Module:
    """A copy of ``model`` with ``migrations`` applied (``model`` itself is not changed)."""
    copied = copy.deepcopy(model)
    for migration in migrations:
        migration.apply(copied)
    return copied


def float_error(model: nn.Module, migrations: Iterable[Migration], batch: Any) -> float:
    """Relative change of ``model``'s output on ``batch`` when ``migrations`` are applied."""
    with torch.no_grad():
        expected = output_tensor(call_with(model, batch))
        found = output_tensor(call_with(migrated(model, migrations), batch))
    return float((found - expected).norm() / expected.norm().clamp_min(1e-12))


def _direct_producers(model: nn.Module, consumers: Iterable[str]) -> dict[str, str]:
    """Consumer -> the module whose output is its first input and nothing else's (in the traced graph)."""
    found = {}
    for consumer, producer in input_producers(model, consumers, alone=True).items():
        module, source = model.get_submodule(consumer), model.get_submodule(producer)
        if not isinstance(module, _CONSUMERS) or getattr(module, "groups", 1) != 1:
            continue
        if isinstance(source, _PRODUCERS) and (not isinstance(source, nn.LayerNorm) or source.weight is not None):
            found[consumer] = producer
    return found


def input_producers(model: nn.Module, consumers: Iterable[str], alone: bool = False) -> dict[str, str]:
    """Module -> the module that produces its first input (in the graph ``torch.fx`` traces), where
    that is a module call; with ``alone``, only where nothing else reads that output."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # an untraceable model: nothing found (FX would not quantize it either)
        return {}
    wanted, found = set(consumers), {}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in wanted or not node.args:
            continue
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and source.op == "call_module" and (not alone or len(source.users) == 1):
            found[str(node.target)] = str(source.target)
    return found


def _input_channel_ranges(model: nn.Module, batches: Sequence[Any], consumers: list[str]) -> dict[str, torch.Tensor]:
    """Per input channel max |x| of each consumer (channels: last dim of a Linear's input, dim 1 of a Conv's)."""
    ranges: dict[str, torch.Tensor] = {}

    def hook(name: str, linear: bool):
        def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            x = x.reshape(-1, x.shape[-1]) if linear else x.transpose(0, 1).reshape(x.shape[1], -1).T
            peak = x.abs().amax(dim=0).float()
            ranges[name] = torch.maximum(ranges[name], peak) if name in ranges else peak

        return record

    handles = [
        model.get_submodule(name).register_forward_pre_hook(hook(name, isinstance(model.get_submodule(name), nn.Linear)))
        for name in consumers
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                call_with(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


class Migrations:
    """The outlier-channel migrations ``runner``'s float model allows (``ModuleSettings.migrate``),
    found once on the calibration data, from the input ranges an analysis observed where it has
    them (``known_ranges``: module -> max |x| per input channel); each is exact in float (checked)."""

    def __init__(self, runner: Runner, known_ranges: Mapping[str, torch.Tensor] | None = None) -> None:
        self.runner = runner
        self._known = dict(known_ranges or {})
        self._found: dict[str, Migration] | None = None

    @property
    def known_ranges(self) -> dict[str, torch.Tensor]:
        """The input ranges given (module -> max |x| per input channel), read instead of a pass."""
        return dict(self._known)

    def found(self) -> dict[str, Migration]:
        """Module -> the migration its input allows."""
        if self._found is None:
            runner = self.runner
            batches = runner.batches.for_searching()
            consumers = [m.fqn for m in runner.modules]
            found = find_migrations(runner.float_model, batches, consumers, known_ranges=self._known) if batches else {}
            self._found = found
        return dict(self._found)

    def for_settings(self, settings: Mapping[str, ModuleSettings]) -> list[Migration]:
        """The migrations ``settings`` ask for; InvalidSettingsError naming the modules that have none."""
        wanted = [fqn for fqn, choice in settings.items() if choice.migrate and not choice.keep_float]
        if not wanted:
            return []
        found = self.found()
        missing = [fqn for fqn in wanted if fqn not in found]
        if missing:
            raise InvalidSettingsError(
                f"{', '.join(missing)}: no outlier input channels to migrate (or no exact migration: its input "
                "must come from one LayerNorm / BatchNorm / Linear / Conv that nothing else reads)"
            )
        return [found[fqn] for fqn in wanted]

    def model_for(self, settings: Mapping[str, ModuleSettings]) -> nn.Module | None:
        """The float model with the migrations ``settings`` ask for applied (a copy), or None for none."""
        moves = self.for_settings(settings)
        return migrated(self.runner.float_model, moves) if moves else None

    def as_code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """The migrations ``settings`` ask for as Python to run on the float model before prepare."""
        return "".join(m.as_code() for m in self.for_settings(settings))
