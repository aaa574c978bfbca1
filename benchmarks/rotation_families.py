"""R1 on decoders whose blocks end in a norm (Gemma 2 / 3's sandwich norms, OLMo 2's post-norms):
what the stream turned as the model runs costs and buys, measured.

Such a block normalises what it adds to the stream, so R1 cannot be folded into its writers: the
norm's output is turned by ``Q`` as the model runs (a product a token per such norm; a tied head
stays tied, the embedding's output and the final norm's input turned too). Byte-level decoders of
each family (the sizes and training recipe of ``demo/text.py``'s Llama, about a minute each on two
cores, cached in ``--cache``), their configs otherwise at their defaults (Gemma ties its head).
Every Linear int4 (weight-only on x86; 8da4w as an ExecuTorch program, XNNPACK in its runtime),
round to nearest and GPTQ, with and without ``Rotation()``: perplexity on the held-out text,
logits' SQNR, bytes, and the program's prefill and decode milliseconds. ``--price LAYERS``: the
products' price where the width is real, on blocks of Gemma 3 270M's shape (width 640, 4 heads, one
key-value head of 256, MLP 2,048; random weights, a 4,096-token vocabulary instead of 262,144: timings
and bytes only), 8da4w g32 programs with and without R1.

    python benchmarks/rotation_families.py [--cache DIR] [--families gemma3 olmo2 llama] [--group 32] [--no-program]
    python benchmarks/rotation_families.py --price 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import run_cells, setup

from qreport_widgets import ModuleSettings, Rotation, analyze
from qreport_widgets.core.progress import quiet
from qreport_widgets.demo.cache import cached_file, recipe_tag, trained_once
from qreport_widgets.demo.text import DECODER, TOKENS, _train, text_data
from qreport_widgets.engines.rotation import matrix_words

STEPS = 600
ALGORITHMS = ("rtn", "gptq")


def build(family: str) -> torch.nn.Module:
    import transformers as t

    sizes = {"vocab_size": 256, "max_position_embeddings": TOKENS, **DECODER}
    built = {
        "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**sizes, num_key_value_heads=1, head_dim=32, sliding_window=64)),
        "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**sizes, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**sizes)),
    }
    torch.manual_seed(0)
    return built[family]()


def trained(family: str, cache: str) -> torch.nn.Module:
    name = f"rotation_family_{family}_{STEPS}_{recipe_tag(family, DECODER, TOKENS, STEPS)}.pt"
    return trained_once(lambda: build(family), lambda model: _train(model, STEPS), cached_file(cache, name)).eval()


def every_linear(session, fmt: str, group: int, algorithm: str) -> dict[str, ModuleSettings]:
    return {
        m.fqn: ModuleSettings(format=fmt, group_size=group, algorithm=algorithm)
        for m in session.modules
        if m.type_name == "Linear"
    }


def measure(family: str, cache: str, group: int, program: bool) -> None:
    model = trained(family, cache)
    data = text_data()
    float_ppl = data.perplexity(model)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    print(
        f"\n## {family}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, head tied: {tied}, "
        f"float {float_ppl:.4f}, every Linear int4 in groups of {group}"
    )
    print(matrix_words(model, Rotation()))
    targets = [("x86", "int4-weight-only", {})]
    if program:
        targets.append(("XNNPACK", "int8-dynamic-int4-weight", {"target": "xnnpack"}))
    print("| target | algorithm | rotation | perplexity | vs float | SQNR (dB) | KB | prefill ms | decode ms | run (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for target, fmt, extra in targets:
        session = analyze(
            model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="eager", metric="perplexity",
            format=fmt, group_size=group, progress=False, **extra,
        ).session  # fmt: skip
        for algorithm in ALGORITHMS:
            for rotation in (None, Rotation()):
                start = time.perf_counter()
                run = session.apply(every_linear(session, fmt, group, algorithm), rotation=rotation, progress=quiet)
                seconds = time.perf_counter() - start
                rotated = "R1 + R2" if rotation is not None else "-"
                if not run.ok:
                    print(f"| {target} | {algorithm} | {rotated} | failed: {run.error} |", flush=True)
                    continue
                speed = "| - | -"
                if target == "XNNPACK":
                    try:
                        found = session.decode_speed(run)
                        speed = f"| {found.prefill_ms:.2f} | {found.decode_ms:.2f}"
                    except Exception as error:  # the static-cache export a family may not take: said, not hidden
                        speed = f"| decode speed failed: {type(error).__name__}: {str(error)[:120]} | -"
                print(f"| {target} | {algorithm} | {rotated} | {run_cells(run, float_ppl)} {speed} | {seconds:.0f} |", flush=True)


def price(layers: int) -> None:
    import transformers as t

    torch.manual_seed(0)
    config = t.Gemma3TextConfig(
        vocab_size=4096, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
    )  # fmt: skip
    model = t.Gemma3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 4096, (1, 128), generator=generator),) for _ in range(3)]
    session = analyze(
        model, batches[0], batches[:2], eval_data=batches[2:], engine="eager", format="int8-dynamic-int4-weight",
        group_size=32, target="xnnpack", progress=False,
    ).session  # fmt: skip
    print(f"\n## the price: {layers} blocks of Gemma 3 270M's shape, every Linear 8da4w g32 (random weights)")
    print(matrix_words(model, Rotation()))
    print("| rotation | .pte KB | prefill ms / token | decode ms / token | lowering + run (s) |")
    print("|---|---|---|---|---|")
    for rotation in (None, Rotation()):
        start = time.perf_counter()
        run = session.apply(every_linear(session, "int8-dynamic-int4-weight", 32, "rtn"), rotation=rotation, progress=quiet)
        seconds = time.perf_counter() - start
        if not run.ok:
            print(f"| {rotation} | failed: {run.error} |")
            continue
        speed = session.decode_speed(run)
        rotated = "R1 + R2" if rotation is not None else "-"
        print(
            f"| {rotated} | {run.deployed_bytes / 1024:.1f} | {speed.prefill_ms:.3f} | {speed.decode_ms:.3f} | {seconds:.0f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cache", default=str(Path(tempfile.gettempdir()) / "qreport_benchmarks"), help="where trained weights are kept"
    )
    parser.add_argument("--families", nargs="+", default=["gemma3", "olmo2", "llama"], choices=["gemma3", "olmo2", "llama"])
    parser.add_argument("--group", type=int, default=32, help="int4 group size (128: one group a row of the width)")
    parser.add_argument("--no-program", action="store_true", help="x86 only: no ExecuTorch programs")
    parser.add_argument("--price", type=int, metavar="LAYERS", help="only the products' price on blocks of Gemma 3 270M's shape")
    arguments = parser.parse_args()
    setup()
    if arguments.price:
        price(arguments.price)
        return
    for family in arguments.families:
        measure(family, arguments.cache, arguments.group, not arguments.no_program)


if __name__ == "__main__":
    main()
