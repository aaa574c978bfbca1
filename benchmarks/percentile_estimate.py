"""Estimated against exact percentiles: the outlier verdicts on the zoo and the trained digits models.

Each model is analyzed twice on the same batches (large enough that channels hold more than 4,096
values a batch, so the estimate is used), with ``exact_percentiles`` True and False; the table gives
per model the inputs and channels estimated, the channels flagged by each, the verdicts that differ
and the largest relative change of a ratio max / p97.5.

    python benchmarks/percentile_estimate.py [--cache-dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from common import model_arguments, setup

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # noqa: E402

from qreport_widgets import analyze  # noqa: E402
from qreport_widgets.demo.digits import trained_digits_model  # noqa: E402
from qreport_widgets.observe.detectors.outlier import OutlierDetector  # noqa: E402

MODELS = [*zoo.ARCHITECTURES, "digits-cnn", "digits-mixer", "digits-mobilenet", "digits-prelu"]


def build(name: str, cache_dir: str | None):
    if name.startswith("digits-"):
        model, data = trained_digits_model(name.removeprefix("digits-"), cache_dir)
        images = torch.cat([b[0] for b in (*data.calibration, *data.evaluation)])
        return model.eval(), [(images[:288],), (images[288:576],)]
    factory, batches = zoo.ARCHITECTURES[name]
    torch.manual_seed(0)
    if name == "text_encoder":
        return factory().eval(), batches(2, batch=64, tokens=96)
    size = 32 if name in ("prelu_net", "vit") else 64
    return factory().eval(), batches(2, batch=16 if size == 32 else 8, size=size)


def verdicts(model, batches, exact: bool):
    report = analyze(model, batches[0], batches, detectors=[OutlierDetector()], exact_percentiles=exact, progress=False)
    text, found = report.generate_model_report()["outlier_detector"]
    flags = {
        f: np.asarray(v["outliers_detected"]) & np.asarray(v["outlier_detection_is_sufficient_batches"]) for f, v in found.items()
    }
    ratios = {f: np.asarray(v["outlier_detection_percentile_ratios"], dtype=np.float64) for f, v in found.items()}
    return flags, ratios, text


def main() -> None:
    args = model_arguments(__doc__.splitlines()[0], MODELS)
    setup()
    print("| model | estimated (note) | channels flagged, exact | estimated | verdicts that differ | largest ratio change |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        model, batches = build(name, args.cache_dir)
        exact_flags, exact_ratios, _ = verdicts(model, batches, True)
        flags, ratios, text = verdicts(model, batches, False)
        differ = sum(int((exact_flags[f] != flags[f]).sum()) for f in exact_flags)
        change = max(
            (
                float(np.nanmax(np.abs(ratios[f] - exact_ratios[f]) / np.maximum(np.abs(exact_ratios[f]), 1e-12)))
                for f in exact_ratios
                if exact_ratios[f].size
            ),
            default=0.0,
        )
        note = next(
            (line.split("note: ")[1].split(",")[0] for line in text.splitlines() if "estimated on" in line), "none (all exact)"
        )
        exact_count = sum(int(v.sum()) for v in exact_flags.values())
        count = sum(int(v.sum()) for v in flags.values())
        print(f"| {name} | {note} | {exact_count} | {count} | {differ} | {change:.1%} |", flush=True)


if __name__ == "__main__":
    main()
