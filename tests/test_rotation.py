"""Rotations folded into a decoder's weights (``engines/rotation.py``): the rotated float model gives
the same logits to float32 round-off, the user's model is not changed, architectures the rotations do
not commute with are refused naming why, and a session's run takes a rotation."""

from __future__ import annotations

import copy
import math

import pandas as pd
import pytest
import torch
from conftest import assert_unchanged, fingerprint
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import qreport_widgets as qw
from qreport_widgets.core.metrics import is_float_output, perplexity, sqnr_db
from qreport_widgets.core.progress import quiet
from qreport_widgets.engines import build_engine, rotation
from qreport_widgets.engines.rotation import ONLINE_HADAMARD, hadamard, matrix_words, random_rotation


def decoder(hidden: int = 48, tied: bool = True) -> LlamaForCausalLM:
    """A Llama layout at its config's defaults (use_cache=True) with norms away from 1, so folding them matters."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("order", [1, 2, 12, 20, 48, 64, 240, 576, 1536])
def test_hadamard_matrices_of_the_orders_decoders_use(order):
    h = hadamard(order)
    assert torch.equal(h @ h.T, order * torch.eye(order, dtype=torch.float64))
    q = random_rotation(order, torch.Generator().manual_seed(0))
    assert torch.allclose(q @ q.T, torch.eye(order, dtype=torch.float64), atol=1e-12)


def test_an_order_without_a_hadamard_matrix_is_said_with_its_cost():
    model = decoder(48, tied=False)  # intermediate 96 = 8 x 12: a Hadamard order; 48 = 4 x 12 too
    assert "R4: a Hadamard matrix of order 96" in matrix_words(model, qw.Rotation(down=True))
    model.config.intermediate_size = 100
    odd = LlamaForCausalLM(model.config).eval()
    said = matrix_words(odd, qw.Rotation(down=True))
    assert "R4: no Hadamard matrix of order 100 is built here" in said and "10,000 multiply-adds a token" in said


def test_an_order_without_a_hadamard_matrix_here_gets_a_random_orthogonal_one():
    assert hadamard(60) is None
    q = random_rotation(60, torch.Generator().manual_seed(0))
    assert torch.allclose(q @ q.T, torch.eye(60, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize(
    ("hidden", "tied", "down"),
    [(48, True, False), (64, False, False), (48, True, True)],
    ids=["paley-tied-head", "sylvester-own-head", "with-r4-online"],
)
def test_the_rotated_float_model_gives_the_same_logits_and_the_users_model_is_untouched(hidden, tied, down):
    model = decoder(hidden, tied)
    before = fingerprint(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    rotated = qw.rotate(model, qw.Rotation(down=down))
    with torch.no_grad():
        expected, found = model(ids).logits, rotated(ids).logits
    assert is_float_output(sqnr_db(expected, found))  # float32 round-off: 130 dB here
    assert_unchanged(model, before)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied and model.config.tie_word_embeddings == tied
    # the rotated head unties: the final norm's scale is folded into it alone
    assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight and not rotated.config.tie_word_embeddings
    assert rotated.model.config is rotated.config  # the inner model reads the same (untied) config
    # each rotation moves the weights it is said to: R1 every reader of the stream, R2 the values' and the
    # attention output's (a test comparing logits alone would pass if either did nothing)
    alone = {"R1": qw.rotate(model, qw.Rotation(values=False)), "R2": qw.rotate(model, qw.Rotation(residual=False))}
    first = {name: m.model.layers[0].self_attn for name, m in (("float", model), ("both", rotated), *alone.items())}
    assert torch.equal(first["R2"].q_proj.weight, first["float"].q_proj.weight)  # R2 leaves the queries alone
    assert not torch.allclose(first["R1"].q_proj.weight, first["float"].q_proj.weight, atol=1e-3)
    for name in ("v_proj", "o_proj"):
        assert not torch.allclose(getattr(first["R2"], name).weight, getattr(first["float"], name).weight, atol=1e-3)
        assert not torch.allclose(getattr(first["both"], name).weight, getattr(first["R1"], name).weight, atol=1e-3)
    # what the rotation is for: the residual stream's outlier channels are spread over all of them
    peak = model.model.embed_tokens.weight.abs().amax(0)
    peak_rotated = rotated.model.embed_tokens.weight.abs().amax(0)
    assert peak_rotated.max() / peak_rotated.median() < peak.max() / peak.median()
    online = [layer.mlp.down_proj for layer in rotated.model.layers if hasattr(layer.mlp.down_proj, ONLINE_HADAMARD)]
    assert len(online) == (len(rotated.model.layers) if down else 0)
    assert len({id(getattr(m, ONLINE_HADAMARD)) for m in online}) <= 1  # one matrix, shared by every block


class PostNormBlock(nn.Module):
    """A decoder block with a norm on its MLP's output before the residual add (Gemma 2's layout)."""

    def __init__(self, block: nn.Module, hidden: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = block.self_attn, block.mlp
        self.input_layernorm, self.post_attention_layernorm = block.input_layernorm, block.post_attention_layernorm
        self.post_feedforward_layernorm = type(block.input_layernorm)(hidden)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        hidden_states = hidden_states + attended
        return hidden_states + self.post_feedforward_layernorm(self.mlp(self.post_attention_layernorm(hidden_states)))


def test_architectures_the_rotations_do_not_commute_with_are_refused_naming_why():
    model = decoder()
    model.model.layers[0] = PostNormBlock(model.model.layers[0], 48)
    problems = qw.rotation_problems(model)
    assert set(problems) == {"R1"} and "norm on a block's output before the residual add" in problems["R1"]
    with pytest.raises(qw.InvalidSettingsError, match="R1 does not apply: block 0 has a norm"):
        qw.rotate(model)
    qw.rotate(model, qw.Rotation(residual=False))  # R2 still applies: the values' rotation is inside attention

    layer_norm = decoder()
    layer_norm.model.norm = nn.LayerNorm(48)
    # a LayerNorm among RMS norms: centring the stream for it would move what the RMS norms compute
    assert "mix LayerNorms (model.norm) and RMS norms" in qw.rotation_problems(layer_norm)["R1"]
    with pytest.raises(qw.InvalidSettingsError, match="R1 does not apply: the stream's norms mix"):
        qw.rotate(layer_norm)
    said = qw.rotation_problems(nn.Linear(4, 4))["R1"]
    assert "not a decoder in a layout the rotations are written for (" in said and "Llama's: model.layers, model.norm" in said


def test_a_session_run_takes_a_rotation_and_measures_against_the_original_float_model():
    model = decoder(64, tied=True)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (2, 32), generator=generator),) for _ in range(6)]
    report = qw.analyze(
        model,
        batches[0],
        batches[:4],
        eval_data=batches[4:],
        engine="eager",
        format="int4-weight-only",
        metric="perplexity",
    )
    session = report.session
    plain = session.apply({})
    rotated = session.apply({}, rotation=qw.Rotation())
    assert rotated.ok and rotated.rotation == qw.Rotation() and plain.rotation is None
    assert any(note.startswith("rotated: R1 (residual stream) + R2 (values per head)") for note in rotated.notes)
    assert any(
        "R1: a Hadamard matrix of order 64 with random signs; R2: a Hadamard matrix of order 16" in n for n in rotated.notes
    )
    runs = session.compare()[0].set_index("run")["changes"]  # the runs table says which run was rotated
    assert runs[rotated.label] == "the float model: rotated: R1 (residual stream) + R2 (values per head)"
    assert runs[plain.label] == "the starting settings"
    # measured against the original float model's logits and perplexity, which the rotation keeps
    assert session.float_metric() == pytest.approx(perplexity(qw.rotate(model), batches[4:]), rel=1e-5)
    assert rotated.output_sqnr_db != plain.output_sqnr_db
    # each block's output SQNR, the rotated run's against the rotated float model (the residual stream
    # turned, its SQNR not): the last block's follows the run's logits, unrotated it would be noise
    blocks = {run.label: session.block_sqnr(run) for run in (plain, rotated)}
    for run in (plain, rotated):
        found = blocks[run.label]
        assert list(found.index) == ["model.layers.0", "model.layers.1"]
        assert (found > 10).all(), found
        assert found.iloc[-1] == pytest.approx(_block_output_sqnr(session, run), abs=1e-4)
    with pytest.raises(IndexError, match="batch 5 of 2"):
        session.block_sqnr(plain, batch=5)


def _block_output_sqnr(session, run):
    """The last block's output SQNR of ``run``, read directly: its float model rotated as the run was."""
    reference = qw.rotate(session.float_model, run.rotation) if run.rotation is not None else session.float_model
    outputs = []
    for model in (reference, run.quantized_model):
        hook = model.model.layers[-1].register_forward_hook(
            lambda _m, _a, output: outputs.append(output[0] if isinstance(output, tuple) else output)
        )
        with torch.no_grad():
            model(*session.eval_data[0])
        hook.remove()
    return sqnr_db(outputs[0], outputs[1])


