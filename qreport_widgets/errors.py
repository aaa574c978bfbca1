"""Exceptions with a message that says what to do next."""

from __future__ import annotations


class QReportError(Exception):
    """Base class of every error this package raises on purpose."""


class ReportStateError(QReportError, RuntimeError):
    """A ModelReport method was called at the wrong point of the workflow."""


class NotPreparedError(ReportStateError):
    pass


class AlreadyPreparedError(ReportStateError):
    pass


class ObserversRemovedError(ReportStateError):
    pass


class NotCalibratedError(ReportStateError):
    """No calibration batch reached any observer."""


class ReportNotGeneratedError(ReportStateError):
    pass


class DetectorConfigError(QReportError, ValueError):
    """Detectors passed to ModelReport do not fit together or do not fit the model."""


class UntraceableModelError(QReportError, RuntimeError):
    """torch.fx could not trace the float model."""


class CalibrationError(QReportError, RuntimeError):
    """A calibration batch could not be run through the model."""


class QReportWarning(UserWarning):
    """Degenerate data, an unobservable module or a quantization step we had to adjust; names the module."""


class ReportFileError(QReportError, ValueError):
    """A saved report file is missing, truncated or was modified."""


class InvalidSettingsError(QReportError, ValueError):
    """Per-module settings the quantization engine cannot apply to that module."""
