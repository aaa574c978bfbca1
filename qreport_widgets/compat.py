"""The one adapter from typed records to PyTorch's per-module report dictionaries.

Value types follow PyTorch's so existing code keeps working: per-channel values are 1-D tensors,
per-layer statistics 0-d tensors, per-channel flags lists of bools.
"""

from __future__ import annotations

from functools import singledispatch
from typing import Any

import numpy as np
import torch

from . import features as F
from .detectors.dynamic_static import DynamicStaticRecord
from .detectors.equalization import EqualizationRecord
from .detectors.outlier import OutlierRecord
from .detectors.per_channel import PerChannelRecord


@singledispatch
def to_upstream(record: Any) -> dict[str, Any]:
    """PyTorch-shaped dictionary of one record; register more record types with ``.register``."""
    raise TypeError(f"no PyTorch-shaped form for {type(record).__name__}; override DetectorBase.upstream_dict")


def _tensor(values: np.ndarray | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values), dtype=dtype)


@to_upstream.register
def _(record: PerChannelRecord) -> dict[str, Any]:
    return {F.PER_CHANNEL_SUPPORTED: record.supported, F.PER_CHANNEL_USED: record.used, F.BACKEND: record.backend}


@to_upstream.register
def _(record: DynamicStaticRecord) -> dict[str, Any]:
    return {
        F.TOLERANCE: record.tolerance,
        F.DYNAMIC_RECOMMENDED: torch.tensor(record.dynamic_recommended),
        F.INPUT_COMP_STAT: _tensor(record.input_stat),
        F.INPUT_DATA_CLASSIFICATION: record.input_classification,
        F.OUTPUT_COMP_STAT: _tensor(record.output_stat),
        F.OUTPUT_DATA_CLASSIFICATION: record.output_classification,
        F.DYNAMIC_SUPPORTED: record.dynamic_supported,
    }


@to_upstream.register
def _(record: EqualizationRecord) -> dict[str, Any]:
    return {
        F.EQUALIZATION_RECOMMENDED: record.channel_recommended.tolist(),
        F.EQUALIZATION_COMP_METRICS: _tensor(record.comparison),
        F.EQUALIZATION_THRESHOLD: record.threshold,
        F.EQUALIZATION_CHANNEL_AXIS: record.ch_axis,
        F.INPUT_PER_CHANNEL_MAX: _tensor(record.input_max),
        F.INPUT_PER_CHANNEL_MIN: _tensor(record.input_min),
        F.INPUT_GLOBAL_MAX: _tensor(np.max(record.input_max, initial=-np.inf)),
        F.INPUT_GLOBAL_MIN: _tensor(np.min(record.input_min, initial=np.inf)),
        F.WEIGHT_PER_CHANNEL_MAX: _tensor(record.weight_max),
        F.WEIGHT_PER_CHANNEL_MIN: _tensor(record.weight_min),
        F.WEIGHT_GLOBAL_MAX: _tensor(record.weight_max.max()),
        F.WEIGHT_GLOBAL_MIN: _tensor(record.weight_min.min()),
    }


@to_upstream.register
def _(record: OutlierRecord) -> dict[str, Any]:
    return {
        F.OUTLIER_CHANNEL_AXIS: record.ch_axis,
        F.OUTLIER_REFERENCE_PERCENTILE: record.reference_percentile,
        F.OUTLIER_RATIO_THRESHOLD: record.ratio_threshold,
        F.OUTLIER_RATIOS: _tensor(record.ratios),
        F.OUTLIER_BATCHES_USED: _tensor(record.batches_used, torch.int64),
        F.OUTLIERS_DETECTED: record.outliers.tolist(),
        F.OUTLIER_SUFFICIENT_BATCHES: record.sufficient_batches.tolist(),
        F.CONSTANT_BATCH_COUNTS: _tensor(record.constant_counts, torch.int64),
        F.INPUT_PER_CHANNEL_MAX: _tensor(record.max_vals),
    }
