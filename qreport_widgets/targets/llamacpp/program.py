"""A run's model as llama.cpp runs it: the GGUF file written and opened in llama.cpp (``GgufProgram``).

``gguf_program(model)`` writes a quantized decoder (the eager engine's int4 / int8 weights, their
scales first rounded to fp16 as the file stores them: ``fp16_scales``) into a folder of its own and
opens it in llama.cpp; calling the program computes the logits there, so a run's output SQNR,
perplexity and latency are llama.cpp's. Its bytes are the file's; ``write(path)`` saves the file
(``tokenizer_from``: with the tokenizer of the GGUF file the model came from).

What it costs to hold: llama.cpp keeps a context (its KV cache and a row of logits per position)
per open file, so a program opens its file at the context its calls need (the next power of two of
the longest row, up to the model's own), and the worker keeps the few files used last open
(``runtime.HELD_FILES``): a program whose file was closed opens it again, its SHA-256 checked first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...core.metrics import token_ids
from ..contract import Deployed
from .blocks import BLOCK, GgufFormat, _is_quantized
from .gguf_file import GgufFile, GgufWriteError, _gguf, family_of, write_gguf
from .runtime import LlamaCppError, LlamaCppModel, Speed, _binding

SMALLEST_CONTEXT = 64


def fp16_scales(model: torch.nn.Module) -> int:
    """Round the scales of ``model``'s int4 / int8 weights to fp16, as a GGUF file stores them (the
    int values stay): the model then computes what the file holds. How many weights changed."""
    return sum(fp16_scaled(getattr(module, "weight", None)) for module in model.modules())


def fp16_scaled(weight: Any) -> bool:
    """Round the scale of ``weight`` (an int4 / int8 weight; anything else is left) to fp16; whether it changed."""
    if weight is None or not _is_quantized(weight):
        return False
    scale = weight.scale
    rounded = scale.to(torch.float16).to(scale.dtype)
    if torch.equal(rounded, scale):
        return False
    weight.scale = rounded  # a new tensor: the earlier scale, wherever else it is held, stays as it was
    return True


def tensor_bytes(shape: Sequence[int], format: GgufFormat) -> int:  # noqa: A002  (llama.cpp's word)
    """The bytes a tensor of ``shape`` takes in ``format`` (rows of blocks of 32 inputs; the file
    aligns each tensor to 32 bytes besides)."""
    count = 1
    for n in shape:
        count *= int(n)
    if format in (GgufFormat.F16, GgufFormat.F32):
        return count * (2 if format is GgufFormat.F16 else 4)
    return count // BLOCK * format.bytes_per_block


def required() -> None:
    """gguf and llama-cpp-python importable, else ``MissingExtraError`` naming the extra."""
    _gguf()
    _binding()


def refusal(model: torch.nn.Module) -> str:
    """Why ``model`` cannot be written as a GGUF file llama.cpp runs ("" where it can)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        return (
            f"llama.cpp runs Hugging Face decoders written as GGUF (a model with a transformers config); "
            f"this is a {type(model).__name__}"
        )
    try:
        family_of(config)
    except GgufWriteError as error:
        return str(error)
    return ""


