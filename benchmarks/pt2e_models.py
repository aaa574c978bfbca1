"""One model through both engines: does PT2E export it, quantize it as well as FX, and does Accept all
help there?

For each model of tests/zoo.py (random weights, 4 calibration and 2 evaluation batches of 4) and
the three models trained on the digits data: the FX baseline (x86 default mapping) and the PT2E
baseline (torchao's X86InductorQuantizer, static, per-channel weights), the layers each quantized,
and Accept all of the PT2E report's verified suggestions. Every SQNR is a real run (prepare_fx ->
calibrate -> convert_fx, or torch.export -> prepare_pt2e -> calibrate -> convert_pt2e). A model
torch.export cannot export is listed with the export's error.

python benchmarks/pt2e_models.py [--models resnet digits-cnn ...] [--cache-dir DIR]
"""

from __future__ import annotations

import time

from common import model_arguments, setup
from suggestion_quality import build, zoo

from qreport_widgets import analyze
from qreport_widgets.errors import UntraceableModelError

MODELS = [*zoo.ARCHITECTURES, "digits-cnn", "digits-mixer", "digits-mobilenet"]


def quiet(done: int, total: int) -> None:
    pass


def measure(name: str, cache_dir: str | None) -> str:
    model, calibration, evaluation = build(name, cache_dir)
    fx = analyze(model, calibration[0], calibration, eval_data=evaluation, progress=False).session.baseline(progress=quiet)
    began = time.perf_counter()
    try:
        report = analyze(model, calibration[0], calibration, eval_data=evaluation, engine="pt2e", progress=False)
    except UntraceableModelError as error:
        return f"| {name} | {fx.output_sqnr_db:.2f} dB ({fx.quantized_layers}) | not exported: {error} | | | |"
    pt2e = report.session.baseline(progress=quiet)
    analysis, began = time.perf_counter() - began, time.perf_counter()
    verified = report.verified_suggestions(progress=quiet)
    verifying = time.perf_counter() - began
    accept = verified.accept_all
    accepted = f"{accept.output_sqnr_db:.2f} dB ({len(verified.offered)} offered)" if accept is not None else "nothing offered"
    return (
        f"| {name} | {fx.output_sqnr_db:.2f} dB ({fx.quantized_layers}) | {pt2e.output_sqnr_db:.2f} dB "
        f"({pt2e.quantized_layers}) | {accepted} | {analysis:.1f} s | {verifying:.1f} s |"
    )


def main() -> None:
    args = model_arguments(__doc__.splitlines()[0], MODELS)
    setup()
    print(
        "| model | FX baseline (layers quantized) | PT2E baseline (layers quantized) | PT2E Accept all, verified "
        "| PT2E analysis + baseline | verifying |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models:
        print(measure(name, args.cache_dir), flush=True)


if __name__ == "__main__":
    main()