def test_the_rotated_twin_keeps_the_sessions_data_metric_and_process_group(monkeypatch):
    """fit(rotation=...) simulates the rotated model on twin parts: they calibrate across the same
    ranks as the session (a group of several processes stands in as the object it is)."""
    group = object()
    monkeypatch.setattr("qreport_widgets.tune.parts.group_of", lambda given: given)
    model = decoder(64, tied=True)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (2, 32), generator=generator),) for _ in range(6)]
    session = qw.QuantizationSession(
        model, batches[0], batches[:4], batches[4:], engine="eager", metric="perplexity", process_group=group
    )
    twin = session.parts.rotations.twin(qw.Rotation())
    assert session.parts.runner.group is group and twin.runner.group is group
    assert twin.runner.batches.calibration == session.calibration_data and twin.runner.batches.eval == session.eval_data
    assert twin.runner.metric == session.metric and twin.runner.engine is not session.engine
    logits = [m(*batches[4]).logits for m in (session.float_model, twin.runner.float_model)]
    assert torch.allclose(*logits, atol=1e-4)  # the same model, rotated
    assert session.parts.rotations.twin(qw.Rotation()) is twin  # made once


def test_r4_is_refused_on_fx_whose_convert_drops_the_online_product():
    # the fact: convert_fx puts a new quantized module in the float Linear's place, without its pre-hook
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16)).eval()
    model[0].register_forward_pre_hook(lambda _module, args: (args[0] * 4.0,))
    x = torch.randn(8, 16)
    prepared = prepare_fx(model, get_default_qconfig_mapping("x86"), (x,))
    prepared(x)
    converted = convert_fx(prepared)
    with torch.no_grad():
        without = torch.nn.functional.linear(x, model[0].weight, model[0].bias)  # the Linear alone, no product
        assert sqnr_db(without, converted(x)) > 25 and sqnr_db(model(x), converted(x)) < 10  # the product is gone
    # so a session on FX refuses R4 before anything runs, and says what to use
    session = qw.QuantizationSession(
        decoder(64, tied=False), (torch.zeros(1, 8, dtype=torch.long),), [(torch.zeros(1, 8, dtype=torch.long),)]
    )
    with pytest.raises(qw.InvalidSettingsError, match="drops its forward pre-hooks"):
        session.apply({}, rotation=qw.Rotation(down=True))


