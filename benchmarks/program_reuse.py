"""A phone program lowered once per graph: a second run that changes only the int4 values, reused
against the same run lowered in full, side by side.

SmolLM2-135M-Instruct as ``real_decoder.py`` loads it (8 windows of 2 x 256 tokens calibrate, 4 held
out), the XNNPACK target, every Linear 8da4w in groups of 32. Three real runs in one process:

1. the baseline (round to nearest): exported, lowered in full, run in ExecuTorch's runtime;
2. GPTQ on every Linear: the same graph, so its int4 values and scales are written into the
   baseline's program (``engines/program_reuse.py``);
3. GPTQ again with no earlier program offered: lowered in full.

Each run's wall seconds (its calibration, GPTQ, lowering and evaluation), the lowering's own seconds,
its perplexity and its ``.pte`` bytes, and whether runs 2 and 3 made the same program byte for byte.

    python benchmarks/program_reuse.py [--algorithm gptq]
"""

from __future__ import annotations

import argparse
import time

from common import setup
from real_decoder import session_for, smollm2

from qreport_widgets import ModuleSettings
from qreport_widgets.core.progress import quiet
from qreport_widgets.engines import program_reuse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="gptq", choices=["gptq", "hqq", "learned"])
    args = parser.parse_args()
    setup()
    model, calibration, held_out = smollm2()
    session = session_for(model, calibration, held_out, "8da4w")
    linears = [m.fqn for m in session.modules if m.type_name == "Linear"]
    chosen = dict.fromkeys(linears, ModuleSettings(format="int8-dynamic-int4-weight", group_size=32, algorithm=args.algorithm))

    rows = []

    def timed(label: str, run_it) -> object:
        start = time.perf_counter()
        run = run_it()
        seconds = time.perf_counter() - start
        assert run.ok, run.error
        program = run.quantized_model
        how = "reused" if program.reused else "full"
        rows.append((label, seconds, program.lowering_s, run.eval_metric, len(program.pte), how))
        print(f"  {label}: {seconds:.1f} s", flush=True)
        return program

    timed("baseline (round to nearest)", lambda: session.baseline(progress=quiet))
    reused = timed(f"{args.algorithm}, the baseline's program rewritten", lambda: session.apply(chosen, progress=quiet))
    program_reuse.LOWERED.clear()  # no earlier program offered: the same run lowered in full
    full = timed(f"{args.algorithm}, lowered in full", lambda: session.apply(chosen, progress=quiet))

    print("\n| run | wall s | lowering s | perplexity | .pte bytes | lowering |")
    print("|---|---|---|---|---|---|")
    for label, seconds, lowering, metric, size, how in rows:
        print(f"| {label} | {seconds:.1f} | {lowering:.1f} | {metric:.3f} | {size:,} | {how} |")
    same = "the same" if reused.pte == full.pte else "DIFFERENT"
    print(f"\nthe rewritten program and the full lowering's, byte for byte: {same}")
    print(f"second run: {rows[1][1] / rows[2][1]:.0%} of the same run lowered in full")


if __name__ == "__main__":
    main()
