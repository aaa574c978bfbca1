"""The rounding learned on each decoder block's output (``algorithm="learned"``): what it promises on
tiny real decoders (transformers' Llama from a config, left at ``use_cache=True``; the trained byte
decoder) and through the session: never worse than its start on the calibration data, values on
the int4 grid, round to nearest's bytes, composed with rotations, refused where it cannot apply."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import VOCAB, _tokens
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import qreport_widgets as qw
from qreport_widgets.core.calibration import call_with
from qreport_widgets.core.progress import quiet
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.eager import learned
from qreport_widgets.engines.eager.algorithms import AlgorithmError, QuantizedWeight, round_to_nearest
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.errors import InvalidSettingsError

STEPS = learned.LearnedRounding(steps=30)


def decoder(layers: int = 3) -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    """A Llama decoder as ``from_config`` builds it (``use_cache=True``), its weights widened so
    int4 rounding costs something, and 6 batches of 4 x 16 tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.mul_(8.0)
    return model, [(ids,) for ids in _tokens(2)]


def block_linears(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn.startswith("model.layers.")]


def recorded(model: nn.Module, batches) -> learned.BlockInputs:
    blocks = learned.decoder_blocks(model, block_linears(model))
    inputs = learned.BlockInputs(model, blocks)
    with torch.no_grad():
        for batch in batches:
            call_with(model, batch)
    inputs.close()
    return inputs


def with_weights(model: nn.Module, weights: dict[str, QuantizedWeight]) -> nn.Module:
    copied = copy.deepcopy(model)
    for fqn, weight in weights.items():
        copied.get_submodule(fqn).weight = nn.Parameter(weight.dequantize(torch.float32), requires_grad=False)
    return copied


@pytest.fixture(scope="module")
def tiny():
    model, batches = decoder()
    return model, batches, recorded(model, batches)


def test_the_first_blocks_inputs_are_recorded_once_a_batch_the_kv_cache_dropped(tiny):
    model, batches, inputs = tiny
    assert inputs.chained and len(inputs.hidden) == len(batches) == 6
    assert inputs.hidden[0].shape == (4, 16, 64)
    arguments = inputs.arguments[1][0]
    assert arguments["past_key_values"] is None  # the model's DynamicCache is not replayed
    assert isinstance(arguments["position_embeddings"], tuple)


def test_each_block_ends_no_worse_than_round_to_nearest_on_the_calibration_batches(tiny):
    """On x86 (the full-range grid, whose start is not round to nearest's values), every block's
    output error summed over the calibration batches, from the inputs the learned blocks before it
    give, is no more than torchao's round to nearest's on those same inputs; the first block's,
    strictly less; and the whole model's logits closer to float."""
    model, batches, inputs = tiny
    names = block_linears(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    found = learned.learn_rounding(model, inputs, dict.fromkeys(names, 32), options=STEPS, progress=quiet)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in original.items())  # the float model untouched
    rounded = {fqn: QuantizedWeight(round_to_nearest(model.get_submodule(fqn).weight, 32)) for fqn in names}
    # every block's output error from the inputs the quantized blocks before it give, learned against rounding
    hidden = list(inputs.hidden)  # what the learned blocks before give
    float_hidden = list(inputs.hidden)
    assert len(inputs.blocks) > 1
    for position, name in enumerate(inputs.blocks):
        float_block = model.get_submodule(name)
        errors, given = {}, {}
        with torch.no_grad():
            target = [learned._call(float_block, h, a) for h, a in zip(float_hidden, inputs.arguments[position], strict=True)]
            for kind, weights in (("learned", found), ("rounded", rounded)):
                quantized = with_weights(model, weights).get_submodule(name)
                outputs = [learned._call(quantized, h, a) for h, a in zip(hidden, inputs.arguments[position], strict=True)]
                errors[kind] = sum(float((o - t).pow(2).sum(dtype=torch.float64)) for o, t in zip(outputs, target, strict=True))
                given[kind] = outputs
        float_hidden, hidden = target, given["learned"]
        assert errors["learned"] <= errors["rounded"] * (1 + 1e-6), (name, errors)  # every block: never worse
        if position == 0:
            assert errors["learned"] < errors["rounded"]
    # and the whole model's logits on the calibration batches
    reference = [model(*b).logits for b in batches]
    with torch.no_grad():
        error = {
            kind: sum(
                float((with_weights(model, w)(*b).logits - r).pow(2).sum()) for b, r in zip(batches, reference, strict=True)
            )
            for kind, w in (("learned", found), ("rounded", rounded))
        }
    assert error["learned"] < error["rounded"]


