"""The eager simulation's passes: blocks before a variant's first change give back the previous
pass's outputs (the same values as whole passes, bit for bit), and int8 tokens fake-quantized as
torchao quantizes them."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama
from torch import nn

from qreport_widgets.core.calibration import call_with
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.eager import EagerConfig, EagerEngine, simulate
from qreport_widgets.engines.eager.formats import fake_quantized_tokens, torchao_eager
from qreport_widgets.engines.eager.simulate import EagerSimulation
from qreport_widgets.engines.settings import ModuleSettings


def simulation(model: nn.Module, batches, format: str = "int8-dynamic") -> EagerSimulation:
    engine = EagerEngine()
    prepared = engine.prepare(model, EagerConfig(linears=format, group_size=32), batches[0])
    return engine.simulator(prepared, engine.tunable_modules(prepared), model, batches[0], lambda m: None)


def sweep(sim: EagerSimulation) -> list[Variant]:
    """Every module alone in each of two formats, then two modules at once: the variants a
    sensitivity and a size front go through."""
    names = list(sim.tunable)
    variants = [Variant()]
    for name in names:
        variants.append(Variant(frozenset({name})))
        variants.append(Variant(settings=frozenset({(name, ModuleSettings(format="int8-weight-only"))})))
    variants.append(Variant(frozenset({names[-1], names[1]})))
    return variants


def whole_passes(sim: EagerSimulation, batches, variants) -> list[list[torch.Tensor]]:
    found = []
    for variant in variants:
        sim.configure(variant)
        with torch.no_grad():
            found.append([call_with(sim.model, batch) for batch in batches])
    sim.configure(())
    return found


def test_passes_from_the_first_changed_block_give_what_whole_passes_give_bit_for_bit():
    model, batches = tiny_llama()
    sim = simulation(model, batches)
    variants = sweep(sim)
    expected = whole_passes(sim, batches, variants)
    outputs = sim.outputs_each(batches, variants)
    for want, got in zip(expected, outputs, strict=True):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a.logits, b.logits)
    assert sim._replay.on
    blocks = len(sim._replay._blocks)
    assert blocks >= 2
    # the second block's and the head's variants start past the blocks before them: a quarter of the
    # block calls on this two-block model (half a block a variant); on a deep one, about half
    assert sim._replay.skipped >= 0.25 * blocks * len(batches) * len(variants)
    # outputs asked again, one variant at a time and out of order: still the same values
    for index in (5, 1, 0, len(variants) - 1):
        again = sim.outputs(batches, variants[index])
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(expected[index], again, strict=True))


class Shared(nn.Module):
    """One numbered block called twice a pass, and a block whose output the next one writes into."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        x = self.layers[1](x)
        x.mul_(0.5)  # written into after the block returned it
        x = self.layers[2](x)
        return self.head(self.layers[2](x) if self.twice else x)

    twice = False


@pytest.mark.parametrize("twice", [False, True])
def test_a_block_called_twice_turns_replay_off_and_an_output_written_into_is_kept_unchanged(twice):
    model = Shared().eval()
    model.twice = twice
    batches = [(torch.randn(8, 16),) for _ in range(3)]
    sim = simulation(model, batches, format="int8-weight-only")
    variants = sweep(sim)
    expected = whole_passes(sim, batches, variants)
    outputs = sim.outputs_each(batches, variants)
    assert all(torch.equal(a, b) for want, got in zip(expected, outputs, strict=True) for a, b in zip(want, got, strict=True))
    assert sim._replay.on is not twice
    assert (sim._replay.skipped > 0) is not twice


def _torchaos(x: torch.Tensor, symmetric: bool) -> torch.Tensor:
    ao = torchao_eager()
    mapping = ao.MappingType.SYMMETRIC if symmetric else ao.MappingType.ASYMMETRIC
    return ao.Int8Tensor.from_hp(x, ao.PerRow(), mapping_type=mapping).dequantize().to(x.dtype)


@pytest.mark.parametrize("symmetric", [True, False])
def test_tokens_fake_quantized_are_torchaos_int8_tokens_bit_for_bit(symmetric):
    g = torch.Generator().manual_seed(0)
    edge = torch.randn(6, 16, generator=g)
    edge[1], edge[2], edge[3, :8] = 0.0, 5.0, -0.0  # all zero, constant, signed zeros
    cases = [
        torch.randn(4, 64, 96, generator=g) * 30,
        torch.rand(8, 100, generator=g),  # no negative value: the range still holds 0
        -torch.rand(8, 100, generator=g),
        torch.randn(5, 16, generator=g) * 1e-20,  # below the smallest scale
        torch.randn(7, 33, generator=g) * 1e6,
        torch.randn(2, 3, 4, 5, generator=g),
        edge,
    ]
    for x in cases:
        assert torch.equal(fake_quantized_tokens(x, symmetric), _torchaos(x, symmetric)), x.shape
    half = torch.randn(4, 32, generator=g).to(torch.bfloat16)  # other dtypes go through torchao itself
    assert torch.equal(fake_quantized_tokens(half, symmetric), _torchaos(half, symmetric))


def test_the_linears_that_read_one_input_quantize_it_once_and_give_what_each_quantizing_it_gives(monkeypatch, shortcuts_as_taken):
    """q / k / v and gate / up read one tensor: a dynamic format's simulation quantizes it once for
    them (4 quantizations a Llama block, not 7), the outputs equal bit for bit to each Linear
    quantizing its own input; an input written into since is quantized again."""
    model, batches = tiny_llama()
    sim = simulation(model, batches)
    calls = []
    quantized = simulate._input_quantized
    monkeypatch.setattr(simulate, "_input_quantized", lambda *given: calls.append(1) or quantized(*given))
    with torch.no_grad():
        shared = call_with(sim.model, batches[0]).logits
    shared_calls = len(calls)
    each = sim._quantized_input

    def fresh(fqn: str, x: torch.Tensor) -> torch.Tensor:
        sim._last_input.forget()
        return each(fqn, x)

    monkeypatch.setattr(sim, "_quantized_input", fresh)
    calls.clear()
    with torch.no_grad():
        own = call_with(sim.model, batches[0]).logits
    assert torch.equal(shared, own)
    blocks = model.config.num_hidden_layers
    assert len(calls) - shared_calls == 3 * blocks and shared_calls == 4 * blocks + 1  # and the head
    monkeypatch.undo()
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    x = torch.randn(2, 8, model.config.hidden_size)
    first = sim._quantized_input(q, x)
    assert sim._quantized_input(k, x) is first
    x.add_(1.0)
    assert torch.equal(sim._quantized_input(k, x), simulate._input_quantized(x, sim._inputs[k], sim._input_scales[k]))
