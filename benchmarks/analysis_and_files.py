"""analyze()'s calibration pass with prepare_fx's own observers paused vs running, and the cost of
saving and opening a ResNet-50-sized report.

Every repeat times the paused and the running pass one after another on the same batches.

    python benchmarks/analysis_and_files.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from common import CASES, batches_for, median, our_model, seconds_per_batch, setup

import qreport_widgets as qw
from qreport_widgets.engines.fx.prepare import torch_observers_paused


def measure_pause(repeats: int = 5, case_name: str = "resnet18 8x3x224x224") -> dict[str, float]:
    case = CASES[case_name]
    batches = batches_for(case, 6)
    model = our_model(case.build(), batches[0])
    seconds_per_batch(model, batches[:1])
    running, paused, ratios = [], [], []
    for _ in range(repeats):
        a = seconds_per_batch(model, batches)
        with torch_observers_paused(model):
            b = seconds_per_batch(model, batches)
        running.append(a)
        paused.append(b)
        ratios.append(a / b)
    return {"running": median(running), "paused": median(paused), "running/paused": median(ratios)}


def measure_files(repeats: int = 5) -> dict[str, float]:
    case = CASES["resnet50 8x3x224x224"]
    batches = [(b,) for b in batches_for(case, 2)]
    report = qw.analyze(case.build(), batches[0], batches, progress=False)
    report.frame()
    save_s, load_s = [], []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "resnet50.qreport"
        for _ in range(repeats):
            start = time.perf_counter()
            report.save(path)
            middle = time.perf_counter()
            loaded = qw.load_report(path)
            save_s.append(middle - start)
            load_s.append(time.perf_counter() - middle)
        size = os.path.getsize(path)
    return {"save_s": median(save_s), "load_s": median(load_s), "mb": size / 1e6, "rows": len(loaded.frame().channels)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    setup()
    row = measure_pause(args.repeats)
    print(
        f"analyze() calibration, ResNet-18 layout: torch observers running {row['running']:.3f} s/batch, "
        f"paused {row['paused']:.3f} s/batch ({row['running/paused']:.2f}x)"
    )
    row = measure_files(args.repeats)
    print(
        f"Report file, ResNet-50 layout ({row['rows']} channel rows): save {row['save_s']:.3f} s, "
        f"load {row['load_s']:.3f} s, {row['mb']:.2f} MB"
    )


if __name__ == "__main__":
    with torch.no_grad():
        main()
