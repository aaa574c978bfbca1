"""What a session keeps alive: the quantized models of the latest run and the pinned runs only (the
others' measurements stay), no model held by torch's or torchao's caches, no model kept by the
verifier's trial runs; a released model says when it went and how to keep one."""

from __future__ import annotations

import gc
import math
import sys
import weakref
from pathlib import Path

import pytest
import torch

import qreport_widgets as qw
from qreport_widgets import FloatModelChangedError, ModelReleasedError, ModuleSettings, QuantizationSession
from qreport_widgets.core import memory
from qreport_widgets.demo.digits import trained_digits_model


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


def digits_session(cache, engine: str = "fx") -> QuantizationSession:
    model, data = trained_digits_model("cnn", cache)
    return QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine=engine)


def alive(model: torch.nn.Module) -> weakref.ref:
    return weakref.ref(model)


def test_only_the_latest_run_keeps_its_quantized_model(cache):
    session = digits_session(cache)
    first = alive(session.baseline().quantized_model)
    names = [m.fqn for m in session.modules if not m.current.keep_float]
    runs = [session.apply({names[i]: ModuleSettings(keep_float=True)}) for i in range(3)]
    gc.collect()
    assert first() is None, "the baseline's quantized model is still alive after three more runs"
    assert isinstance(session.history[-1].quantized_model, torch.nn.Module)
    for earlier in session.history[:-1]:
        assert not earlier.quantized_model
        assert math.isfinite(earlier.output_sqnr_db) and len(earlier.per_layer_sqnr_db)  # measurements stay
    assert session.baseline() is session.history[0]  # the baseline in the history is the released one
    with pytest.raises(ModelReleasedError, match=r"'baseline' was released when 'run 2' was recorded.*session\.keep"):
        session.history[0].quantized_model(torch.zeros(1, 1, 8, 8))
    with pytest.raises(ModelReleasedError, match="released"):
        session.history[1].quantized_model.fc1  # noqa: B018
    assert "released" in repr(session.history[2].quantized_model)
    assert runs[-1] is session.history[-1]
    assert session.compare()[0]["output SQNR (dB)"].notna().all()


def test_a_pinned_run_keeps_its_model_until_unpinned(cache):
    session = digits_session(cache)
    baseline = session.keep(session.baseline())
    assert session.kept(0) and session.kept(baseline)
    session.apply({"fc1": ModuleSettings(keep_float=True)})
    session.apply({"fc1": ModuleSettings(per_channel=False)})
    assert isinstance(session.history[0].quantized_model, torch.nn.Module)  # pinned
    assert not session.history[1].quantized_model  # neither latest nor pinned
    with pytest.raises(ModelReleasedError, match="apply its settings again"):
        session.keep(1)
    session.keep(0, keep=False)
    session.apply({"fc1": ModuleSettings(keep_float=False)})
    assert not session.history[0].quantized_model and not session.kept(0)
    with pytest.raises(IndexError, match="no run 7 in a history of 4"):
        session.keep(7)


@pytest.mark.parametrize("engine", ["fx", "pt2e"])
def test_no_model_outlives_its_step_in_torchs_caches(cache, engine):
    """torch's FX prepare / convert and torchao's PT2E convert cache every model they see (a
    functools.cache keyed by the module); the session empties those caches after each step."""
    session = digits_session(cache, engine)
    session.baseline()
    prepared = alive(session.engine.prepare(session.float_model, session.engine.base_config(), session.example_inputs))
    first = alive(session.history[0].quantized_model)
    session.apply({"fc1": ModuleSettings(keep_float=True)})
    gc.collect()
    assert prepared() is None and first() is None
    from torch.ao.quantization.fx.utils import assert_and_get_unique_device

    assert assert_and_get_unique_device.cache_info().currsize == 0


def test_verified_suggestions_keep_no_trial_model(cache):
    model, data = trained_digits_model("cnn", cache)
    report = qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)
    session = report.session
    verified = session.verified_suggestions(report.suggestions())
    run = verified.accept_all
    assert run is not None and not run.quantized_model and math.isfinite(run.output_sqnr_db)
    with pytest.raises(ModelReleasedError, match="trial run"):
        run.quantized_model.fc1  # noqa: B018


