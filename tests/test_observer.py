"""ModelReportObserver against a numpy reference, merging, histograms and size limits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qreport_widgets import ModelReportObserver
from qreport_widgets.core.features import Stat
from qreport_widgets.observe import observer as observer_module
from qreport_widgets.observe import selection
from qreport_widgets.observe.observer import percentile_rank

ALL = [Stat.RANGE, Stat.CHANNEL_MINMAX, Stat.PERCENTILE, Stat.HISTOGRAM]


def reference(batches: list[np.ndarray], axis: int, q: float) -> dict:
    """Straightforward numpy statistics of the same batches."""
    ranges, mins, maxs, sums, counts, constant = [], [], [], 0.0, 0, 0
    for x in batches:
        x = x.astype(np.float64)
        y = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1) if x.ndim else x.reshape(1, 1)
        ranges.append(x.max() - x.min())
        mins.append(y.min(1))
        maxs.append(y.max(1))
        k = percentile_rank(q, y.shape[1])
        ref = np.sort(y, axis=1)[:, k - 1] + 0.0
        cmax, cmin = y.max(1), y.min(1)
        used = (ref != 0) | (cmax != 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            sums = sums + np.where(used, cmax / ref, 0.0)
        counts = counts + used
        constant = constant + (cmax == cmin)
    return {
        "epoch_min": min(m.min() for m in mins),
        "epoch_max": max(m.max() for m in maxs),
        "range_mean": np.mean(ranges),
        "range_var": np.var(ranges, ddof=1) if len(ranges) > 1 else math.nan,
        "min": np.min(mins, axis=0),
        "max": np.max(maxs, axis=0),
        "ratio": np.where(counts > 0, sums / np.maximum(counts, 1), 0.0),
        "count": counts,
        "constant": constant,
    }


@st.composite
def observed_batches(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    axis = draw(st.integers(-ndim, ndim - 1))
    dtype = draw(st.sampled_from([np.float32, np.float64, np.int32]))
    n_batches = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n_batches):
        values = rng.normal(size=shape) * rng.uniform(0.1, 10)
        if draw(st.booleans()):
            values = np.round(values)  # ties and exact zeros
        batches.append(values.astype(dtype))
    q = draw(st.sampled_from([0.5, 0.9, 0.975, 0.99]))
    return batches, axis, q


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(observed_batches())
def test_statistics_match_numpy_reference(case):
    batches, axis, q = case
    observer = ModelReportObserver(axis, q, stats=ALL, histogram_bins=16)
    for x in batches:
        observer(torch.from_numpy(x))
    expected = reference([x.astype(np.float32) for x in batches], axis, q)
    rtol = 1e-5
    assert observer.num_batches_tracked == len(batches)
    assert math.isclose(observer.epoch_activation_min.item(), expected["epoch_min"], rel_tol=rtol, abs_tol=1e-6)
    assert math.isclose(observer.epoch_activation_max.item(), expected["epoch_max"], rel_tol=rtol, abs_tol=1e-6)
    assert math.isclose(observer.average_batch_activation_range.item(), expected["range_mean"], rel_tol=1e-4, abs_tol=1e-5)
    if not math.isnan(expected["range_var"]):
        scale = max(1.0, expected["range_mean"] ** 2)
        assert abs(observer.batch_range_variance.item() - expected["range_var"]) <= 1e-4 * scale
    np.testing.assert_allclose(observer.min_val.numpy(), expected["min"], rtol=rtol)
    np.testing.assert_allclose(observer.max_val.numpy(), expected["max"], rtol=rtol)
    ratio, count = observer.percentile_ratio(q)
    np.testing.assert_array_equal(count.numpy(), expected["count"])
    np.testing.assert_allclose(ratio.numpy(), expected["ratio"], rtol=1e-4, atol=1e-5)  # sums of signed ratios cancel
    np.testing.assert_array_equal(observer.constant_channels.numpy(), expected["constant"])
    assert observer.histogram.sum().item() == sum(x.size for x in batches)


def test_percentile_rank_matches_torch_quantile_lower():
    for n in (1, 2, 7, 100, 12345):
        values = torch.randn(n)
        for q in (0.5, 0.9, 0.975, 0.999):
            k = percentile_rank(q, n)
            expected = torch.quantile(values, q, interpolation="lower")
            assert values.kthvalue(k).values == expected


def test_merged_observers_equal_one_that_saw_every_batch():
    torch.manual_seed(0)
    batches = [torch.randn(4, 6, 5) * (1 + i) for i in range(6)]
    whole, first, second = (ModelReportObserver(1, 0.9, stats=ALL, histogram_bins=32) for _ in range(3))
    for i, x in enumerate(batches):
        whole(x)
        (first if i < 2 else second)(x * 1.0)
    first.merge_(second)
    for name, value in whole.state_dict().items():
        np.testing.assert_allclose(first.state_dict()[name].numpy(), value.numpy(), rtol=1e-5, err_msg=name)
    assert first.num_batches_tracked == whole.num_batches_tracked
    np.testing.assert_allclose(first.batch_range_variance, whole.batch_range_variance, rtol=1e-5)


def test_histogram_rebins_exactly_when_range_grows():
    observer = ModelReportObserver(stats=[Stat.RANGE, Stat.HISTOGRAM], histogram_bins=8)
    observer(torch.tensor([0.1, 0.2, -0.3]))  # fits in [-0.5, 0.5]
    observer(torch.tensor([3.0]))  # range grows to [-4, 4]: old counts fold into the middle bins
    edges = observer.histogram_edges()
    assert edges[0] == -4 and edges[-1] == 4
    assert observer.histogram.tolist() == [0, 0, 0, 1, 2, 0, 0, 1]


def test_no_input_size_limit():
    """torch.quantile refuses more than 2**24 values; selection has no such limit."""
    x = torch.zeros(17, 1, 1024, 1024)
    x[0, 0, 0, :10] = 5.0
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(x.reshape(1, -1), 0.9, dim=1)
    observer = ModelReportObserver(1, 0.9, percentile_sample=None)  # exact: no sample
    observer(x)
    assert observer.max_val.item() == 5.0
    assert math.isinf(observer.average_percentile_ratio.item())


def test_degenerate_inputs_do_not_raise():
    observer = ModelReportObserver(1, 0.9, stats=ALL, histogram_bins=8)
    observer(torch.ones(2, 3, 4))  # constant tensor
    observer(torch.empty(0, 3, 4))  # empty batch
    observer(torch.tensor([1.0, math.nan, math.inf, 0.0, 2.0, 3.0]).reshape(2, 3, 1))  # NaN and inf
    observer(torch.zeros(2, 3, 4, dtype=torch.bool))  # bool
    assert observer.empty_batches == 1
    assert torch.isnan(observer.get_batch_to_epoch_ratio())
    assert torch.isnan(observer.max_val).any()


def test_channel_count_change_is_a_clear_error():
    observer = ModelReportObserver(1)
    observer(torch.randn(2, 3))
    with pytest.raises(ValueError, match="channels"):
        observer(torch.randn(2, 4))


def test_forward_returns_input_unchanged_and_records_first_tensor_of_several():
    observer = ModelReportObserver(-1)
    q, k = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    assert observer(q, k, k) is q
    assert observer.max_val.shape == (4,)
    assert observer((q, None)) is not None


def test_forward_never_syncs_with_host(monkeypatch):
    """The hot path must not call .item(), .tolist() or .cpu() on tensors.

    This is the path accelerators take; on the CPU the selections and the histogram's range read
    values on the host on purpose (there the data already lives on the host).
    """
    observer = ModelReportObserver(1, 0.9, stats=ALL, histogram_bins=8, percentiles=[0.5])
    # the CPU's paths read values back on purpose (NumPy's selection, the histogram's range); an
    # accelerator's never do
    monkeypatch.setattr(selection, "on_host", lambda t: False)
    monkeypatch.setattr(observer_module, "on_host", lambda t: False)
    called = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _n=name, _o=original, **k: called.append(_n) or _o(self, *a, **k)
        )
    for _ in range(3):
        observer(torch.randn(4, 5, 6))
    monkeypatch.undo()
    assert called == []


def test_histogram_on_the_host_equals_the_accelerators_path(monkeypatch):
    """The CPU reads the range and rebins only when it grew; the device path rebins every batch with
    tensor operations. Both give the same counts and range, through growth, shrinkage, zeros and
    subnormal values."""
    generator = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 3, 9, generator=generator) * scale for scale in (0.01, 3.0, 0.5, 1e4, 2.0)]
    batches += [torch.zeros(4, 3, 9), torch.full((4, 3, 9), 2.0**-140)]

    def histogram() -> tuple[torch.Tensor, torch.Tensor]:
        observer = ModelReportObserver(1, 0.9, stats=[Stat.RANGE, Stat.HISTOGRAM], histogram_bins=16)
        for batch in batches:
            observer(batch)
        return observer.histogram.clone(), observer.histogram_exponent.clone()

    host = histogram()
    monkeypatch.setattr(observer_module, "on_host", lambda t: False)
    device = histogram()
    assert torch.equal(host[0], device[0]) and torch.equal(host[1], device[1])
    assert host[0].sum() == sum(b.numel() for b in batches)
