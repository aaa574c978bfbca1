"""Invariants over random small models and data (hypothesis).

Random stacks of Linear / Conv1d / Conv2d layers (grouped or not) with random channel counts on
2-D, 3-D and 4-D inputs, ReLU / GELU / none between them and residual adds where shapes allow, run on random data
(batch size 1 included, constant channels included):

- analyze, generate_model_report, ReportFrame and the widget never raise;
- each layer's observed input statistics and per-input-channel weight ranges equal a numpy
  reference computed from the float model;
- generating the report again gives identical tables, and save/load gives them back exactly;
- the caller's float model is bit-identical afterwards.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from conftest import assert_unchanged, fingerprint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import qreport_widgets as qw
from qreport_widgets.core import features as F

KINDS = {2: "linear", 3: "token_linear", 4: "conv2d", -3: "conv1d"}  # -3: (batch, channels, length)


@dataclass(frozen=True)
class Spec:
    rank: int  # 2, 3 or 4; -3 for Conv1d inputs
    widths: tuple[int, ...]  # input channels, then each layer's output channels
    activations: tuple[str, ...]
    residual: tuple[bool, ...]
    batches: int
    batch_size: int
    scale: float
    constant_channel: bool
    seed: int
    grouped: bool = False  # Conv1d / Conv2d layers use the largest group count both widths allow


class RandomNet(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        layers, acts = [], []
        for cin, cout, act in zip(spec.widths[:-1], spec.widths[1:], spec.activations, strict=True):
            groups = math.gcd(cin, cout) if spec.grouped else 1
            if spec.rank == 4:
                layers.append(nn.Conv2d(cin, cout, 3, padding=1, groups=groups))
            elif spec.rank == -3:
                layers.append(nn.Conv1d(cin, cout, 1, groups=groups))
            else:
                layers.append(nn.Linear(cin, cout))
            acts.append({"relu": nn.ReLU(), "gelu": nn.GELU(), "none": nn.Identity()}[act])
        self.layers, self.acts = nn.ModuleList(layers), nn.ModuleList(acts)
        # a residual add where the layer keeps the width (decided here: FX cannot branch on shapes)
        self.adds = [r and cin == cout for r, cin, cout in zip(spec.residual, spec.widths[:-1], spec.widths[1:], strict=True)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, act, add in zip(self.layers, self.acts, self.adds, strict=True):
            y = act(layer(x))
            x = x + y if add else y
        return x


@st.composite
def specs(draw) -> Spec:
    rank = draw(st.sampled_from(list(KINDS)))
    depth = draw(st.integers(1, 3))
    widths = tuple(draw(st.lists(st.integers(1, 9), min_size=depth + 1, max_size=depth + 1)))
    return Spec(
        rank=rank,
        widths=widths,
        activations=tuple(draw(st.lists(st.sampled_from(["relu", "gelu", "none"]), min_size=depth, max_size=depth))),
        residual=tuple(draw(st.lists(st.booleans(), min_size=depth, max_size=depth))),
        batches=draw(st.integers(1, 3)),
        batch_size=draw(st.integers(1, 3)),
        scale=draw(st.sampled_from([1e-3, 1.0, 1e3])),
        constant_channel=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        grouped=draw(st.booleans()),
    )


def make_batches(spec: Spec) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(spec.seed)
    channels = spec.widths[0]
    shape = {2: (channels,), 3: (4, channels), 4: (channels, 5, 5), -3: (channels, 6)}[spec.rank]
    batches = []
    for _ in range(spec.batches):
        x = torch.randn(spec.batch_size, *shape, generator=g) * spec.scale
        if spec.constant_channel:
            x[..., 0] = 0.5 if spec.rank in (2, 3) else x[..., 0]
            if spec.rank in (4, -3):
                x[:, 0] = 0.5
        batches.append((x,))
    return batches


def channel_axis(spec: Spec, ndim: int) -> int:
    return ndim - 1 if spec.rank in (2, 3) else 1


def layer_inputs(model: nn.Module, batches) -> dict[str, list[np.ndarray]]:
    """Each Linear/Conv layer's input in every batch, from the float model."""
    seen: dict[str, list[np.ndarray]] = {}
    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: seen.setdefault(name, []).append(args[0].numpy().copy()))
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d))
    ]
    with torch.no_grad():
        for batch in batches:
            model(*batch)
    for hook in hooks:
        hook.remove()
    return seen


