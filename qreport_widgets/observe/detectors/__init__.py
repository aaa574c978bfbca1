"""The four built-in detectors and the base class for writing more."""

from .base import DetectorBase, DetectorResult, ObservationRequest, QReportWarning, ReportContext, Suggestion
from .dynamic_static import DynamicStaticDetector, DynamicStaticRecord
from .equalization import EqualizationRecord, InputWeightEqualizationDetector
from .outlier import OutlierDetector, OutlierRecord
from .per_channel import PerChannelDetector, PerChannelRecord

__all__ = [
    "DetectorBase",
    "DetectorResult",
    "DynamicStaticDetector",
    "DynamicStaticRecord",
    "EqualizationRecord",
    "InputWeightEqualizationDetector",
    "ObservationRequest",
    "OutlierDetector",
    "OutlierRecord",
    "PerChannelDetector",
    "PerChannelRecord",
    "QReportWarning",
    "ReportContext",
    "Suggestion",
]
