"""Calibration across torch.distributed processes (two gloo ranks spawned on this machine): each rank
analyzes half the batches and ends with the report one process makes from all of them, and a
baseline run whose output SQNR is one process's; GPTQ and AWQ on the trained decoder fit the same
int4 weights from two ranks' inputs as from one process's; shards of different sizes, or a rank with
no data, raise a clear error on every rank instead of hanging."""

from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qreport_widgets as qw
from qreport_widgets.demo.digits import trained_digits_model

RANKS = 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "analyze_with_torchrun.py"
DEADLINE_S = 240  # a hang fails the test instead of stalling the suite
SHARDS = {  # case -> each rank's calibration batches, as slices of the batches one process sees
    "halves": (slice(0, 3), slice(3, 6)),
    "uneven": (slice(0, 1), slice(1, 6)),
    "empty": (slice(0, 6), slice(0, 0)),
}


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


def six_batches(data) -> list[tuple[torch.Tensor]]:
    """The calibration images in six equal batches."""
    images = torch.cat([batch[0] for batch in data.calibration])
    size = len(images) // 6
    return [(images[i * size : (i + 1) * size],) for i in range(6)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, cache: str, cases: tuple[str, ...], out: str) -> None:
    """Each of ``cases`` in turn in one process group (every rank stops at the same collective when one
    fails, so the next case starts together); what each found saved as ``{case}-rank{rank}.pt``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        for case in cases:
            torch.save(rank_case(rank, cache, case, out), os.path.join(out, f"{case}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def rank_case(rank: int, cache: str, case: str, out: str) -> dict:
    try:
        model, data = trained_digits_model("cnn", cache)
        shard = six_batches(data)[SHARDS[case][rank]]
        report = qw.analyze(model, data.calibration[0], shard, eval_data=data.evaluation, progress=False)
        baseline = report.session.baseline()
        assert baseline.ok, baseline.error
        if rank == 0:
            report.save(os.path.join(out, "report.qreport"))
        return {"values": flat(report.generate_model_report()), "sqnr": baseline.output_sqnr_db}
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}


def flat(reports: dict) -> dict[str, float]:
    """Every number of a generate_model_report() answer, by detector / module / feature (/ channel)."""
    values = {}
    for detector, (_, modules) in reports.items():
        for fqn, features in modules.items():
            for feature, value in features.items():
                if isinstance(value, (bool, str)) or value is None:
                    continue
                array = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value, dtype=float).ravel()
                for i, number in enumerate(array):
                    values[f"{detector}/{fqn}/{feature}/{i}"] = float(number)
    return values


def run_ranks(main, args: tuple, what: str) -> None:
    """``main(rank, *args)`` in RANKS spawned processes, waited for; a hang fails the test."""
    context = mp.start_processes(main, args=args, nprocs=RANKS, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what}: the ranks did not finish within {DEADLINE_S} s (a rank is waiting in a collective)")


def spawn(cases: tuple[str, ...], cache, tmp_path) -> dict[str, list[dict]]:
    """Each case's answer from every rank, the cases run one after another by the same ranks (one
    spawn: each rank's imports are most of its time)."""
    run_ranks(rank_main, (free_port(), str(cache), cases, str(tmp_path)), " then ".join(cases))
    return {case: [torch.load(tmp_path / f"{case}-rank{rank}.pt", weights_only=False) for rank in range(RANKS)] for case in cases}


def test_two_ranks_with_half_the_batches_each_make_one_process_report(cache, tmp_path):
    model, data = trained_digits_model("cnn", cache)
    whole = six_batches(data)
    alone = qw.analyze(model, whole[0], whole, eval_data=data.evaluation, progress=False)
    expected, expected_sqnr = flat(alone.generate_model_report()), alone.session.baseline().output_sqnr_db
    ranks = spawn(("halves",), cache, tmp_path)["halves"]
    for rank, found in enumerate(ranks):
        assert "error" not in found, found.get("trace")
        assert found["values"].keys() == expected.keys()
        for key, value in expected.items():
            assert math.isclose(found["values"][key], value, rel_tol=1e-5, abs_tol=1e-5) or (
                math.isnan(value) and math.isnan(found["values"][key])
            ), f"rank {rank}: {key} {found['values'][key]} != {value}"
        assert abs(found["sqnr"] - expected_sqnr) <= 0.05, f"rank {rank}: {found['sqnr']:.3f} vs {expected_sqnr:.3f} dB"
    assert ranks[0]["sqnr"] == ranks[1]["sqnr"]  # the same merged observers, the same evaluation batches
    saved = qw.load_report(tmp_path / "report.qreport")  # rank 0's, as a notebook opens it
    a, b = alone.frame(), saved.frame()
    for table in ("modules", "channels"):
        pd.testing.assert_frame_equal(getattr(a, table), getattr(b, table), rtol=1e-5, atol=1e-5)
    assert list(a.histograms) == list(b.histograms) and a.histograms  # histograms merge exactly
    for module, (counts, edges) in a.histograms.items():
        np.testing.assert_array_equal(b.histograms[module][0], counts)
        np.testing.assert_array_equal(b.histograms[module][1], edges)
    assert [(s.module_fqn, s.kind) for s in saved.suggestions()] == [(s.module_fqn, s.kind) for s in alone.suggestions()]
    assert saved.calibration_batches() == alone.calibration_batches()


