"""Exceptions with a message that says what to do next."""

from __future__ import annotations

import os
import sys
import warnings


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


class MissingExtraError(QReportError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


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


class CheckpointError(QReportError, ValueError):
    """A run that cannot be written as a Hugging Face checkpoint; the message says why and what to do."""


class ModelReleasedError(QReportError, AttributeError):
    """A run's quantized model was released to save memory (the session keeps the latest run's and
    the pinned runs'); its measurements are all still there."""


class FloatModelChangedError(QReportError, RuntimeError):
    """The float model's weights were changed in place after ``analyze()`` or the session started:
    the session shares them instead of holding a copy, so it can no longer tune the model it was
    given."""


class DistributedCalibrationError(QReportError, RuntimeError):
    """Calibration across a torch.distributed group failed on a rank, or the ranks' shards differ;
    raised on every rank of the group."""


class NotEnoughMemoryError(QReportError, MemoryError):
    """A step would need more memory than the machine has free: refused before it starts, so
    nothing the session holds is lost."""


class DecodeSpeedError(QReportError, ValueError):
    """A run's decode speed cannot be measured: not a decoder program, or no way to export it with a cache."""


class DeviceMismatchError(QReportError, ValueError):
    """The inputs are on another device than the model (``analyze(..., move_batches=True)`` moves them)."""


def warn_user(message: str) -> None:
    """A QReportWarning attributed to the first caller outside this package and torch (the notebook
    cell or script line that called analyze / generate_model_report), however deep it was raised."""
    import torch

    inside = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(1), 2  # level 2: warn_user's caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, QReportWarning, stacklevel=level)