@pytest.mark.parametrize("full_range", [False, True], ids=["round-to-nearest-grid", "full-range-grid"])
def test_the_learned_values_stay_on_the_int4_grid(tiny, full_range):
    model, _, inputs = tiny
    names = block_linears(model)[:7]  # the first block's
    options = learned.LearnedRounding(steps=30, full_range=full_range)
    found = learned.learn_rounding(model, inputs, dict.fromkeys(names, 32), options=options, progress=quiet)
    changed, negative = 0, 0
    for fqn, weight in found.items():
        float_weight = model.get_submodule(fqn).weight
        tensor, rounded = weight.tensor, round_to_nearest(float_weight, 32)
        assert type(tensor) is type(rounded) and tensor.block_size == rounded.block_size
        assert tensor.qdata.dtype == torch.int8 and int(tensor.qdata.min()) >= -8 and int(tensor.qdata.max()) <= 7
        assert not bool(tensor.zero_point.any())
        grouped = float_weight.view(*tensor.scale.shape, 32)
        # each group's range clipped, never widened: from its largest weight over 7.5, or (full range) over 8
        widest = grouped.abs().amax(-1) / (8.0 if full_range else 7.5)
        ratio = tensor.scale.abs() / widest
        assert float(ratio.max()) <= 1 + 1e-5 and float(ratio.min()) >= learned.CLIP_FLOOR - 1e-6
        if full_range:  # negative where the group's extreme weight is positive: it lands on -8
            extreme = grouped.gather(-1, grouped.abs().argmax(-1, keepdim=True))[..., 0]
            assert torch.equal(tensor.scale < 0, extreme > 0)
            negative += int((tensor.scale < 0).sum())
        else:
            assert bool((tensor.scale > 0).all())
        # a value moves at most one step from where its clipped scale rounds it
        nearest = torch.clamp(torch.round(grouped / tensor.scale[..., None]), -8, 7)
        assert int((tensor.qdata.view_as(nearest).float() - nearest).abs().max()) <= 1
        changed += int((tensor.qdata != rounded.qdata).sum())
    assert changed > 0 and (negative > 0) == full_range


def test_the_full_range_grid_rounds_closer_and_is_refused_where_the_kernels_take_positive_scales_only(tiny):
    model, _, _ = tiny
    for fqn in block_linears(model)[:7]:
        weight = model.get_submodule(fqn).weight
        errors = {}
        for signed in (False, True):
            rounding = learned._Rounding.of(weight, 32, signed=signed)
            with torch.no_grad():
                errors[signed] = float((rounding.dequantized(*rounding.beginning) - weight).pow(2).sum())
        assert errors[True] < errors[False], fqn  # 16 values over the group's span, not 15 and a half
    assert learned.LearnedRounding().signed("x86") and not learned.LearnedRounding().signed("xnnpack")
    assert not learned.LearnedRounding(start="gptq").signed("x86")  # GPTQ's values sit on round to nearest's scales
    with pytest.raises(AlgorithmError, match="positive scales only"):
        learned.LearnedRounding(full_range=True).signed("xnnpack")
    with pytest.raises(AlgorithmError, match="starts from round to nearest"):
        learned.LearnedRounding(full_range=True, start="gptq").signed("x86")


def test_started_from_gptqs_values_it_ends_no_worse_than_them_on_the_first_block(tiny):
    model, _, inputs = tiny
    names = block_linears(model)[:7]  # the first block's: its inputs are the float ones for every start
    options = learned.LearnedRounding(steps=30, start="gptq")
    block = model.get_submodule(inputs.blocks[0])
    starts = learned._gptq_starts(block, inputs.blocks[0], dict.fromkeys(names, 32), inputs.hidden, inputs.arguments[0])
    assert starts  # where GPTQ's values beat rounding on held-out sequences they are the start, else rounding's
    found = learned.learn_rounding(model, inputs, dict.fromkeys(names, 32), options=options, progress=quiet)
    gptq_start = {}
    for fqn in names:
        rounded = round_to_nearest(model.get_submodule(fqn).weight, 32)
        values = starts.get(fqn, rounded.qdata)
        gptq_start[fqn] = QuantizedWeight(learned.int4_tensor(values, rounded.scale, 32, torch.float32))
        assert int(found[fqn].tensor.qdata.min()) >= -8 and int(found[fqn].tensor.qdata.max()) <= 7

    def first_block_error(weights):
        quantized = with_weights(model, weights).get_submodule(inputs.blocks[0])
        with torch.no_grad():
            return sum(
                float((learned._call(quantized, h, a) - learned._call(block, h, a)).pow(2).sum())
                for h, a in zip(inputs.hidden, inputs.arguments[0], strict=True)
            )

    assert first_block_error(found) <= first_block_error(gptq_start)


