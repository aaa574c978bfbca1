"""What running ExecuTorch programs in a worker process costs per batch.

Each program is executed by ExecuTorch's runtime twice over the same batches: in this process
(``executorch.runtime`` directly, as a crash would take the caller down with it) and through a
``DeployedProgram``, whose forward sends the inputs to the ``RuntimeWorker`` process and gets the
outputs back through shared memory. Both on one thread; the median of repeated calls per batch.

Programs: the trained digits CNN (PT2E, XNNPACK's quantizer, batches of 64 images) and the trained
byte decoder (eager, 8da4w g32, batches of 4 x 128 bytes: logits of 4 x 128 x 256 floats come back).

python benchmarks/runtime_isolation.py [--repeats 50] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import setup

from qreport_widgets import analyze
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.demo.text import trained_text_decoder


def median_ms(call, batch, repeats: int) -> float:
    call(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    setup()
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    portable_lib._unsafe_reset_threadpool(1)  # one thread, as the worker
    cnn, digits = trained_digits_model("cnn", args.cache_dir)
    decoder, text = trained_text_decoder(args.cache_dir)
    cases = [
        ("digits CNN (64 x 1 x 8 x 8)", cnn, digits.calibration, {"engine": "pt2e", "target": "xnnpack"}),
        (
            "byte decoder 8da4w (4 x 128 ids)",
            decoder,
            text.calibration,
            {"engine": "eager", "target": "xnnpack", "format": "int8-dynamic-int4-weight", "group_size": 32},
        ),
    ]
    print(f"{'program':36} {'.pte bytes':>11} {'in process ms':>14} {'worker ms':>10} {'cost ms':>8}")
    for name, model, batches, options in cases:
        report = analyze(model, batches[0], batches, eval_data=batches[:1], progress=False, **options)
        program = report.session.baseline().quantized_model
        loaded = Runtime.get().load_program(program.pte)  # kept while its method executes
        method = loaded.load_method("forward")
        batch = batches[0][0]
        with torch.no_grad():
            inside = median_ms(lambda x, run=method.execute: run([x]), batch, args.repeats)
            worker = median_ms(program, batch, args.repeats)
        print(f"{name:36} {len(program.pte):>11,} {inside:>14.3f} {worker:>10.3f} {worker - inside:>8.3f}")


if __name__ == "__main__":
    main()
