"""The fixed vocabularies of a report, spelled once.

Report keys are the exact strings PyTorch's ``torch.ao.quantization.fx._model_report`` uses, so
code written against its dictionaries keeps working.
"""

from __future__ import annotations

from enum import Enum


class Stat(str, Enum):
    """Statistics an observer can collect; each detector asks only for what it reads."""

    RANGE = "range"  # tensor min / max, per-batch range mean and variance
    CHANNEL_MINMAX = "channel_minmax"  # per-channel min / max
    PERCENTILE = "percentile"  # per-channel max / reference-percentile ratio, constant channels
    HISTOGRAM = "histogram"  # running histogram of the values on power-of-two aligned bins


class Side(str, Enum):
    """Which tensor of a module an observation point watches."""

    INPUT = "input"
    OUTPUT = "output"


class DetectorName(str, Enum):
    PER_CHANNEL = "per_channel_detector"
    DYNAMIC_STATIC = "dynamic_vs_static_detector"
    EQUALIZATION = "input_weight_equalization_detector"
    OUTLIER = "outlier_detector"


class SuggestionKind(str, Enum):
    """What a detector can recommend for a module."""

    DYNAMIC = "dynamic"
    PER_CHANNEL = "per_channel"
    EQUALIZATION = "equalization"
    OUTLIERS = "outliers"


STATIONARY = "stationary"
NON_STATIONARY = "non-stationary"
UNDETERMINED = "undetermined"

# PerChannelDetector
BACKEND = "backend"
PER_CHANNEL_SUPPORTED = "per_channel_quantization_supported"
PER_CHANNEL_USED = "per_channel_quantization_used"

# DynamicStaticDetector
TOLERANCE = "dynamic_static_tolerance"
DYNAMIC_RECOMMENDED = "dynamic_recommended"
INPUT_COMP_STAT = "input_activation_dynamic_static_comp_stat"
OUTPUT_COMP_STAT = "output_activation_dynamic_static_comp_stat"
INPUT_DATA_CLASSIFICATION = "input_activation_dynamic_static_data_classification"
OUTPUT_DATA_CLASSIFICATION = "output_activation_dynamic_static_data_classification"
DYNAMIC_SUPPORTED = "is_dynamic_supported"

# InputWeightEqualizationDetector
INPUT_PER_CHANNEL_MAX = "input_activation_per_channel_max"
INPUT_PER_CHANNEL_MIN = "input_activation_per_channel_min"
INPUT_GLOBAL_MAX = "input_activation_global_max"
INPUT_GLOBAL_MIN = "input_activation_global_min"
WEIGHT_PER_CHANNEL_MAX = "weight_per_channel_max"
WEIGHT_PER_CHANNEL_MIN = "weight_per_channel_min"
WEIGHT_GLOBAL_MAX = "weight_global_max"
WEIGHT_GLOBAL_MIN = "weight_global_min"
EQUALIZATION_RECOMMENDED = "input_weight_equalization_recommended"
EQUALIZATION_COMP_METRICS = "input_weight_channel_comparison_metrics"
EQUALIZATION_THRESHOLD = "input_weight_threshold"
EQUALIZATION_CHANNEL_AXIS = "input_weight_channel_axis"

# OutlierDetector
OUTLIERS_DETECTED = "outliers_detected"
OUTLIER_BATCHES_USED = "outlier_detection_batches_used"
OUTLIER_SUFFICIENT_BATCHES = "outlier_detection_is_sufficient_batches"
OUTLIER_RATIOS = "outlier_detection_percentile_ratios"
OUTLIER_RATIO_THRESHOLD = "outlier_detection_ratio_threshold"
OUTLIER_REFERENCE_PERCENTILE = "outlier_detection_reference_percentile"
OUTLIER_CHANNEL_AXIS = "outlier_detection_channel_axis"
CONSTANT_BATCH_COUNTS = "constant_batch_counts"

# Share of a module's channels that must favour equalization before the module is recommended.
EQUALIZATION_MODULE_FRACTION = 0.4
