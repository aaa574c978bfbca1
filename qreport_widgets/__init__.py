"""qreport_widgets: see why post-training quantization hurts a model, and fix it, in a notebook."""

from __future__ import annotations

from .analyze import analyze, default_detectors
from .detectors import (
    DetectorBase,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
    QReportWarning,
)
from .errors import (
    AlreadyPreparedError,
    CalibrationError,
    DetectorConfigError,
    NotCalibratedError,
    NotPreparedError,
    ObserversRemovedError,
    QReportError,
    ReportFileError,
    ReportNotGeneratedError,
    UntraceableModelError,
)
from .observer import ModelReportObserver
from .qconfig import ModuleSettings
from .report import ModelReport
from .storage import SavedReport, load_report

__version__ = "0.1.0"

__all__ = [
    "AlreadyPreparedError",
    "CalibrationError",
    "DetectorBase",
    "DetectorConfigError",
    "DynamicStaticDetector",
    "InputWeightEqualizationDetector",
    "ModelReport",
    "ModelReportObserver",
    "ModuleSettings",
    "NotCalibratedError",
    "NotPreparedError",
    "ObserversRemovedError",
    "OutlierDetector",
    "PerChannelDetector",
    "QReportError",
    "QReportWarning",
    "ReportFileError",
    "ReportNotGeneratedError",
    "SavedReport",
    "UntraceableModelError",
    "analyze",
    "default_detectors",
    "load_report",
]
