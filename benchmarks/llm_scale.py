"""Decoders at scale: per step, the wall time against a plain forward pass over the same batches and
the peak / held resident memory as a multiple of the float weights.

Llama-style decoders built offline from ``LlamaConfig`` (random weights: time and memory do not
depend on what the weights are), eager engine, each size and format in a fresh process. Batches of
1 x 256 tokens: 4 to calibrate, 2 held out. Steps: ``analyze`` (against a plain pass over the 4
calibration batches; also timed again after the steps without the memory probe, side by side with
a plain pass), ``baseline``, ``sensitivity`` (per module, against a plain pass over the 2
held-out batches), ``fit`` to a size budget, three ``apply``, ``block_sensitivity`` with perplexity
the metric (per block, against a plain pass over the held-out batches: one pass a block variant).
Memory above the process with the float model loaded and the tool's code imported (a tiny decoder is taken through the same steps
first), sampled every 2 ms (``memory.RssProbe``). With ``--calibration``: the instrumented
calibration against a plain ``prepare_fx`` calibration (``calibration_overhead.py``'s cases).

    python benchmarks/llm_scale.py [--sizes 100m 500m 1b] [--formats int8-weight-only int4-weight-only]
    python benchmarks/llm_scale.py --calibration
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from memory import RssProbe, model_bytes, plain_pass_seconds, settle

from qreport_widgets import ModuleSettings, analyze
from qreport_widgets.core.cpu import cpu_simd
from qreport_widgets.core.progress import quiet

TOKENS = 256
CALIBRATION, HELD_OUT = 4, 2
SIZES = {  # name -> LlamaConfig's sizes (vocabulary 32,000, untied embeddings)
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12},
    "500m": {"hidden_size": 1280, "intermediate_size": 3584, "num_hidden_layers": 20, "num_attention_heads": 20},
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32},
}
FORMATS = ("int8-weight-only", "int4-weight-only")
STEPS = ("analyze", "baseline", "sensitivity", "fit", "apply 1", "apply 2", "apply 3", "block sensitivity")


def decoder(size: str) -> tuple[torch.nn.Module, list[tuple[torch.Tensor]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=TOKENS, use_cache=False, **SIZES[size])
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32000, (1, TOKENS), generator=generator),) for _ in range(CALIBRATION + HELD_OUT)]
    return model, batches


def take_through(
    model: torch.nn.Module, batches: list, fmt: str, step: Callable[[str, Callable[[], object]], object], until: str = STEPS[-1]
) -> None:
    """analyze -> baseline -> sensitivity -> fit -> three applies -> block sensitivity with perplexity the
    metric (a session of its own), each through ``step``, up to ``until``."""
    last = STEPS.index(until)
    calibration, held_out = batches[:CALIBRATION], batches[CALIBRATION:]
    report = step(
        "analyze",
        lambda: analyze(model, calibration[0], calibration, eval_data=held_out, engine="eager", format=fmt, progress=False),
    )
    session = report.session
    baseline = step("baseline", lambda: session.baseline(progress=quiet))
    if last < STEPS.index("sensitivity"):
        return
    step("sensitivity", lambda: session.sensitivity(progress=quiet, metric=False))
    if last < STEPS.index("fit"):
        return
    step("fit", lambda: session.fit(max_size_bytes=baseline.deployed_bytes * 1.05, progress=quiet))
    tunable = [m.fqn for m in session.modules if not m.current.keep_float]
    for i in range(min(last, STEPS.index("apply 3")) - STEPS.index("fit")):
        step(f"apply {i + 1}", lambda i=i: session.apply({tunable[i]: ModuleSettings(keep_float=True)}, progress=quiet))
    if last < STEPS.index("block sensitivity"):
        return
    given = {"engine": "eager", "format": fmt, "metric": "perplexity", "progress": False}
    by_perplexity = analyze(model, calibration[0], calibration, eval_data=held_out, **given).session
    step("block sensitivity", lambda: by_perplexity.block_sensitivity(progress=quiet))


def child(size: str, fmt: str, until: str) -> None:
    torch.set_num_threads(2)
    model, batches = decoder(size)
    weights = model_bytes(model)
    plain_calibration = plain_pass_seconds(model, batches[:CALIBRATION])
    plain_held_out = plain_pass_seconds(model, batches[CALIBRATION:])
    loaded = settle()
    tiny, tiny_batches = decoder("tiny")
    take_through(tiny, tiny_batches, fmt, lambda name, action: action())  # imports and caches first
    del tiny
    base = settle()
    probe = RssProbe()
    rows = []

    def step(name: str, action: Callable[[], object]) -> object:
        start = time.perf_counter()
        with probe.watching() as peak:
            value = action()
        seconds = time.perf_counter() - start
        held = settle()
        rows.append({"step": name, "seconds": seconds, "peak": (peak() - base) / weights, "held": (held - base) / weights})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        return value

    found = {}

    def step_keeping(name: str, action: Callable[[], object]) -> object:
        found[name] = step(name, action)
        return found[name]

    take_through(model, batches, fmt, step_keeping, until)
    blocks = len(found["block sensitivity"]) if "block sensitivity" in found else 0
    analyze_alone = analyze_side_by_side(model, batches, fmt)
    modules = sum(1 for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    print(
        json.dumps(
            {
                "size": size,
                "format": fmt,
                "parameters": sum(p.numel() for p in model.parameters()),
                "weights_mb": weights / 2**20,
                "plain_calibration_s": plain_calibration,
                "plain_held_out_s": plain_held_out,
                "modules": modules,
                "block_variants": blocks,
                "fixed_mb": (base - loaded) / 2**20,
                "analyze_alone": analyze_alone,
                "rows": rows,
            }
        )
    )


def analyze_side_by_side(model: torch.nn.Module, batches: list, fmt: str, repeats: int = 3) -> dict[str, float]:
    """``analyze()`` timed without the memory probe (whose sampling thread shares the 2 cores), each
    repeat right after a plain pass over the same calibration batches; medians."""
    calibration, held_out = batches[:CALIBRATION], batches[CALIBRATION:]
    plain, ours = [], []
    for _ in range(repeats):
        plain.append(plain_pass_seconds(model, calibration))
        start = time.perf_counter()
        analyze(model, calibration[0], calibration, eval_data=held_out, engine="eager", format=fmt, progress=False)
        ours.append(time.perf_counter() - start)
    return {"plain_s": statistics.median(plain), "analyze_s": statistics.median(ours)}


def versus_plain(row: dict, table: dict) -> str:
    if row["step"] == "analyze":
        return f"{row['seconds'] / table['plain_calibration_s']:.2f}x a plain pass over the calibration batches"
    if row["step"] == "block sensitivity":  # one variant per block, each one pass over the held-out batches
        per_variant = row["seconds"] / max(table["block_variants"], 1) / table["plain_held_out_s"]
        return f"{per_variant:.2f}x a plain pass over the held-out batches, per block ({table['block_variants']} blocks)"
    if row["step"] == "sensitivity":
        per_module = row["seconds"] / table["modules"] / table["plain_held_out_s"]
        return f"{per_module:.2f}x a plain pass over the held-out batches, per module"
    return f"{row['seconds'] / table['plain_held_out_s']:.2f}x a plain pass over the held-out batches"


def calibration_table() -> None:
    from calibration_overhead import measure

    print("\ninstrumented calibration against a plain prepare_fx calibration (medians of 3, 8 batches):")
    for case in ("tiny-conv 8x3x32x32", "resnet18 8x3x224x224", "mlp-blocks 8x128x768"):
        row = measure(case, repeats=3, batch_count=8, upstream=False)
        print(f"  {case:28s} ours / plain {row['ours/plain']:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["100m", "500m", "1b"], choices=[s for s in SIZES if s != "tiny"])
    parser.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--calibration", action="store_true", help="only the calibration ratios")
    parser.add_argument("--until", default=STEPS[-1], choices=STEPS[1:], help="the last step taken")
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "FORMAT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.until)
        return
    print(f"CPU: {cpu_simd()}")
    if args.calibration:
        calibration_table()
        return
    print(f"torch {torch.__version__}, 2 threads; {CALIBRATION} calibration + {HELD_OUT} held-out batches of 1 x {TOKENS} tokens")
    for size in args.sizes:
        for fmt in args.formats:
            out = subprocess.run(
                [sys.executable, __file__, "--child", size, fmt, "--until", args.until], capture_output=True, text=True
            )
            if out.returncode:
                print(f"\n{size} {fmt}: the measuring process failed:\n{out.stderr[-3000:]}", flush=True)
                continue
            table = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"\n{size} ({table['parameters'] / 1e6:.0f}M parameters, {table['weights_mb']:.0f} MB float), {fmt}: "
                f"plain pass {table['plain_calibration_s']:.2f} s over {CALIBRATION} batches, "
                f"{table['plain_held_out_s']:.2f} s over {HELD_OUT}; {table['modules']} modules"
            )
            print(f"  {'step':12s} {'seconds':>8s} {'peak x':>7s} {'held x':>7s}   time against a plain pass")
            for row in table["rows"]:
                print(
                    f"  {row['step']:12s} {row['seconds']:8.1f} {row['peak']:7.2f} {row['held']:7.2f}   "
                    + versus_plain(row, table)
                )
            alone = table["analyze_alone"]
            print(
                f"  analyze without the memory probe, side by side with a plain pass (medians of 3): {alone['analyze_s']:.2f} s "
                f"against {alone['plain_s']:.2f} s = {alone['analyze_s'] / alone['plain_s']:.2f}x"
            )


if __name__ == "__main__":
    main()