def stand_in_kernel_checks(monkeypatch, found) -> dict[int, list[str]]:
    """The eager engine's kernels agree with their reference, so a broken one is stood in for: a
    kernel check that finds ``found(quantized)`` (name -> dB) on each checked run, and a simulation
    that takes whatever it is given. Returns the names each simulation took (by its id)."""
    from qreport_widgets.engines.eager.engine import EagerEngine
    from qreport_widgets.engines.eager.simulate import EagerSimulation

    taken: dict[int, list[str]] = {}

    def kernel_sqnr(self, reference, quantized, batch):
        return pd.Series(found(quantized), name="kernel SQNR (dB)", dtype=float)

    def run_real_kernels(self, quantized, names):
        mine = taken.setdefault(id(self), [])
        mine.extend(name for name in names if name not in mine)
        return list(mine)

    monkeypatch.setattr(EagerEngine, "reference_model", lambda self, prepared: prepared)
    monkeypatch.setattr(EagerEngine, "kernel_sqnr", kernel_sqnr)
    monkeypatch.setattr(EagerSimulation, "run_real_kernels", run_real_kernels)
    return taken


def test_a_rotated_runs_kernels_are_never_taken_by_the_simulation_of_the_unrotated_model(monkeypatch):
    """A recorded run hands the kernels it finds computing something else than their reference to the
    simulation, which runs them from then on (FX's broken PReLU: tests/test_search.py). A rotated run's
    kernels compute the rotated weights, and the simulation runs the model unrotated: stood in for here
    on the eager engine (whose kernels agree with their reference) by a check that finds two broken
    kernels, one of them only on the rotated run, and a simulation that takes whatever it is given."""
    broken, hidden = "model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj"
    rotated = {"now": False}
    taken = stand_in_kernel_checks(monkeypatch, lambda _: {broken: 1.0, **({hidden: 2.0} if rotated["now"] else {})})
    batches = [(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5)),) for _ in range(3)]
    session = qw.QuantizationSession(decoder(64, tied=False), batches[0], batches[:2], batches[2:], engine="eager")
    assert session.baseline().ok and session.truth_check().disagreeing == [broken]
    rotated["now"] = True
    run = session.apply({}, rotation=qw.Rotation(), label="rotated")
    assert run.ok and run.rotation == qw.Rotation()
    assert not any(taken.values()) and session.truth_check().real_kernels == ()  # the unrotated simulation took none
    said = [note for note in run.notes if "does not take them" in note]
    assert said and f"{broken} (1.0 dB)" in said[0] and f"{hidden} (2.0 dB)" in said[0], run.notes
    rotated["now"] = False
    assert session.apply({}, label="plain").ok  # an unrotated run hands its broken kernel over
    assert list(taken.values()) == [[broken]] and session.truth_check().real_kernels == (broken,)


