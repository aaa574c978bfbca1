"""A Hugging Face decoder written as a GGUF file llama.cpp runs, tensor by tensor.

The file's tensor names and metadata are llama.cpp's for the family (``FAMILIES``), looked up with
the ``gguf`` package's own name map; each weight in its format (``blocks.packed_weight``: the eager
engine's int values as they are, a float weight F16 / F32, or a format asked for by module and
rounded to nearest here); norms F32 as llama.cpp reads them. The tokenizer's fields are copied from
a GGUF file (the one a model was loaded from), else a vocabulary of bytes is written (byte-level BPE with no
merges: a model trained on bytes, or one built from a config, whose tokens are fed by id).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch
from torch import nn

from ...core.calibration import call_with
from ...errors import MissingExtraError, QReportError
from .blocks import GgufFormat, Packed, float_tensor, packed_weight, rounded_to_nearest


class GgufWriteError(QReportError, ValueError):
    """A model or a choice this target cannot write as a GGUF file; nothing was written."""


@dataclass(frozen=True)
class Family:
    """How llama.cpp names one Hugging Face family: its GGUF architecture, and whether the query and
    key rows are reordered (llama.cpp's ``llama`` rotates adjacent pairs, transformers the two halves)."""

    architecture: str
    pairs_rotated: bool


# transformers' model_type -> llama.cpp's architecture
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", True),
    "mistral": Family("llama", True),
    "qwen2": Family("qwen2", False),
    "qwen3": Family("qwen3", False),
}


@dataclass
class GgufFile:
    """What was written: the file, its bytes, each tensor's format, and what to know of it."""

    path: Path
    bytes: int
    formats: dict[str, GgufFormat]  # GGUF tensor name -> format
    notes: list[str] = field(default_factory=list)

    def count(self, format: GgufFormat) -> int:
        """How many tensors are in ``format``."""
        return sum(1 for f in self.formats.values() if f is format)


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as error:
        raise MissingExtraError(
            "writing a GGUF file needs the gguf package: pip install 'qreport-widgets[llamacpp]' (or pip install gguf)"
        ) from error
    return gguf


