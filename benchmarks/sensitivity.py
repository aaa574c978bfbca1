"""Which layer hurts: session.sensitivity() and the per-layer SQNR against the real keep-one-float sweep.

For each model: a baseline FX run from the x86 default mapping, then one real prepare_fx ->
calibrate -> convert_fx run per tunable module with only that module kept float. A module's real
effect is the output SQNR gained that way. Scored as rankings of that effect (Spearman rank
correlation, overlap of the top three): ``session.sensitivity()`` (calibrated once, simulated) and
the baseline's per-layer SQNR (Numeric Suite FX, error accumulated from the input). Also: how far
the simulated output SQNR of each variant is from the real run's, and both costs, side by side.

Then the in-context search behind reach() against the one-at-a-time walk it replaced, on fresh
sessions for the same target: the float modules each keeps, the sets the search simulated and its
time against one ``sensitivity()`` pass (the search needs that ranking first: its cost is on top),
and the same for a target 20 dB beyond the walk's best, where the search goes on until nothing gains.

python benchmarks/sensitivity.py [--models cnn mixer] [--search-only]
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch
from common import setup

from qreport_widgets import ModuleSettings, QuantizationSession
from qreport_widgets.demo.architectures import mobilenet_v3_small
from qreport_widgets.demo.digits import trained_digits_model


def keep_one_float_sweep(session: QuantizationSession) -> pd.DataFrame:
    """One real run per tunable module with only that module float: output SQNR gain (dB), metric gain."""
    baseline = session.baseline(progress=_quiet)
    rows = []
    for module in session.modules:
        result = session.apply({module.fqn: ModuleSettings(keep_float=True)}, label=f"float {module.fqn}", progress=_quiet)
        rows.append(
            {
                "module": module.fqn,
                "real gain (dB)": result.output_sqnr_db - baseline.output_sqnr_db,
                "metric gain": (result.eval_metric - baseline.eval_metric) if baseline.eval_metric is not None else None,
                "per-layer SQNR (dB)": baseline.per_layer_sqnr_db.get(module.fqn, float("nan")),
            }
        )
    return pd.DataFrame(rows).set_index("module")


def ranking_quality(truth: pd.Series, score: pd.Series) -> tuple[float, int]:
    """Spearman correlation of ``score`` with ``truth`` and how many of the true top three it ranks top three."""
    both = pd.concat([truth, score], axis=1).dropna()
    spearman = float(both.iloc[:, 0].corr(both.iloc[:, 1], method="spearman"))
    top = set(both.iloc[:, 0].nlargest(3).index) & set(both.iloc[:, 1].nlargest(3).index)
    return spearman, len(top)


# MobileNetV3-Small: batches of 8 measured on. With 2 (16 images) single-module gains at an output
# SQNR of 11 dB move by tenths of a dB with any change of rounding, real and simulated alike.
EVAL_BATCHES = int(os.environ.get("QREPORT_EVAL_BATCHES", "8"))


def build(name: str, cache_dir: str | None = None) -> QuantizationSession:
    if name in ("cnn", "mixer", "mobilenet", "prelu", "prelu_chain"):
        model, data = trained_digits_model(name, cache_dir)
        return QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy)
    model = mobilenet_v3_small()
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 3, 96, 96, generator=generator),) for _ in range(4 + EVAL_BATCHES)]
    return QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:])


def greedy_real(session: QuantizationSession, gains: pd.Series, target: float) -> tuple[int, float, int]:
    """Modules made float in the order of their real gain, one real run per step: (count, SQNR, runs)."""
    order = list(gains.sort_values(ascending=False).index)
    for count in range(len(order) + 1):
        run = session.apply({m: ModuleSettings(keep_float=True) for m in order[:count]}, label="greedy", progress=_quiet)
        if run.output_sqnr_db >= target:
            break
    return count, run.output_sqnr_db, count + 1


def measure(name: str, cache_dir: str | None = None) -> dict[str, object]:
    session = build(name, cache_dir)
    baseline = session.baseline(progress=_quiet)  # both sides then start warm (imports, first calls)
    start = time.perf_counter()
    sensitivity = session.sensitivity(progress=_quiet)
    sensitivity_s = time.perf_counter() - start
    start = time.perf_counter()
    sweep = keep_one_float_sweep(session)
    seconds = time.perf_counter() - start
    sweep = sweep.join(sensitivity[["output_sqnr_gain_db", "local_sqnr_db"]])
    truth = sweep["real gain (dB)"]
    # low per-layer SQNR would mean "harmful": score it negated
    spearman, top3 = ranking_quality(truth, -sweep["per-layer SQNR (dB)"])
    ours_spearman, ours_top3 = ranking_quality(truth, sweep["output_sqnr_gain_db"])
    # reach: a target halfway between the baseline and the best point of the simulated curve, reached
    # from a fresh session (its own sensitivity and simulated checks, then real runs), as a user would
    curve = session.tradeoff(progress=_quiet)
    target = baseline.output_sqnr_db + (curve["simulated_output_sqnr_db"].max() - baseline.output_sqnr_db) / 2
    fresh = build(name, cache_dir)
    fresh.baseline(progress=_quiet)
    start = time.perf_counter()
    reached = fresh.reach(target, progress=_quiet)
    reach_s = time.perf_counter() - start
    start = time.perf_counter()
    greedy_count, greedy_sqnr, greedy_runs = greedy_real(session, truth, target)
    greedy_s = time.perf_counter() - start + seconds
    return {
        "sweep": sweep,
        "baseline": baseline,
        "seconds": seconds,
        "spearman": spearman,
        "top3": top3,
        "sensitivity_s": sensitivity_s,
        "ours_spearman": ours_spearman,
        "ours_top3": ours_top3,
        "agreement": float((sweep["output_sqnr_gain_db"] - truth).abs().max()),
        "target": target,
        "reach_sqnr": reached.output_sqnr_db,
        "reach_count": sum(s.keep_float for s in reached.settings.values()),
        "reach_s": reach_s,
        "greedy_count": greedy_count,
        "greedy_sqnr": greedy_sqnr,
        "greedy_s": greedy_s,
        "greedy_runs": greedy_runs,
    }


def search_cost(name: str, cache_dir: str | None = None) -> dict[str, object]:
    """The in-context search and the one-at-a-time walk on a fresh session, for a target halfway from
    the baseline to the best simulated point (25 dB on the PReLU chain, whose walk reaches nothing)."""
    session = build(name, cache_dir)
    baseline = session.baseline(progress=_quiet)
    start = time.perf_counter()
    ranking = session.sensitivity(progress=_quiet, metric=False)
    sensitivity_s = time.perf_counter() - start
    order = list(ranking.index)
    walk = [sqnr for sqnr, _ in session.simulate_each([order[:c] for c in range(len(order) + 1)], _quiet, metric=False)]
    target = 25.0 if name == "prelu_chain" else baseline.output_sqnr_db + (max(walk) - baseline.output_sqnr_db) / 2
    walk_count = next((count for count, sqnr in enumerate(walk) if sqnr >= target), None)
    start = time.perf_counter()
    plan = session.plan_reach(target, progress=_quiet)
    search_s = time.perf_counter() - start
    reached = session.reach(target, progress=_quiet)
    unreachable = build(name, cache_dir)  # out of reach: the search's longest case, on its own session
    unreachable.baseline(progress=_quiet)
    unreachable.sensitivity(progress=_quiet, metric=False)
    start = time.perf_counter()
    far = unreachable.plan_reach(max(walk) + 20.0, progress=_quiet)
    far_s = time.perf_counter() - start
    old_run = None
    if walk_count:  # the walk's point, measured by a real run too
        old_run = session.apply({m: ModuleSettings(keep_float=True) for m in order[:walk_count]}, progress=_quiet)
    return {
        "model": name,
        "modules": len(order),
        "target (dB)": round(target, 2),
        "walk float": "out of reach" if walk_count is None else walk_count,
        "walk real (dB)": None if old_run is None else round(old_run.output_sqnr_db, 2),
        "search float": sum(s.keep_float for s in reached.settings.values()),
        "search real (dB)": round(reached.output_sqnr_db, 2),
        "sensitivity sets": len(order) + 1,
        "sensitivity (s)": round(sensitivity_s, 2),
        "search sets": plan.path.simulated if plan.path is not None else 0,
        "search (s)": round(search_s, 2),
        "search / sensitivity": round(search_s / sensitivity_s, 2),
        "out of reach: sets": far.path.simulated if far.path is not None else 0,
        "out of reach / sensitivity": round(far_s / sensitivity_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mixer", "mobilenet", "mobilenet_v3_small"])
    parser.add_argument(
        "--search-models", nargs="+", default=["cnn", "mixer", "prelu", "prelu_chain", "mobilenet", "mobilenet_v3_small"]
    )
    parser.add_argument("--search-only", action="store_true", help="only the in-context search against the walk")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    setup()
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    for name in [] if args.search_only else args.models:
        row = measure(name, args.cache_dir)
        baseline = row["baseline"]
        accuracy = f", accuracy {baseline.eval_metric:.3f}" if baseline.eval_metric is not None else ""
        print(
            f"{name}: baseline output SQNR {baseline.output_sqnr_db:.2f} dB{accuracy}; "
            f"real keep-one-float sweep of {len(row['sweep'])} modules in {row['seconds']:.1f} s"
        )
        print(row["sweep"].sort_values("real gain (dB)", ascending=False).round(3).to_string())
        print(f"per-layer SQNR as a ranking: Spearman {row['spearman']:+.2f}, top-3 overlap {row['top3']}/3")
        print(
            f"reach({row['target']:.2f} dB): {row['reach_count']} float, {row['reach_sqnr']:.2f} dB in {row['reach_s']:.1f} s; "
            f"greedy of real runs: {row['greedy_count']} float, {row['greedy_sqnr']:.2f} dB in {row['greedy_s']:.1f} s "
            f"(sweep + {row['greedy_runs']} runs)"
        )
        print(
            f"session.sensitivity(): Spearman {row['ours_spearman']:+.2f}, top-3 overlap {row['ours_top3']}/3, "
            f"{row['sensitivity_s']:.2f} s ({row['sensitivity_s'] / row['seconds']:.0%} of the sweep); "
            f"simulated vs real gain within {row['agreement']:.3f} dB"
        )
        print()
    table = pd.DataFrame([search_cost(name, args.cache_dir) for name in args.search_models]).set_index("model")
    print("in-context search (reach) against the one-at-a-time walk, fresh sessions, same target:")
    print(table.to_string())


def _quiet(done: int, total: int | None) -> None:
    pass


if __name__ == "__main__":
    main()
