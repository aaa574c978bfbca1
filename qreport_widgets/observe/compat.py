"""The one adapter between report columns and PyTorch's per-module report dictionaries.

PyTorch's ``_model_report`` hands out per-channel values as 1-D tensors, per-layer statistics as
0-d tensors, per-channel flags as lists of bools and settings as plain Python values. Report
columns (see ``records.py``) carry the same information in numpy, and their types say which form
each key takes upstream: numpy values become tensors of the same dtype, except 1-D bool arrays,
which become lists; Python scalars stay as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .records import Column


def to_upstream(columns: Mapping[str, Column]) -> dict[str, Any]:
    """PyTorch's dictionary for one module, from its report columns."""
    return {key: _upstream_value(value) for key, value in columns.items()}


def from_upstream(features: Mapping[str, Any]) -> dict[str, Column]:
    """Report columns from a PyTorch-shaped dictionary (for detectors that only write that form)."""
    return {key: _column(value) for key, value in features.items()}


def _upstream_value(value: Column) -> Any:
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.bool_:
        return value.tolist()
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.array(value))  # a copy: the report's columns stay read-only
    return value


def _column(value: Any) -> Column:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, (list, tuple)):
        return np.asarray(value)
    return value
