"""The bracketed selection returns exactly what kthvalue returns, whatever the bound was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qreport_widgets.observe.observer
from qreport_widgets.observe import selection


@pytest.fixture(scope="module")
def bracket_everything():
    saved = selection.BRACKET_MIN_ROW, selection.BRACKET_MIN_VALUES
    selection.BRACKET_MIN_ROW, selection.BRACKET_MIN_VALUES = 1, 1
    yield
    selection.BRACKET_MIN_ROW, selection.BRACKET_MIN_VALUES = saved


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.integers(8, 300),
    fraction=st.floats(0.0, 0.12),
    batches=st.integers(1, 4),
    ties=st.booleans(),
    drift=st.floats(0.2, 5.0),
    seed=st.integers(0, 2**16),
)
def test_matches_kthvalue_across_batches(bracket_everything, rows, n, fraction, batches, ties, drift, seed):
    rng = np.random.default_rng(seed)
    m = max(1, int(fraction * n))
    hint = None
    for b in range(batches):
        values = rng.standard_normal((rows, n)) * drift**b
        if ties:
            values = np.round(values)
        y = torch.from_numpy(values.astype(np.float32))
        got, hint = selection.kth_largest_per_channel(y, 0, m, hint)
        assert torch.equal(got, y.kthvalue(n - m + 1, dim=1).values)


@pytest.mark.parametrize(
    "shape, axis, bracketed",
    [
        ((8, 64, 56, 56), 1, True),
        ((3, 401408), 0, True),
        ((8, 1024, 64), 1, True),
        ((4, 40000), None, True),
        ((8, 128, 768), 2, False),  # channels-last: a plain selection on a channel-major copy
        ((1, 256, 32000), 2, False),  # a decoder's logits
    ],
)
def test_large_tensors_take_the_bracket_where_it_pays_and_stay_exact(shape, axis, bracketed):
    torch.manual_seed(0)
    hint = None
    for scale in (1.0, 1.3, 0.5):
        t = torch.randn(*shape).relu() * scale
        reference = selection.channel_major(selection.channel_view(t, axis))
        m = reference.shape[1] // 40
        got, hint = selection.kth_largest_per_channel(t, axis, m, hint)
        assert (hint is not None) == bracketed
        assert torch.equal(got, reference.kthvalue(reference.shape[1] - m + 1, dim=1).values)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 400),
    channels=st.integers(1, 40),
    fraction=st.floats(0.0, 0.07),
    values=st.sampled_from(["normal", "ties", "relu", "constant columns", "infinities"]),
    seed=st.integers(0, 2**16),
)
def test_channels_last_tournament_matches_kthvalue(rows, channels, fraction, values, seed):
    """Tokens x features: the tournament over blocks of rows gives kthvalue's answer, ties and all."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.randn(1, rows, channels, generator=generator)
    if values == "ties":
        t = t.round()
    elif values == "relu":
        t = t.relu()
    elif values == "constant columns":
        t[..., ::2] = 1.5
    elif values == "infinities":
        t[0, ::3, ::2] = -torch.inf
        t[0, ::7, 1::2] = torch.inf
    m = max(1, int(rows * fraction))
    got, hint = selection.kth_largest_per_channel(t, 2, m)
    reference = t[0].t().contiguous()
    assert hint is None
    assert torch.equal(got, reference.kthvalue(rows - m + 1, dim=1).values)


@pytest.mark.kernels  # the threshold follows NumPy's SIMD level: run again without AVX-512
@pytest.mark.parametrize("n", [1, 256, 257, 768, 769, 4096])
@pytest.mark.parametrize("values", ["normal", "ties", "nan"])
def test_numpys_sort_and_partition_select_what_kthvalue_does(n, values):
    """Rows up to ``_SORT_MAX_ROW`` values are sorted, longer ones partitioned (the threshold is 768
    with NumPy's AVX-512 kernels, 256 without): both sides give kthvalue's order statistic, NaN last."""
    rng = np.random.default_rng(n)
    y = torch.from_numpy(rng.standard_normal((5, n)).astype(np.float32))
    if values == "ties":
        y = y.round()
    elif values == "nan":
        y[0, rng.integers(0, n)] = np.nan
    for m in sorted({1, max(1, n // 100), n}):
        found = selection.select(y, m)
        expected = np.sort(y.numpy(), axis=1)[:, n - m]
        assert np.array_equal(found.numpy(), expected, equal_nan=True), (n, m)
        rows = slice(1, None) if values == "nan" else slice(None)  # kthvalue has no order for NaN
        assert torch.equal(found[rows], y[rows].kthvalue(n - m + 1, dim=1).values)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="m must lie"):
        selection.kth_largest_per_channel(torch.zeros(2, 5), 0, 6)


@pytest.mark.parametrize("n", [1000, 300_000, (1 << 24) + 5])
def test_the_percentile_observer_is_exact_and_takes_more_than_16m_values(n):
    """torch.quantile refuses more than 2**24 values; the observer selects, so it has no limit."""
    from qreport_widgets.engines.fx.observers import PercentileObserver

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    observer = PercentileObserver(percentile=99.9)
    observer(x)
    m = n - qreport_widgets.observe.observer.percentile_rank(0.999, n) + 1  # the same count clipped at each end
    ordered = x.sort().values
    assert float(observer.max_val) == float(ordered[n - m]) and float(observer.min_val) == float(ordered[m - 1])
    scale, _ = observer.calculate_qparams()
    assert float(scale) > 0
