"""InputWeightEqualizationDetector: layers whose input channels and weights are badly balanced."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.ao.nn.qat as nnqat
from torch import nn

from ...core import features as F
from ...core.features import EQUALIZATION_MODULE_FRACTION, DetectorName, Side, Stat, SuggestionKind
from ..graph import ModelGraph, Unit
from .base import (
    DetectorBase,
    DetectorResult,
    ObservationRequest,
    ReportContext,
    Suggestion,
    check_axis,
    check_range,
    weighted_units,
)

_SUPPORTED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nnqat.Linear, nnqat.Conv1d, nnqat.Conv2d, nnqat.Conv3d)


@dataclass(frozen=True)
class EqualizationRecord:
    module_fqn: str
    threshold: float
    ch_axis: int
    input_min: np.ndarray  # per input channel
    input_max: np.ndarray
    weight_min: np.ndarray  # per input channel, over the output channels that read it
    weight_max: np.ndarray
    comparison: np.ndarray  # s_c = sqrt(w_c / W) / sqrt(i_c / I), NaN where undefined
    applicable: bool = True  # False where torch's FX equalization cannot equalize this layer

    @property
    def channel_recommended(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return (self.comparison < self.threshold) | (self.comparison > 1.0 / self.threshold)

    @property
    def recommended(self) -> bool:
        flags = self.channel_recommended
        return bool(flags.size) and flags.mean() >= EQUALIZATION_MODULE_FRACTION

    def columns(self) -> dict[str, object]:
        f32 = np.float32
        return {
            F.EQUALIZATION_RECOMMENDED: self.channel_recommended,
            F.EQUALIZATION_COMP_METRICS: self.comparison.astype(f32),
            F.EQUALIZATION_THRESHOLD: self.threshold,
            F.EQUALIZATION_CHANNEL_AXIS: self.ch_axis,
            F.INPUT_PER_CHANNEL_MAX: self.input_max.astype(f32),
            F.INPUT_PER_CHANNEL_MIN: self.input_min.astype(f32),
            F.INPUT_GLOBAL_MAX: f32(np.max(self.input_max, initial=-np.inf)),
            F.INPUT_GLOBAL_MIN: f32(np.min(self.input_min, initial=np.inf)),
            F.WEIGHT_PER_CHANNEL_MAX: self.weight_max.astype(f32),
            F.WEIGHT_PER_CHANNEL_MIN: self.weight_min.astype(f32),
            F.WEIGHT_GLOBAL_MAX: f32(self.weight_max.max()),
            F.WEIGHT_GLOBAL_MIN: f32(self.weight_min.min()),
        }


class InputWeightEqualizationDetector(DetectorBase):
    """Recommends input-weight equalization where s_c = sqrt(w_c/W) / sqrt(i_c/I) is far from 1.

    ``w_c`` / ``i_c`` are the weight and input ranges of input channel ``c``, ``W`` / ``I`` the
    ranges over all channels. A channel favours equalization when s_c < ``ratio_threshold`` or
    s_c > 1 / ``ratio_threshold`` (its input and weight are out of balance); a module is
    recommended when at least 40% of its channels favour it.

    PyTorch's detector marks the channels *inside* that band instead, so it recommends
    equalization exactly where it cannot help; the per-channel flags here are its complement.

    Args:
        ratio_threshold: in (0, 1).
        ch_axis: input channel axis; None picks it per layer (Conv: 1, Linear: last dimension).
    """

    name = DetectorName.EQUALIZATION.value
    affects_qconfig = True

    def __init__(self, ratio_threshold: float, ch_axis: int | None = None) -> None:
        self.ratio_threshold = check_range("ratio_threshold", ratio_threshold, 0.0, 1.0)
        self.ch_axis = check_axis(ch_axis)

    def _units(self, graph: ModelGraph) -> list[Unit]:
        return weighted_units(graph, _SUPPORTED_TYPES, exact=True)

    def requests(self, graph: ModelGraph) -> list[ObservationRequest]:
        wanted = frozenset({Stat.CHANNEL_MINMAX})
        return [ObservationRequest(u.fqn, Side.INPUT, wanted, ch_axis=self.ch_axis) for u in self._units(graph)]

    def analyze(self, context: ReportContext) -> DetectorResult:
        records, notes, suggestions = [], [], []
        for unit in self._units(context.graph):
            seen = context.observed(unit.fqn, Side.INPUT, self.ch_axis)
            if seen is None:
                continue
            input_min, input_max = seen.channel_min(), seen.channel_max()
            weight_min, weight_max = _weight_ranges(unit)
            comparison, problem = _comparison(input_min, input_max, weight_min, weight_max)
            if seen.batches == 0:
                problem = "no calibration batch reached this layer"
            if problem:
                notes.append(context.warn(unit.fqn, f"{problem}; equalization metrics are NaN"))
            # torch's equalization observes dim 1 of a Linear's input, so it only works on 2-D inputs
            ndim = seen.observer.observed_ndim or 2
            applicable = not (unit.is_linear and ndim > 2)
            record = EqualizationRecord(
                unit.fqn, self.ratio_threshold, seen.ch_axis, input_min, input_max, weight_min, weight_max, comparison, applicable
            )
            records.append(record)
            if not record.recommended:
                continue
            flagged = int(record.channel_recommended.sum())
            reason = f"{flagged}/{comparison.size} input channels are out of balance with their weights"
            if applicable:
                suggestions.append(
                    Suggestion(unit.fqn, self.name, SuggestionKind.EQUALIZATION, reason, flagged / comparison.size)
                )
            else:
                notes.append(
                    f"{unit.fqn}: {reason}, but torch's input-weight equalization reads dim 1 of a Linear's input "
                    f"and cannot equalize this {ndim}-D input; per-channel weights or keeping the layer in float "
                    "are the options here"
                )
        return DetectorResult(self.name, tuple(records), tuple(notes), tuple(suggestions))

    def describe(self, result: DetectorResult) -> str:
        lines = ["Input-weight equalization:"]
        for r in result.records:
            flagged, total = int(r.channel_recommended.sum()), r.comparison.size
            verdict = ("use" if r.applicable else "cannot apply (torch needs a 2-D input)") if r.recommended else "skip"
            lines.append(
                f"  {r.module_fqn} (axis {r.ch_axis}): {verdict} equalization, {flagged}/{total} channels out of balance"
            )
        if not result.records:
            lines.append("  No Linear or Conv layer was observed.")
        return "\n".join(lines + [f"  note: {n}" for n in result.notes]) + "\n"


def _weight_ranges(unit: Unit) -> tuple[np.ndarray, np.ndarray]:
    """Weight min / max per *input* channel; a grouped conv's channel only sees its group's filters."""
    weight = unit.weight.detach().float().cpu()
    groups = getattr(unit.base, "groups", 1)
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    # reduced in the weight's own layout: a channel-major copy of a 32,000-row weight costs 6x the reduction
    grouped = weight.reshape(groups, out_channels // groups, in_per_group, -1)
    low, high = grouped.amin(dim=(1, 3)).reshape(-1), grouped.amax(dim=(1, 3)).reshape(-1)
    return low.numpy(), high.numpy()


def _comparison(input_min, input_max, weight_min, weight_max) -> tuple[np.ndarray, str]:
    if input_min.shape != weight_min.shape:
        nan = np.full(weight_min.shape, np.nan, dtype=np.float32)
        return nan, f"input has {input_min.size} channels on the observed axis but the weight expects {weight_min.size}"
    with np.errstate(divide="ignore", invalid="ignore"):
        input_ratio = (input_max - input_min) / (input_max.max() - input_min.min())
        weight_ratio = (weight_max - weight_min) / (weight_max.max() - weight_min.min())
        comparison = np.sqrt(weight_ratio) / np.sqrt(input_ratio)
    comparison = np.where(np.isfinite(comparison), comparison, np.nan).astype(np.float32)
    problem = ""
    if not np.isfinite(comparison).all():
        problem = "some channels have a zero or non-finite input or weight range"
    return comparison, problem