def test_through_the_session_in_both_layouts_and_rotated_at_round_to_nearests_program_bytes(monkeypatch):
    monkeypatch.setattr(learned, "LEARNED_STEPS", 20)
    monkeypatch.setattr(learned, "LEARNED_BATCHES", 1)
    model, batches = decoder(layers=2)
    results = {}
    for fmt, target in (("int4-weight-only", "x86"), ("int8-dynamic-int4-weight", "xnnpack")):
        session = qw.analyze(
            model,
            batches[0],
            batches,
            eval_data=batches[:2],
            engine="eager",
            format=fmt,
            group_size=32,
            target=target,
            progress=False,
        ).session
        names = block_linears(model)
        runs = [("rtn", None), ("learned", None)] + ([("learned", qw.Rotation())] if target == "x86" else [])
        for algorithm, rotation in runs:
            chosen = dict.fromkeys(names, ModuleSettings(format=fmt, group_size=32, algorithm=algorithm))
            run = session.apply(chosen, rotation=rotation, progress=quiet)
            assert run.ok, run.error
            results[target, algorithm, rotation is not None] = run
        # in the program's own runtime for XNNPACK, the int8 rounding of 8da4w's inputs learned with
        assert results[target, "learned", False].output_sqnr_db > results[target, "rtn", False].output_sqnr_db
        # plain int4 values and scales: the program (and its .pte) is round to nearest's, byte for byte
        assert results[target, "learned", False].deployed_bytes == results[target, "rtn", False].deployed_bytes
        # the whole-model stage says what it kept, with the divergence before and after
        stage = [n for n in results[target, "learned", False].notes if n.startswith("learned rounding: ")]
        assert len(stage) == 1 and "before" in stage[0] and "after" in stage[0], results[target, "learned", False].notes
    assert results["x86", "learned", True].output_sqnr_db > results["x86", "rtn", False].output_sqnr_db
    tensor = results["x86", "learned", False].quantized_model.get_submodule("model.layers.0.mlp.up_proj").weight
    assert int(tensor.qdata.min()) >= -8 and int(tensor.qdata.max()) <= 7


def test_outside_a_block_it_is_refused_and_as_code_it_builds_the_same_weights(monkeypatch):
    monkeypatch.setattr(learned, "LEARNED_STEPS", 10)
    monkeypatch.setattr(learned, "LEARNED_BATCHES", 1)
    model, batches = decoder(layers=2)
    session = qw.analyze(
        model, batches[0], batches, eval_data=batches[:2], engine="eager", format="int4-weight-only", progress=False
    ).session
    head = next(m for m in session.modules if m.fqn == "lm_head")
    assert "sits in no block" in head.algorithms["learned"]
    with pytest.raises(InvalidSettingsError, match="sits in no block"):
        session.apply({"lm_head": ModuleSettings(format="int4-weight-only", group_size=32, algorithm="learned")})
    with pytest.raises(AlgorithmError, match="sit in none"):
        qw.quantize_weights(copy.deepcopy(model), {"lm_head": ("learned", 32)}, batches)
    names = block_linears(model)[:7]
    copied = qw.quantize_weights(copy.deepcopy(model), dict.fromkeys(names, ("learned", 32)), batches)
    chosen = dict.fromkeys(names, ModuleSettings(format="int4-weight-only", group_size=32, algorithm="learned"))
    run = session.apply(chosen, progress=quiet)
    assert run.ok, run.error
    assert "quantize_weights" in session.settings_as_code(chosen) and "'learned'" in session.settings_as_code(chosen)
    for fqn in names:
        assert torch.equal(copied.get_submodule(fqn).weight.qdata, run.quantized_model.get_submodule(fqn).weight.qdata), fqn