def test_a_kernel_a_rotated_fit_finds_is_taken_by_the_rotated_front_which_is_fitted_again(monkeypatch):
    """The rotated front's fit does what the plain one does when its real run finds a kernel the
    baseline hid: that front's simulation (the twin's) runs it from then on and the fit is made again
    on the front simulated with it; the unrotated simulation never takes it. Stood in for by
    ``stand_in_kernel_checks``: one broken kernel, on rotated runs made after the rotated baseline only."""
    hidden = "model.layers.1.mlp.up_proj"
    model = decoder(64, tied=False)
    norm = model.model.norm.weight.detach().clone()  # R1 folds it into the head: a rotated run's is all ones
    after_baseline = {"now": False}

    def found(quantized):
        rotated = not torch.equal(quantized.model.norm.weight, norm)
        return {hidden: 2.0} if rotated and after_baseline["now"] else {}

    stand_in_kernel_checks(monkeypatch, found)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 32), generator=generator),) for _ in range(6)]
    options = {"engine": "eager", "format": "int4-weight-only", "metric": "perplexity", "algorithms": ("rtn",)}
    session = qw.analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False, **options).session
    twin = session.parts.rotations.twin(qw.Rotation())
    assert twin.mixed.real.baseline().ok, twin.mixed.real.baseline(quiet).error
    assert twin.mixed.real.truth(quiet).real_kernels == ()
    after_baseline["now"] = True
    budget = 0.9 * session.baseline().deployed_bytes
    unreachable = session.float_metric() * 0.5  # both fits run
    session.fit(max_size_bytes=budget, target_metric=unreachable, rotation=True, progress=quiet)
    assert twin.mixed.real.truth(quiet).real_kernels == (hidden,)  # the rotated front's simulation runs it now
    assert session.truth_check().real_kernels == ()  # the unrotated one does not
    rotated = [run for run in session.history if run.rotation == qw.Rotation() and run.label.startswith("fit")]
    said = [note for run in rotated for note in run.notes if "the front was simulated again with them" in note]
    assert len(rotated) == 2 and said and f"{hidden} (2.0 dB)" in said[0], [run.notes for run in rotated]


def test_fit_with_rotation_checks_its_arguments_before_any_front_is_built():
    model = decoder(64, tied=False)
    generator = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 256, (2, 32), generator=generator),) for _ in range(6)]
    session = qw.QuantizationSession(
        model, batches[0], batches[:4], batches[4:], engine=build_engine("eager", format="int4-weight-only"), metric="perplexity"
    )
    with pytest.raises(ValueError, match="needs max_size_bytes"):
        session.fit(rotation=True)
    with pytest.raises(ValueError, match="infinite SQNR"):
        session.fit(target_sqnr_db=float("inf"), rotation=True)
    assert session.parts.rotations.twins == {}  # no rotated front was built for any of them
    fx = qw.QuantizationSession(model, batches[0], batches[:4], engine="fx")
    with pytest.raises(qw.InvalidSettingsError, match="over the eager engine.s int4 formats"):
        fx.fit(max_size_bytes=1e6, rotation=True)
    # a rotation the model does not take is refused only when it is asked for
    layernormed = decoder(64, tied=False)
    layernormed.model.norm = nn.LayerNorm(64)
    other = qw.QuantizationSession(layernormed, batches[0], batches[:4], engine="eager")
    assert set(other.rotation_problems()) == {"R1"}
    with pytest.raises(qw.InvalidSettingsError, match=r"R1: the stream.s norms mix LayerNorms \(model.norm\)"):
        other.parts.rotations.check(qw.Rotation())
    other.parts.rotations.check(qw.Rotation(residual=False))  # R2 alone applies


