"""The eager simulation's passes from the first changed block against whole passes, side by side.

A Llama-style decoder built from a config (random weights: the simulation's cost is what is
measured; 12 layers of 256 by default), perplexity the metric, 4 held-out batches of 4 x 64 tokens.
For each start format, two fresh sessions, one with the replay turned off: ``format_sensitivity()``,
``block_sensitivity()`` and ``sensitivity()`` timed, and their tables compared (they must be equal
to the bit).

    python benchmarks/eager_replay.py [--layers 12] [--hidden 256]
"""

from __future__ import annotations

import argparse
import time

import pandas as pd
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qreport_widgets import analyze
from qreport_widgets.core.progress import quiet

THREADS = 2
FORMATS = {"int8-dynamic": {}, "int4-weight-only": {"group_size": 32}}


def decoder(layers: int, hidden: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=128,
        use_cache=False,
    )
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 512, (4, 64), generator=generator),) for _ in range(8)]
    return LlamaForCausalLM(config).eval(), batches


def measure(model, batches, name: str, replay: bool) -> tuple[dict[str, float], list[pd.DataFrame], int]:
    report = analyze(
        model, batches[0], batches[:4], eval_data=batches[4:], engine="eager", format=name,
        metric="perplexity", progress=False, **FORMATS[name],
    )  # fmt: skip
    session = report.session
    simulation = session.parts.simulated.simulation()
    simulation._replay.on = replay  # the switch the comparison needs; off, every pass is whole
    seconds, tables = {}, []
    for step in ("format_sensitivity", "block_sensitivity", "sensitivity"):
        start = time.perf_counter()
        tables.append(getattr(session, step)(progress=quiet))
        seconds[step] = time.perf_counter() - start
    return seconds, tables, simulation._replay.skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    model, batches = decoder(args.layers, args.hidden)
    print(f"Llama-style decoder, {args.layers} layers of {args.hidden}, {THREADS} threads, 4 held-out batches of 4 x 64")
    columns = f"{'format_sens. s':>15s} {'block_sens. s':>14s} {'sensitivity s':>14s} {'blocks skipped':>15s}"
    print(f"{'start format':18s} {'passes':7s} {columns}")
    for name in FORMATS:
        found = {}
        for replay in (False, True):
            seconds, tables, skipped = measure(model, batches, name, replay)
            found[replay] = tables
            times = " ".join(f"{seconds[s]:>{w}.1f}" for s, w in zip(seconds, (15, 14, 14), strict=True))
            print(f"{name:18s} {'replay' if replay else 'whole':7s} {times} {skipped:15d}", flush=True)
        for replayed, whole in zip(found[True], found[False], strict=True):
            pd.testing.assert_frame_equal(replayed, whole, check_exact=True)
        print(f"{name:18s} the three tables are equal, bit for bit")


if __name__ == "__main__":
    main()
