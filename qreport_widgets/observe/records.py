"""What detectors hand on: typed per-module records, their suggestions, and the columns views read.

A record is any object with a ``module_fqn`` and a ``columns()`` method returning the module's
features keyed by report key: 1-D numpy arrays are per-channel values, everything else (a numpy
scalar, a 0-d array, a Python bool, int, float or str) is one value for the module. Records of the
built-in detectors are frozen dataclasses in ``detectors/``; a report opened from a file holds
:class:`StoredRecord` s with the same columns.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..core.features import SuggestionKind

Column = Any  # np.ndarray (1-D: per channel; 0-d: one value), np.generic, bool, int, float or str


@runtime_checkable
class ReportRecord(Protocol):
    module_fqn: str

    def columns(self) -> Mapping[str, Column]: ...


@dataclass(frozen=True)
class Suggestion:
    """One recommendation of one detector for one module."""

    module_fqn: str
    detector: str
    kind: SuggestionKind
    reason: str
    evidence: float = math.nan


@dataclass(frozen=True)
class DetectorResult:
    """Typed output of one detector: per-module records plus notes on what it could not judge."""

    detector: str
    records: tuple[Any, ...]
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()

    def by_module(self) -> dict[str, Any]:
        return {record.module_fqn: record for record in self.records}


@dataclass(frozen=True)
class StoredRecord:
    """A record read back from a report file: the module's columns and its value histogram."""

    module_fqn: str
    values: Mapping[str, Column]
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(0))
    histogram_edges: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def columns(self) -> Mapping[str, Column]:
        return self.values
