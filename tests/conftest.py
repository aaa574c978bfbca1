from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.ao.quantization import QConfigMapping, default_qconfig, get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import prepare_fx

torch.manual_seed(0)


def prepared(model: torch.nn.Module, example, mapping: QConfigMapping | None = None):
    """A prepare_fx copy of ``model`` (the original is left alone)."""
    mapping = mapping if mapping is not None else QConfigMapping().set_global(default_qconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_fx(copy.deepcopy(model).eval(), mapping, example)


def run(model, batches):
    with torch.no_grad():
        for batch in batches:
            model(*batch)


@pytest.fixture
def x86_mapping():
    return get_default_qconfig_mapping("x86")