def int4_weights_by_algorithm(cache: str, calibration: list, evaluation: list) -> dict:
    """The trained byte decoder's Linears in int4 (group 32), GPTQ on the MLPs and AWQ on the
    attention: each module's int4 values and scales, the norms AWQ's scales folded into, the output SQNR and perplexity."""
    from qreport_widgets.demo.text import trained_text_decoder
    from qreport_widgets.engines.eager.algorithms import INPUT_SCALE

    model, data = trained_text_decoder(cache_dir=cache)
    given = {"engine": "eager", "format": "int4-weight-only", "metric": "perplexity", "progress": False}
    session = qw.analyze(model, data.calibration[0], calibration, eval_data=evaluation, **given).session
    settings = {
        m.fqn: qw.ModuleSettings(format="int4-weight-only", group_size=32, algorithm="gptq" if ".mlp." in m.fqn else "awq")
        for m in session.modules
        if m.type_name == "Linear" and "layers" in m.fqn
    }
    run = session.apply(settings)
    assert run.ok, run.error
    weights = {}
    for fqn in settings:
        module = run.quantized_model.get_submodule(fqn)
        weights[fqn] = [module.weight.qdata, module.weight.scale, getattr(module, INPUT_SCALE, torch.zeros(0))]
    # AWQ's scales, folded into the norms before q/k/v (v_proj's rows carry o_proj's)
    norms = {
        fqn: module.weight.detach()
        for fqn, module in run.quantized_model.named_modules()
        if fqn.endswith("input_layernorm") and not torch.equal(module.weight, model.get_submodule(fqn).weight)
    }
    return {"weights": weights, "norms": norms, "sqnr": run.output_sqnr_db, "perplexity": run.eval_metric, "kept": run.notes}


def decoder_rank_main(rank: int, port: int, cache: str, out: str) -> None:
    from qreport_widgets.demo.text import trained_text_decoder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        _, data = trained_text_decoder(cache_dir=cache)
        half = len(data.calibration) // RANKS
        found = int4_weights_by_algorithm(cache, data.calibration[rank * half : (rank + 1) * half], data.evaluation)
    except Exception as error:
        found = {"error": type(error).__name__, "message": str(error), "trace": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(found, os.path.join(out, f"decoder{rank}.pt"))


def test_gptq_and_awq_from_two_ranks_inputs_are_one_processs(text_decoder, digits_cache, tmp_path):
    """Each rank gathers GPTQ's Gram matrices and AWQ's input magnitudes on half the calibration
    batches; summed across the ranks they give the int4 weights (values, scales, AWQ's input scales)
    one process fits on all of them, bit for bit, and the same output SQNR and perplexity. The one
    process runs on one thread, as each rank does: at another thread count a float32 matrix product
    sums in another order (on a CPU without AVX-512 it does), and a rounding step flips."""
    _, data = text_decoder
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = int4_weights_by_algorithm(str(digits_cache), data.calibration, data.evaluation)
    finally:
        torch.set_num_threads(threads)
    run_ranks(decoder_rank_main, (free_port(), str(digits_cache), str(tmp_path)), "GPTQ and AWQ")
    awq_scaled = 0
    for rank in range(RANKS):
        found = torch.load(tmp_path / f"decoder{rank}.pt", weights_only=False)
        assert "error" not in found, found.get("trace")
        assert found["weights"].keys() == alone["weights"].keys()
        for fqn, expected in alone["weights"].items():
            for ours, theirs in zip(found["weights"][fqn], expected, strict=True):
                assert torch.equal(ours, theirs), f"rank {rank}: {fqn}"
        assert found["norms"].keys() == alone["norms"].keys()
        for fqn, expected in alone["norms"].items():
            assert torch.equal(found["norms"][fqn], expected), f"rank {rank}: {fqn}"
        assert found["sqnr"] == alone["sqnr"] and found["perplexity"] == alone["perplexity"]
        awq_scaled = len(found["norms"])
    assert awq_scaled > 0  # AWQ chose input scales somewhere, folded into norms, and they match too


def test_uneven_or_empty_shards_stop_every_rank_with_a_clear_error(cache, tmp_path):
    """Uneven shards, then a rank with none, in the same ranks: each stops every rank with its reason."""
    trained_digits_model("cnn", cache)  # trained once here, loaded by the ranks
    said = {"uneven": r"different numbers of batches \(rank 0: 1, rank 1: 5\)", "empty": r"rank 1: NotCalibratedError"}
    for case, ranks in spawn(tuple(said), cache, tmp_path).items():
        for rank, found in enumerate(ranks):
            assert found.get("error") == "DistributedCalibrationError", f"{case}, rank {rank}: {found}"
            assert "every rank stops here" in found["message"]
            assert re.search(said[case], found["message"]), found["message"]


def test_the_torchrun_example_saves_a_report_a_notebook_opens(cache, tmp_path):
    """examples/analyze_with_torchrun.py as docs/SCALE.md runs it: torchrun, two ranks, rank 0 saves."""
    trained_digits_model("cnn", cache)
    out = tmp_path / "digits.qreport"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(RANKS),
        str(EXAMPLE),
        "--out",
        str(out),
        "--cache",
        str(cache),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    said = f"stdout: {done.stdout!r}\nstderr (end): {done.stderr[-3000:]}"  # all of it where a rank's line is missing
    assert len(lines) == RANKS and len({line.split(": ", 1)[1] for line in lines}) == 1, said  # same report, same SQNR
    saved = qw.load_report(out)
    assert f"report on {saved.calibration_batches()} batches" in lines[0]
    assert saved.widget() is not None
