"""Analyze a model with its calibration data spread over processes, then open the report in a notebook.

    torchrun --nproc-per-node 2 examples/analyze_with_torchrun.py --out digits.qreport

Each rank reads its own share of the calibration images (a DistributedSampler), ``analyze()``
calibrates on it and merges the observers across the ranks, so every rank holds the report one
process would make from all the images; a baseline run merges its observers the same way. Rank 0
saves the report; in a notebook, ``qreport_widgets.load_report("digits.qreport").widget()``.
gloo on CPUs; on GPUs, ``--backend nccl`` with the model and batches on each rank's device.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import qreport_widgets as qw
from qreport_widgets.demo.digits import trained_digits_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="digits.qreport")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "qreport_widgets"))
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    try:
        model, data = trained_digits_model("cnn", args.cache)  # the same weights on every rank
        images = torch.cat([batch[0] for batch in data.calibration])
        sampler = DistributedSampler(TensorDataset(images), shuffle=False, drop_last=True)  # this rank's share
        calibration = [(x,) for (x,) in DataLoader(TensorDataset(images), batch_size=64, sampler=sampler)]
        report = qw.analyze(model, calibration[0], calibration, eval_data=data.evaluation, progress=rank == 0)
        baseline = report.session.baseline()  # observers merged across the ranks before convert
        line = (
            f"rank {rank}: {len(calibration)} of the batches; report on {report.calibration_batches()} batches; "
            f"baseline output SQNR {baseline.output_sqnr_db:.2f} dB\n"
        )
        sys.stdout.write(line)  # one write with its newline: the ranks' lines never interleave
        sys.stdout.flush()
        if rank == 0:
            print(f"saved {report.save(args.out)}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
