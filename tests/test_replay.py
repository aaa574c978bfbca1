"""Replaying a graph from one kept run: a change recomputes only what depends on it, in-place ops included."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from qreport_widgets.fx.replay import Replay


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


def node(model: torch.fx.GraphModule, target: str) -> torch.fx.Node:
    return next(n for n in model.graph.nodes if n.target == target)


@pytest.mark.parametrize("changed", ["stem", "conv1", "conv2", "head"])
def test_a_changed_module_recomputes_its_descendants_and_matches_a_whole_pass(changed):
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(Residual().eval())
    replay = Replay(model)
    nodes = replay.affected([node(model, changed)])
    batches = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    with torch.no_grad():
        kept = [replay.run(batch, replay.inputs_of(nodes)) for batch in batches]
        assert replay.exact and {n.name for n in replay._mutated} == {"conv1", "add"}  # relu_, hardswish_
        before = [model(batch) for batch in batches]
        weight = model.get_submodule(changed).weight
        original = weight.clone()
        weight.mul_(1.5)
        for batch, values, old in zip(batches, kept, before, strict=True):
            assert torch.equal(replay.rerun(values, nodes), model(batch))
            assert not torch.equal(model(batch), old)
            assert torch.equal(replay.rerun(values, []), old)  # nothing changed: the kept output
        weight.copy_(original)
        for values, old in zip(kept, before, strict=True):  # the kept values were not mutated
            assert torch.equal(replay.rerun(values, nodes), old)


def test_an_unchanged_module_is_not_recomputed():
    model = torch.fx.symbolic_trace(Residual().eval())
    nodes = {n.target for n in Replay(model).affected([node(model, "conv2")])}
    assert {"conv2", "act", "head"} <= nodes and not nodes & {"stem", "conv1", "relu"}


def test_a_mutation_through_a_view_is_detected():
    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(ViewMutation().eval())
    replay = Replay(model)
    with torch.no_grad():
        replay.run(torch.randn(1, 3, 4, 4), replay.inputs_of(replay.affected([node(model, "scale")])))
    assert not replay.exact