def test_r4_is_refused_on_the_xnnpack_target_before_anything_runs():
    pytest.importorskip("executorch", reason="the [executorch] extra is not installed")
    model = decoder(64, tied=False)
    batches = [(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3)),)] * 2
    options = {"engine": "eager", "target": "xnnpack", "format": "int8-dynamic-int4-weight", "progress": False}
    session = qw.analyze(model, batches[0], batches, **options).session
    with pytest.raises(qw.InvalidSettingsError, match=r"on the XNNPACK target use Rotation\(\)"):
        session.apply({}, rotation=qw.Rotation(down=True))
    assert not session.compare()[0].shape[0]  # no run was made


def test_the_tune_tab_applies_a_rotated_run_when_its_box_is_ticked_and_offers_none_where_it_cannot():
    from qreport_widgets.demo.architectures import TinyConvNet

    model = decoder(64, tied=True)
    batches = [(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4)),) for _ in range(4)]
    report = qw.analyze(model, batches[0], batches, engine="eager", format="int4-weight-only", progress=False)
    tune = report.widget().tuning
    assert tune.rotate.layout.display != "none"
    tune.rotate.value = True
    assert "model = qreport_widgets.rotate(model)" in tune.code.value  # the code pane does what Apply does
    tune.apply.click()
    baseline, applied = report.session.history
    assert baseline.rotation is None and applied.rotation == qw.Rotation() and applied.ok

    cnn = TinyConvNet().eval()
    images = [(torch.randn(2, 3, 32, 32),)]
    assert qw.analyze(cnn, images[0], images, progress=False).widget().tuning.rotate.layout.display == "none"


def test_fit_weighs_the_rotated_model_as_one_more_choice_and_returns_the_better_real_run():
    model = decoder(64, tied=True)
    before = fingerprint(model)
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 32), generator=generator),) for _ in range(6)]
    report = qw.analyze(
        model,
        batches[0],
        batches[:4],
        eval_data=batches[4:],
        engine="eager",
        format="int4-weight-only",
        metric="perplexity",
        algorithms=("rtn",),
        progress=False,
    )
    session = report.session
    budget = 0.9 * session.baseline().deployed_bytes
    found = session.fit(max_size_bytes=budget, rotation=True, progress=quiet)
    plain_front, rotated_front = session.pareto(), session.parts.rotations.twin(qw.Rotation()).mixed.front().points
    # the fit starts on the front whose best point within the budget simulates the lower perplexity ...
    best = {
        key: front[front["size_bytes"] <= budget]["simulated_metric"].iloc[-1]
        for key, front in (("plain", plain_front), ("rotated", rotated_front))
    }
    first = "rotated" if best["rotated"] < best["plain"] else "plain"
    fits = [run for run in session.history if run.label.startswith("fit")]
    assert found.ok and found.deployed_bytes <= budget and fits == [found]
    assert (found.rotation == qw.Rotation()) == (first == "rotated")  # rotated runs recorded here as rotated
    # ... and its real run met the goal (within the budget): the other front is weighed in simulation only
    assert any("in simulation only" in note for note in found.notes), found.notes
    # a target no point reaches: the first fit's real run misses it, so the other fit runs too, and
    # the better real run of the two is returned
    unreachable = session.float_metric() * 0.5
    found = session.fit(max_size_bytes=budget, target_metric=unreachable, rotation=True, progress=quiet)
    assert any(note.startswith("weighed with and without rotation") for note in found.notes)
    fits = [run for run in session.history if run.label.startswith("fit") and "<= " in run.label and "perplexity" in run.label]
    rotated = [run for run in fits if run.rotation == qw.Rotation()]
    plain = [run for run in fits if run.rotation is None]
    assert rotated and plain
    within = [run for run in (plain[-1], rotated[-1]) if run.deployed_bytes <= budget] or [plain[-1], rotated[-1]]
    assert found.eval_metric == min(run.eval_metric for run in within)
    assert list(session.parts.rotations.twins) == [qw.Rotation()]  # the rotated model's parts, kept for the next fit
    assert_unchanged(model, before)
    cnn = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    images = [torch.randn(4, 8) for _ in range(2)]
    other = qw.analyze(cnn, images[0], images, engine="eager", format="int4-weight-only", progress=False).session
    with pytest.raises(qw.InvalidSettingsError, match="rotations do not apply"):
        other.fit(max_size_bytes=10_000, rotation=True)