def test_its_start_is_chosen_in_the_call_and_its_code_starts_there_too(monkeypatch):
    """``analyze(..., learned_start="gptq")``: the run, its simulation and its code learn from GPTQ's values."""
    from qreport_widgets.engines.contract import Variant

    monkeypatch.setattr(learned, "LEARNED_STEPS", 10)
    monkeypatch.setattr(learned, "LEARNED_BATCHES", 1)
    model, batches = decoder(layers=2)
    names = block_linears(model)[:7]  # the first block's
    chosen = dict.fromkeys(names, ModuleSettings(format="int4-weight-only", group_size=32, algorithm="learned"))
    options = {"eval_data": batches[:2], "engine": "eager", "format": "int4-weight-only", "progress": False}
    runs = {}
    for start in ("rtn", "gptq"):
        session = qw.analyze(model, batches[0], batches, learned_start=start, **options).session
        runs[start] = run = session.apply(chosen, progress=quiet)
        assert run.ok, run.error
        simulated, _ = session.simulate(Variant(settings=tuple(chosen.items())))
        assert simulated == pytest.approx(run.output_sqnr_db, abs=0.05)  # the simulation learns from the same start
        assert ("learned_start='gptq'" in session.settings_as_code(chosen)) == (start == "gptq")
    copied = qw.quantize_weights(copy.deepcopy(model), dict.fromkeys(names, ("learned", 32)), batches, learned_start="gptq")

    def values(found, fqn):
        return found.get_submodule(fqn).weight.qdata

    assert all(torch.equal(values(copied, fqn), values(runs["gptq"].quantized_model, fqn)) for fqn in names)
    assert not all(torch.equal(values(runs["rtn"].quantized_model, f), values(runs["gptq"].quantized_model, f)) for f in names)
    with pytest.raises(ValueError, match="learned_start must be 'rtn' or 'gptq', got 'hqq'"):
        qw.analyze(model, batches[0], batches, learned_start="hqq", **options)
    with pytest.raises(ValueError, match="learned_start= is not for engine='fx'"):
        qw.analyze(model, batches[0], batches, learned_start="gptq", progress=False)


def test_the_size_front_leaves_it_out_unless_asked():
    model, batches = decoder(layers=2)
    session = qw.analyze(model, batches[0], batches, engine="eager", format="int4-weight-only", progress=False).session
    assert "learned" not in session.engine.searched_algorithms
    asked = qw.analyze(
        model, batches[0], batches, engine="eager", format="int4-weight-only", algorithms=("rtn", "learned"), progress=False
    ).session
    assert "learned" in asked.engine.searched_algorithms


def divergence(model: nn.Module, weights: dict[str, QuantizedWeight], batches) -> float:
    """The quantized model's next-token divergence from float, summed over ``batches``."""
    quantized = with_weights(model, weights)
    with torch.no_grad():
        return sum(
            float(
                torch.nn.functional.kl_div(
                    torch.log_softmax(quantized(*b).logits, -1),
                    torch.log_softmax(model(*b).logits, -1),
                    log_target=True,
                    reduction="none",
                )
                .sum(-1)
                .mean()
            )
            for b in batches
        )


def test_the_whole_model_stage_tunes_the_scales_alone_and_keeps_them_only_where_they_lower_the_divergence(tiny):
    model, batches, inputs = tiny
    assert len(inputs.calls) == len(batches) and torch.equal(inputs.calls[0][0][0], batches[0][0])  # the model's own calls
    names = block_linears(model)
    blockwise = learned.learn_rounding(model, inputs, dict.fromkeys(names, 32), options=STEPS, progress=quiet)
    tuned, note = learned.tune_scales(model, inputs.calls, blockwise, options=learned.LearnedRounding(epochs=3), progress=quiet)
    assert note.startswith(learned.TUNED)
    for fqn in names:  # the int4 values are the block-wise ones; only the group scales moved
        assert torch.equal(tuned[fqn].tensor.qdata, blockwise[fqn].tensor.qdata), fqn
        assert tuned[fqn].tensor.scale.shape == blockwise[fqn].tensor.scale.shape
        assert not tuned[fqn].note
    assert any(not torch.equal(tuned[f].tensor.scale, blockwise[f].tensor.scale) for f in names)
    assert divergence(model, tuned, batches) < divergence(model, blockwise, batches)
    # a step size that throws the scales far off ends worse than it started: the block-wise weights are kept
    wild = learned.LearnedRounding(epochs=1, tuning_rate=50.0)
    kept, note = learned.tune_scales(model, inputs.calls, blockwise, options=wild, progress=quiet)
    assert note.startswith(learned.TUNING_KEPT) and all(kept[f] is blockwise[f] for f in names)
    # none asked: nothing done
    assert learned.tune_scales(model, inputs.calls, blockwise, options=learned.LearnedRounding(epochs=0)) == (blockwise, "")


class _Knob:
    """A block argument that is no tensor (as a flex-attention ``BlockMask`` is): the factor a block scales by."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


class _KnobCache(_Knob):
    """A KV cache by its name that shapes the output: what the replay drops, and its check catches."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(32, 32)

    def forward(self, hidden: torch.Tensor, knob: _Knob | None = None) -> torch.Tensor:
        return hidden + self.mlp(hidden) * (1.0 if knob is None else knob.factor)


class _KnobbedDecoder(nn.Module):
    def __init__(self, knob: _Knob) -> None:
        super().__init__()
        self.knob = knob
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden, knob=self.knob)
        return self.head(hidden)


