"""int4 weight algorithms side by side: round to nearest, torchao's HQQ, GPTQ, AWQ and the learned rounding.

On the byte-level decoder trained on the Python reference's help topics (``demo/text.py``; trained
once, about a minute, cached in ``--cache``): every Linear in int4 weight-only at group sizes 32 and
128, each algorithm a real run of the session (``session.apply``; the learned rounding on the
blocks' Linears, GPTQ on the head, which sits in no block), its perplexity on the held-out
text, its output SQNR (logits against float) and its wall time, in one table. With ``--decoder
100m``: the same algorithms over every Linear of the 134M-parameter Llama decoder of
``llm_scale.py`` (random weights: timings only), one real run each at group size 128. With
``--program``: every Linear 8da4w in groups of 32 as an ExecuTorch program (XNNPACK, in its
runtime), each algorithm with and without rotation (R1 + R2): perplexity, logits' SQNR, ``.pte``
bytes, and the program's prefill and decode speed (``session.decode_speed``: a 32-token prompt, 32
tokens generated, one thread).

    python benchmarks/int4_algorithms.py [--cache DIR] [--decoder 100m] [--program]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import run_cells, setup

from qreport_widgets import ModuleSettings, Rotation, analyze
from qreport_widgets.core.progress import quiet
from qreport_widgets.demo.text import trained_text_decoder

ALGORITHMS = ("rtn", "hqq", "gptq", "awq", "learned")


def linears(session) -> list[str]:
    return [m.fqn for m in session.modules if m.type_name == "Linear"]


def every_linear(session, fmt: str, group: int, algorithm: str) -> dict[str, ModuleSettings]:
    """Every Linear in ``fmt`` by ``algorithm``; GPTQ where the module does not take it (the learned
    rounding works on blocks: the head takes GPTQ)."""
    modules = {m.fqn: m for m in session.modules}
    return {
        fqn: ModuleSettings(
            format=fmt, group_size=group, algorithm=algorithm if modules[fqn].algorithm_allowed(algorithm) else "gptq"
        )
        for fqn in linears(session)
    }


def runs(session, groups: tuple[int, ...]) -> list[dict]:
    rows = []
    for group in groups:
        for algorithm in ALGORITHMS:
            settings = every_linear(session, "int4-weight-only", group, algorithm)
            start = time.perf_counter()
            run = session.apply(settings, progress=quiet)
            seconds = time.perf_counter() - start
            if not run.ok:
                raise RuntimeError(f"{algorithm} g{group}: {run.error}")
            rows.append(
                {
                    "group": group,
                    "algorithm": algorithm,
                    "perplexity": run.eval_metric,
                    "output SQNR (dB)": run.output_sqnr_db,
                    "deployed KB": run.deployed_bytes / 1024,
                    "run (s)": seconds,
                }
            )
    return rows


def trained_session(cache: str, **formats: object) -> tuple[torch.nn.Module, object, float, object]:
    """The trained byte decoder, its data, its float perplexity and its eager session in ``formats``."""
    model, data = trained_text_decoder(cache_dir=cache)
    session = analyze(
        model,
        data.calibration[0],
        data.calibration,
        eval_data=data.evaluation,
        engine="eager",
        metric="perplexity",
        progress=False,
        **formats,
    ).session
    return model, data, data.perplexity(model), session


def trained(cache: str) -> None:
    model, data, float_ppl, session = trained_session(cache, format="int4-weight-only")
    rows = runs(session, (32, 128))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"byte-level decoder trained on real text, {parameters / 1e6:.2f}M parameters, every Linear int4 weight-only")
    print(f"float perplexity {float_ppl:.4f} on {len(data.evaluation)} held-out batches of 4 x 128 bytes")
    header = ("group", 5), ("algorithm", 9), ("perplexity", 10), ("vs float", 9), ("SQNR (dB)", 9), ("vs rtn", 7), ("KB", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'run (s)':>7}")
    for row in rows:
        rtn = next(r for r in rows if r["group"] == row["group"] and r["algorithm"] == "rtn")
        print(
            f"{row['group']:>5} {row['algorithm']:>9} {row['perplexity']:>10.4f} "
            f"{100 * (row['perplexity'] / float_ppl - 1):>8.2f}% {row['output SQNR (dB)']:>9.2f} "
            f"{row['output SQNR (dB)'] - rtn['output SQNR (dB)']:>+7.2f} {row['deployed KB']:>8.1f} {row['run (s)']:>7.2f}"
        )


def programs(cache: str) -> None:
    _, _, float_ppl, session = trained_session(cache, format="int8-dynamic-int4-weight", group_size=32, target="xnnpack")
    print(f"\nthe same decoder, every Linear 8da4w g32 as an ExecuTorch program (XNNPACK, in its runtime); float {float_ppl:.4f}")
    print("| algorithm | rotation | perplexity | vs float | SQNR (dB) | .pte KB | prefill ms | decode ms | run (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for algorithm in ALGORITHMS:
        for rotation in (None, Rotation()):
            start = time.perf_counter()
            run = session.apply(
                every_linear(session, "int8-dynamic-int4-weight", 32, algorithm), rotation=rotation, progress=quiet
            )
            seconds = time.perf_counter() - start
            rotated = "R1 + R2" if rotation is not None else "-"
            if not run.ok:
                print(f"| {algorithm} | {rotated} | failed: {run.error} |")
                continue
            speed = session.decode_speed(run)
            timings = f"{speed.prefill_ms:.2f} | {speed.decode_ms:.2f} | {seconds:.0f}"
            print(f"| {algorithm} | {rotated} | {run_cells(run, float_ppl)} | {timings} |", flush=True)


def decoder_timings(size: str) -> None:
    from llm_scale import CALIBRATION, decoder

    model, batches = decoder(size)
    report = analyze(
        model,
        batches[0],
        batches[:CALIBRATION],
        eval_data=batches[CALIBRATION:],
        engine="eager",
        format="int4-weight-only",
        group_size=128,
        progress=False,
    )
    rows = runs(report.session, (128,))
    parameters = sum(p.numel() for p in model.parameters())
    names = linears(report.session)
    print(f"\n{size} Llama decoder (random weights), {parameters / 1e6:.0f}M parameters, {len(names)} Linears int4 g128")
    print(f"{'algorithm':>9} {'run (s)':>8} {'SQNR (dB)':>9}")
    for row in rows:
        print(f"{row['algorithm']:>9} {row['run (s)']:>8.1f} {row['output SQNR (dB)']:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", default=str(Path(tempfile.gettempdir()) / "qreport_benchmarks"), help="where the trained decoder is kept"
    )
    parser.add_argument("--decoder", choices=["100m", "500m", "1b"], help="also time each algorithm on a large decoder")
    parser.add_argument(
        "--program", action="store_true", help="also each algorithm, rotated or not, as an 8da4w ExecuTorch program"
    )
    arguments = parser.parse_args()
    setup()
    torch.manual_seed(0)
    trained(arguments.cache)
    if arguments.program:
        programs(arguments.cache)
    if arguments.decoder:
        decoder_timings(arguments.decoder)


if __name__ == "__main__":
    main()
