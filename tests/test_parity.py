"""Same report keys, values and suggested QConfigMapping as torch's _model_report on models it handles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import prepared, run
from models import ConvNet, Mixed, Mlp, conv_batches, mlp_batches
from torch.ao.quantization.fx._model_report import detector as upstream_detector
from torch.ao.quantization.fx._model_report.model_report import ModelReport as UpstreamReport

import qreport_widgets as qw
from qreport_widgets.core import features as F

# statistics against torch's on the same kernels: `make test` runs them again without AVX-512 and on one thread
pytestmark = pytest.mark.kernels

CASES = [
    pytest.param(ConvNet, conv_batches, id="conv-net"),
    pytest.param(Mlp, mlp_batches, id="mlp-2d"),
    pytest.param(Mixed, conv_batches, id="mixed"),
]

# Where we differ from torch on purpose (docs/ARCHITECTURE.md, "Differences from PyTorch").
INTENTIONAL = {F.EQUALIZATION_RECOMMENDED}


def upstream_reports(model, batches):
    """torch's detectors, run in two ModelReports so its shared pre-observer name cannot mix settings."""
    combined = {}
    mappings = None
    for detectors in (
        {
            upstream_detector.PerChannelDetector("x86"),
            upstream_detector.DynamicStaticDetector(),
            upstream_detector.InputWeightEqualizationDetector(0.5),
        },
        {upstream_detector.OutlierDetector()},
    ):
        report = UpstreamReport(prepared(model, batches[0]), detectors)
        run(report.prepare_detailed_calibration(), batches)
        combined.update(report.generate_model_report(remove_inserted_observers=False))
        if mappings is None:
            mappings = report.generate_qconfig_mapping()
    return combined, mappings


def ours(model, batches):
    report = qw.ModelReport(
        prepared(model, batches[0]),
        [qw.PerChannelDetector("x86"), qw.DynamicStaticDetector(), qw.InputWeightEqualizationDetector(0.5), qw.OutlierDetector()],
    )
    run(report.prepare_detailed_calibration(), batches)
    return report, report.generate_model_report(remove_inserted_observers=False)


def assert_same_value(key, theirs, mine):
    if isinstance(theirs, torch.Tensor):
        assert isinstance(mine, torch.Tensor), key
        a, b = theirs.detach().double().numpy(), mine.detach().double().numpy()
        if key.endswith(F.OUTLIER_RATIOS):
            # torch turns an unbounded ratio (reference percentile 0, max > 0) into float32's max
            # value and averages that; we keep it infinite
            a = np.where(a >= 1e38, np.inf, a)
        assert a.shape == b.shape, key
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, equal_nan=True, err_msg=key)
    elif isinstance(theirs, float):
        assert math.isclose(theirs, mine, rel_tol=1e-5), key
    else:
        assert theirs == mine, key


@pytest.mark.parametrize("model_cls, make_batches", CASES)
def test_report_keys_and_values_match_torch(model_cls, make_batches):
    torch.manual_seed(0)
    model = model_cls().eval()
    batches = make_batches()
    theirs, _ = upstream_reports(model, batches)
    _, mine = ours(model, batches)
    assert set(mine) == set(theirs)
    for name, (_, their_dict) in theirs.items():
        my_dict = mine[name][1]
        assert set(my_dict) == set(their_dict), name
        for module, their_features in their_dict.items():
            assert set(my_dict[module]) == set(their_features), (name, module)
            for key, value in their_features.items():
                if key not in INTENTIONAL:
                    assert_same_value(f"{name}/{module}/{key}", value, my_dict[module][key])


@pytest.mark.parametrize("model_cls, make_batches", CASES)
def test_equalization_flags_are_the_complement_of_torch(model_cls, make_batches):
    """torch flags the channels inside the band (where equalization cannot help); we flag the rest."""
    torch.manual_seed(0)
    model = model_cls().eval()
    batches = make_batches()
    theirs, _ = upstream_reports(model, batches)
    _, mine = ours(model, batches)
    for module, features in theirs[F.DetectorName.EQUALIZATION.value][1].items():
        their_flags = np.array(features[F.EQUALIZATION_RECOMMENDED])
        my_flags = np.array(mine[F.DetectorName.EQUALIZATION.value][1][module][F.EQUALIZATION_RECOMMENDED])
        assert (my_flags == ~their_flags).all(), module


def _qconfig_signature(qconfig):
    return tuple((part.p.func, tuple(sorted(part.p.keywords.items()))) for part in (qconfig.activation, qconfig.weight))


@pytest.mark.parametrize("model_cls, make_batches", CASES)
def test_suggested_qconfig_mapping_matches_torch(model_cls, make_batches):
    torch.manual_seed(0)
    model = model_cls().eval()
    batches = make_batches()
    _, their_mapping = upstream_reports(model, batches)
    report, _ = ours(model, batches)
    mine = report.generate_qconfig_mapping()
    assert list(mine.module_name_qconfigs) == list(their_mapping.module_name_qconfigs)
    for fqn, qconfig in their_mapping.module_name_qconfigs.items():
        assert _qconfig_signature(mine.module_name_qconfigs[fqn]) == _qconfig_signature(qconfig), fqn
