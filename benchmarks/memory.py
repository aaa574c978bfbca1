"""Memory per step of the workflow on big layouts, each layout in a fresh process.

A thread samples the process's resident set every 2 ms. Each step's row gives its peak and what
stays held after it (after garbage collection and ``malloc_trim``, so memory the C allocator kept
for reuse is not counted as held), as a multiple of the float model's size (its parameters and
buffers): above the process with the float model loaded and the tool's code imported (a small
model of the same family is taken through the same steps first: importing torch's quantization,
FX and torchao and their caches cost the same for any model), and, "with imports", above the
process with only the float model loaded.

    python benchmarks/memory.py [--layouts resnet50 vit-b16 bert-base] [--batches 4] [--skip "verified suggestions"]
    python benchmarks/memory.py --calibration [--case "resnet18 8x3x224x224"]   # the instrumented pass alone
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil
import torch
from common import CASES, batches_for, our_model, plain_model, setup

from qreport_widgets import ModuleSettings, analyze

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: held memory is measured as the allocator leaves it
    _LIBC = None


def settle() -> int:
    """Resident bytes once garbage is collected and the C allocator gave back what it can."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    return psutil.Process().memory_info().rss


class RssProbe:
    """The peak resident set of this process while a block runs, sampled every 2 ms."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._peak = 0
        self._running = False

    @contextmanager
    def watching(self) -> Iterator[Callable[[], int]]:
        self._peak = self._process.memory_info().rss
        self._running = True
        thread = threading.Thread(target=self._sample, daemon=True)
        thread.start()
        try:
            yield lambda: self._peak
        finally:
            self._running = False
            thread.join()

    def _sample(self) -> None:
        while self._running:
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(0.002)


LAYOUTS = ("resnet50", "vit-b16", "bert-base")


def build(layout: str, batches: int, size: int = 8) -> tuple[torch.nn.Module, list, dict]:
    """The float model (random weights), its calibration batches and analyze()'s keyword arguments."""
    generator = torch.Generator().manual_seed(0)
    if layout == "resnet50":
        from qreport_widgets.demo.architectures import resnet50

        return resnet50().eval(), [torch.randn(size, 3, 224, 224, generator=generator) for _ in range(batches)], {}
    if layout == "vit-b16":
        from qreport_widgets.demo.architectures import VitTiny

        model = VitTiny(dim=768, depth=12, heads=12).eval()  # ViT-B/16: 86M parameters
        return model, [torch.randn(size, 3, 224, 224, generator=generator) for _ in range(batches)], {}
    if layout == "bert-base":
        from transformers import BertConfig, BertModel

        model = BertModel(BertConfig(attn_implementation="eager")).eval()  # BERT-base: 110M parameters
        ids = [{"input_ids": torch.randint(0, 30522, (size, 128), generator=generator)} for _ in range(batches)]
        return model, ids, {"engine": "eager"}
    raise ValueError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def small_twin(layout: str) -> tuple[torch.nn.Module, list, dict]:
    """A small model of the layout's family, on the same engine: run once before measuring, so that
    the tool's own code and caches (imports of torch's quantization, FX, torchao; the same for any
    model) are in the process already and the multiples are what the model's size costs."""
    generator = torch.Generator().manual_seed(1)
    if layout == "resnet50":
        from qreport_widgets.demo.architectures import resnet50

        return resnet50(width=8, classes=10).eval(), [torch.randn(2, 3, 64, 64, generator=generator) for _ in range(3)], {}
    if layout == "vit-b16":
        from qreport_widgets.demo.architectures import VitTiny

        return VitTiny(dim=32, depth=1, heads=2).eval(), [torch.randn(2, 3, 224, 224, generator=generator) for _ in range(3)], {}
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, attn_implementation="eager"
    )
    ids = [{"input_ids": torch.randint(0, 30522, (2, 16), generator=generator)} for _ in range(3)]
    return BertModel(config).eval(), ids, {"engine": "eager"}


def warm_up(layout: str) -> None:
    model, batches, kwargs = small_twin(layout)
    report = analyze(model, batches[0], batches, progress=False, **kwargs)
    session = report.session
    report.widget()
    session.baseline()
    session.sensitivity()
    first = next(m.fqn for m in session.modules if not m.current.keep_float)
    session.apply({first: ModuleSettings(keep_float=True)})


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def plain_pass_seconds(model: torch.nn.Module, batches: list) -> float:
    from qreport_widgets.core.calibration import call_with

    with torch.no_grad():
        call_with(model, batches[0])
        start = time.perf_counter()
        for batch in batches:
            call_with(model, batch)
    return time.perf_counter() - start


STEPS = ("analyze", "widget", "baseline", "sensitivity", "verified suggestions", "apply 1", "apply 2", "apply 3")