def family_of(config: Any) -> Family:
    """The llama.cpp family of a transformers config; ``GgufWriteError`` naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise GgufWriteError(
            f"a {model_type!r} model cannot be written as GGUF yet: the families written are {', '.join(sorted(FAMILIES))}"
        )
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind not in ("default", None):
        raise GgufWriteError(
            f"the model's rotary embedding is scaled ({kind!r}): llama.cpp reads that scaling from metadata "
            "this writer does not write yet; write a model whose config has no rope_scaling"
        )
    return FAMILIES[model_type]


def write_gguf(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    formats: Mapping[str, GgufFormat | str] | None = None,
    float_format: GgufFormat | str = GgufFormat.F16,
    tokenizer_from: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    name: str = "",
    tied_head: bool = False,
) -> GgufFile:
    """Write ``model`` (a transformers causal LM of a family in ``FAMILIES``, float or with the
    eager engine's int4 / int8 weights) as the GGUF file ``path``.

    ``formats``: a format for some modules by name (``"model.embed_tokens"``: ``"Q4_0"``), their
    float weights rounded to nearest here; every other quantized weight keeps its own values
    (``blocks.packed_weight``), every other float matrix is ``float_format``. ``tokenizer_from``: a
    GGUF file whose tokenizer is copied (else a vocabulary of bytes). ``tied_head``: the head
    reads the embedding's tensor (no output tensor is written; llama.cpp multiplies by
    ``token_embd``), as it does wherever the model's head weight is its embedding's. The file is
    written next to ``path`` and moved there once whole; an existing ``path`` is kept unless ``overwrite``."""
    gguf = _gguf()
    path = Path(path)
    if path.exists() and not overwrite:
        raise GgufWriteError(f"{path} exists; pass overwrite=True to replace it")
    config = model.config
    family = family_of(config)
    chosen = {module: GgufFormat(f) for module, f in (formats or {}).items()}
    float_format = GgufFormat(float_format)
    if float_format not in (GgufFormat.F16, GgufFormat.F32):
        raise GgufWriteError(f"float_format is F16 or F32, not {float_format.value}: a block format goes in formats")
    tensors, notes = _tensors(model, family, chosen, float_format, tied_head), []
    unknown = sorted(set(chosen) - {module for module, _ in tensors.values()})
    if unknown:
        raise GgufWriteError(f"formats names modules the model's weights do not come from: {', '.join(unknown)}")
    inexact = sorted(gguf_name for gguf_name, (_, packed) in tensors.items() if not packed.scales_exact)
    if inexact:
        notes.append(
            f"{len(inexact)} tensors' scales were not on fp16's grid and were rounded to it (their int values are "
            f"written as they are): {', '.join(inexact[:4])}{' and more' if len(inexact) > 4 else ''}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(partial, family.architecture)
        _metadata(writer, gguf, config, family, name or type(model).__name__, tensors)
        _tokenizer(writer, gguf, int(config.vocab_size), tokenizer_from)
        for gguf_name, (_, packed) in tensors.items():
            raw = None if packed.format in (GgufFormat.F16, GgufFormat.F32) else gguf.GGMLQuantizationType[packed.format.value]
            writer.add_tensor(gguf_name, packed.data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    formats_written = {gguf_name: packed.format for gguf_name, (_, packed) in tensors.items()}
    return GgufFile(path, path.stat().st_size, formats_written, notes)


def _tensors(
    model: nn.Module, family: Family, chosen: Mapping[str, GgufFormat], float_format: GgufFormat, tied_head: bool = False
) -> dict[str, tuple[str, Packed]]:
    """GGUF tensor name -> (the module it comes from, its packed data), in the model's order."""
    config = model.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    tensors: dict[str, tuple[str, Packed]] = {}
    head = model.get_output_embeddings()
    if tied_head and head is not None and hasattr(head.weight, "qdata"):
        raise GgufWriteError("the head is quantized on its own: it cannot also read the embedding's tensor (tied_head)")
    for parameter_name, value, gguf_name in _in_gguf(model, family, tied_head):
        if gguf_name is None:
            raise GgufWriteError(
                f"{parameter_name} has no tensor in llama.cpp's {family.architecture!r} layout: the model is not the "
                "family its config names, or a module was added to it (an online rotation's product cannot be written)"
            )
        module, _, leaf = parameter_name.rpartition(".")
        if value.dim() == 1:
            packed = float_tensor(value, GgufFormat.F32)  # norms and biases: llama.cpp computes them in F32
        elif module in chosen:
            if hasattr(value, "qdata"):
                raise GgufWriteError(f"{module} is quantized already: its own values are written, drop it from formats")
            packed = rounded_to_nearest(value, chosen[module])
        else:
            packed = packed_weight(value, float_format)
        if family.pairs_rotated and leaf == "weight" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            packed = _pairs_reordered(packed, heads if gguf_name.endswith("attn_q.weight") else kv_heads)
        tensors[gguf_name] = (module, packed)
    return tensors


def tensor_names(model: nn.Module) -> dict[str, str]:
    """Each parameter of ``model`` (``model.layers.0.self_attn.q_proj.weight``) -> its tensor's name
    in the GGUF file (``blk.0.attn_q.weight``); a head tied to the embedding has none of its own."""
    return {name: gguf_name for name, _, gguf_name in _in_gguf(model, family_of(model.config)) if gguf_name is not None}


def _in_gguf(model: nn.Module, family: Family, tied_head: bool = False) -> list[tuple[str, torch.Tensor, str | None]]:
    """Every parameter and persistent buffer of ``model`` once, with its GGUF tensor name (None where
    llama.cpp's layout for ``family`` has none), but a head tied to the embedding (its weight the
    embedding's, or ``tied_head``): llama.cpp reads the embedding as the head when the file has no
    output tensor."""
    gguf = _gguf()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.architecture.upper()], int(model.config.num_hidden_layers))
    embedding = model.get_input_embeddings().weight
    return [
        (name, value, names.get_name(name, try_suffixes=(".weight", ".bias")))
        for name, value in _named_tensors(model)
        if not (name.endswith("lm_head.weight") and (value is embedding or tied_head))
    ]


