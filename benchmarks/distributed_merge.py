"""Calibration across processes against one process: two gloo ranks spawned on this machine, each
with half the calibration batches, against one process with all of them, on the trained digits
models (FX, x86 default mapping: HistogramObserver activations, per-channel weights).

Prints, per model: the largest difference between any number of the two reports (relative to
the number, absolute below 1) (the report's
observers merge exactly, the batch-range averages to float rounding), and the baseline run's
output SQNR in one process and on each rank (the run's HistogramObservers merge approximately),
next to how much one process's own baseline moves when the same batches come in another order
(torch's HistogramObserver depends on the order: it re-bins whenever the range grows).

    python benchmarks/distributed_merge.py [--models cnn mixer] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qreport_widgets as qw
from qreport_widgets.demo.digits import trained_digits_model

RANKS = 2


def quiet(done: int, total: int | None) -> None:
    """No progress bars: the table is the output."""


def numbers(report: qw.ModelReport) -> dict[str, float]:
    found = {}
    for detector, (_, modules) in report.generate_model_report().items():
        for fqn, features in modules.items():
            for feature, value in features.items():
                if isinstance(value, (bool, str)) or value is None:
                    continue
                array = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value, dtype=float).ravel()
                found.update({f"{detector}/{fqn}/{feature}/{i}": float(v) for i, v in enumerate(array)})
    return found


def batches_of(data) -> list[tuple[torch.Tensor]]:
    images = torch.cat([batch[0] for batch in data.calibration])
    size = len(images) // 6
    return [(images[i * size : (i + 1) * size],) for i in range(6)]


def rank_main(rank: int, port: int, name: str, cache: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        model, data = trained_digits_model(name, cache)
        shard = batches_of(data)[rank * 3 : rank * 3 + 3]
        start = time.perf_counter()
        report = qw.analyze(model, shard[0], shard, eval_data=data.evaluation, progress=False)
        seconds = time.perf_counter() - start
        sqnr = report.session.baseline().output_sqnr_db
        torch.save({"numbers": numbers(report), "sqnr": sqnr, "seconds": seconds}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["cnn", "mixer", "mobilenet"])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "qreport_digits"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {RANKS} gloo ranks with 3 batches each vs one process with all 6, 1 thread each")
    print(
        f"{'model':8s} {'report: largest rel. diff.':>28s} {'baseline SQNR, one process':>27s} "
        f"{'rank 0':>8s} {'rank 1':>8s} {'difference':>11s} {'one process, 3 batch orders':>28s}"
    )
    for name in args.models:
        model, data = trained_digits_model(name, args.cache)
        whole = batches_of(data)
        alone = qw.analyze(model, whole[0], whole, eval_data=data.evaluation, progress=False)
        expected, sqnr = numbers(alone), alone.session.baseline().output_sqnr_db
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(rank_main, args=(port, name, args.cache, out), nprocs=RANKS, start_method="spawn")
            ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(RANKS)]
        gap = max(
            abs(ranks[0]["numbers"][k] - v) / max(1.0, abs(v))
            for k, v in expected.items()
            if np.isfinite(v) and np.isfinite(ranks[0]["numbers"][k])
        )
        worst = max(abs(r["sqnr"] - sqnr) for r in ranks)
        orders = [
            qw.QuantizationSession(model, order[0], order, eval_data=data.evaluation).baseline(progress=quiet).output_sqnr_db
            for order in (whole, whole[::-1], whole[3:] + whole[:3])
        ]
        line = (
            f"{name:8s} {gap:28.2e} {sqnr:24.3f} dB {ranks[0]['sqnr']:8.3f} {ranks[1]['sqnr']:8.3f} {worst:8.3f} dB "
            f"{min(orders):16.3f} - {max(orders):.3f} dB"
        )
        print(line, flush=True)


if __name__ == "__main__":
    main()
