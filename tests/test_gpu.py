"""The tool with the model on a CUDA GPU: `make test-gpu` (marked ``gpu``, left out of `make test`).

Each test fails, never skips, on a machine without CUDA: a run of these that passes has run them.
``test_devices.py`` checks on the CPU (in `make test`) what these rely on: every tensor the tool
makes names its device, the observers read nothing back from one.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_unchanged, fingerprint
from hf_models import tiny_llama

import qreport_widgets as qw
from qreport_widgets.core.features import Stat
from qreport_widgets.demo.architectures import TinyConvNet
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.observe.observer import ModelReportObserver

pytestmark = pytest.mark.gpu
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail(f"the gpu tests need a CUDA device; torch {torch.__version__} finds none here", pytrace=False)
    return torch.device("cuda")


def _conv_session(device: torch.device):
    torch.manual_seed(0)
    model = TinyConvNet().eval().to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32, generator=generator).to(device),) for _ in range(6)]
    return model, qw.analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False)


def test_an_fx_session_on_the_gpu_runs_each_step_and_its_runs_are_the_cpus(cuda):
    model, report = _conv_session(cuda)
    before = fingerprint(model)
    session = report.session
    baseline = session.baseline()
    assert baseline.ok, baseline.error
    assert any("measured on torch's x86 int8 kernels on the CPU" in note for note in baseline.notes)
    accepted = report.verified_suggestions().accept_all
    assert accepted is None or accepted.ok
    assert len(session.sensitivity())
    assert session.reach(target_sqnr_db=30).ok
    _, on_cpu = _conv_session(CPU)
    assert baseline.output_sqnr_db == pytest.approx(on_cpu.session.baseline().output_sqnr_db, abs=0.1)
    assert_unchanged(model, before)
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # the user's model stays where it was


def _decoder_session(device: torch.device):
    model, batches = tiny_llama()
    model = model.to(device)
    batches = [tuple(t.to(device) for t in batch) for batch in batches]
    options = {"engine": "eager", "format": "int4-weight-only", "group_size": 32, "metric": "perplexity"}
    return model, qw.analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False, **options)


@pytest.mark.parametrize("algorithm", ["rtn", "gptq", "awq", "hqq", "learned"])
def test_an_eager_decoder_on_the_gpu_runs_each_weight_algorithm_as_the_cpu_does(cuda, algorithm):
    model, report = _decoder_session(cuda)
    _, on_cpu = _decoder_session(CPU)
    chosen = ModuleSettings(format="int4-weight-only", group_size=32, algorithm=algorithm)
    # the learned rounding is offered to a block's Linears, not the head
    linears = [m.fqn for m in report.session.modules if m.current.format == "int4-weight-only" and m.algorithm_allowed(algorithm)]
    here, there = (r.session.apply(dict.fromkeys(linears, chosen)) for r in (report, on_cpu))
    assert here.ok, here.error
    assert here.eval_metric == pytest.approx(there.eval_metric, rel=1e-3 if algorithm != "learned" else 2e-2)
    # the weights computed from the calibration batches are computed on the GPU, the run converted on the CPU
    computed = any("computed on cuda" in note for note in here.notes)
    assert computed == (algorithm in ("gptq", "awq", "learned")), here.notes
    assert len(report.session.block_sensitivity())
    # each block's SQNR of a run whose copy is on the CPU, against the float model on the GPU
    assert report.session.block_sqnr(here).to_numpy() == pytest.approx(on_cpu.session.block_sqnr(there).to_numpy(), abs=0.5)


def test_batches_on_the_cpu_are_moved_to_the_model_when_asked(cuda):
    model, batches = tiny_llama()
    model = copy.deepcopy(model).to(cuda)
    with pytest.raises(qw.DeviceMismatchError, match="move_batches=True"):
        qw.analyze(model, batches[0], batches, progress=False, engine="eager")
    report = qw.analyze(model, batches[0], batches, progress=False, engine="eager", move_batches=True)
    assert report.session.baseline().ok


def test_calibration_on_the_gpu_never_waits_for_the_host(cuda):
    observer = ModelReportObserver(1, 0.975, stats=list(Stat), device=cuda)
    batch = torch.randn(8, 64, 56, 56, device=cuda)
    observer(batch)  # the first batch makes the per-channel state
    torch.cuda.set_sync_debug_mode("error")  # any copy back to the host raises
    try:
        for _ in range(3):
            observer(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert observer.num_batches_tracked == 4
