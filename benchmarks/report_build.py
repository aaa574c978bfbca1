"""Report generation + tidy tables for a ResNet-50-sized model (the first widget state needs both).

python benchmarks/report_build.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

from common import CASES, batches_for, median, setup

from qreport_widgets import ModelReport, default_detectors
from qreport_widgets.engines.fx.prepare import prepare


def measure(repeats: int = 5) -> dict[str, float]:
    case = CASES["resnet50 8x3x224x224"]
    batches = batches_for(case, 2)
    model = case.build()
    from torch.ao.quantization import get_default_qconfig_mapping

    report = ModelReport(prepare(model, get_default_qconfig_mapping("x86"), (batches[0],)), default_detectors())
    instrumented = report.prepare_detailed_calibration()
    import torch

    with torch.no_grad():
        for batch in batches:
            instrumented(batch)
    report_s, frame_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        report.generate_model_report()
        middle = time.perf_counter()
        frame = report.frame()  # built from the fresh analysis
        end = time.perf_counter()
        report_s.append(middle - start)
        frame_s.append(end - middle)
    report.generate_model_report()  # a fresh analysis, so the widget builds its tables too
    start = time.perf_counter()
    report.widget()  # tables + first widget state
    widget_s = time.perf_counter() - start
    return {
        "widget_s": widget_s,
        "modules": len(frame.module_names),
        "channels": len(frame.channels),
        "report_s": median(report_s),
        "frame_s": median(frame_s),
        "total_s": median([a + b for a, b in zip(report_s, frame_s, strict=True)]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    setup()
    row = measure(args.repeats)
    print(f"resnet50 layout: {row['modules']} observed modules, {row['channels']} channel rows")
    print(f"generate_model_report {row['report_s']:.3f} s + ReportFrame {row['frame_s']:.3f} s = {row['total_s']:.3f} s (median)")
    print(f"report.widget() (tables + first widget state) {row['widget_s']:.3f} s")


if __name__ == "__main__":
    main()