def steps_child(layout: str, batch_count: int, skip: set[str], batch_size: int) -> None:
    setup()
    model, batches, kwargs = build(layout, batch_count, batch_size)
    size = model_bytes(model)
    plain_s = plain_pass_seconds(model, batches)
    loaded = settle()
    warm_up(layout)
    base = settle()  # the model loaded and the tool's code imported
    probe = RssProbe()
    rows = []

    def step(name: str, action: Callable[[], object]) -> object:
        """``action()``, measured; the caller keeps what it returns only where the user would."""
        if name in skip:
            return None
        start = time.perf_counter()
        with probe.watching() as peak:
            value = action()
        seconds = time.perf_counter() - start
        peak_bytes = peak()
        held = settle()
        rows.append(
            {
                "step": name,
                "seconds": seconds,
                "peak": (peak_bytes - base) / size,
                "held": (held - base) / size,
                "peak_cold": (peak_bytes - loaded) / size,
                "held_cold": (held - loaded) / size,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        return value

    report = step("analyze", lambda: analyze(model, batches[0], batches, progress=False, **kwargs))
    session = report.session
    step("widget", lambda: report.widget() and None)
    step("baseline", session.baseline)
    step("sensitivity", session.sensitivity)
    step("verified suggestions", lambda: session.verified_suggestions(report.suggestions()))
    modules = [m.fqn for m in session.modules if not m.current.keep_float]
    for i in range(3):
        step(f"apply {i + 1}", lambda i=i: session.apply({modules[i]: ModuleSettings(keep_float=True)}))
    fixed = (base - loaded) / 2**20
    print(json.dumps({"layout": layout, "model_mb": size / 2**20, "plain_pass_s": plain_s, "fixed_mb": fixed, "rows": rows}))


def calibration_child(case_name: str, variant: str, batches: int) -> None:
    setup()
    case = CASES[case_name]
    data = batches_for(case, batches)
    model = (our_model if variant == "ours" else plain_model)(case.build(), data[0])
    largest = 0

    def record(_module, _inputs, output):
        nonlocal largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in model.modules()]
    with torch.no_grad():
        model(data[0])
    for hook in hooks:
        hook.remove()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        for batch in data:
            model(batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kb": peak, "before_kb": before, "largest_activation_bytes": largest}))


def calibration_row(case_name: str, batches: int = 8) -> dict[str, float]:
    """Peak memory of the instrumented calibration pass against the plain prepare_fx model's."""
    results = {}
    for variant in ("plain", "ours"):
        out = subprocess.run(
            [sys.executable, __file__, "--child-calibration", variant, "--case", case_name, "--batches", str(batches)],
            check=True,
            capture_output=True,
            text=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    extra = (results["ours"]["peak_kb"] - results["plain"]["peak_kb"]) * 1024
    largest = results["plain"]["largest_activation_bytes"]
    return {
        "plain_peak_mb": results["plain"]["peak_kb"] / 1024,
        "ours_peak_mb": results["ours"]["peak_kb"] / 1024,
        "extra_mb": extra / 2**20,
        "largest_activation_mb": largest / 2**20,
        "extra_over_activation": extra / largest,
    }


def steps_table(layout: str, batches: int, skip: list[str], batch_size: int = 8) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child-steps",
        layout,
        "--batches",
        str(batches),
        "--batch-size",
        str(batch_size),
        "--skip",
        *skip,
    ]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{layout}: the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8, help="images (224 x 224) or sequences (128 tokens) per batch")
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS, help="steps left out (analyze always runs)")
    parser.add_argument("--calibration", action="store_true", help="the instrumented calibration pass alone")
    parser.add_argument("--case", default="resnet18 8x3x224x224")
    parser.add_argument("--child-steps", choices=LAYOUTS)
    parser.add_argument("--child-calibration", choices=["plain", "ours"])
    args = parser.parse_args()
    if args.child_steps:
        steps_child(args.child_steps, args.batches, set(args.skip) - {"analyze"}, args.batch_size)
        return
    if args.child_calibration:
        calibration_child(args.case, args.child_calibration, args.batches)
        return
    if args.calibration:
        row = calibration_row(args.case, args.batches)
        print(
            f"{args.case}: peak RSS plain {row['plain_peak_mb']:.0f} MB, ours {row['ours_peak_mb']:.0f} MB; "
            f"extra {row['extra_mb']:.0f} MB = {row['extra_over_activation']:.2f} x the largest activation "
            f"({row['largest_activation_mb']:.0f} MB)"
        )
        return
    print(
        f"torch {torch.__version__}, {args.batches} batches of {args.batch_size}; x = multiples of the float model's "
        "size above the process with it loaded and the tool's code imported (a small model of the same family run "
        "first); 'with imports': above the process with only the model loaded"
    )
    for layout in args.layouts:
        table = steps_table(layout, args.batches, args.skip, args.batch_size)
        analyzed = table["rows"][0]["seconds"]
        print(
            f"\n{layout}: {table['model_mb']:.0f} MB of weights; one plain forward pass over the batches "
            f"{table['plain_pass_s']:.1f} s; analyze() {analyzed:.1f} s = {analyzed / table['plain_pass_s']:.2f}x; "
            f"the tool's code and caches {table['fixed_mb']:.0f} MB = {table['fixed_mb'] / table['model_mb']:.2f}x "
            "the model"
        )
        print(f"  {'step':22s} {'seconds':>8s} {'peak x':>7s} {'held x':>7s}   with imports: {'peak x':>7s} {'held x':>7s}")
        for row in table["rows"]:
            print(
                f"  {row['step']:22s} {row['seconds']:8.1f} {row['peak']:7.2f} {row['held']:7.2f}   "
                f"{'':14s}{row['peak_cold']:7.2f} {row['held_cold']:7.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
