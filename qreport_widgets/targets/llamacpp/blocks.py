"""llama.cpp's block formats: a weight's values and scales laid out as GGUF stores them.

Every quantized format cuts a row into blocks of 32 inputs, each block one scale (fp16) and its
values packed:

- ``Q4_0``: 2 bytes of scale ``d``, 16 bytes of 4-bit codes ``c`` (0..15, the block's first 16 inputs
  in the low nibbles, the last 16 in the high ones); the weight is ``d * (c - 8)``: symmetric int4.
- ``Q4_1``: ``d`` and a minimum ``m`` (fp16 each), 16 bytes of codes; the weight is ``d * c + m``.
- ``Q8_0``: ``d`` and 32 int8 values; the weight is ``d * v``.
- ``F16`` / ``F32``: the weights themselves.

The eager engine's int4 and int8 tensors (torchao's ``IntxUnpackedToInt8Tensor``: int values, a
scale and a zero point per group of inputs) are written as they are: their integer values exactly,
a group of 64 or 128 inputs as 2 or 4 blocks sharing its scale, each scale rounded to fp16 (exact
where the scale was chosen on fp16's grid; ``Packed.scales_exact`` says whether it was).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy
import torch

from ...errors import QReportError

BLOCK = 32  # inputs per block, every format here


class GgufFormat(str, Enum):
    """The GGUF tensor formats this target writes (llama.cpp's ``ggml_type`` names)."""

    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q8_0 = "Q8_0"
    F16 = "F16"
    F32 = "F32"

    @property
    def bytes_per_block(self) -> int:
        """Bytes a block of 32 inputs takes."""
        return {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "F16": 64, "F32": 128}[self.value]


class GgufFormatError(QReportError, ValueError):
    """A weight that no GGUF format this target writes holds as it is."""


@dataclass(frozen=True)
class Packed:
    """One tensor in a GGUF format: ``data`` as the file stores it (``uint8`` rows for the block
    formats, rows x inputs otherwise) and whether its scales were already on fp16's grid."""

    format: GgufFormat
    data: numpy.ndarray
    scales_exact: bool = True


def _fp16(scale: torch.Tensor) -> tuple[numpy.ndarray, bool]:
    """``scale`` (float) as fp16, and whether rounding changed none of them."""
    as_float = scale.detach().to(torch.float32).cpu()
    half = as_float.to(torch.float16)
    return half.numpy(), bool(torch.equal(half.to(torch.float32), as_float))


def _blocks_of(per_group: torch.Tensor, inputs: int) -> torch.Tensor:
    """A per-group tensor (rows x groups) repeated to one entry per block of 32 inputs."""
    groups = per_group.shape[1]
    if inputs % groups or (inputs // groups) % BLOCK:
        raise GgufFormatError(
            f"a group of {inputs // max(groups, 1)} inputs is not a whole number of llama.cpp's blocks of {BLOCK}"
        )
    return per_group.repeat_interleave(inputs // groups // BLOCK, dim=1)


def q4_0(values: torch.Tensor, scales: torch.Tensor) -> Packed:
    """Symmetric int4 ``values`` (rows x inputs, in [-8, 7]) and per-group ``scales`` as ``Q4_0``."""
    rows, inputs = values.shape
    d, exact = _fp16(_blocks_of(scales, inputs))
    codes = (values.to(torch.int16) + 8).to(torch.uint8).reshape(rows, inputs // BLOCK, BLOCK).numpy()
    nibbles = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    block = numpy.concatenate([d.reshape(rows, -1, 1).view(numpy.uint8), nibbles], axis=-1)
    return Packed(GgufFormat.Q4_0, block.reshape(rows, -1), exact)


def q4_1(codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> Packed:
    """Unsigned 4-bit ``codes`` (rows x inputs, in [0, 15]), per-group ``scales`` and ``minimums``
    (the weight is ``scale * code + minimum``) as ``Q4_1``."""
    rows, inputs = codes.shape
    d, exact_d = _fp16(_blocks_of(scales, inputs))
    m, exact_m = _fp16(_blocks_of(minimums, inputs))
    packed = codes.to(torch.uint8).reshape(rows, inputs // BLOCK, BLOCK).numpy()
    nibbles = packed[..., : BLOCK // 2] | (packed[..., BLOCK // 2 :] << 4)
    as_bytes = [d.reshape(rows, -1, 1).view(numpy.uint8), m.reshape(rows, -1, 1).view(numpy.uint8), nibbles]
    return Packed(GgufFormat.Q4_1, numpy.concatenate(as_bytes, axis=-1).reshape(rows, -1), exact_d and exact_m)


def q8_0(values: torch.Tensor, scales: torch.Tensor) -> Packed:
    """Symmetric int8 ``values`` (rows x inputs) and per-group ``scales`` (one column: per row) as ``Q8_0``."""
    rows, inputs = values.shape
    d, exact = _fp16(_blocks_of(scales, inputs))
    ints = values.to(torch.int8).reshape(rows, inputs // BLOCK, BLOCK).numpy().view(numpy.uint8)
    block = numpy.concatenate([d.reshape(rows, -1, 1).view(numpy.uint8), ints], axis=-1)
    return Packed(GgufFormat.Q8_0, block.reshape(rows, -1), exact)


def rounded_to_nearest(weight: torch.Tensor, format: GgufFormat) -> Packed:
    """``weight`` (rows x inputs, float) in ``format`` by round to nearest on each block. ``Q4_0``
    on the full range, as llama.cpp's own rule: the block's extreme weight lands on -8 (its scale
    negative where that weight is positive), so all 16 values span the block; ``Q8_0`` its largest
    magnitude over 127; ``Q4_1`` its range over 15 from its minimum. Each scale is rounded to fp16
    before the values are chosen on it (llama.cpp chooses them on the unrounded scale)."""
    weight = weight.detach().to(torch.float32).cpu()
    rows, inputs = weight.shape
    if format in (GgufFormat.F16, GgufFormat.F32):
        return float_tensor(weight, format)
    if inputs % BLOCK:
        raise GgufFormatError(f"{inputs} inputs are not a whole number of llama.cpp's blocks of {BLOCK}: keep it F16")
    blocks = weight.reshape(rows, inputs // BLOCK, BLOCK)
    if format is GgufFormat.Q4_1:
        low, high = blocks.amin(-1), blocks.amax(-1)
        scale = ((high - low) / 15).to(torch.float16).to(torch.float32)
        low = low.to(torch.float16).to(torch.float32)
        codes = ((blocks - low[..., None]) / _nonzero(scale)[..., None]).round().clamp(0, 15)
        return q4_1(codes.reshape(rows, inputs), scale, low)
    if format is GgufFormat.Q4_0:
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)
        scale, low_value, high_value = extreme / -8, -8, 7
    else:
        scale, low_value, high_value = blocks.abs().amax(-1) / 127, -127, 127
    scale = scale.to(torch.float16).to(torch.float32)
    values = (blocks / _nonzero(scale)[..., None]).round().clamp(low_value, high_value).reshape(rows, inputs)
    return (q4_0 if format is GgufFormat.Q4_0 else q8_0)(values, scale)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with its zeros (an all-zero block) replaced by 1: its values are 0 either way."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def float_tensor(weight: torch.Tensor, format: GgufFormat) -> Packed:
    """``weight`` as ``F16`` or ``F32``."""
    dtype = numpy.float16 if format is GgufFormat.F16 else numpy.float32
    return Packed(format, weight.detach().to(torch.float32).cpu().numpy().astype(dtype))


def packed_weight(weight: torch.Tensor, float_format: GgufFormat = GgufFormat.F16) -> Packed:
    """A module's weight as llama.cpp stores it: a torchao int4 / int8 tensor in the block format
    that holds its values exactly (symmetric int4 ``Q4_0``, asymmetric int4 ``Q4_1``, int8
    ``Q8_0``); a float weight in ``float_format``."""
    if not _is_quantized(weight):
        return float_tensor(weight, float_format)
    values, scale, zero = (getattr(weight, name).detach().cpu() for name in ("qdata", "scale", "zero_point"))
    rows, inputs = values.shape
    group = int(weight.block_size[-1])
    if int(weight.block_size[0]) != 1 or group % BLOCK:
        raise GgufFormatError(
            f"a weight quantized in groups of {tuple(weight.block_size)} has no llama.cpp format: llama.cpp's "
            f"blocks are {BLOCK} inputs of one row; use a group size of 32, 64 or 128 (Q4_0 / Q8_0)"
        )
    scale = scale.reshape(rows, inputs // group).to(torch.float32)
    zero = zero.reshape(rows, inputs // group).to(torch.float32)
    low, high = int(values.min()), int(values.max())
    if weight.target_dtype == torch.int4 or (low >= -8 and high <= 7 and weight.target_dtype != torch.int8):
        if bool((zero == 0).all()):
            return q4_0(values, scale)
        # (value - zero) * scale = scale * (value + 8) - (zero + 8) * scale
        return q4_1((values.to(torch.int16) + 8).to(torch.uint8), scale, -(zero + 8) * scale)
    if weight.target_dtype == torch.int8 and bool((zero == 0).all()):
        return q8_0(values, scale)
    raise GgufFormatError(
        f"a {weight.target_dtype} weight with zero points has no llama.cpp format that holds it exactly: use "
        "symmetric int8 (Q8_0) or int4 (Q4_0 / Q4_1)"
    )


def _is_quantized(weight: torch.Tensor) -> bool:
    return all(hasattr(weight, name) for name in ("qdata", "scale", "zero_point", "block_size", "target_dtype"))
