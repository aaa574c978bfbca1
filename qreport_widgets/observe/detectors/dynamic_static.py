"""DynamicStaticDetector: is a layer's activation range stable enough for static quantization?"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import nn

from ...core import features as F
from ...core.features import NON_STATIONARY, STATIONARY, UNDETERMINED, DetectorName, Side, Stat, SuggestionKind
from ..graph import ModelGraph
from .base import DetectorBase, DetectorResult, ObservationRequest, ReportContext, Suggestion, check_range, weighted_units

_OBSERVED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class DynamicStaticRecord:
    module_fqn: str
    tolerance: float
    input_stat: float  # average batch range / range over all batches, NaN when undefined
    output_stat: float
    input_range_std: float  # spread of the per-batch range, NaN with fewer than 2 batches
    output_range_std: float
    dynamic_supported: bool
    batches: int

    @property
    def dynamic_recommended(self) -> bool:
        return self.output_stat <= self.tolerance  # False for NaN

    @property
    def input_classification(self) -> str:
        return _classify(self.input_stat, self.tolerance)

    @property
    def output_classification(self) -> str:
        return _classify(self.output_stat, self.tolerance)

    def columns(self) -> dict[str, object]:
        return {
            F.TOLERANCE: self.tolerance,
            F.DYNAMIC_RECOMMENDED: np.bool_(self.dynamic_recommended),
            F.INPUT_COMP_STAT: np.float32(self.input_stat),
            F.INPUT_DATA_CLASSIFICATION: self.input_classification,
            F.OUTPUT_COMP_STAT: np.float32(self.output_stat),
            F.OUTPUT_DATA_CLASSIFICATION: self.output_classification,
            F.DYNAMIC_SUPPORTED: self.dynamic_supported,
        }


def _classify(stat: float, tolerance: float) -> str:
    if math.isnan(stat):
        return UNDETERMINED
    return STATIONARY if stat > tolerance else NON_STATIONARY


class DynamicStaticDetector(DetectorBase):
    """Recommends dynamic activation quantization where the output range moves between batches.

    The statistic is S = mean(per-batch range) / range over all batches; S <= ``tolerance`` means
    the distribution is non-stationary and a static range would waste resolution.
    """

    name = DetectorName.DYNAMIC_STATIC.value
    affects_qconfig = True

    def __init__(self, tolerance: float = 0.5) -> None:
        self.tolerance = check_range("tolerance", tolerance, 0.0, 1.0, high_open=False)

    def requests(self, graph: ModelGraph) -> list[ObservationRequest]:
        wanted = frozenset({Stat.RANGE})
        return [
            ObservationRequest(u.fqn, side, wanted)
            for u in weighted_units(graph, _OBSERVED_TYPES)
            for side in (Side.INPUT, Side.OUTPUT)
        ]

    def analyze(self, context: ReportContext) -> DetectorResult:
        records, notes, suggestions = [], [], []
        for unit in weighted_units(context.graph, _OBSERVED_TYPES):
            seen_in, seen_out = context.observed(unit.fqn, Side.INPUT), context.observed(unit.fqn, Side.OUTPUT)
            if seen_in is None or seen_out is None:
                continue
            record = DynamicStaticRecord(
                unit.fqn,
                self.tolerance,
                seen_in.range_ratio(),
                seen_out.range_ratio(),
                seen_in.batch_range_std(),
                seen_out.batch_range_std(),
                unit.is_linear,
                min(seen_in.batches, seen_out.batches),
            )
            records.append(record)
            if record.batches == 0:
                notes.append(context.warn(unit.fqn, "no calibration batch reached this layer; its statistics are NaN"))
            else:
                for side, stat in (("input", record.input_stat), ("output", record.output_stat)):
                    if math.isnan(stat):
                        notes.append(context.warn(unit.fqn, f"{side} range is zero or not finite; its statistic is NaN"))
            if record.dynamic_recommended:
                reason = f"output range is non-stationary (S={record.output_stat:.3f} <= {self.tolerance})"
                if record.dynamic_supported:
                    suggestions.append(Suggestion(unit.fqn, self.name, SuggestionKind.DYNAMIC, reason, record.output_stat))
                else:
                    notes.append(f"{unit.fqn}: {reason}, but FX has no dynamic quantization for {unit.type_name}")
        return DetectorResult(self.name, tuple(records), tuple(notes), tuple(suggestions))

    def describe(self, result: DetectorResult) -> str:
        lines = ["Dynamic vs. static activation quantization:"]
        for r in result.records:
            choice = "dynamic" if r.dynamic_recommended and r.dynamic_supported else "static"
            lines.append(
                f"  {r.module_fqn}: {choice} (input {r.input_classification}, S={r.input_stat:.3f}; "
                f"output {r.output_classification}, S={r.output_stat:.3f}; tolerance {r.tolerance})"
            )
        if not result.records:
            lines.append("  No Linear or Conv layer was observed.")
        return "\n".join(lines + [f"  note: {n}" for n in result.notes]) + "\n"