def test_rotate_checks_itself_on_an_example_and_refuses_a_layout_its_folds_do_not_commute_with():
    model = decoder(64, tied=False)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert qw.rotate(model, qw.Rotation(), (ids,)) is not None  # the Llama layout passes its own check
    # a per-channel scale on a block's output (as some models' "layer scale"): every module is named as in
    # Llama, so nothing in the names says R1 cannot apply; the rotated model's logits do
    scale = torch.linspace(0.5, 1.5, 64)
    model.model.layers[0].register_forward_hook(
        lambda _m, _a, output: (output[0] * scale, *output[1:]) if isinstance(output, tuple) else output * scale
    )
    assert qw.rotation_problems(model) == {}
    with pytest.raises(qw.InvalidSettingsError, match=r"changes what this llama model computes: the rotated model's output is"):
        qw.rotate(model, qw.Rotation(), (ids,))
    qw.rotate(model, qw.Rotation(residual=False), (ids,))  # R2 stays within the attention: it still applies


def _family(name: str) -> nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Olmo2Config, Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    sizes = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    tokens = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    built = {
        "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**sizes, head_dim=16, sliding_window=16)),
        "phi3": lambda: Phi3ForCausalLM(Phi3Config(**sizes, **tokens)),  # fused qkv_proj and gate_up_proj
        "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**sizes, **tokens)),  # norms after attention and MLP
    }[name]()
    return built.eval()


