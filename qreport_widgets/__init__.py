"""qreport_widgets: see why post-training quantization hurts a model, and fix it, in a notebook."""

from __future__ import annotations

from ._version import __version__ as __version__
from .analysis import Analysis
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
    DistributedCalibrationError,
    FloatModelChangedError,
    InvalidSettingsError,
    ModelReleasedError,
    NotCalibratedError,
    NotPreparedError,
    ObserversRemovedError,
    QReportError,
    ReportFileError,
    ReportNotGeneratedError,
    UntraceableModelError,
)
from .observer import ModelReportObserver
from .report import ModelReport
from .session import QuantizationSession, RunResult
from .settings import ModuleSettings
from .storage import SavedReport, load_report

__all__ = [
    "AlreadyPreparedError",
    "Analysis",
    "CalibrationError",
    "DetectorBase",
    "DetectorConfigError",
    "DistributedCalibrationError",
    "DynamicStaticDetector",
    "FloatModelChangedError",
    "InputWeightEqualizationDetector",
    "InvalidSettingsError",
    "ModelReleasedError",
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
    "QuantizationSession",
    "ReportFileError",
    "ReportNotGeneratedError",
    "RunResult",
    "SavedReport",
    "UntraceableModelError",
    "analyze",
    "default_detectors",
    "load_report",
]
