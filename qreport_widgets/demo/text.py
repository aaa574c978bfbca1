"""A small byte-level decoder trained on real English text that every Python installation carries:
the help topics of the Python reference (``pydoc_data.topics``, about 460 KB), no download.

A decoder's quantization is judged on what it predicts: its perplexity on held-out text (how many
bytes it hesitates between, on average; 256 for a model that knows nothing) moves with every
weight format, where random weights would only show noise. Training takes well under a minute on
two CPU cores with fixed seeds; pass ``cache_dir`` to keep the weights between calls. The model is a
Hugging Face ``LlamaForCausalLM`` (``transformers`` is a development dependency).

    model, data = trained_text_decoder()
    report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation,
                     engine="eager", metric="perplexity")
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.metrics import perplexity
from .cache import USER_CACHE, cached_file, recipe_tag, trained_once

TOKENS = 128  # bytes per sequence
HELD_OUT = 0.1  # the last tenth of the text is never trained on
DECODER = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4}


def text_bytes() -> torch.Tensor:
    """The Python reference's help topics in a fixed order, as byte values (int64)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


@dataclass
class TextData:
    """Held-out text: ``calibration`` and ``evaluation`` batches of ``(ids,)``, each ids (4, 128)."""

    calibration: list[tuple[torch.Tensor]]
    evaluation: list[tuple[torch.Tensor]]

    def perplexity(self, model: nn.Module) -> float:
        """exp(mean next-byte negative log-likelihood) of ``model`` on the evaluation text (lower is better)."""
        return perplexity(model, self.evaluation)


def text_data(batch_size: int = 4, calibration_batches: int = 4, evaluation_batches: int = 8) -> TextData:
    """Windows of the held-out tenth of the text, none overlapping: calibration first, then evaluation."""
    ids = text_bytes()
    held = ids[int(len(ids) * (1 - HELD_OUT)) :]
    windows = held[: len(held) // TOKENS * TOKENS].view(-1, TOKENS)
    needed = batch_size * (calibration_batches + evaluation_batches)
    if len(windows) < needed:  # pragma: no cover - the topics are ~460 KB on every CPython
        raise ValueError(f"the held-out text has {len(windows)} windows of {TOKENS} bytes, {needed} are needed")
    batches = [(windows[i : i + batch_size],) for i in range(0, needed, batch_size)]
    return TextData(batches[:calibration_batches], batches[calibration_batches:])


def build_text_decoder() -> nn.Module:
    """A Llama-style decoder over bytes (vocabulary 256, 4 layers of width 128, no cache): 0.9M parameters."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as error:  # pragma: no cover - transformers is a dev dependency
        raise ImportError("the text decoder is a Hugging Face model: pip install transformers") from error
    config = LlamaConfig(vocab_size=256, max_position_embeddings=TOKENS, use_cache=False, tie_word_embeddings=False, **DECODER)
    return LlamaForCausalLM(config)


def trained_text_decoder(cache_dir: str | Path | None = USER_CACHE, steps: int = 600) -> tuple[nn.Module, TextData]:
    """The byte-level decoder trained for ``steps`` steps of 16 random windows of the first nine
    tenths of the text (fixed seeds), in eval mode, and the held-out text. Trained once (about a
    minute on two cores) and kept in ``cache_dir`` (default: ``cache.cache_folder()``; None: not kept)
    as ``decoder_weights_name(steps)``."""
    cached = cached_file(cache_dir, decoder_weights_name(steps))
    return trained_once(build_text_decoder, lambda model: _train(model, steps), cached), text_data()


def decoder_weights_name(steps: int = 600) -> str:
    """The file the trained decoder's weights are kept as: named by its steps and a tag of its whole
    recipe (the model, the training loop, the text), so weights of another recipe are never loaded."""
    parts = (inspect.getsource(build_text_decoder), inspect.getsource(_train), DECODER, TOKENS, HELD_OUT, steps)
    return f"text_decoder_{steps}_{recipe_tag(*parts, _text_digest())}.pt"


@functools.cache
def _text_digest() -> str:
    return recipe_tag(text_bytes().numpy().tobytes())


def _train(model: nn.Module, steps: int) -> None:
    ids = text_bytes()
    text = ids[: int(len(ids) * (1 - HELD_OUT))]
    generator = torch.Generator().manual_seed(0)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for _ in range(steps):
        starts = torch.randint(0, len(text) - TOKENS, (16,), generator=generator)
        windows = torch.stack([text[s : s + TOKENS] for s in starts.tolist()])
        optimiser.zero_grad()
        model(input_ids=windows, labels=windows).loss.backward()
        optimiser.step()
        schedule.step()
