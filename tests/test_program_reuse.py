"""A program lowered before, reused where only the weights changed (``engines/program_reuse.py``):
the bytes a fresh lowering gives, and a full lowering wherever that cannot be shown.

On a one-block tiny Llama, every Linear 8da4w in groups of 32 as the eager engine's XNNPACK target lowers
it (``DYNAMIC`` partitioner, quantized-op fusion). The session's own reuse (a second algorithm on
the trained decoder's phone program) is checked in ``test_eager_xnnpack.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import tiny_llama

pytest.importorskip("executorch", reason="the [executorch] extra is not installed")

from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # noqa: E402
from torchao.quantization.granularity import PerGroup  # noqa: E402

from qreport_widgets.core.metrics import sqnr_db  # noqa: E402
from qreport_widgets.core.progress import Stopped  # noqa: E402
from qreport_widgets.engines import program_reuse  # noqa: E402
from qreport_widgets.engines.executorch import DYNAMIC, _exported, lower  # noqa: E402


def quantized(model, group_size: int = 32):
    model = copy.deepcopy(model)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)))
    return model


def lowered(model, example):
    return lower(model, example, partitioner=DYNAMIC, fuse_quantized_ops=True)


def lowered_fresh(model, example):
    """``model`` lowered in full, whatever was lowered before (the programs held for reuse put back after)."""
    held = dict(program_reuse.LOWERED)
    program_reuse.LOWERED.clear()
    try:
        return lowered(model, example)
    finally:
        program_reuse.LOWERED.update(held)


def structure_of(model, example):
    return program_reuse.structure(_exported(model, example, free_batch=False), DYNAMIC, True)


def with_weights(model, **changes):
    """A copy of ``model`` with Linear weights changed: ``name=factor`` scales every weight whose
    module name ends with ``name``; ``name=other`` copies module ``other``'s weight there."""
    model = copy.deepcopy(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, change in changes.items():
            for fqn, module in modules.items():
                if fqn.endswith(name):
                    if isinstance(change, str):
                        module.weight.copy_(modules[change].weight)
                    else:
                        module.weight.mul_(change)
    return model


@pytest.fixture(scope="module")
def decoder():
    """A one-block tiny Llama with its k_proj and v_proj weights alike (XNNPACK stores their int4
    values and scales once, under one key each), quantized and lowered: every test's earlier program."""
    model, batches = tiny_llama(layers=1)
    model = with_weights(model, v_proj="model.layers.0.self_attn.k_proj")
    example = batches[0]
    first = lowered(quantized(model), example)
    assert first.reused == "" and first.structure is not None
    return model, example, first


def rewritten(first, model, example):
    return program_reuse.rewritten(first.pte, first.structure, structure_of(quantized(model), example))


def test_other_int4_values_are_written_into_the_earlier_program_and_it_runs(decoder, shortcuts_as_taken):
    model, example, first = decoder
    program_reuse.LOWERED[first.structure.key] = first
    other = quantized(with_weights(model, proj=1.03))  # every Linear's int4 values and scales move, the twins alike
    program = lowered(other, example)
    assert "lowered before" in program.reused and "changed weights and scales" in program.reused
    assert len(program.pte) == len(first.pte) and program.pte != first.pte
    # the program computes with the new weights: as close to the eager model it was lowered from as the first is to its own
    logits, eager = program(*example).logits, other(*example).logits
    assert torch.nn.functional.cosine_similarity(logits.flatten(), eager.flatten(), dim=0) > 0.99
    # and it is, byte for byte, the program a fresh lowering of the new weights gives
    fresh = lowered_fresh(other, example)
    assert fresh.reused == "" and fresh.pte == program.pte


def test_constants_outside_the_delegates_are_written_into_the_earlier_edge_program_and_serialised_again(
    decoder, shortcuts_as_taken
):
    model, example, first = decoder
    program_reuse.LOWERED[first.structure.key] = first
    assert first.edge is not None  # a decoder's edge program kept beside its program
    other = with_weights(model, proj=1.03, input_layernorm=1.5, post_attention_layernorm=0.7)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.2)  # three norms alike (all 1: one blob) now apart: three blobs
        other.model.embed_tokens.weight.mul_(0.9)  # the embedding ExecuTorch's own kernel reads
    other = quantized(other)
    program = lowered(other, example)
    assert "serialised again" in program.reused and "4 changed constants that ExecuTorch's own kernels read" in program.reused
    assert program.edge is first.edge  # the lowering's edge program and what it holds, for the next
    fresh = lowered_fresh(other, example)
    assert fresh.reused == "" and fresh.pte == program.pte and len(program.pte) > len(first.pte)  # the bytes of a lowering
    logits, eager = program(*example).logits, other(*example).logits
    assert torch.nn.functional.cosine_similarity(logits.flatten(), eager.flatten(), dim=0) > 0.99


