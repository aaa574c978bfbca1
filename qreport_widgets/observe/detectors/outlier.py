"""OutlierDetector: channels whose maximum sits far above a high reference percentile."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...core import features as F
from ...core.features import DetectorName, Side, Stat, SuggestionKind
from ..graph import ModelGraph
from ..observer import estimate_bounds
from .base import DetectorBase, DetectorResult, ObservationRequest, ReportContext, Suggestion, check_axis, check_range

DEFAULT_HISTOGRAM_BINS = 128


@dataclass(frozen=True)
class OutlierRecord:
    module_fqn: str
    ch_axis: int
    reference_percentile: float
    ratio_threshold: float
    fraction_threshold: float
    total_batches: int
    ratios: np.ndarray  # mean over batches of max / reference percentile, folded to >= 1
    batches_used: np.ndarray
    constant_counts: np.ndarray
    max_vals: np.ndarray
    histogram: np.ndarray  # counts of the input values (a strided sample of each batch); may be empty
    histogram_edges: np.ndarray

    @property
    def outliers(self) -> np.ndarray:
        return self.ratios > self.ratio_threshold

    @property
    def sufficient_batches(self) -> np.ndarray:
        if self.total_batches == 0:
            return np.zeros(self.batches_used.shape, dtype=bool)
        return self.batches_used / self.total_batches >= self.fraction_threshold

    def columns(self) -> dict[str, object]:
        return {
            F.OUTLIER_CHANNEL_AXIS: self.ch_axis,
            F.OUTLIER_REFERENCE_PERCENTILE: self.reference_percentile,
            F.OUTLIER_RATIO_THRESHOLD: self.ratio_threshold,
            F.OUTLIER_RATIOS: self.ratios.astype(np.float32),
            F.OUTLIER_BATCHES_USED: self.batches_used.astype(np.int64),
            F.OUTLIERS_DETECTED: self.outliers,
            F.OUTLIER_SUFFICIENT_BATCHES: self.sufficient_batches,
            F.CONSTANT_BATCH_COUNTS: self.constant_counts.astype(np.int64),
            F.INPUT_PER_CHANNEL_MAX: self.max_vals.astype(np.float32),
        }


class OutlierDetector(DetectorBase):
    """Flags input channels whose mean per-batch ratio max / ``reference_percentile`` exceeds
    ``ratio_threshold``: a few large values that stretch the quantization range.

    Args:
        ratio_threshold: >= 1; 3.5 matches a normal distribution's tail at the default reference.
        reference_percentile: in (0, 1).
        fraction_batches_used_threshold: in [0, 1]; a channel counted in fewer batches than this
            fraction (all-zero batches are skipped) is marked as having insufficient data.
        ch_axis: None picks the channel axis per layer (Conv and norms: 1, Linear: last dim,
            element-wise layers: that of the layer feeding them).
        histogram_bins: bins of the recorded activation histogram (0 turns it off).
    """

    name = DetectorName.OUTLIER.value

    def __init__(
        self,
        ratio_threshold: float = 3.5,
        reference_percentile: float = 0.975,
        fraction_batches_used_threshold: float = 0.95,
        ch_axis: int | None = None,
        histogram_bins: int = DEFAULT_HISTOGRAM_BINS,
    ) -> None:
        self.ratio_threshold = check_range("ratio_threshold", ratio_threshold, 1.0, float("inf"), low_open=False)
        self.reference_percentile = check_range("reference_percentile", reference_percentile, 0.0, 1.0)
        self.fraction_batches_used_threshold = check_range(
            "fraction_batches_used_threshold", fraction_batches_used_threshold, 0.0, 1.0, low_open=False, high_open=False
        )
        self.ch_axis = check_axis(ch_axis)
        if histogram_bins < 0 or histogram_bins % 2:
            raise ValueError(f"histogram_bins must be 0 or a positive even number, got {histogram_bins}")
        self.histogram_bins = histogram_bins

    def requests(self, graph: ModelGraph) -> list[ObservationRequest]:
        stats = {Stat.PERCENTILE, Stat.CHANNEL_MINMAX} | ({Stat.HISTOGRAM} if self.histogram_bins else set())
        return [
            ObservationRequest(fqn, Side.INPUT, frozenset(stats), self.reference_percentile, self.ch_axis, self.histogram_bins)
            for fqn in graph.units
        ]

    def analyze(self, context: ReportContext) -> DetectorResult:
        records, notes, suggestions = [], [], []
        estimated: list[tuple[int, int]] = []
        for fqn in context.graph.units:
            seen = context.observed(fqn, Side.INPUT, self.ch_axis)
            if seen is None:
                continue
            if seen.estimated_from is not None:
                estimated.append(seen.estimated_from)
            ratios, used = seen.percentile_ratio(self.reference_percentile)
            record = OutlierRecord(
                fqn,
                seen.ch_axis,
                self.reference_percentile,
                self.ratio_threshold,
                self.fraction_batches_used_threshold,
                seen.batches,
                _fold(ratios),
                used,
                seen.constant_counts(),
                seen.channel_max(),
                *seen.histogram(),
            )
            records.append(record)
            if seen.batches == 0:
                notes.append(context.warn(fqn, "no calibration batch reached this layer; outlier statistics are empty"))
                continue
            if np.isnan(record.ratios).any() or not np.isfinite(record.max_vals).all():
                notes.append(context.warn(fqn, "input holds NaN or infinite values; affected channels are NaN"))
            constant = int((record.constant_counts > 0).sum())
            if constant:
                notes.append(f"{fqn}: {constant} channel(s) were constant in at least one batch")
            flagged = record.outliers & record.sufficient_batches
            if flagged.any():
                worst = float(np.nanmax(np.where(flagged, record.ratios, np.nan)))
                percentile = f"p{self.reference_percentile * 100:g}"
                reason = f"{int(flagged.sum())}/{flagged.size} input channels have outliers (max/{percentile} up to {worst:.3g})"
                suggestions.append(Suggestion(fqn, self.name, SuggestionKind.OUTLIERS, reason, worst))
        if estimated:
            notes.append(estimate_note(self.reference_percentile, estimated, len(records)))
        return DetectorResult(self.name, tuple(records), tuple(notes), tuple(suggestions))


def estimate_note(q: float, estimated: list[tuple[int, int]], observed: int) -> str:
    """What an estimated reference percentile means, in one sentence."""
    sample, most = min(s for s, _ in estimated), max(n for _, n in estimated)
    low, high = estimate_bounds(q, sample)
    return (
        f"p{q * 100:g} estimated on {len(estimated)} of {observed} inputs, from an evenly spread sample of "
        f"{sample:,} or more of up to {most:,} values a channel and batch: within the p{low * 100:.1f}-p{high * 100:.1f} "
        "(3 standard errors); analyze(..., exact_percentiles=True) computes it exactly"
    )

    def describe(self, result: DetectorResult) -> str:
        lines = ["Outlier detection:"]
        for record in result.records:
            channels = np.flatnonzero(record.outliers)
            if channels.size == 0:
                continue
            shown = ", ".join(f"{c} (max {record.max_vals[c]:.4g})" for c in channels[:8])
            more = f" and {channels.size - 8} more" if channels.size > 8 else ""
            lines.append(f"  {record.module_fqn} (axis {record.ch_axis}): outlier channels {shown}{more}")
        if len(lines) == 1:
            lines.append("  No outliers found in the observed activations.")
        else:
            lines.append("  Outlier detection is reliable for stationary inputs; check the dynamic vs. static report.")
        return "\n".join(lines + [f"  note: {n}" for n in result.notes]) + "\n"


def _fold(ratios: np.ndarray) -> np.ndarray:
    """Ratios as distance from 1 on a log scale: |r|, inverted when below 1 (0 stays 0)."""
    magnitude = np.abs(ratios)
    with np.errstate(divide="ignore"):
        return np.where((magnitude < 1) & (magnitude > 0), 1.0 / magnitude, magnitude).astype(ratios.dtype)