def importance_matrix(model: nn.Module, batches: Any) -> dict[str, torch.Tensor]:
    """llama.cpp's importance matrix of ``model`` on ``batches`` (token ids, as calibration takes
    them): for each Linear's weight, by its GGUF tensor name, the mean over every token of each input
    column's square (what llama-imatrix stores as ``in_sum2 / counts``), for ``runtime.quantize``."""
    names = tensor_names(model)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def recorder(gguf_name: str) -> Any:
        def record(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
            sums[gguf_name] = sums.get(gguf_name, 0) + x.square().sum(0)
            counts[gguf_name] = counts.get(gguf_name, 0) + x.shape[0]

        return record

    hooks = []
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear) and f"{fqn}.weight" in names:
            hooks.append(module.register_forward_pre_hook(recorder(names[f"{fqn}.weight"])))
    try:
        with torch.no_grad():
            for batch in batches:
                call_with(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: (sums[name] / counts[name]).to(torch.float32) for name in sums}


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of ``model`` once (a tied one under its first name)."""
    seen: set[int] = set()
    found = []
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if id(value) in seen or name.endswith(("rotary_emb.inv_freq", "original_inv_freq")):
            continue
        seen.add(id(value))
        found.append((name, value))
    return found


def _pairs_reordered(packed: Packed, heads: int) -> Packed:
    """A query or key weight's rows put in the order llama.cpp's ``llama`` rotates them in: each
    head's two halves interleaved row by row (rows carry whole blocks, so a quantized tensor's packed
    rows move as they are)."""
    rows = packed.data.shape[0]
    half = rows // heads // 2
    order = numpy.arange(rows).reshape(heads, 2, half).transpose(0, 2, 1).reshape(-1)
    return Packed(packed.format, numpy.ascontiguousarray(packed.data[order]), packed.scales_exact)


def _metadata(writer: Any, gguf: Any, config: Any, family: Family, name: str, tensors: Mapping[str, Any]) -> None:
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    writer.add_name(name)
    writer.add_context_length(int(getattr(config, "max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))
    counts: dict[GgufFormat, int] = {}
    for _, packed in tensors.values():
        if packed.data.ndim == 2 and packed.format is not GgufFormat.F32:
            counts[packed.format] = counts.get(packed.format, 0) + 1
    most = max(counts, key=counts.__getitem__) if counts else GgufFormat.F32
    file_type = {
        GgufFormat.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
        GgufFormat.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
        GgufFormat.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
        GgufFormat.F16: gguf.LlamaFileType.MOSTLY_F16,
        GgufFormat.F32: gguf.LlamaFileType.ALL_F32,
    }[most]
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _rope_theta(config: Any) -> float:
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return parameters["rope_theta"]
    return getattr(config, "rope_theta", 10000.0)


def _tokenizer(writer: Any, gguf: Any, vocab_size: int, source: str | os.PathLike[str] | None) -> None:
    if source is None:
        # byte-level BPE with no merges: token i is byte i, spelled as GPT-2 spells bytes; ids above 255 unused
        spelled = _byte_spellings()
        tokens = [spelled[i] if i < 256 else f"<unused{i}>" for i in range(vocab_size)]
        types = [int(gguf.TokenType.NORMAL) if i < 256 else int(gguf.TokenType.UNUSED) for i in range(vocab_size)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        # the format wants a merge: bytes 0xC0 and 0xC1, which never occur in UTF-8 text, so it never applies
        writer.add_token_merges([f"{spelled[0xC0]} {spelled[0xC1]}"])
        writer.add_add_bos_token(False)
        return
    reader = gguf.GGUFReader(str(source))
    copied = 0
    for key, found in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = found.types[0]
        sub = found.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, found.contents(), kind, sub_type=sub)
        copied += 1
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if not copied or tokens is None:
        raise GgufWriteError(f"{source} holds no tokenizer (no tokenizer.* fields) to copy")
    if len(tokens.data) != vocab_size:
        raise GgufWriteError(
            f"the tokenizer in {source} has {len(tokens.data)} tokens, the model {vocab_size}: copy it from the "
            "file this model was loaded from"
        )


def _byte_spellings() -> list[str]:
    """The character byte-level BPE spells each byte with: a printable byte as itself, the others
    (controls, space, the non-breaking range) as characters from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]