def test_the_same_weights_reuse_the_program_as_it_is(decoder):
    model, example, first = decoder
    program_reuse.LOWERED[first.structure.key] = first
    program = lowered(quantized(model), example)
    assert program.pte == first.pte and "weights are the same" in program.reused


def test_another_graph_or_constant_shape_has_another_structure(decoder):
    model, example, first = decoder
    assert structure_of(quantized(model), example).key == first.structure.key
    assert structure_of(quantized(model, group_size=64), example).key != first.structure.key  # scales of another shape
    longer = (torch.cat([example[0], example[0]], dim=1),)
    assert structure_of(quantized(model), longer).key != first.structure.key  # another sequence length
    assert rewritten(first, model, longer) is None


def test_what_a_lowering_would_store_otherwise_is_lowered_in_full(decoder):
    model, example, first = decoder
    assert rewritten(first, model, example).constants == 0
    # a norm's weight is the program's own constant (ExecuTorch's kernels read it), not XNNPACK's
    assert rewritten(first, with_weights(model, input_layernorm=1.5), example) is None
    # two weights stored apart that become alike: a lowering stores them once
    assert rewritten(first, with_weights(model, up_proj="model.layers.0.mlp.gate_proj"), example) is None
    # one blob stored for two weights, one of them changed: a lowering stores two
    assert rewritten(first, with_weights(model, v_proj=1.1), example) is None
    # both changed alike: still one blob
    assert rewritten(first, with_weights(model, k_proj=1.1, v_proj=1.1), example).constants == 4


def test_a_lowering_reports_its_stages_and_a_callback_that_raises_stops_it(decoder):
    model, example, first = decoder
    program_reuse.LOWERED[first.structure.key] = first
    counts = []
    program = lower(quantized(model), example, partitioner=DYNAMIC, fuse_quantized_ops=True, progress=lambda *c: counts.append(c))
    assert "weights are the same" in program.reused and counts == [(1, 3), (2, 3), (3, 3)]  # export, rewriting, serialised

    def stop(done, total):
        raise Stopped

    with pytest.raises(Stopped):  # after the export: no lowering error, nothing lowered
        lower(quantized(with_weights(model, proj=0.5)), example, partitioner=DYNAMIC, fuse_quantized_ops=True, progress=stop)


def test_a_run_of_rewrites_each_gives_a_fresh_lowerings_bytes_and_follows_its_own_model(decoder, shortcuts_as_taken):
    """Four lowerings in a row on one graph: the baseline; ``up_proj`` changed (its delegated weights
    written into the program); the same and a norm changed (the edge program, which still holds the
    baseline's delegates, serialised again and every delegated change since it written in); the same
    and ``down_proj`` changed. Each program is the bytes a fresh lowering gives (lowered afresh here:
    the check mode would lower each again)."""
    model, example, first = decoder
    program_reuse.LOWERED.clear()
    program_reuse.LOWERED[first.structure.key] = first
    up = with_weights(model, up_proj=1.1)
    normed = with_weights(up, post_attention_layernorm=1.3)
    down = with_weights(normed, down_proj=0.9)
    said = ["changed weights and scales", "serialised again", "changed weights and scales"]
    for changed, words in zip((up, normed, down), said, strict=True):
        other = quantized(changed)
        program = lowered(other, example)
        assert words in program.reused and program.edge is first.edge
        fresh = lowered_fresh(other, example)
        assert fresh.pte == program.pte
    eager = other(*example).logits
    assert sqnr_db(eager, program(*example).logits) == pytest.approx(sqnr_db(eager, fresh(*example).logits), abs=1e-6)
