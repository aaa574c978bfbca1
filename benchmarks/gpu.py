"""The whole loop with the model on a GPU, beside the same steps with the model on the CPU.

Two sessions, each taken through its steps twice in one run, the model and its batches first on
``--device`` (default ``cuda``), then on the CPU, so each step's time and result sit side by side:

- FX, a ResNet-18 layout (``demo.architectures.resnet18``): analyze -> report (its tables) ->
  baseline -> Accept all (the verified suggestions, combined and run) -> sensitivity -> reach;
- eager, a 134M Llama layout (``LlamaConfig`` left at its defaults but for its sizes, random
  weights, int4 weight-only in groups of 64, perplexity the metric): analyze -> baseline -> GPTQ,
  AWQ and HQQ on every Linear, the learned rounding on every block's Linear -> block sensitivity ->
  fit to the baseline's size.

A real run converts and measures where its kernels are (the x86 int8 kernels are the CPU's), so its
SQNR and perplexity should equal the CPU session's within round-off; the last column says whether
they do (0.1 dB, 0.1%). Times are wall seconds with the device synchronised around each step.

    python benchmarks/gpu.py [--device cuda] [--scale full|small] [--sessions fx eager] [--algorithms gptq awq hqq learned]

``--scale small`` (a ResNet-18 16 channels wide on 64 x 64 images, a 2-layer decoder) checks the
script itself on a machine without a GPU: ``--device cpu --scale small``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from qreport_widgets import ModuleSettings, analyze
from qreport_widgets.core.cpu import cpu_simd
from qreport_widgets.core.progress import quiet
from qreport_widgets.demo.architectures import resnet18

SCALES = {
    "full": {"image": (8, 3, 224, 224), "width": 64, "tokens": (8, 512), "layers": 12, "hidden": 768, "mlp": 2048},
    "small": {"image": (2, 3, 64, 64), "width": 16, "tokens": (2, 64), "layers": 2, "hidden": 64, "mlp": 128},
}
CALIBRATION, HELD_OUT = 4, 2
VOCABULARY = 32000
ALGORITHMS = ("gptq", "awq", "hqq", "learned")
AGREE_DB, AGREE_FRACTION = 0.1, 0.001
# the learned rounding's sign-gradient steps sum in another order on the GPU, so a few roundings flip:
# its runs agree within 2% (the gpu tests' bound), the others within round-off
LEARNED_FRACTION = 0.02


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Steps:
    """Each step's wall time and result, in the order taken."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # step -> (seconds, result in words, the value compared with the other device's, whether relatively)
        self.rows: dict[str, tuple[float, str, float, bool]] = {}

    def take(self, name: str, action: Callable[[], Any], result: Callable[[Any], tuple[str, float, bool]]) -> Any:
        synchronized(self.device)
        start = time.perf_counter()
        try:
            value = action()
            synchronized(self.device)
        except Exception as error:  # a step that fails is a row saying so; the rest still run
            self.rows[name] = (time.perf_counter() - start, f"FAILED {type(error).__name__}: {str(error)[:120]}", math.nan, False)
            self.said(name)
            return None
        seconds = time.perf_counter() - start
        self.rows[name] = (seconds, *result(value))
        self.said(name)
        return value

    def said(self, name: str) -> None:
        # each step as it ends, so that a run stopped part way still shows what it measured
        seconds, said, _, _ = self.rows[name]
        print(f"  {self.device}: {name}, {seconds:.2f} s, {said}", file=sys.stderr, flush=True)


def run_words(run: Any) -> tuple[str, float, bool]:
    """A run's output SQNR (compared in dB) and perplexity (compared relatively, where it has one)."""
    if run is None or not run.ok:
        return f"failed: {(getattr(run, 'error', None) or 'nothing to run')[:100]}", math.nan, False
    if run.eval_metric is not None:
        return f"{run.output_sqnr_db:.2f} dB, perplexity {run.eval_metric:.3f}", run.eval_metric, True
    return f"{run.output_sqnr_db:.2f} dB", run.output_sqnr_db, False


def words(text: str) -> tuple[str, float, bool]:
    return text, math.nan, False


