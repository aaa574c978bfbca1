"""Do the suggestions help? Accept all as the detectors propose it, against the verified suggestions.

For each model of tests/zoo.py (random weights), three digits models (trained) and a transformer
MLP block with planted outlier channels (``architectures.OutlierMlpBlock``), from the x86
default mapping and from a per-tensor start: the baseline, the simulated baseline and its gap to
the real one with the modules whose quantized kernels differ from their reference (the truth
check), Accept all of the detectors' suggestions
unmeasured (what upstream's generate_qconfig_mapping() amounts to), Accept all of the verified
suggestions, each kind of verified setting alone, and the candidates rejected with what they
measured. Every number is a real prepare_fx -> calibrate -> convert_fx run except the
"measured" column of the candidates, which says how each was measured.

python benchmarks/suggestion_quality.py [--models resnet digits-cnn ...] [--starts x86 per-tensor]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import setup
from torch.ao.quantization import QConfig, get_default_qconfig_mapping
from torch.ao.quantization.observer import default_weight_observer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

from qreport_widgets import analyze  # noqa: E402
from qreport_widgets.demo.architectures import OutlierMlpBlock  # noqa: E402
from qreport_widgets.demo.digits import trained_digits_model  # noqa: E402

MODELS = [*zoo.ARCHITECTURES, "digits-cnn", "digits-mixer", "digits-prelu", "outlier-block"]
STARTS = ("x86", "per-tensor")


def start_mapping(name: str):
    mapping = get_default_qconfig_mapping("x86")
    if name == "per-tensor":
        mapping.set_global(QConfig(activation=mapping.global_qconfig.activation, weight=default_weight_observer))
    return mapping


def build(name: str, cache_dir: str | None):
    if name == "outlier-block":  # LayerNorm gain 20x on 4 of 64 hidden channels, fc1 weights 20x smaller there
        generator = torch.Generator().manual_seed(0)
        batches = [(torch.randn(8, 16, 64, generator=generator),) for _ in range(8)]
        return OutlierMlpBlock().eval(), batches[:6], batches[6:]
    if name.startswith("digits-"):
        model, data = trained_digits_model(name.removeprefix("digits-"), cache_dir)
        return model, data.calibration, data.evaluation
    factory, batches = zoo.ARCHITECTURES[name]
    torch.manual_seed(0)
    model = factory().eval()
    data = batches(6)
    return model, data[:4], data[4:]


def measure(name: str, start: str, cache_dir: str | None = None) -> dict[str, object]:
    model, calibration, evaluation = build(name, cache_dir)
    quiet = lambda done, total: None  # noqa: E731
    report = analyze(
        model, calibration[0], calibration, eval_data=evaluation, qconfig_mapping=start_mapping(start), progress=False
    )
    session = report.session
    baseline = session.baseline(progress=quiet)
    current = session.current_settings()
    raw_settings = {k: v for k, v in report.suggested_settings().items() if v != current[k]}
    raw = session.apply(raw_settings, label="accept all (unmeasured)", progress=quiet) if raw_settings else baseline
    began = time.perf_counter()
    verified = report.verified_suggestions(progress=quiet)
    seconds = time.perf_counter() - began
    chosen = {k: v for k, v in verified.settings.items() if v != current[k]}
    accept = session.apply(chosen, label="accept all (verified)", progress=quiet) if chosen else baseline
    kinds = {}
    for verdict in verified.offered:
        kinds.setdefault(verdict.candidate.setting, {})[verdict.candidate.module_fqn] = verdict.candidate.applied_to(
            current[verdict.candidate.module_fqn]
        )
    alone = {kind: session.apply(settings, label=kind, progress=quiet) for kind, settings in kinds.items()}
    return {
        "baseline": baseline,
        "raw": raw,
        "raw_count": len(raw_settings),
        "verified": verified,
        "accept": accept,
        "alone": alone,
        "seconds": seconds,
        "truth": session.truth_check(),
    }


def _db(run) -> str:
    return f"{run.output_sqnr_db:.2f} dB" if run.ok else f"crashed ({run.error.splitlines()[-1][:80]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--starts", nargs="+", default=list(STARTS))
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    setup()
    print(
        "| model | start | baseline | simulated baseline | gap | kernels apart | accept all, unmeasured "
        "| accept all, verified | offered | rejected | verifying |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    details = []
    for name in args.models:
        for start in args.starts:
            row = measure(name, start, args.cache_dir)
            verified = row["verified"]
            truth = row["truth"]
            apart = ", ".join(truth.disagreeing) or "none"
            print(
                f"| {name} | {start} | {_db(row['baseline'])} | {truth.simulated_db:.2f} dB | {truth.gap_db:+.2f} dB | {apart} | "
                f"{_db(row['raw'])} ({row['raw_count']} modules) | "
                f"{_db(row['accept'])} | {len(verified.offered)} | {len(verified.rejected)} | {row['seconds']:.1f} s |",
                flush=True,
            )
            details.append((name, start, row))
    for name, start, row in details:
        verified = row["verified"]
        print(f"\n{name}, {start} start: baseline {_db(row['baseline'])}")
        for note in row["truth"].notes:
            print(f"  truth check: {note}")
        for kind, run in row["alone"].items():
            print(f"  {kind} alone (offered ones): {_db(run)}")
        for note in verified.notes:
            print(f"  note: {note}")
        frame = verified.frame()
        if len(frame):
            print(frame.round(3).to_string(index=False, max_colwidth=70))


if __name__ == "__main__":
    main()
