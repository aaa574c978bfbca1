from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

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


def fingerprint(model: torch.nn.Module) -> tuple[dict, str, str | None, list[bool]]:
    """What must not change in a caller's float model: parameters and buffers (values and dtypes),
    structure, traced graph code (None when plain FX cannot trace it) and train / eval flags."""
    try:
        code = torch.fx.symbolic_trace(model).code
    except Exception:
        code = None
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, str(model), code, [m.training for m in model.modules()]


def assert_unchanged(model: torch.nn.Module, before: tuple[dict, str, str | None, list[bool]]) -> None:
    state, text, code, training = before
    after_state, after_text, after_code, after_training = fingerprint(model)
    assert list(after_state) == list(state)
    for name, value in after_state.items():
        assert value.dtype == state[name].dtype and torch.equal(value, state[name]), name
    assert after_text == text and after_code == code and after_training == training


@pytest.fixture
def x86_mapping():
    return get_default_qconfig_mapping("x86")


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory):
    """One folder for the trained digits models of the whole run: each is trained once (seeded, so
    every test sees the same weights) and loaded from here after. ``QREPORT_TEST_CACHE`` names a
    folder kept across runs instead (a developer's repeated runs skip the training)."""
    kept = os.environ.get("QREPORT_TEST_CACHE")
    return Path(kept) if kept else tmp_path_factory.mktemp("digits")


@pytest.fixture(scope="session")
def text_decoder(digits_cache):
    """The byte-level decoder trained on the Python reference's help topics (about a minute, once
    per run) and its held-out text."""
    from qreport_widgets.demo.text import trained_text_decoder

    return trained_text_decoder(cache_dir=digits_cache)
