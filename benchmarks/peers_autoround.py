"""AutoRound's half of ``peers.py``, run by the Python of AutoRound's own virtual environment (it
pins its own stack; nothing of qreport_widgets is imported here).

    python peers_autoround.py MODEL_FOLDER CALIBRATION.pt OUT.pt --group-size 64 --iters 200 --batch-size 4

Loads the float model ``peers.py`` saved (``save_pretrained``) and the calibration token batches
it saved, quantizes every Linear inside the decoder blocks to int4, symmetric, in groups of
``--group-size`` with float32 scales (the head stays float), ``--iters`` learned steps a block, no
torch.compile, on the CPU; saves each quantized Linear's dequantized weight and group scales, and
the seconds ``quantize()`` took, to ``OUT.pt``.
"""

from __future__ import annotations

import argparse
import time
import types

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("calibration")
    parser.add_argument("out")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    batches = torch.load(args.calibration)
    samples = sum(len(b) for b in batches)
    # the batches are token ids already: AutoRound asks for a tokenizer only to say it has one
    no_tokenizer = types.SimpleNamespace(pad_token_id=None, eos_token_id=None)
    start = time.perf_counter()
    rounder = AutoRound(
        model,
        no_tokenizer,
        bits=4,
        group_size=args.group_size,
        sym=True,
        iters=args.iters,
        nsamples=samples,
        seqlen=int(batches[0].shape[-1]),
        batch_size=args.batch_size,
        dataset=batches,
        scale_dtype=torch.float32,
        enable_torch_compile=False,
        device_map="cpu",
    )
    quantized = rounder.quantize()[0]
    seconds = time.perf_counter() - start
    found = {}
    for name, module in quantized.named_modules():
        scale = getattr(module, "scale", None)
        if isinstance(module, torch.nn.Linear) and isinstance(scale, torch.Tensor):
            found[name] = {"weight": module.weight.detach().float().clone(), "scale": scale.detach().float().clone()}
    torch.save({"weights": found, "seconds": seconds, "iters": args.iters, "batch_size": args.batch_size}, args.out)
    print(f"AutoRound: {len(found)} Linears in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
