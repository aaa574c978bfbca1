"""qreport_widgets: see why post-training quantization hurts a model, and fix it, in a notebook."""

from __future__ import annotations

from ._version import __version__ as __version__
from .analyze import analyze, default_detectors
from .core.metrics import Metric, perplexity
from .core.tasks import TaskAccuracy, write_task
from .engines import quantize_weights
from .engines.rotation import Rotation, rotate, rotation_problems
from .engines.settings import ModuleSettings
from .errors import (
    AlreadyPreparedError,
    CalibrationError,
    CheckpointError,
    DetectorConfigError,
    DeviceMismatchError,
    DistributedCalibrationError,
    FloatModelChangedError,
    InvalidSettingsError,
    ModelReleasedError,
    NotCalibratedError,
    NotEnoughMemoryError,
    NotPreparedError,
    ObserversRemovedError,
    QReportError,
    ReportFileError,
    ReportNotGeneratedError,
    UntraceableModelError,
)
from .observe.analysis import Analysis
from .observe.detectors import (
    DetectorBase,
    DynamicStaticDetector,
    InputWeightEqualizationDetector,
    OutlierDetector,
    PerChannelDetector,
    QReportWarning,
)
from .observe.observer import ModelReportObserver
from .report.model_report import ModelReport
from .share.storage import SavedReport, load_report
from .tune.session import QuantizationSession, RunResult

__all__ = [
    "AlreadyPreparedError",
    "Analysis",
    "CalibrationError",
    "CheckpointError",
    "DetectorBase",
    "DetectorConfigError",
    "DeviceMismatchError",
    "DistributedCalibrationError",
    "DynamicStaticDetector",
    "FloatModelChangedError",
    "NotEnoughMemoryError",
    "InputWeightEqualizationDetector",
    "InvalidSettingsError",
    "Metric",
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
    "Rotation",
    "RunResult",
    "SavedReport",
    "TaskAccuracy",
    "UntraceableModelError",
    "analyze",
    "default_detectors",
    "load_report",
    "perplexity",
    "quantize_weights",
    "rotate",
    "rotation_problems",
    "write_task",
]