@pytest.mark.parametrize("family", ["gemma3", "phi3", "olmo2"])
def test_r2_applies_to_every_attention_with_value_and_output_projections_and_r1_to_fused_ones_checked_by_the_logits(family):
    model = _family(family)
    before = fingerprint(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert qw.rotation_problems(model) == {}
    if family == "phi3":  # fused projections read and write the stream as the separate ones do: R1 applies
        both = qw.rotate(model, qw.Rotation(), (ids,))  # checked by its own logits
        assert not torch.allclose(both.model.layers[0].mlp.gate_up_proj.weight, model.model.layers[0].mlp.gate_up_proj.weight)
    rotated = qw.rotate(model, qw.Rotation(residual=False), (ids,))  # its own logits check passed
    # what a run's notes say of it, read without the Llama layout R1 would need
    assert matrix_words(model, qw.Rotation(residual=False)) == "R2: a Hadamard matrix of order 16 with random signs"
    attention, turned = model.model.layers[0].self_attn, rotated.model.layers[0].self_attn
    values = "qkv_proj" if family == "phi3" else "v_proj"
    width = 2 * 16  # key-value heads x head size: the last rows of a fused qkv_proj
    moved = getattr(turned, values).weight[-width:]
    assert not torch.allclose(moved, getattr(attention, values).weight[-width:], atol=1e-3)
    if family == "phi3":  # the queries and keys of a fused projection stay as they were
        assert torch.equal(turned.qkv_proj.weight[:-width], attention.qkv_proj.weight[:-width])
    assert not torch.allclose(turned.o_proj.weight, attention.o_proj.weight, atol=1e-3)
    assert_unchanged(model, before)


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_r1_on_blocks_that_end_in_a_norm_turns_each_such_norms_output_as_the_model_runs(family):
    """Gemma's sandwich norms and OLMo 2's post-norms normalise what a block adds to the stream, so
    the writers keep their weights and each such norm's output is turned by Q as the model runs; the
    readers take Q back (Gemma's ``1 + w`` scales folded in first); Gemma's tied head stays tied, its
    embedding's output and the final norm's input turned as the model runs instead."""
    from qreport_widgets.engines.rotation import ONLINE_ROTATION

    model = _family(family)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a trained model's norms: scales away from their start, so folding them matters
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    before = fingerprint(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    rotated = qw.rotate(model, qw.Rotation(values=False), (ids,))  # refused if the logits moved past float round-off
    assert_unchanged(model, before)
    for layer, turned in zip(model.model.layers, rotated.model.layers, strict=True):
        assert torch.equal(turned.self_attn.o_proj.weight, layer.self_attn.o_proj.weight)  # writers kept
        assert torch.equal(turned.mlp.down_proj.weight, layer.mlp.down_proj.weight)
        assert not torch.allclose(turned.self_attn.q_proj.weight, layer.self_attn.q_proj.weight, atol=1e-3)  # readers turned
        assert not torch.allclose(turned.mlp.up_proj.weight, layer.mlp.up_proj.weight, atol=1e-3)
    online = [m for m in rotated.modules() if hasattr(m, ONLINE_ROTATION[0])]
    for name in ONLINE_ROTATION:  # one set of Kronecker factors and signs, read by every product
        assert len({id(getattr(m, name)) for m in online}) == 1
    left, right, signs = (getattr(online[0], name).double() for name in ONLINE_ROTATION)
    q = torch.kron(left, right) * signs  # orthogonal: a Hadamard matrix of order 8 x 8 with random signs
    assert left.shape == right.shape == (8, 8) and torch.allclose(q @ q.T, torch.eye(64, dtype=torch.float64), atol=1e-6)
    post = [
        getattr(layer, name)
        for layer in rotated.model.layers
        for name in ("post_attention_layernorm", "post_feedforward_layernorm")
    ]
    assert all(any(norm is m for m in online) for norm in post)
    head, embedding = rotated.get_output_embeddings(), rotated.get_input_embeddings()
    if family == "gemma3":  # tied: the 262k-row head of a real Gemma 3 is not copied
        assert head.weight is embedding.weight and torch.equal(embedding.weight, model.get_input_embeddings().weight)
        assert len(online) == len(post) + 2 and embedding in online and rotated.model.norm in online
        assert all(bool((layer.input_layernorm.weight == 0).all()) for layer in rotated.model.layers)  # 1 + 0: folded
    else:  # untied: the final norm folds into the head and the embedding's rows turn, as on Llama
        assert len(online) == len(post) and not torch.allclose(embedding.weight, model.get_input_embeddings().weight)
    words = matrix_words(model, qw.Rotation(values=False))
    assert f"at the output of each of the {len(post)} norms on a block's output" in words
    assert "each 64 x (8 + 8) multiply-adds (its Kronecker factors of orders 8 and 8)" in words
    assert ("(the head stays tied to the embedding)" in words) == (family == "gemma3")


def test_r1_turned_as_the_model_runs_is_refused_on_fx_whose_convert_drops_a_modules_hooks():
    # the fact: convert_fx puts a quantized Embedding in the float one's place, without its forward hook
    from torch.ao.quantization import QConfigMapping, float_qparams_weight_only_qconfig
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    model = nn.Sequential(nn.Embedding(32, 16)).eval()
    model[0].register_forward_hook(lambda _module, _args, output: output * 4.0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    mapping = QConfigMapping().set_object_type(nn.Embedding, float_qparams_weight_only_qconfig)
    prepared = prepare_fx(model, mapping, (ids,))
    prepared(ids)
    with torch.no_grad():
        assert sqnr_db(model(ids) / 4.0, convert_fx(prepared)(ids)) > 25  # the hook's product is gone
    # so a session on FX refuses R1 where it runs as hooks, before anything runs, and says what to use
    session = qw.QuantizationSession(
        _family("gemma3"), (torch.zeros(1, 8, dtype=torch.long),), [(torch.zeros(1, 8, dtype=torch.long),)]
    )
    with pytest.raises(qw.InvalidSettingsError, match="R1 on this model turns the stream .* convert_fx puts a new module"):
        session.apply({}, rotation=qw.Rotation())  # refused before FX traces anything (it cannot trace Gemma 3)


def test_a_gemma_run_on_x86_carries_r1s_products_and_keeps_their_kronecker_factors_once():
    model = _family("gemma3")
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (2, 16), generator=generator),) for _ in range(3)]
    session = qw.analyze(model, batches[0], batches, engine="eager", format="int4-weight-only", progress=False).session
    plain = session.apply({})
    rotated = session.apply({}, rotation=qw.Rotation())
    assert plain.ok and rotated.ok, rotated.error
    # what every product reads: two float32 Kronecker factors of order 8 and the signs, not a 64 x 64 matrix
    assert rotated.deployed_bytes - plain.deployed_bytes == (8 * 8 * 2 + 64) * 4
    assert any("turned as the model runs" in note and "the head stays tied" in note for note in rotated.notes)
    # the run is measured against the rotated float model, which computes the original's logits
    assert rotated.output_sqnr_db > 5 and math.isfinite(rotated.output_sqnr_db)