def test_folded_weights_are_held_once_and_no_run_writes_into_them():
    """The report's model, the simulation and every run fold each batch norm into its conv: equal
    weights, held once; and after runs the session's float copy is still the caller's model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3),
        torch.nn.BatchNorm2d(8),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 12 * 12, 10),
    ).eval()
    for norm in (model[1], model[4]):
        norm.running_mean.normal_(), norm.running_var.uniform_(0.5, 2.0), norm.weight.data.uniform_(0.5, 2.0)
    batches = [(torch.randn(4, 3, 16, 16),) for _ in range(4)]
    report = qw.analyze(model, batches[0], batches, progress=False)
    session = report.session
    simulation = session.simulation(progress=lambda done, total: None)
    held = {p.data_ptr() for p in (*report.model.parameters(), *session.float_model.parameters())}
    weights = [p for name, p in simulation.model.named_parameters() if name.endswith("weight") and p.dim() == 4]
    assert weights and {p.data_ptr() for p in weights} <= held  # the simulation's conv weights are the report's
    session.apply({m.fqn: ModuleSettings(keep_float=True) for m in session.modules[:1]})
    for (name, theirs), ours in zip(model.state_dict().items(), session.float_model.state_dict().values(), strict=True):
        assert torch.equal(theirs, ours), name


def test_the_session_shares_the_callers_weights_and_refuses_them_once_changed_in_place():
    """No second float copy: the session's float model is the caller's weights in its own modules;
    a weight changed in place afterwards is named in a clear error, and assigning a new one is harmless."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    batches = [torch.randn(4, 8) for _ in range(3)]
    report = qw.analyze(model, batches[0], batches, progress=False)
    session = report.session
    assert session.float_model is not model
    assert [p.data_ptr() for p in session.float_model.parameters()] == [p.data_ptr() for p in model.parameters()]
    model[0].weight = torch.nn.Parameter(model[0].weight.detach() * 2)  # a new tensor: the session keeps the old one
    assert session.baseline(progress=lambda done, total: None).ok
    with torch.no_grad():
        model[2].bias.add_(1.0)  # in place: the session's weight too
    run = session.apply({"0": ModuleSettings(keep_float=True)}, progress=lambda done, total: None)
    assert not run.ok and "FloatModelChangedError" in run.error and "changed in place after it was analyzed (2.bias)" in run.error
    assert [run.label for run in session.history] == ["baseline"]  # nothing recorded, nothing lost
    with pytest.raises(FloatModelChangedError, match=r"\(2\.bias\).*Run analyze\(\) again"):
        session.sensitivity(progress=lambda done, total: None)


def test_sensitivity_holds_no_more_than_one_variants_output_at_once():
    """A decoder's logits for dozens of variants would not fit: each simulated output is reduced to
    its SQNR terms as soon as it exists, and the SQNRs are those of whole outputs (the FX replay's
    own outputs: ``test_replay.py``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import tiny_llama

    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    session.baseline(progress=lambda done, total: None)
    outputs: list[weakref.ref] = []
    most_alive = 0

    def watch(module, args, output):
        nonlocal most_alive
        if module is session.parts.simulated.simulation().model:
            most_alive = max(most_alive, sum(ref() is not None for ref in outputs))
            outputs.append(weakref.ref(output.logits))  # the logits themselves, as the decoder gave them

    handle = torch.nn.modules.module.register_module_forward_hook(watch)
    try:
        table = session.sensitivity(progress=lambda done, total: None, metric=False)
    finally:
        handle.remove()
    assert len(outputs) >= len(table) and most_alive <= 1
    simulation, runner = session.parts.simulated.simulation(), session.parts.runner
    for fqn in list(table.index)[:3]:  # against the SQNR of the whole outputs, concatenated
        whole = runner.output_sqnr(simulation.outputs(runner.eval_data, [fqn]))
        assert table.at[fqn, "simulated_output_sqnr_db"] == pytest.approx(whole, abs=1e-6)
    simulation.configure(())


def test_a_step_the_machine_has_no_memory_for_is_refused_before_it_starts_and_nothing_is_lost(monkeypatch):
    sys.path.insert(0, str(Path(__file__).parent))
    from hf_models import tiny_llama

    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    quiet = lambda done, total: None  # noqa: E731
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(memory, "free_bytes", lambda: weights // 10)
    with pytest.raises(qw.NotEnoughMemoryError, match=r"the run 'baseline' would need about .* is free: nothing was started"):
        session.sensitivity(progress=quiet)
    assert session.history == []  # nothing recorded
    monkeypatch.setattr(memory, "free_bytes", lambda: 64 * weights)  # enough for a run, not for the simulation
    monkeypatch.setattr(memory, "STEP_WEIGHTS", {**memory.STEP_WEIGHTS, "simulation": 100.0})
    with pytest.raises(qw.NotEnoughMemoryError, match="building the simulation"):
        session.sensitivity(progress=quiet)
    assert [(run.label, run.ok) for run in session.history] == [("baseline", True)]  # the run it could make is kept
    monkeypatch.undo()
    table = session.sensitivity(progress=quiet)
    assert len(table) == len([m for m in session.modules if not m.current.keep_float])