def reference_weight_ranges(layer: nn.Module) -> tuple[np.ndarray, np.ndarray]:
    weight = layer.weight.detach().numpy()
    groups = getattr(layer, "groups", 1)
    per_group_out, per_group_in = weight.shape[0] // groups, weight.shape[1]
    low, high = [], []
    for c in range(per_group_in * groups):
        group = c // per_group_in
        filters = weight[group * per_group_out : (group + 1) * per_group_out, c % per_group_in]
        low.append(filters.min())
        high.append(filters.max())
    return np.array(low, dtype=np.float32), np.array(high, dtype=np.float32)


def per_channel(arrays: list[np.ndarray], axis: int) -> np.ndarray:
    """(batches, channels, values) as one array per batch, channel-major."""
    return [np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1) for a in arrays]


# QREPORT_PROPERTY_EXAMPLES=300 for a longer hunt than the 30 examples make test draws
@settings(
    max_examples=int(os.environ.get("QREPORT_PROPERTY_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(spec=specs())
def test_random_models_never_break_the_pipeline_and_match_numpy(spec, tmp_path_factory):
    torch.manual_seed(spec.seed)
    model = RandomNet(spec).eval()
    batches = make_batches(spec)
    before = fingerprint(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # degenerate random data warns by design; here we check values
        report = qw.analyze(model, batches[0], batches, progress=False)
        first = copy.deepcopy(report.frame())
        report.generate_model_report()
        again = report.frame()
        report.widget()
    for table in ("modules", "channels", "suggestions"):  # idempotent
        pd.testing.assert_frame_equal(getattr(first, table), getattr(again, table), check_exact=True)

    # numpy reference: each layer's per-channel input min / max and the dynamic-vs-static statistic
    inputs = layer_inputs(model, batches)
    modules = again.modules
    for name, arrays in inputs.items():
        rows = per_channel(arrays, channel_axis(spec, arrays[0].ndim))
        stacked = np.concatenate(rows, axis=1)
        if name not in modules.index:
            continue
        np.testing.assert_array_equal(again.channel_values(name, F.INPUT_PER_CHANNEL_MAX), stacked.max(1).astype(np.float32))
        np.testing.assert_array_equal(again.channel_values(name, F.INPUT_PER_CHANNEL_MIN), stacked.min(1).astype(np.float32))
        constant = np.sum([r.min(1) == r.max(1) for r in rows], axis=0)
        np.testing.assert_array_equal(again.channel_values(name, F.CONSTANT_BATCH_COUNTS), constant)
        batch_ranges = np.array([a.max() - a.min() for a in arrays], dtype=np.float64)
        epoch_range = float(stacked.max()) - float(stacked.min())
        expected = batch_ranges.mean() / epoch_range if epoch_range > 0 else np.nan
        np.testing.assert_allclose(modules.at[name, F.INPUT_COMP_STAT], expected, rtol=1e-5, equal_nan=True)
    assert set(inputs) & set(modules.index), "no layer was observed"

    # weight ranges per input channel; a grouped conv's input channel meets only its group's filters
    for name, layer in model.named_modules():
        if name in modules.index and isinstance(layer, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            low, high = reference_weight_ranges(layer)
            np.testing.assert_array_equal(again.channel_values(name, F.WEIGHT_PER_CHANNEL_MIN), low)
            np.testing.assert_array_equal(again.channel_values(name, F.WEIGHT_PER_CHANNEL_MAX), high)

    # save / load gives every table back exactly
    loaded = qw.load_report(report.save(tmp_path_factory.mktemp("saved") / "random.qreport"))
    for table in ("modules", "channels", "suggestions"):
        pd.testing.assert_frame_equal(getattr(again, table), getattr(loaded.frame(), table), check_exact=True)

    # the caller's float model: parameters, buffers, structure and traced graph unchanged
    assert_unchanged(model, before)
