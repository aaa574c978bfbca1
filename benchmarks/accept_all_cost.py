"""What "Accept all suggestions" costs: seconds, real runs, and how each candidate was measured
(simulated, a real run, not tried), side by side for several models in one run, each from the x86
start after its baseline.

Models: a ViT-Tiny/16 layout as timm builds it (``architectures.VitTiny``: 50 Linear / Conv layers,
224 px, random weights), the layouts of tests/zoo.py that have the most candidates, and the digits CNN
and mixer (trained here).

    python benchmarks/accept_all_cost.py [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/zoo.py

import qreport_widgets as qw
from qreport_widgets.demo.architectures import VitTiny
from qreport_widgets.demo.digits import trained_digits_model

THREADS = 2
ZOO = ("text_encoder", "efficientnet", "mobilenet_v3", "prelu_net")


def report_of(name: str, cache_dir: str | None) -> qw.ModelReport:
    torch.manual_seed(0)
    if name == "vit-tiny":
        generator = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 3, 224, 224, generator=generator),) for _ in range(6)]
        return qw.analyze(VitTiny().eval(), batches[0], batches[:4], eval_data=batches[4:], progress=False)
    if name.startswith("digits-"):
        model, data = trained_digits_model(name.removeprefix("digits-"), cache_dir=cache_dir)
        return qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)
    from zoo import ARCHITECTURES

    build, data = ARCHITECTURES[name]
    batches = data(8)
    return qw.analyze(build().eval(), batches[0], batches[:6], eval_data=batches[6:], progress=False)


def measure(name: str, cache_dir: str | None) -> dict:
    report = report_of(name, cache_dir)
    session = report.session
    session.baseline(progress=lambda done, total: None)
    runs: list[str] = []
    apply = session.apply

    def counted(*args, **kwargs):
        runs.append(kwargs.get("label", ""))
        return apply(*args, **kwargs)

    session.apply = counted
    start = time.perf_counter()
    verified = report.verified_suggestions(progress=lambda done, total: None)
    seconds = time.perf_counter() - start
    measured = verified.frame()["measured"].value_counts()
    return {
        "name": name,
        "weighted": sum(m.weighted for m in session.modules),
        "seconds": seconds,
        "runs": len(runs),
        "candidates": len(verified.verdicts),
        "simulated": int(measured.get("simulated", 0)),
        "real": int(measured.get("real run", 0)),
        "not tried": int(measured.get("not tried", 0)),
        "offered": len(verified.offered),
        "gain": verified.accept_all_gain_db,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help="where the trained digits models are kept")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    print(f"# Accept all, {THREADS} threads\n")
    print("| model | layers | candidates | simulated | real run | not tried | real runs | seconds | offered | gain dB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ("vit-tiny", *ZOO, "digits-cnn", "digits-mixer"):
        r = measure(name, args.cache_dir)
        print(
            f"| {name} | {r['weighted']} | {r['candidates']} | {r['simulated']} | {r['real']} | {r['not tried']} | "
            f"{r['runs']} | {r['seconds']:.1f} | {r['offered']} | {r['gain']:+.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
