"""Peak memory during calibration: plain prepare_fx model vs ours, each in a fresh process.

The extra peak of the instrumented model is compared with the largest activation tensor of the
model (the observers keep O(channels + bins) state; work buffers are sized by one activation).

    python benchmarks/memory.py [--case "resnet18 8x3x224x224"]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from common import CASES, batches_for, our_model, plain_model, setup


def child(case_name: str, variant: str, batches: int) -> None:
    setup()
    case = CASES[case_name]
    data = batches_for(case, batches)
    model = (our_model if variant == "ours" else plain_model)(case.build(), data[0])
    largest = 0

    def record(_module, _inputs, output):
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules()]
    with torch.no_grad():
        model(data[0])
    for hook in hooks:
        hook.remove()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        for batch in data:
            model(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kb": peak, "before_kb": before, "largest_activation_bytes": largest}))


def measure(case_name: str, batches: int = 8) -> dict[str, float]:
    results = {}
    for variant in ("plain", "ours"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--case", case_name, "--batches", str(batches)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    extra = (results["ours"]["peak_kb"] - results["plain"]["peak_kb"]) * 1024
    largest = results["plain"]["largest_activation_bytes"]
    return {
        "plain_peak_mb": results["plain"]["peak_kb"] / 1024,
        "ours_peak_mb": results["ours"]["peak_kb"] / 1024,
        "extra_mb": extra / 2**20,
        "largest_activation_mb": largest / 2**20,
        "extra_over_activation": extra / largest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="resnet18 8x3x224x224")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--child", choices=["plain", "ours"])
    args = parser.parse_args()
    if args.child:
        child(args.case, args.child, args.batches)
        return
    row = measure(args.case, args.batches)
    print(
        f"{args.case}: peak RSS plain {row['plain_peak_mb']:.0f} MB, ours {row['ours_peak_mb']:.0f} MB; "
        f"extra {row['extra_mb']:.0f} MB = {row['extra_over_activation']:.2f} x the largest activation "
        f"({row['largest_activation_mb']:.0f} MB)"
    )


if __name__ == "__main__":
    main()
