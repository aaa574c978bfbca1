"""The PT2E engine's XNNPACK target: runs lowered to XNNPACK and measured in ExecuTorch's runtime.

Ground truth here is the runtime itself: a run's numbers are checked against the ``.pte`` it wrote,
loaded and executed again through ExecuTorch's own Python API. Needs the ``[executorch]`` extra.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

pytest.importorskip("executorch", reason="the [executorch] extra is not installed")

from executorch.runtime import Runtime  # noqa: E402

from qreport_widgets import analyze  # noqa: E402
from qreport_widgets.core.metrics import sqnr_db  # noqa: E402
from qreport_widgets.demo.digits import trained_digits_model  # noqa: E402
from qreport_widgets.engines import executorch as lowering  # noqa: E402
from qreport_widgets.engines.pt2e import xnnpack  # noqa: E402
from qreport_widgets.engines.pt2e.xnnpack import DeployedProgram  # noqa: E402
from qreport_widgets.engines.settings import ModuleSettings  # noqa: E402
from qreport_widgets.errors import MissingExtraError  # noqa: E402
from qreport_widgets.tune.truth import SIMULATION_ERROR_DB  # noqa: E402


@pytest.fixture(scope="module")
def digits_cnn(digits_cache):
    model, data = trained_digits_model("cnn", digits_cache)
    report = analyze(
        model,
        data.calibration[0],
        data.calibration,
        engine="pt2e",
        target="xnnpack",
        eval_data=data.evaluation,
        eval_fn=data.accuracy,
        progress=False,
    )
    return model, data, report


def executed(pte: bytes, batches):
    """The outputs of ``pte`` loaded and executed by ExecuTorch's runtime, apart from the package."""
    loaded = Runtime.get().load_program(pte)  # kept while its method executes: it holds the program's memory
    method = loaded.load_method("forward")
    return [method.execute([batch[0]])[0] for batch in batches]


def test_the_baseline_is_the_program_executorch_runs_its_size_the_pte(digits_cnn, tmp_path):
    model, data, report = digits_cnn
    session = report.session
    baseline = session.baseline()
    assert baseline.ok, baseline.error
    program = baseline.quantized_model
    assert isinstance(program, DeployedProgram)
    assert program.input_shapes is None  # exported with its batch size free: the last batch of 5 runs too
    assert baseline.size_bytes == baseline.deployed_bytes == len(program.pte) == program.write(tmp_path / "model.pte")

    # the run's SQNR and metric are the runtime's: the written program, executed again, gives them
    outputs = executed((tmp_path / "model.pte").read_bytes(), data.evaluation)
    with torch.no_grad():
        expected = torch.cat([model(*batch).flatten() for batch in data.evaluation])
    assert baseline.output_sqnr_db == pytest.approx(sqnr_db(expected, torch.cat([o.flatten() for o in outputs])), abs=1e-6)
    labels = torch.cat([o.argmax(dim=1) for o in outputs])
    assert baseline.eval_metric == pytest.approx(float((labels == data.evaluation_labels).float().mean()))
    assert math.isfinite(baseline.latency_ms) and baseline.latency_ms > 0

    # per-layer SQNR of the reference graph it was lowered from, every module; what XNNPACK took
    assert set(baseline.per_layer_sqnr_db.index) == {m.fqn for m in session.modules}
    assert any("measured in ExecuTorch's runtime" in note for note in baseline.notes)
    assert any(note.startswith("XNNPACK runs ") for note in baseline.notes)

    # the simulation against the runtime: the truth check compares them
    truth = session.truth_check()
    assert truth.real_db == baseline.output_sqnr_db
    assert abs(truth.gap_db) <= SIMULATION_ERROR_DB


def test_reach_and_accept_all_are_confirmed_in_the_runtime_and_their_code_runs(digits_cnn, tmp_path, monkeypatch):
    model, data, report = digits_cnn
    session = report.session
    baseline = session.baseline()
    reached = session.reach(baseline.output_sqnr_db + 2.0)
    assert reached.ok and reached.output_sqnr_db >= baseline.output_sqnr_db + 2.0
    floats = [fqn for fqn, choice in reached.settings.items() if choice.keep_float]
    assert floats and isinstance(reached.quantized_model, DeployedProgram)
    kept = {row["module"]: row["quantized"] for _, row in reached.conversions.iterrows()}
    assert all(not kept[fqn] for fqn in floats)

    # a widget shown after runs made in code lists them, the program's size and latency included
    history = report.widget().tuning.history.value
    assert "reach output SQNR &gt;=" in history and "baseline" in history

    verified = report.verified_suggestions()
    accepted = verified.accept_all
    assert accepted is not None and accepted.ok
    assert accepted.output_sqnr_db >= baseline.output_sqnr_db - SIMULATION_ERROR_DB

    # the settings as code build the same program: executed, its output is the run's
    code = session.settings_as_code(reached.settings)
    monkeypatch.chdir(tmp_path)  # the code writes model.pte
    scope = {"model": model, "example_inputs": data.calibration[0], "calibration_batches": data.calibration}
    exec(compile(code, "settings_as_code", "exec"), scope)  # noqa: S102
    ours = reached.quantized_model(*data.calibration[0])
    assert sqnr_db(ours, scope["outputs"][0]) > 60  # the same program (histogram observers: to rounding)


