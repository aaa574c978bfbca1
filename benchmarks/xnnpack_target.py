"""x86 against the phone: each model quantized by the PT2E engine for x86 and for XNNPACK, the
XNNPACK runs lowered and executed in ExecuTorch's runtime.

Per model: the float model's size (torch.save), the x86 baseline (torchao's X86InductorQuantizer,
convert_pt2e's graph in PyTorch) and the XNNPACK baseline (XNNPACK's quantizer, the .pte program in
ExecuTorch's runtime): output SQNR, the simulation's SQNR of the XNNPACK start and its gap to the
runtime, the .pte's bytes, latency on one thread, lowering time, and what XNNPACK did not delegate.
Then on the XNNPACK target: the sensitivity ranking's top module, reach (1 dB past the best single
module kept float) and Accept all of the verified suggestions, each confirmed by a run in the runtime.

Models: the digits CNN and MobileNet trained in fixtures, and the MobileNetV3-Small (54 layers, 96 x 96)
and ResNet-18 (224 x 224) layouts with random weights on random images (4 calibration, 2 evaluation
batches of 4).

python benchmarks/xnnpack_target.py [--models digits-cnn mobilenet_v3_small resnet18 ...] [--baseline-only] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import io
import time

import torch
from common import setup

from qreport_widgets import analyze
from qreport_widgets.demo.architectures import mobilenet_v3_small, resnet18
from qreport_widgets.demo.digits import trained_digits_model

MODELS = ["digits-cnn", "digits-mobilenet", "mobilenet_v3_small", "resnet18"]


def quiet(done: int, total: int | None) -> None:
    pass


def build(name: str, cache_dir: str | None):
    if name.startswith("digits-"):
        model, data = trained_digits_model(name.removeprefix("digits-"), cache_dir)
        return model, data.calibration, data.evaluation, data.accuracy
    torch.manual_seed(0)
    model = (mobilenet_v3_small() if name == "mobilenet_v3_small" else resnet18()).eval()
    size = 96 if name == "mobilenet_v3_small" else 224
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, size, size, generator=generator),) for _ in range(6)]
    return model, batches[:4], batches[4:], None


def float_bytes(model: torch.nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return len(buffer.getvalue())


def measure(name: str, cache_dir: str | None, tune: bool = True) -> tuple[str, str]:
    model, calibration, evaluation, eval_fn = build(name, cache_dir)
    given = {"eval_data": evaluation, "eval_fn": eval_fn, "engine": "pt2e", "progress": False}
    x86 = analyze(model, calibration[0], calibration, **given).session.baseline(progress=quiet)
    began = time.perf_counter()
    report = analyze(model, calibration[0], calibration, target="xnnpack", **given)
    session = report.session
    baseline = session.baseline(progress=quiet)
    if not baseline.ok:
        return f"| {name} | failed: {baseline.error} |", ""
    truth = session.truth_check()
    program = baseline.quantized_model
    first = time.perf_counter() - began
    metric = f" / {x86.eval_metric:.3f} vs {baseline.eval_metric:.3f}" if eval_fn is not None else ""
    left = ", ".join(f"{op} x{n}" for op, n in program.delegation.left.items()) or "nothing"
    line = (
        f"| {name} | {float_bytes(model) / 1024:,.0f} | {x86.output_sqnr_db:.2f}{metric} | {baseline.output_sqnr_db:.2f} "
        f"| {truth.simulated_db:.2f} ({truth.gap_db:+.2f}) | {len(program.pte) / 1024:,.0f} | {x86.latency_ms:.2f} "
        f"| {baseline.latency_ms:.2f} | {program.lowering_s:.1f} | {program.delegation.delegated} | {left} | {first:.0f} s |"
    )
    if not tune:
        return line, ""

    began = time.perf_counter()
    sensitivity = session.sensitivity(progress=quiet)
    ranking = time.perf_counter() - began
    top, gain = sensitivity.index[0], float(sensitivity["output_sqnr_gain_db"].iloc[0])
    target = baseline.output_sqnr_db + max(gain, 0.0) + 1.0
    began = time.perf_counter()
    reached = session.reach(target)
    reaching = time.perf_counter() - began
    floats = sum(1 for choice in reached.settings.values() if choice.keep_float)
    reach_words = (
        f"{reached.output_sqnr_db:.2f} dB real, {floats} float, {reached.deployed_bytes / 1024:,.0f} KB"
        if reached.ok
        else f"failed: {reached.error}"
    )
    began = time.perf_counter()
    verified = report.verified_suggestions(progress=quiet)
    verifying = time.perf_counter() - began
    accept = verified.accept_all
    offered = len(verified.offered)
    accepted = f"{accept.output_sqnr_db:.2f} dB real ({offered} offered)" if accept is not None else "nothing offered"
    tuning = (
        f"| {name} | {top} +{gain:.2f} dB ({ranking:.0f} s) | >= {target:.2f} dB: {reach_words} ({reaching:.0f} s) "
        f"| {accepted} ({verifying:.0f} s) |"
    )
    return line, tuning


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--baseline-only", action="store_true", help="the first table only (no sensitivity, reach, Accept all)")
    args = parser.parse_args()
    setup()
    lines, tunings = [], []
    for name in args.models:
        line, tuning = measure(name, args.cache_dir, tune=not args.baseline_only)
        print(line, flush=True)
        lines.append(line)
        tunings.append(tuning)
    print()
    print(
        "| model | float (KB) | x86 SQNR dB (/ accuracy x86 vs XNNPACK) | XNNPACK runtime SQNR dB | simulated (gap) "
        "| .pte (KB) | x86 ms | XNNPACK ms | lowering s | XNNPACK ops | left to portable kernels | analyze + baseline |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    print()
    print("| model (XNNPACK) | most sensitive module | reach | Accept all, verified |")
    print("|---|---|---|---|")
    print("\n".join(t for t in tunings if t))


if __name__ == "__main__":
    main()