class GgufProgram(Deployed):
    """A quantized decoder written as a GGUF file and opened in llama.cpp, called like the model:
    token ids in (a tensor, a tuple starting with one, or ``input_ids=``), llama.cpp's logits out
    (rows x positions x vocabulary) as a causal LM's output's ``logits``. ``file``: what was
    written (its path, bytes, tensor formats); ``reference``: the model it was written from;
    ``written_s``: the seconds writing took."""

    suffix = ".gguf"

    def __init__(
        self, reference: torch.nn.Module, file: GgufFile, folder: str, written_s: float, tied_head: bool = False
    ) -> None:
        super().__init__()
        self.tied_head = tied_head  # the head reads the embedding's tensor (``write_gguf``)
        object.__setattr__(self, "reference", reference)  # not a submodule: its tensors are not the file's
        self.file = file
        self.written_s = written_s
        self.longest = int(getattr(reference.config, "max_position_embeddings", 0) or 0)  # the model's own context
        self._llama: LlamaCppModel | None = None
        self.last_call_s = 0.0
        weakref.finalize(self, shutil.rmtree, folder, True)

    @property
    def artifact_bytes(self) -> int:
        return self.file.bytes

    def llama(self, positions: int = SMALLEST_CONTEXT) -> LlamaCppModel:
        """The file open in llama.cpp with a context of at least ``positions``."""
        if self._llama is None or self._llama.context < positions:
            context = max(SMALLEST_CONTEXT, 1 << (max(positions, 1) - 1).bit_length())
            self._llama = None  # the smaller one closes before the larger opens
            self._llama = LlamaCppModel(self.file.path, context=min(context, self.longest) if self.longest else context)
        return self._llama

    def forward(self, *inputs: Any, **named: Any) -> Any:
        ids = named.get("input_ids")
        if ids is None:
            ids = token_ids(inputs[0] if len(inputs) == 1 else inputs)
        if ids is None:
            raise LlamaCppError(
                "a GGUF program is called with token ids (an integer tensor, batch x tokens, or input_ids=); "
                f"it was given {', '.join(type(x).__name__ for x in (*inputs, *named.values()))}"
            )
        mask = named.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise LlamaCppError(
                "llama.cpp computes every row whole from its first token: give evaluation batches without padding "
                "(an attention_mask of ones)"
            )
        if self.longest and ids.shape[-1] > self.longest:
            raise LlamaCppError(f"rows of {ids.shape[-1]} tokens are longer than the model's context ({self.longest} positions)")
        llama = self.llama(int(ids.shape[-1]))
        start = time.perf_counter()
        logits = llama.logits(ids.cpu())
        self.last_call_s = time.perf_counter() - start
        return _as_the_model_returns(logits)

    def block_outputs(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Each decoder block's output as llama.cpp computes token ids ``ids`` (``LlamaCppModel.block_outputs``)."""
        return self.llama(int(ids.shape[-1])).block_outputs(ids.cpu())

    def speed(self, prompt: Sequence[int], new_tokens: int = 32) -> Speed:
        """llama.cpp's prefill and decode speed on ``prompt``, then ``new_tokens`` generated."""
        return self.llama(len(prompt) + new_tokens).speed(prompt, new_tokens)

    def write(
        self,
        path: str | os.PathLike[str],
        *,
        tokenizer_from: str | os.PathLike[str] | None = None,
        overwrite: bool = False,
    ) -> int:
        """Save the GGUF file as ``path``; the bytes written. ``tokenizer_from``: a GGUF file (the
        one the model was loaded from) whose tokenizer the saved file carries, else the file as it
        was measured (a vocabulary of bytes). An existing ``path`` is kept unless ``overwrite``."""
        destination = Path(path)
        if destination.exists() and not overwrite:
            raise GgufWriteError(f"{destination} exists; pass overwrite=True to replace it")
        if tokenizer_from is not None:
            written = write_gguf(
                self.reference, destination, tokenizer_from=tokenizer_from, overwrite=overwrite, tied_head=self.tied_head
            )
            return written.bytes
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(f".{destination.name}.partial")
        try:
            shutil.copyfile(self.file.path, partial)
            os.replace(partial, destination)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return destination.stat().st_size

    def formats(self) -> Mapping[str, int]:
        """How many tensors the file holds in each format."""
        return {f.value: self.file.count(f) for f in GgufFormat if self.file.count(f)}

    def extra_repr(self) -> str:
        held = ", ".join(f"{n} {name}" for name, n in self.formats().items())
        return f"{self.file.bytes:,} bytes of GGUF ({held})"


def gguf_program(model: torch.nn.Module, float_format: GgufFormat = GgufFormat.F16, tied_head: bool = False) -> GgufProgram:
    """``model`` (a quantized Hugging Face decoder, left as it is but for its scales, rounded to
    fp16 first: ``fp16_scales``) written as a GGUF file in a folder of its own and opened in
    llama.cpp; ``tied_head``: its head reads the embedding's tensor (``write_gguf``)."""
    start = time.perf_counter()
    fp16_scales(model)
    folder = tempfile.mkdtemp(prefix="qreport-gguf-")
    try:
        written = write_gguf(model, Path(folder) / "model.gguf", float_format=float_format, tied_head=tied_head)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return GgufProgram(model, written, folder, time.perf_counter() - start, tied_head)


def _as_the_model_returns(logits: torch.Tensor) -> Any:
    """``logits`` as a transformers causal language model returns them (its output's ``logits``)."""
    from transformers.modeling_outputs import CausalLMOutput

    return CausalLMOutput(logits=logits)