def test_a_linear_model_starting_dynamic_is_partly_delegated_and_its_simulation_checked(digits_cache):
    """XNNPACK's dynamic config as the start of the trained token mixer: its LayerNorms and mean stay in
    ExecuTorch's portable kernels between delegated parts."""
    model, data = trained_digits_model("mixer", digits_cache)
    api = xnnpack.executorch_api()
    dynamic = api.XNNPACKQuantizer().set_global(xnnpack.xnnpack_config(True, dynamic=True))
    report = analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation,
        engine="pt2e", target="xnnpack", quantizer=dynamic, progress=False,
    )  # fmt: skip
    session = report.session
    assert all(m.current.dynamic for m in session.modules)
    baseline = session.baseline()
    assert baseline.ok, baseline.error
    delegation = baseline.quantized_model.delegation
    assert delegation.subgraphs > 1 and "aten.native_layer_norm" in delegation.left
    said = next(note for note in baseline.notes if note.startswith("XNNPACK runs "))
    assert "left to ExecuTorch's portable kernels" in said and "aten.native_layer_norm" in said
    # the simulation is built from the calibrated dynamic start and checked against the runtime, which
    # does better than the reference graph: XNNPACK quantizes a dynamic Linear's input per token where
    # the graph says per tensor (3 dB here), so the truth check marks the simulation unverified
    truth = session.truth_check()
    assert not truth.error and truth.real_db - truth.simulated_db > SIMULATION_ERROR_DB and not truth.reliable


def test_a_lowering_that_fails_is_a_failed_run_saying_what_to_do(digits_cnn, monkeypatch):
    _, data, report = digits_cnn

    def refused(*args, **kwargs):
        raise RuntimeError("an op the partitioner cannot place")

    api = lowering.executorch_api()
    monkeypatch.setattr(api, "to_edge_transform_and_lower", refused)
    run = report.session.apply({"fc1": ModuleSettings(keep_float=True)}, label="refused")
    assert not run.ok
    assert "could not lower the quantized model to XNNPACK" in run.error
    assert "Keep the modules around the failing op float" in run.error


def test_the_target_is_checked_and_executorch_missing_is_said(monkeypatch):
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    batches = [(torch.randn(2, 4),)]
    with pytest.raises(ValueError, match="target= is not for engine='fx'"):
        analyze(model, batches[0], batches, target="xnnpack", progress=False)
    with pytest.raises(ValueError, match="target must be 'x86' or 'xnnpack'"):
        analyze(model, batches[0], batches, engine="pt2e", target="arm", progress=False)
    monkeypatch.setitem(__import__("sys").modules, "executorch.runtime", None)
    xnnpack.executorch_api.cache_clear()
    lowering.executorch_api.cache_clear()
    try:
        with pytest.raises(MissingExtraError, match=r"qreport-widgets\[executorch\]"):
            analyze(model, batches[0], batches, engine="pt2e", target="xnnpack", progress=False)
    finally:
        monkeypatch.undo()
        xnnpack.executorch_api.cache_clear()
        lowering.executorch_api.cache_clear()


def test_a_quantizer_of_your_own_is_the_start_and_keeping_a_module_float_holds_over_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).eval()
    batches = [(torch.randn(4, 3, 8, 8),) for _ in range(3)]
    per_tensor = xnnpack.executorch_api().XNNPACKQuantizer().set_global(xnnpack.xnnpack_config(False, dynamic=False))
    report = analyze(model, batches[0], batches, engine="pt2e", target="xnnpack", quantizer=per_tensor, progress=False)
    session = report.session
    assert {m.fqn: m.current.per_channel for m in session.modules} == {"0": False, "3": False}
    run = session.apply({"3": ModuleSettings(keep_float=True)})
    assert run.ok, run.error
    quantized = dict(zip(run.conversions["module"], run.conversions["quantized"], strict=True))
    assert quantized == {"0": True, "3": False} and not run.module_notes
    assert "base_quantizer" in session.settings_as_code({"3": ModuleSettings(keep_float=True)})


