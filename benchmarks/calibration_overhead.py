"""Calibration cost: plain prepare_fx model vs ours (all four detectors; percentiles estimated, and
exact) vs PyTorch's ModelReport.

Every repeat times the three models one after another on the same batches, so the ratios are
measured side by side; the table shows medians over the repeats.

    python benchmarks/calibration_overhead.py [--repeats 5] [--batches 8] [--cases ...] [--no-upstream]
"""

from __future__ import annotations

import argparse

import torch
from common import CASES, batches_for, median, our_model, plain_model, seconds_per_batch, setup, upstream_model

from qreport_widgets.core.cpu import cpu_simd


def measure(case_name: str, repeats: int, batch_count: int, upstream: bool, device: str = "cpu") -> dict[str, float]:
    case = CASES[case_name]
    model = case.build()
    batches = [b.to(device) for b in batches_for(case, batch_count)]
    models = {
        "plain": plain_model(model, batches[0]),
        "ours": our_model(model, batches[0]),
        "exact": our_model(model, batches[0], exact_percentiles=True),
    }
    if upstream:
        models["upstream"] = upstream_model(model, batches[0])
    for m in models.values():
        m.to(device)
        seconds_per_batch(m, batches[:1])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    ratios: dict[str, list[float]] = {"ours/plain": [], "exact/plain": [], "upstream/ours": []}
    for _ in range(repeats):
        run = {name: seconds_per_batch(m, batches) for name, m in models.items()}
        for name, value in run.items():
            times[name].append(value)
        ratios["ours/plain"].append(run["ours"] / run["plain"])
        ratios["exact/plain"].append(run["exact"] / run["plain"])
        if upstream:
            ratios["upstream/ours"].append(run["upstream"] / run["ours"])
    row = {name: median(values) for name, values in times.items()}
    row.update({name: median(values) for name, values in ratios.items() if values})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--cases", nargs="*", default=[c for c in CASES if not c.startswith("resnet50")])
    parser.add_argument("--no-upstream", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    setup()
    print(f"CPU: {cpu_simd()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"{args.batches} batches x {args.repeats} repeats (medians)"
    )
    columns = ("plain s/batch", "ours s/batch", "upstream s/batch", "ours/plain", "exact/plain", "upstream/ours")
    print(f"{'case':24s} " + " ".join(f"{c:>16s}" for c in columns))
    for name in args.cases:
        row = measure(name, args.repeats, args.batches, not args.no_upstream, args.device)
        upstream = f"{row['upstream']:16.4f}" if "upstream" in row else f"{'-':>16s}"
        ratio = f"{row['upstream/ours']:16.2f}" if "upstream/ours" in row else f"{'-':>16s}"
        ratios = f"{row['ours/plain']:16.2f} {row['exact/plain']:16.2f} {ratio}"
        print(f"{name:24s} {row['plain']:16.4f} {row['ours']:16.4f} {upstream} {ratios}", flush=True)


if __name__ == "__main__":
    main()
