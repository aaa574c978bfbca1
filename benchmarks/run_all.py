"""`make bench`: every benchmark, one table. Numbers are measured here and now, never asserted.

python benchmarks/run_all.py [--quick]   (--quick: 3 repeats, no ResNet-50 calibration row)
"""

from __future__ import annotations

import argparse
import platform

import analysis_and_files
import apply_cost
import calibration_overhead
import memory
import pt2e
import report_build
import sensitivity
import torch
import widget_interaction
from common import CASES, THREADS, setup

from qreport_widgets.core.cpu import cpu_simd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    setup()
    repeats = 3 if args.quick else 5
    machine = platform.processor() or platform.machine()
    print(f"CPU: {cpu_simd()}")
    print(f"{machine}, torch {torch.__version__}, {THREADS} threads; medians of {repeats} repeats")
    print()
    print("Calibration, seconds per batch of 8 (plain prepare_fx | ours, all four detectors | PyTorch ModelReport)")
    columns = ("plain s/batch", "ours s/batch", "upstream s/batch", "ours/plain", "upstream/ours")
    print(f"{'case':24s} " + " ".join(f"{c:>16s}" for c in columns))
    cases = [c for c in CASES if not (args.quick and c.startswith("resnet50"))]
    for name in cases:
        row = calibration_overhead.measure(name, repeats, 8, upstream=not name.startswith("resnet50"))
        upstream = f"{row['upstream']:16.4f}" if "upstream" in row else f"{'-':>16s}"
        ratio = f"{row['upstream/ours']:16.2f}" if "upstream/ours" in row else f"{'-':>16s}"
        print(f"{name:24s} {row['plain']:16.4f} {row['ours']:16.4f} {upstream} {row['ours/plain']:16.2f} {ratio}", flush=True)
    print()
    row = report_build.measure(repeats)
    print(
        f"Report + tables, ResNet-50 layout ({row['modules']} modules, {row['channels']} channel rows): "
        f"generate_model_report {row['report_s']:.3f} s + ReportFrame {row['frame_s']:.3f} s = {row['total_s']:.3f} s"
    )
    row = widget_interaction.measure()
    print(
        f"Widget: first state {row['first_state_s']:.3f} s; dropdown change to a {row['channels']}-channel module "
        f"{row['change_ms']:.1f} ms in the kernel, {row['sent_kb']:.1f} KB sent"
    )
    for case in ("demo", "resnet18 8x3x224x224"):
        row = apply_cost.measure(case, repeats)
        bare = f"bare prepare_fx + calibrate + convert_fx {row['bare_s']:.3f} s"
        print(f"Apply, {case}: {row['apply_s']:.3f} s vs {bare} = {row['ratio']:.2f}x")
    for name in ("resnet18 8x3x224x224", "mlp-blocks 8x128x768"):
        row = memory.calibration_row(name)
        print(
            f"Peak memory, {name}: extra {row['extra_mb']:.0f} MB = {row['extra_over_activation']:.2f} x the largest "
            f"activation ({row['largest_activation_mb']:.0f} MB)"
        )
    row = analysis_and_files.measure_pause(repeats)
    print(
        f"analyze() calibration, ResNet-18 layout: torch observers running {row['running']:.3f} s/batch, "
        f"paused {row['paused']:.3f} s/batch ({row['running/paused']:.2f}x)"
    )
    for name in ("cnn", "mixer"):
        row = sensitivity.measure(name)
        print(
            f"Digits {name}: real keep-one-float sweep {row['seconds']:.1f} s for {len(row['sweep'])} modules; "
            f"as a ranking of it, per-layer SQNR: Spearman {row['spearman']:+.2f}, top-3 {row['top3']}/3; "
            f"session.sensitivity(): Spearman {row['ours_spearman']:+.2f}, top-3 {row['ours_top3']}/3 in "
            f"{row['sensitivity_s']:.2f} s; simulated vs real gains within {row['agreement']:.3f} dB"
        )
    for name in ("resnet18 8x3x224x224", "mlp-blocks 8x128x768"):
        row = pt2e.calibration(name, repeats, 8)
        apply = pt2e.apply(name, repeats, 8)
        print(
            f"PT2E, {name}: calibration through our observers {row['ours']:.4f} s/batch vs plain prepare_pt2e "
            f"{row['plain']:.4f} = {row['ratio']:.2f}x; Apply PT2E {apply['pt2e']:.2f} s vs FX {apply['fx']:.2f} s "
            f"(bare PT2E {apply['bare pt2e']:.2f} s)"
        )
    row = analysis_and_files.measure_files(repeats)
    print(
        f"Report file, ResNet-50 layout ({row['rows']} channel rows): save {row['save_s']:.3f} s, "
        f"load {row['load_s']:.3f} s, {row['mb']:.2f} MB"
    )


if __name__ == "__main__":
    main()
