"""Apply cost: QuantizationSession.run (prepare + calibrate + convert + metrics) vs a bare
prepare_fx + calibrate + convert_fx on the same calibration batches, side by side.

    python benchmarks/apply_cost.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from common import CASES, batches_for, median, setup
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

from qreport_widgets import demo
from qreport_widgets.tune.session import QuantizationSession


def bare(model, mapping, batches) -> float:
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare_fx(copy.deepcopy(model).eval(), mapping, batches[0])
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        convert_fx(prepared)
    return time.perf_counter() - start


def measure(case: str, repeats: int) -> dict[str, float]:
    if case == "demo":
        model, batches, mapping = demo.build_demo_model(), demo.demo_batches(8), demo.demo_qconfig_mapping()
    else:
        spec = CASES[case]
        model, batches, mapping = spec.build(), [(b,) for b in batches_for(spec, 8)], get_default_qconfig_mapping("x86")
    session = QuantizationSession(model, batches[0], batches, qconfig_mapping=mapping)
    session.baseline(progress=lambda done, total: None)  # warm-up; the float reference outputs are computed once per session
    ours, theirs, ratios = [], [], []
    for _ in range(repeats):
        a = session.run(mapping, label="timed", progress=lambda done, total: None).duration_s
        b = bare(model, mapping, session.calibration_data)
        ours.append(a)
        theirs.append(b)
        ratios.append(a / b)
    return {
        "bare_s": median(theirs),
        "apply_s": median(ours),
        "ratio": median(ratios),
        "calibration_batches": len(session.calibration_data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    setup()
    for case in ("demo", "resnet18 8x3x224x224"):
        row = measure(case, args.repeats)
        print(
            f"Apply, {case}: {row['apply_s']:.3f} s vs bare {row['bare_s']:.3f} s "
            f"({row['calibration_batches']} calibration batches) = {row['ratio']:.2f}x"
        )


if __name__ == "__main__":
    main()