def _scaled(output, scale: torch.Tensor):
    """A block's output times a per-channel ``scale`` (a "layer scale"): what R1 does not commute with."""
    if isinstance(output, tuple):
        return (output[0] * scale.to(output[0].dtype), *output[1:])
    return output * scale.to(output.dtype)


def test_a_low_precision_model_is_rotated_its_layout_checked_in_float32_and_its_round_off_against_its_own():
    """A bfloat16 or float16 decoder is rotated (the rotation computed in float64, the weights rounded
    back to the model's dtype): its layout is checked on a float32 copy rotated alike, and its output
    against the float32 model's is held to its own round-off, not float32's (it was refused as a layout
    the folds do not commute with). A layout that does not commute is refused for that, in any dtype."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float16):
        model = decoder(64, tied=False).to(dtype)
        rotated = qw.rotate(model, qw.Rotation(), (ids,))
        assert next(rotated.parameters()).dtype == dtype
        wide = copy.deepcopy(model).float()
        with torch.no_grad():
            own, found = (sqnr_db(wide(ids).logits, m(ids).logits.float()) for m in (model, rotated))
        assert 20 < found < 100 and found > own - rotation.LOW_PRECISION_MARGIN_DB
        scale = torch.linspace(0.5, 1.5, 64, dtype=dtype)  # a layer scale on a block's output: R1 does not commute
        model.model.layers[0].register_forward_hook(lambda _m, _a, out, s=scale: _scaled(out, s))
        with pytest.raises(qw.InvalidSettingsError, match=r"in float32, on the example input.*does not commute"):
            qw.rotate(model, qw.Rotation(), (ids,))


def test_rotate_without_example_inputs_checks_itself_on_token_ids_drawn_in_its_vocabulary():
    model = decoder(64, tied=False)
    assert qw.rotate(model, qw.Rotation()) is not None
    model.model.layers[0].register_forward_hook(lambda _m, _a, out: _scaled(out, torch.linspace(0.5, 1.5, 64)))
    with pytest.raises(qw.InvalidSettingsError, match="changes what this llama model computes"):
        qw.rotate(model, qw.Rotation())  # once: nothing checked without example inputs
    plain = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(qw.InvalidSettingsError, match="pass example_inputs="):
        rotation.check(plain, copy.deepcopy(plain), qw.Rotation())


def test_a_rotated_models_state_dict_keeps_its_function_or_is_refused(tmp_path):
    """R1 and R2 folded whole (a Llama layout): its state dict loaded into a fresh model of the same
    config computes the rotated function. R4 (computed as the model runs, by a hook reading a buffer):
    its state dict and ``save_pretrained`` are refused, naming the module and what to do, since a model
    loaded from them would not run the hook."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model = decoder(64, tied=True)
    folded = qw.rotate(model, qw.Rotation(), (ids,))
    loaded = LlamaForCausalLM(folded.config).eval()
    loaded.load_state_dict(folded.state_dict())
    with torch.no_grad():
        assert sqnr_db(folded(ids).logits, loaded(ids).logits) >= 100 and sqnr_db(model(ids).logits, loaded(ids).logits) >= 100
    online = qw.rotate(model, qw.Rotation(down=True), (ids,))
    with pytest.raises(qw.InvalidSettingsError, match=r"model\.layers\.0\.mlp\.down_proj computes a rotation as the model runs"):
        online.state_dict()
    with pytest.raises(qw.InvalidSettingsError, match="rotate it again after loading"):
        online.save_pretrained(tmp_path / "rotated")
    assert not any((tmp_path / "rotated").glob("*.safetensors"))