def fx_session(scale: dict, device: torch.device) -> Steps:
    torch.manual_seed(0)
    model = resnet18(width=scale["width"]).eval().to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(scale["image"], generator=generator).to(device),) for _ in range(CALIBRATION + HELD_OUT)]
    steps = Steps(device)
    report = steps.take(
        "analyze",
        lambda: analyze(model, batches[0], batches[:CALIBRATION], eval_data=batches[CALIBRATION:], progress=False),
        lambda r: words(f"{len(r.session.modules)} tunable modules"),
    )
    if report is None:
        return steps
    session = report.session
    steps.take("report", lambda: report.generate_model_report(False), lambda r: words(f"{len(r)} detector reports"))
    steps.take("baseline", lambda: session.baseline(progress=quiet), run_words)
    steps.take("Accept all", lambda: report.verified_suggestions().accept_all, run_words)
    steps.take("sensitivity", lambda: session.sensitivity(progress=quiet), lambda t: words(f"worst: {t.index[0]}"))
    steps.take("reach 35 dB", lambda: session.reach(target_sqnr_db=35, progress=quiet), run_words)
    return steps


def decoder_session(scale: dict, device: torch.device, algorithms: tuple[str, ...] = ALGORITHMS) -> Steps:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=scale["hidden"],
        intermediate_size=scale["mlp"],
        num_hidden_layers=scale["layers"],
        num_attention_heads=max(scale["hidden"] // 64, 4),
    )
    model = LlamaForCausalLM(config).eval().to(device)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, VOCABULARY, scale["tokens"], generator=generator).to(device),) for _ in range(CALIBRATION + HELD_OUT)
    ]
    steps = Steps(device)
    report = steps.take(
        "analyze",
        lambda: analyze(
            model,
            batches[0],
            batches[:CALIBRATION],
            eval_data=batches[CALIBRATION:],
            engine="eager",
            format="int4-weight-only",
            group_size=64,
            metric="perplexity",
            progress=False,
        ),
        lambda r: words(f"{len(r.session.modules)} tunable modules"),
    )
    if report is None:
        return steps
    session = report.session
    baseline = steps.take("baseline", lambda: session.baseline(progress=quiet), run_words)
    for algorithm in algorithms:
        # the learned rounding is offered to the blocks' Linears (the head keeps round to nearest)
        linears = [m.fqn for m in session.modules if m.current.format == "int4-weight-only" and m.algorithm_allowed(algorithm)]
        chosen = ModuleSettings(format="int4-weight-only", group_size=64, algorithm=algorithm)
        steps.take(
            "learned rounding, every block's Linear" if algorithm == "learned" else f"{algorithm.upper()}, every Linear",
            lambda c=chosen, m=linears: session.apply(dict.fromkeys(m, c), progress=quiet),
            run_words,
        )
    steps.take(
        "block sensitivity",
        lambda: session.block_sensitivity(progress=quiet),
        lambda t: words(f"{len(t)} blocks, worst: {t.index[0]}"),
    )
    if baseline is not None and baseline.ok:
        steps.take(
            "fit to the baseline's size", lambda: session.fit(max_size_bytes=baseline.deployed_bytes, progress=quiet), run_words
        )
    return steps


def agree(first: float, second: float, relative: bool, fraction: float = AGREE_FRACTION) -> str:
    if math.isnan(first) or math.isnan(second):
        return ""
    gap = abs(first - second) / abs(second) if relative else abs(first - second)
    return "yes" if gap <= (fraction if relative else AGREE_DB) else f"NO ({first:.4g} / {second:.4g})"


def table(title: str, on_device: Steps, on_cpu: Steps) -> None:
    print(f"\n{title}")
    print(f"| step | {on_device.device} s | result | cpu s | result | same |")
    print("|---|---|---|---|---|---|")
    for name, (seconds, said, value, relative) in on_device.rows.items():
        cpu_seconds, cpu_said, cpu_value, _ = on_cpu.rows.get(name, (math.nan, "", math.nan, False))
        fraction = LEARNED_FRACTION if name.startswith("learned") else AGREE_FRACTION
        same = agree(value, cpu_value, relative, fraction)
        print(f"| {name} | {seconds:.2f} | {said} | {cpu_seconds:.2f} | {cpu_said} | {same} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", default="full", choices=SCALES)
    parser.add_argument("--sessions", nargs="*", default=["fx", "eager"], choices=["fx", "eager"])
    parser.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS), choices=ALGORITHMS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here (torch.cuda.is_available() is False): pass --device cpu to check the script")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
    print(f"torch {torch.__version__}; {device}: {where}; CPU: {cpu_simd()}; scale {args.scale}")
    scale = SCALES[args.scale]
    sessions = {
        "fx": ("FX, ResNet-18 layout", fx_session),
        "eager": ("eager, Llama layout, int4 g64", functools.partial(decoder_session, algorithms=tuple(args.algorithms))),
    }
    for name in args.sessions:
        title, session = sessions[name]
        table(title, session(scale, device), session(scale, torch.device("cpu")))


if __name__ == "__main__":
    main()
