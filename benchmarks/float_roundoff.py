"""Float round-off: how far a float model's output moves from itself when only the CPU's SIMD level
or the thread count changes, which is what ``core.metrics.FLOAT_ROUNDOFF_DB`` must stay below.

Each setting runs in a fresh process (torch, fbgemm and NumPy read their settings at start): the
machine as it is at 2 and 1 threads, tools/without-avx512.env (a CPU with AVX2 and no AVX-512) at 2
and 1 threads, and torch's default (no-SIMD) dispatch at 1 thread. Every model's output under each
setting is compared with the first setting's (output SQNR, dB; inf: bit for bit the same).
Models: tests/zoo.py (random weights), the trained digits models, the trained byte decoder and a
Llama layout from ``LlamaConfig`` left at its defaults (``use_cache=True``).

    python benchmarks/float_roundoff.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

WITHOUT_AVX512 = dict(
    line.split("=", 1) for line in (ROOT / "tools" / "without-avx512.env").read_text().splitlines() if line and line[0] != "#"
)
SETTINGS = {
    "as is, 2 threads": ({}, 2),
    "as is, 1 thread": ({}, 1),
    "no AVX-512, 2 threads": (WITHOUT_AVX512, 2),
    "no AVX-512, 1 thread": (WITHOUT_AVX512, 1),
    "no SIMD, 1 thread": ({"ATEN_CPU_CAPABILITY": "default"}, 1),
}


def models() -> dict[str, tuple[torch.nn.Module, list[tuple]]]:
    import zoo
    from transformers import LlamaConfig, LlamaForCausalLM

    from qreport_widgets.demo.cache import cache_folder
    from qreport_widgets.demo.digits import MODELS, trained_digits_model
    from qreport_widgets.demo.text import trained_text_decoder

    found = {}
    for name, (factory, batches) in zoo.ARCHITECTURES.items():
        torch.manual_seed(0)
        found[name] = (factory().eval(), batches())
    cache = cache_folder()
    for name in MODELS:
        model, data = trained_digits_model(name, cache)
        found[f"digits {name}"] = (model, data.calibration[:2])
    model, text = trained_text_decoder(cache_dir=cache)
    found["byte decoder"] = (model, text.evaluation[:2])
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8)
    generator = torch.Generator().manual_seed(0)
    found["llama 4 layers"] = (LlamaForCausalLM(config).eval(), [(torch.randint(0, 512, (2, 64), generator=generator),)])
    return found


def outputs(path: str) -> None:
    """In the child: every model's outputs, saved to ``path``."""
    from qreport_widgets.core.cpu import cpu_simd
    from qreport_widgets.core.metrics import output_tensor

    warnings.simplefilter("ignore")
    saved = {"cpu": str(cpu_simd())}
    found = models()  # trained where no weights are kept yet: outside no_grad
    with torch.no_grad():
        for name, (model, batches) in found.items():
            saved[name] = [output_tensor(model(*batch) if isinstance(batch, tuple) else model(**batch)) for batch in batches]
    torch.save(saved, path)


def main() -> None:
    from qreport_widgets.core.metrics import FLOAT_ROUNDOFF_DB, sqnr_db

    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for label, (settings, threads) in SETTINGS.items():
            path = str(Path(folder) / f"{len(runs)}.pt")
            env = {**os.environ, **settings, "OMP_NUM_THREADS": str(threads)}
            subprocess.run([sys.executable, __file__, "--child", path], env=env, check=True)
            runs[label] = torch.load(path)
    first, *others = runs
    for label, run in runs.items():
        print(f"{label:24s} {run['cpu']}")
    names = [name for name in runs[first] if name != "cpu"]
    print(f"\noutput SQNR (dB) against '{first}'; FLOAT_ROUNDOFF_DB = {FLOAT_ROUNDOFF_DB:g}")
    print(f"{'model':20s} " + " ".join(f"{label:>22s}" for label in others))
    lowest = float("inf")
    for name in names:
        row = []
        for label in others:
            terms = [sqnr_db(a, b) for a, b in zip(runs[first][name], runs[label][name], strict=True)]
            value = min(terms)
            lowest = min(lowest, value)
            row.append(f"{value:22.1f}")
        print(f"{name:20s} " + " ".join(row))
    print(f"\nlowest: {lowest:.1f} dB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        outputs(sys.argv[2])
    else:
        main()
