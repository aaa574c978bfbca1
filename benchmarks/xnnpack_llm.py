"""A decoder on a phone: the eager engine's XNNPACK target against ExecuTorch's own LLM quantizer.

Per format (float, 8da8w: int8 dynamic activations with int8 per-row weights, 8da4w g32: with int4
weights in groups of 32), the decoder quantized two ways and lowered the same way (XNNPACK's
dynamically quantized partitioner, quantized-op fusion; float with XNNPACK's full partitioner):

- ours: ``analyze(..., engine="eager", target="xnnpack", format=...)``, the baseline run (round to
  nearest), measured in ExecuTorch's runtime by the session;
- ExecuTorch's: ``executorch.extension.llm.export.quantize.quantize_model_(model, qlinear_config=...)``
  (HQQ's scales, as ExecuTorch's export chooses them), lowered by ``engines.executorch.lower``.

Printed side by side: the ``.pte``'s bytes, prefill milliseconds per token (one thread, a batch of
4 x 128 bytes), lowering seconds and perplexity on the held-out text. Bytes and speed depend on the
layout, not on how the int4 values were chosen; perplexity does.

Models: the byte-level decoder trained on Python's help topics (4 x 128); ``--models 134m`` adds
the 134M Llama layout of ``llm_scale.py`` (random weights, 12 layers of 768: minutes per lowering).

python benchmarks/xnnpack_llm.py [--models trained 134m] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import time

from common import setup

from qreport_widgets import analyze
from qreport_widgets.core.metrics import perplexity
from qreport_widgets.demo.text import trained_text_decoder
from qreport_widgets.engines.executorch import DYNAMIC, FULL, lower

FORMATS = {  # ours -> (ExecuTorch's qlinear_config, group size)
    "float": (None, None),
    "int8-dynamic": ("8da8w", 0),
    "int8-dynamic-int4-weight": ("8da4w", 32),
}


def decoder(name: str, cache_dir: str | None):
    model, data = trained_text_decoder(cache_dir)
    if name == "trained":
        return model, data.calibration, data.evaluation
    from llm_scale import decoder as llama_layout

    big, batches = llama_layout("100m")  # 134M parameters: 12 layers of 768, a 32,000-token vocabulary
    return big, batches[:2], batches[2:4]


def timed_ms(program, batch, repeats: int = 5) -> float:
    program(*batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        program(*batch)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1000


def theirs(model, config: str | None, group: int | None, calibration, evaluation):
    from executorch.extension.llm.export.quantize import quantize_model_

    quantized = copy.deepcopy(model)
    if config is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints what it applies
            quantize_model_(quantized, qlinear_config=config, qlinear_group_size=group)
    program = lower(quantized, calibration[0], partitioner=FULL if config is None else DYNAMIC, fuse_quantized_ops=True)
    tokens = calibration[0][0].numel()
    return len(program.pte), timed_ms(program, calibration[0]) / tokens, program.lowering_s, perplexity(program, evaluation)


def ours(model, name: str, calibration, evaluation):
    if name == "float":
        return theirs(model, None, None, calibration, evaluation)
    options = {"format": name} | ({"group_size": 32} if "int4" in name else {})
    report = analyze(
        model,
        calibration[0],
        calibration,
        eval_data=evaluation,
        engine="eager",
        target="xnnpack",
        metric="perplexity",
        progress=False,
        **options,
    )
    run = report.session.baseline()
    if not run.ok:
        raise RuntimeError(run.error)
    program = run.quantized_model
    tokens = calibration[0][0].numel()
    return run.size_bytes, timed_ms(program, calibration[0]) / tokens, program.lowering_s, run.eval_metric


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["trained"], choices=["trained", "134m"])
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    setup()
    header = f"{'model':8} {'format':34} {'.pte ours':>11} {'theirs':>11} {'ms/tok ours':>11} {'theirs':>7} "
    print(header + f"{'lower s ours':>12} {'theirs':>7} {'ppl ours':>9} {'theirs':>8}")
    for name in args.models:
        model, calibration, evaluation = decoder(name, args.cache_dir)
        for ours_name, (config, group) in FORMATS.items():
            a = ours(model, ours_name, calibration, evaluation)
            b = a if config is None else theirs(model, config, group, calibration, evaluation)
            label = ours_name if config is None else f"{ours_name} ({config})"
            print(
                f"{name:8} {label:34} {a[0]:>11,} {b[0]:>11,} {a[1]:>11.4f} {b[1]:>7.4f} "
                f"{a[2]:>12.1f} {b[2]:>7.1f} {a[3]:>9.4f} {b[3]:>8.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