def test_a_blocks_argument_that_is_no_tensor_is_replayed_as_given_and_one_not_replayed_is_caught():
    """The keyword arguments a model gives its blocks are replayed as they were given, objects
    included (a flex-attention ``BlockMask``; once turned into None, unchecked); a KV cache is dropped,
    and the first block replayed is checked against what it gave in the model: a dropped argument
    that changed the output is refused, named."""
    torch.manual_seed(0)
    batches = [(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    names = {"layers.0.mlp": 32, "layers.1.mlp": 32}

    def recorded_blocks(model):
        inputs = learned.BlockInputs(model, ["layers.0", "layers.1"])
        with torch.no_grad():
            for batch in batches:
                call_with(model, batch)
        inputs.close()
        return inputs

    model = _KnobbedDecoder(_Knob(0.25)).eval()
    inputs = recorded_blocks(model)
    assert isinstance(inputs.arguments[0][0]["knob"], _Knob) and not inputs.dropped
    found = learned.learn_rounding(model, inputs, names, options=learned.LearnedRounding(steps=3), progress=quiet)
    assert set(found) == set(names)
    cached = _KnobbedDecoder(_KnobCache(0.25)).eval()
    with pytest.raises(AlgorithmError, match=r"not replayed: knob.*layers\.0 replayed gives another output"):
        learned.learn_rounding(cached, recorded_blocks(cached), names, options=learned.LearnedRounding(steps=3), progress=quiet)


def test_a_block_whose_start_is_worse_than_round_to_nearest_keeps_round_to_nearest(tiny):
    """On x86 the learned rounding starts from the full-range grid (each group's extreme weight on -8),
    which clips the other side of a group whose largest weights are nearly equal and opposite: there
    round to nearest is the better start. With no step to learn from, every block keeps torchao's round to
    nearest (its note saying so), not the start: never worse than round to nearest, as promised."""
    model, batches, _ = tiny
    model = copy.deepcopy(model)
    names = block_linears(model)
    with torch.no_grad():  # each group of 32: its largest weight +m, five more at -0.99 m
        for fqn in names:
            weight = model.get_submodule(fqn).weight
            groups = weight.view(weight.shape[0], -1, 32)
            largest = 2 * groups.abs().amax(-1, keepdim=True)
            groups[..., :1], groups[..., 1:6] = largest, -0.99 * largest
    inputs = recorded(model, batches)
    options = learned.LearnedRounding(steps=0, epochs=0)
    found = learned.learn_rounding(model, inputs, dict.fromkeys(names, 32), options=options, target="x86", progress=quiet)
    for fqn in names:
        nearest = round_to_nearest(model.get_submodule(fqn).weight, 32)
        assert torch.equal(found[fqn].tensor.qdata, nearest.qdata) and torch.equal(found[fqn].tensor.scale, nearest.scale), fqn
        assert found[fqn].note == learned.KEPT


def test_the_simulation_learns_a_variant_in_its_whole_configuration_as_the_real_run_does(monkeypatch):
    """A block's learned rounding depends on every other Linear's format (the block's others in the
    loop, the blocks before it through their outputs, all of them in the whole-model stage). A mixed
    variant (q / k / v learned, the rest of the blocks GPTQ or round to nearest) is simulated with the
    learned weights its real run computes, bit for bit, and another mix learns again; the simulation
    once took values learned with every other Linear float for any of them."""
    monkeypatch.setattr(learned, "LEARNED_STEPS", 4)
    monkeypatch.setattr(learned, "LEARNED_EPOCHS", 1)
    model, batches = decoder(layers=2)
    session = qw.analyze(
        model, batches[0], batches[:4], eval_data=batches[4:], engine="eager", format="int4-weight-only", progress=False
    ).session
    names = block_linears(model)

    def mix(rest: str) -> dict[str, ModuleSettings]:
        return {
            fqn: ModuleSettings(
                format="int4-weight-only",
                group_size=32,
                algorithm="learned" if fqn.endswith(("q_proj", "k_proj", "v_proj")) else rest,
            )
            for fqn in names
        }

    simulation = session.parts.simulated.simulation()
    for rest in ("gptq", "rtn"):
        settings = mix(rest)
        run = session.apply(settings)
        assert run.ok, run.error
        simulation.configure(Variant(settings=tuple(settings.items())))
        for fqn in names:
            real = run.quantized_model.get_submodule(fqn).weight.dequantize()
            assert torch.equal(simulation.model.get_submodule(fqn).weight, real), (rest, fqn)
        simulation.configure(())
