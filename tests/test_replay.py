"""Replaying a graph from one kept run: a change recomputes only what depends on it, in-place ops included."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.fx
from torch import nn

from qreport_widgets.engines.fx.replay import Replay


class Residual(nn.Module):
    """In-place ops whose mutation only the mutating node sees: ReLU(inplace) after a conv, ``+=``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.Hardswish(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += x
        out = self.act(out)
        return self.head(out.mean((2, 3)))


class ViewMutation(nn.Module):
    """A value changed through a view while another node still reads it: no safe replay."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.scale = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        flat = y.view(-1)
        flat.mul_(2.0)
        return self.scale(y) + y


class ReadAfterMutation(nn.Module):
    """A value changed in place by an op whose result nothing reads, and read again after it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.scale = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        z = self.scale(y)
        y.mul_(2.0)
        return z + y


class Chain(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def node(model: torch.fx.GraphModule, target: str) -> torch.fx.Node:
    return next(n for n in model.graph.nodes if n.target == target)


def scaled(model: nn.Module, names: list[str], factor: float = 1.5):
    """configure(i): module ``names[i]``'s weight times ``factor``; configure(None): as it was."""
    originals = {name: model.get_submodule(name).weight.detach().clone() for name in names}

    def configure(i):
        for name, weight in originals.items():
            model.get_submodule(name).weight.copy_(weight)
        if i is not None:
            model.get_submodule(names[i]).weight.mul_(factor)

    return configure


def whole_passes(model: nn.Module, names: list[str], configure, batch: torch.Tensor) -> list[torch.Tensor]:
    found = []
    for i in range(len(names)):
        configure(i)
        found.append(model(batch.clone()))
    configure(None)
    return found


CASES = [
    (Residual, ["stem", "conv1", "conv2", "head"]),
    (ViewMutation, ["conv", "scale"]),
    (ReadAfterMutation, ["conv", "scale"]),
]


@pytest.mark.parametrize(("module", "changed"), CASES)
def test_each_variant_computed_from_its_first_change_matches_a_whole_pass(module, changed):
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(module().eval())
    replay = Replay(model)
    batches = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    configure = scaled(model, changed)
    with torch.no_grad():
        replay.learn(batches[0])
        plans = [replay.plan([node(model, name)]) for name in changed]
        for batch in batches:
            expected = whole_passes(model, changed, configure, batch)
            start = model(batch.clone())
            steps = []
            found = replay.outputs(batch.clone(), plans, configure, lambda steps=steps: steps.append(1))
            assert replay.exact and len(steps) == len(changed)
            for name, got, want in zip(changed, found, expected, strict=True):
                assert torch.equal(got, want), name
            assert torch.equal(model(batch.clone()), start)  # left in the starting configuration
    if module is Residual:  # relu_ and hardswish_ change their inputs
        assert {"conv1", "add"} <= {n.name for changed_values in replay._changes.values() for n in changed_values}


def test_keep_takes_each_output_as_it_is_computed_and_holds_only_what_it_returns():
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(Residual().eval())
    replay, changed = Replay(model), ["stem", "conv2", "head"]
    batch = torch.randn(2, 3, 8, 8)
    configure = scaled(model, changed)
    alive: list[weakref.ref] = []

    def keep(output: torch.Tensor) -> float:
        alive.append(weakref.ref(output))
        return float(output.square().sum())

    with torch.no_grad():
        replay.learn(batch)
        plans = [replay.plan([node(model, name)]) for name in changed] + [replay.plan([])]  # the last: unchanged
        expected = [*whole_passes(model, changed, configure, batch), model(batch.clone())]
        found = replay.outputs(batch.clone(), plans, configure, keep=keep)
    assert found == pytest.approx([float(e.square().sum()) for e in expected], rel=1e-6)
    assert len(alive) == len(plans) and all(ref() is None for ref in alive)  # no output outlived its keep()


def test_a_variant_recomputes_what_follows_its_first_change_and_nothing_before():
    model = torch.fx.symbolic_trace(Residual().eval())
    replay = Replay(model)
    replay.learn(torch.randn(1, 3, 4, 4))
    nodes = {n.target for n in replay.plan([node(model, "conv2")]).nodes}
    assert {"conv2", "act", "head"} <= nodes and not nodes & {"stem", "conv1", "relu"}
    assert replay.plan([]).nodes == []  # nothing changed: the starting run's output


class HeldViews(nn.Module):
    """``flat`` and ``y`` are the same memory, both held when ``side`` runs, then changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.side = nn.Conv2d(3, 4, 1)
        self.scale = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        flat = y.view(-1)
        side = self.side(x)
        flat.mul_(2.0)
        return self.scale(y) + y + side


def test_two_held_views_of_one_value_changed_in_place_are_refused():
    """A variant starting at ``side`` would copy ``flat`` and ``y`` and part them: whole passes instead."""
    model = torch.fx.symbolic_trace(HeldViews().eval())
    replay = Replay(model)
    batch = torch.randn(1, 3, 4, 4)
    with torch.no_grad():
        replay.learn(batch)
        replay.outputs(batch, [replay.plan([node(model, "conv")])], lambda i: None)
        assert replay.exact  # from before the view: nothing held is changed
        replay.outputs(batch, [replay.plan([node(model, "side")])], lambda i: None)
    assert not replay.exact


def test_what_is_alive_at_once_is_a_forward_pass_not_every_activation():
    """Forty layers, a variant starting at each: at most a few activations exist at any time."""
    torch.manual_seed(0)
    depth = 40
    model = torch.fx.symbolic_trace(Chain(depth).eval())
    alive, most = set(), [0]

    def watch(_module, _args, output):
        alive.add(id(output))
        weakref.finalize(output, alive.discard, id(output))
        most[0] = max(most[0], len(alive))

    names = [f"layers.{i}" for i in range(depth)]
    for name in names:
        model.get_submodule(name).register_forward_hook(watch)
    replay = Replay(model)
    batch = torch.randn(4, 16)
    with torch.no_grad():
        replay.learn(batch)
        most[0] = 0
        found = replay.outputs(batch, [replay.plan([node(model, name)]) for name in names], scaled(model, names))
    assert replay.exact and len(found) == depth
    assert most[0] <= 4, most[0]


def test_an_input_placed_after_the_first_change_is_read_from_the_starting_run():
    """FX puts an input's quantize right after it, before the next input: a variant starting there reads that input."""
    torch.manual_seed(0)
    root = nn.Module()
    root.conv, root.fc = nn.Conv2d(3, 4, 1), nn.Linear(5, 4)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    conv = graph.call_module("conv", (x,))
    meta = graph.placeholder("meta")
    fc = graph.call_module("fc", (meta,))
    pooled = graph.call_method("mean", (conv, (2, 3)))
    graph.output(graph.call_function(torch.add, (pooled, fc)))
    model = torch.fx.GraphModule(root, graph)
    replay = Replay(model)
    batch = (torch.randn(2, 3, 4, 4), torch.randn(2, 5))
    configure = scaled(model, ["conv", "fc"])
    with torch.no_grad():
        replay.learn(batch)
        found = replay.outputs(batch, [replay.plan([node(model, "conv")]), replay.plan([node(model, "fc")])], configure)
        for i, got in enumerate(found):
            configure(i)
            assert torch.equal(got, model(*batch))
