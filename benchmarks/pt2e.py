"""PT2E: calibration through our observers on the exported float graph vs a plain ``prepare_pt2e``
model (torchao's observers), and one Apply under each engine, side by side.

Calibration: every repeat times both models one after another on the same batches; the table
shows medians over the repeats and the median of the per-repeat ratios. Apply: a session's
``apply`` with the starting settings (export or prepare, calibrate, convert, metrics) under the
FX and the PT2E engine, and the bare PT2E workflow (export, prepare_pt2e, calibrate, convert_pt2e).

    python benchmarks/pt2e.py [--repeats 5] [--batches 8] [--cases ...]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from common import CASES, batches_for, median, seconds_per_batch, setup

from qreport_widgets import ModelReport, QuantizationSession, default_detectors
from qreport_widgets.engines.pt2e import Pt2eEngine, export_model, torchao_pt2e
from qreport_widgets.engines.pt2e.numerics import convert, pt2e_warnings_hidden
from qreport_widgets.observe.graph import ModelGraph


def plain_pt2e(model: torch.nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    ao = torchao_pt2e()
    with pt2e_warnings_hidden():
        prepared = ao.prepare_pt2e(
            export_model(model, (example,)),
            ao.X86InductorQuantizer().set_global(ao.get_default_x86_inductor_quantization_config()),
        )
    return prepared


def ours_pt2e(model: torch.nn.Module, example: torch.Tensor) -> torch.fx.GraphModule:
    """What analyze(engine="pt2e") calibrates: the exported float graph (batch norms folded) with the
    four detectors' observers."""
    exported = copy.deepcopy(Pt2eEngine().float_reference(model, (example,)))
    report = ModelReport(exported, default_detectors("x86"), graph_of=lambda m: ModelGraph.of_exported(m, model))
    return report.prepare_detailed_calibration()


def calibration(case_name: str, repeats: int, batch_count: int) -> dict[str, float]:
    case = CASES[case_name]
    model = case.build().eval()
    batches = batches_for(case, batch_count)
    models = {"plain": plain_pt2e(model, batches[0]), "ours": ours_pt2e(model, batches[0])}
    for m in models.values():
        seconds_per_batch(m, batches[:1])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    ratios = []
    for _ in range(repeats):
        run = {name: seconds_per_batch(m, batches) for name, m in models.items()}
        for name, value in run.items():
            times[name].append(value)
        ratios.append(run["ours"] / run["plain"])
    return {"plain": median(times["plain"]), "ours": median(times["ours"]), "ratio": median(ratios)}


def bare_pt2e(model: torch.nn.Module, batches: list[tuple[torch.Tensor]]) -> float:
    start = time.perf_counter()
    prepared = plain_pt2e(copy.deepcopy(model), batches[0][0])
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    convert(prepared)
    return time.perf_counter() - start


def apply(case_name: str, repeats: int, batch_count: int) -> dict[str, float]:
    case = CASES[case_name]
    model = case.build().eval()
    batches = [(b,) for b in batches_for(case, batch_count)]
    sessions = {
        "fx": QuantizationSession(model, batches[0], batches),
        "pt2e": QuantizationSession(model, batches[0], batches, engine=Pt2eEngine()),
    }
    for session in sessions.values():
        session.baseline(progress=lambda done, total: None)  # warm-up; the export is made once per session
    times: dict[str, list[float]] = {"fx": [], "pt2e": [], "bare pt2e": []}
    for _ in range(repeats):
        for name, session in sessions.items():
            run = session.apply(session.current_settings(), label="timed", progress=lambda done, total: None)
            times[name].append(run.duration_s)
        times["bare pt2e"].append(bare_pt2e(model, sessions["pt2e"].calibration_data))
    return {name: median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--cases", nargs="*", default=["tiny-conv 8x3x32x32", "resnet18 8x3x224x224", "mlp-blocks 8x128x768"])
    args = parser.parse_args()
    setup()
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {args.batches} batches x {args.repeats} repeats (medians)")
    print("calibration, s/batch")
    print(f"{'case':24s} {'plain prepare_pt2e':>20s} {'ours (4 detectors)':>20s} {'ours/plain':>12s}")
    for name in args.cases:
        row = calibration(name, args.repeats, args.batches)
        print(f"{name:24s} {row['plain']:20.4f} {row['ours']:20.4f} {row['ratio']:12.2f}", flush=True)
    print("one Apply (starting settings; metrics included), s")
    print(f"{'case':24s} {'FX apply':>12s} {'PT2E apply':>12s} {'PT2E/FX':>10s} {'bare PT2E':>12s}")
    for name in args.cases:
        row = apply(name, args.repeats, args.batches)
        print(
            f"{name:24s} {row['fx']:12.2f} {row['pt2e']:12.2f} {row['pt2e'] / row['fx']:10.2f} {row['bare pt2e']:12.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