class FixedBatch(nn.Module):
    """A model that reshapes by its example's batch size: exported with that size only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).reshape(4, 2, 2)


def test_a_program_fixed_to_its_batch_size_runs_other_batch_sizes_in_chunks_and_says_so_on_other_shapes():
    torch.manual_seed(0)
    model = FixedBatch().eval()
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    baseline = analyze(model, batches[0], batches, engine="pt2e", target="xnnpack", progress=False).session.baseline()
    assert baseline.ok, baseline.error
    program = baseline.quantized_model
    assert program.input_shapes == ((4, 8),) and program.batch_limit == 4
    rows = torch.randn(10, 8)
    whole = torch.cat([program(rows[i : i + 4]) for i in range(0, 8, 4)] + [program(rows[8:].repeat(2, 1))[:2]])
    assert torch.equal(program(rows), whole)  # 4 + 4 + 2 padded to 4
    assert torch.equal(program(rows[:3]), program(torch.cat([rows[:3], rows[2:3]]))[:3])
    with pytest.raises(xnnpack.RuntimeFailedError, match=r"exported for inputs of shape \(\(4, 8\),\) only"):
        program(torch.randn(4, 9))


@pytest.mark.slow  # a session and a program more (about 25 s); chunks of a planned batch: the fixed-batch test
# above and tests/test_eager_xnnpack.py (batches of 8 on a program planned for 4); a smaller last batch: the baseline
def test_evaluation_batches_larger_and_smaller_than_calibration_batches_run(digits_cache):
    """The program's memory is planned for the calibration batch (32 rows): a batch of 64 runs in two
    executions, one of 5 in one, each row's output the same as alone."""
    model, data = trained_digits_model("cnn", digits_cache)
    images = torch.cat([b[0] for b in data.evaluation])
    calibration = [(b[0][:32],) for b in data.calibration]
    evaluation = [(images[:64],), (images[64:69],)]
    report = analyze(model, calibration[0], calibration, engine="pt2e", target="xnnpack", eval_data=evaluation, progress=False)
    baseline = report.session.baseline()
    assert baseline.ok, baseline.error
    program = baseline.quantized_model
    assert program.batch_limit == 32 and program.input_shapes is None
    assert torch.equal(program(images[:64]), torch.cat([program(images[:32]), program(images[32:64])]))
    assert torch.allclose(program(images[64:69])[2], program(images[66:67])[0], atol=1e-5)


def test_a_crash_of_the_runtime_fails_the_call_and_leaves_the_session_and_its_process_alive(digits_cnn):
    """The runtime is native code: a segfault in it (here the signal a freed buffer raises, sent to
    the worker process while the program runs over and over) ends the worker, and the call says so;
    the session runs its next program in a new worker."""
    _, data, report = digits_cnn
    session = report.session
    program = session.keep(-1).quantized_model  # the latest run's program (earlier tests' runs released the baseline's)
    worker = lowering.runtime_worker()
    images = data.evaluation[0][0]
    program(images)  # the worker holds the program
    pid, starts = worker.pid, worker.starts
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGSEGV))
    killer.start()
    deadline = time.monotonic() + 30
    with pytest.raises(lowering.RuntimeFailedError, match="killed by SIGSEGV") as failure:
        while time.monotonic() < deadline:
            program(images)
    killer.join()
    assert "Your Python session is unaffected" in str(failure.value)
    assert "executing the program on inputs of shape" in str(failure.value) or "loading" in str(failure.value)

    # the same program runs again, loaded into a new worker, as the session's next program would be
    assert torch.equal(program(images), program(images))
    assert worker.starts == starts + 1 and worker.pid != pid
    assert session.truth_check().real_db == session.baseline().output_sqnr_db  # the session answers as before


def test_the_quantizers_patterns_traced_once_annotate_as_traced_each_time():
    """XNNPACK's conv-batch-norm patterns (matched where batch norms are not folded: QAT) traced once
    and copied: the same prepared graph as traced each time, the second time from the copies."""
    from executorch.backends.xnnpack.quantizer import xnnpack_quantizer_utils as utils
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    example = (torch.randn(2, 3, 8, 8),)
    api = xnnpack.executorch_api()

    def prepared() -> str:
        quantizer = api.XNNPACKQuantizer().set_global(api.get_symmetric_quantization_config(is_per_channel=True, is_qat=True))
        graph = prepare_qat_pt2e(torch.export.export(model.train(), example).module(), quantizer)
        return graph.code

    traced = utils._get_aten_graph_module_for_pattern
    expected = prepared()
    with xnnpack.patterns_traced_once():
        assert utils._get_aten_graph_module_for_pattern is not traced
        first, again = prepared(), prepared()
    assert utils._get_aten_graph_module_for_pattern is traced  # put back
    assert "activation_post_process_1 = self.activation_post_process_1(mul)" in expected  # the conv's weight, by the pattern
    assert first == expected and again == expected
