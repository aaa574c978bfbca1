"""Estimated percentiles: an evenly spread sample of a large channel, its stated rank bound checked on
real activations, and the same outlier verdicts as the exact path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_properties import layer_inputs
from torch import nn
from zoo import ARCHITECTURES, image_batches

from qreport_widgets import ModelReportObserver, analyze
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.observe.detectors.outlier import OutlierDetector
from qreport_widgets.observe.observer import PERCENTILE_SAMPLE, estimate_bounds, percentile_rank, spread_positions
from qreport_widgets.observe.selection import channel_major, channel_view

Q = 0.975


def inputs_of(model: nn.Module, batches) -> list[tuple[str, torch.Tensor, int]]:
    """Every Conv / Linear input (name, tensor, channel axis) the batches produce."""
    kinds = {name: type(module) for name, module in model.named_modules()}
    return [
        (name, torch.from_numpy(x), 1 if issubclass(kinds[name], (nn.Conv1d, nn.Conv2d)) else -1)
        for name, xs in layer_inputs(model, batches).items()
        for x in xs
    ]


def test_spread_positions_cover_the_range_and_avoid_the_layouts_periods():
    positions = spread_positions(8 * 56 * 56, 4096, (8, 56, 56))
    stride = int(positions[1] - positions[0])
    assert len(positions) >= 4096 and all(np.gcd(stride, s) == 1 for s in (8, 56))
    assert positions[0] <= stride and positions[-1] >= 8 * 56 * 56 - stride  # both ends reached
    assert len(set((positions % 56).tolist())) == 56  # every pixel column, not one column per row
    tokens = spread_positions(4 * 128, 16, (4, 128))  # a stride of 32 would read 4 token positions
    assert len(set((tokens % 128).tolist())) == len(tokens)
    # no stride of 2 or more avoids the layout's factors: every value, read exactly
    assert len(spread_positions(8 * 28 * 28, 4096, (8, 28, 28))) == 8 * 28 * 28
    assert len(spread_positions(8 * 32 * 32, 4096, (8, 32, 32))) == 8 * 32 * 32


@pytest.mark.parametrize("shape", [(8, 5, 56, 56), (2, 3, 112, 112), (3, 4, 49, 75), (2001, 3, 5), (8, 6, 28, 28)])
def test_the_sample_reads_the_spread_positions(shape):
    """Each row sliced at the stride, or indexed by rows and columns (5 values a row): the same values
    in position order; none where every value is read (8 x 28 x 28)."""
    t = torch.randn(*shape)
    view = channel_view(t, 1)
    before, _, after = view.shape
    positions = spread_positions(before * after, PERCENTILE_SAMPLE, (shape[0], *shape[2:]))
    sample = ModelReportObserver(1, Q)._spread_sample(t, 1)
    if len(positions) == before * after:
        assert sample is None
    else:
        assert torch.equal(sample, channel_major(view)[:, positions])


def test_the_stated_rank_bound_holds_on_real_activations(digits_cache):
    """The estimate's rank in the whole channel lies within estimate_bounds on every channel of every
    Conv / Linear input of a trained digits CNN (batches of 288) and two zoo models at 8 x 160 x 160."""
    model, data = trained_digits_model("cnn", digits_cache)
    images = torch.cat([b[0] for b in (*data.calibration, *data.evaluation)])  # 576 images: batches of 288
    cases = [("digits-cnn", model.eval(), [(images[:288],), (images[288:],)])]
    for name in ("resnet", "mobilenet_v3"):
        torch.manual_seed(0)
        cases.append((name, ARCHITECTURES[name][0]().eval(), image_batches(2, batch=8, size=160)))
    checked, low, high = 0, *estimate_bounds(Q, PERCENTILE_SAMPLE)
    worst = 0.0
    for name, net, batches in cases:
        for layer, t, axis in inputs_of(net, batches):
            view = channel_view(t, axis % t.dim())
            whole = channel_major(view).double()
            n = whole.shape[1]
            sample = ModelReportObserver(axis, Q)._spread_sample(t, axis % t.dim()) if n > PERCENTILE_SAMPLE else None
            if sample is None:  # exact: every value is read
                continue
            count = sample.shape[1]
            estimate = sample.double().kthvalue(percentile_rank(Q, count), dim=1).values
            below = (whole < estimate[:, None]).sum(1).double() / n  # the estimate's rank interval in the channel
            at_most = (whole <= estimate[:, None]).sum(1).double() / n
            assert bool(((at_most >= low) & (below <= high)).all()), (name, layer, float(below.min()), float(at_most.max()))
            off = torch.where(at_most < Q, Q - at_most, torch.where(below > Q, below - Q, torch.zeros_like(below)))
            worst, checked = max(worst, float(off.max())), checked + whole.shape[0]
    assert checked > 100  # channels estimated and checked against their whole data
    assert worst < (high - low) / 2


@pytest.mark.parametrize("name", ["resnet", "convnext", "prelu_net"])
def test_estimated_and_exact_percentiles_give_the_same_outlier_verdicts(name):
    torch.manual_seed(0)
    model = ARCHITECTURES[name][0]().eval()
    batches = image_batches(2, batch=16, size=32) if name == "prelu_net" else image_batches(2, batch=8, size=64)
    verdicts, texts = [], []
    for exact in (True, False):
        report = analyze(model, batches[0], batches, detectors=[OutlierDetector()], exact_percentiles=exact, progress=False)
        text, found = report.generate_model_report()["outlier_detector"]
        verdicts.append(
            {
                fqn: (np.asarray(v["outliers_detected"]), np.asarray(v["outlier_detection_percentile_ratios"]))
                for fqn, v in found.items()
            }
        )
        texts.append(text)
    exact, estimated = verdicts
    assert exact.keys() == estimated.keys()
    for fqn in exact:
        np.testing.assert_array_equal(exact[fqn][0], estimated[fqn][0], err_msg=fqn)
        np.testing.assert_allclose(exact[fqn][1], estimated[fqn][1], rtol=0.15, err_msg=fqn)
    assert "estimated" not in texts[0]
    assert "p97.5 estimated on" in texts[1] and "exact_percentiles=True" in texts[1]


def test_merging_keeps_what_was_estimated():
    torch.manual_seed(0)
    small, large = torch.randn(2, 4, 8, 8), torch.randn(16, 4, 32, 32)
    first, second = ModelReportObserver(1, Q), ModelReportObserver(1, Q)
    first(small)
    assert first.estimated_from is None  # 128 values a channel: exact
    second(large)
    assert second.estimated_from is not None and second.estimated_from[1] == 16 * 32 * 32
    first.merge_(second)
    assert first.estimated_from == second.estimated_from
    with pytest.raises(ValueError, match="same settings"):
        first.merge_(ModelReportObserver(1, Q, percentile_sample=None))
    with pytest.raises(ValueError, match="percentile_sample"):
        ModelReportObserver(1, Q, percentile_sample=4)
