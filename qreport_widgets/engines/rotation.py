"""Rotations folded into a decoder's weights: the float model computes the same function, while its
weights and the activations its Linears read lose their outlier channels (QuaRot, SpinQuant).

- **R1**, the residual stream: every norm's scale (``w``, or Gemma's ``1 + w``) folded into the
  Linears that read it, then the stream rotated by an orthogonal ``Q`` (a Hadamard matrix with random
  signs): the embedding's rows and every Linear that writes the stream (``o_proj``, ``down_proj``)
  produce ``h Q``, every Linear that reads it (``q/k/v_proj``, ``gate/up_proj``, the head) takes
  ``Q`` back in its weight. An RMS norm with unit scale commutes with ``Q``, so nothing between them
  changes. A head tied to the embedding unties: the final norm's scale folds into the head alone.
  Where a block's output passes a norm before the residual add (Gemma 2 / 3's sandwich norms, OLMo
  2's post-norms), that norm's output is turned by ``Q`` as the model runs (a forward hook reading
  ``Q``'s two Kronecker factors and signs, ``ONLINE_ROTATION``, buffers shared by every hook) and the
  writers keep their weights; a tied head then stays tied, the embedding's output turned and the
  final norm's input turned back.
- **R2**, each head's values: ``v_proj`` produces every head's values times ``R`` (head size),
  ``o_proj`` takes ``R`` back in that head's columns; attention mixes values linearly, so its
  output carries the same ``R``.
- **R4**, ``down_proj``'s input (off by default): a normalised Hadamard matrix ``H`` applied to the
  input as the model runs (a forward pre-hook multiplying by a buffer, ``ONLINE_HADAMARD``) and
  taken back in the weight (``W H``). It is computed, not folded: a matrix product per token, which an
  exported program carries too.

R1 is written for the layouts of ``LAYOUTS``: Llama's (Mistral, Qwen2, SmolLM, StableLM and their
kin, Phi-3's fused projections, Qwen3-MoE's router and 3-d experts), Phi's parallel blocks,
GPT-NeoX's, LFM2's (convolution blocks too), OPT's and GPT-2's (``Conv1D``: ``TransposedLinear``),
Gemma's and OLMo 2's (norms on the blocks' outputs): RMS norms or LayerNorms (made RMS norms on a
centred stream). R2 is written for any block whose attention has value and output projections
(``v_proj``, or the value rows of a fused ``qkv_proj`` / ``c_attn`` or of each head in GPT-NeoX's
interleaved ``query_key_value``, and ``o_proj`` / ``out_proj`` / ``dense`` / ``c_proj``).
``rotation_problems`` says why a model does not take one (LayerNorms mixed with RMS norms, a norm
on a block's output where its layout does not say so, a layout it does not know);
``rotate(..., example_inputs)`` checks the result by the outputs themselves (``check``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.calibration import call_with
from ..core.experts import ExpertLinears
from ..core.linears import is_transposed_linear
from ..core.metrics import FLOAT_ROUNDOFF_DB, is_float_output, output_tensor, sqnr_db
from ..errors import InvalidSettingsError

ONLINE_HADAMARD = "online_hadamard"  # the buffer R4's pre-hook multiplies down_proj's input by
# the buffers R1's hooks turn a norm's output (or the embedding's) by: Q = kron(left, right) * signs (``_rotation_parts``)
ONLINE_ROTATION = ("online_rotation_left", "online_rotation_right", "online_rotation_signs")
_PALEY_12 = 11  # a prime q = 3 mod 4 gives a Hadamard matrix of order q + 1 (Paley's first construction)
_PALEY_20 = 19


@dataclass(frozen=True)
class Rotation:
    """Which rotations to fold in: ``residual`` (R1), ``values`` (R2), ``down`` (R4, computed as the
    model runs), the random ones drawn from ``seed``."""

    residual: bool = True
    values: bool = True
    seed: int = 0
    down: bool = False

    @property
    def words(self) -> str:
        named = (
            ("R1 (residual stream)", self.residual),
            ("R2 (values per head)", self.values),
            ("R4 (down_proj's input, online)", self.down),
        )
        return " + ".join(name for name, on in named if on) or "none"


def hadamard(n: int) -> torch.Tensor | None:
    """A Hadamard matrix of order ``n`` (entries +-1, rows orthogonal) in float64, built as a
    Kronecker product of Sylvester's order 2 and Paley's orders 12 and 20; None for an order that is
    not 2^a 12^b 20^c (576 = 4 x 12 x 12 is; 1,000 is not)."""
    factors = _hadamard_factors(n)
    return None if factors is None else _kron(factors)


def _hadamard_factors(n: int) -> list[torch.Tensor] | None:
    """The Kronecker factors of ``hadamard(n)`` in order: Paley's of orders 20 and 12, then
    Sylvester's order 2 as often as it takes; None where ``n`` is not 2^a 12^b 20^c."""
    factors: list[torch.Tensor] = []
    rest = n
    for prime in (_PALEY_20, _PALEY_12):  # 5 and 3 divide n only through these orders
        while rest > 0 and rest % (prime + 1) == 0:
            factors.append(_paley(prime))
            rest //= prime + 1
    if not _power_of_two(rest):
        return None
    two = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return factors + [two] * (rest.bit_length() - 1)


def _kron(factors: list[torch.Tensor]) -> torch.Tensor:
    result = torch.ones(1, 1, dtype=torch.float64)
    for factor in factors:
        result = torch.kron(result, factor)
    return result


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _paley(q: int) -> torch.Tensor:
    """Paley's Hadamard matrix of order q + 1 for a prime q = 3 mod 4."""
    residues = {(i * i) % q for i in range(1, q)}
    jacobsthal = torch.tensor(
        [[0.0 if i == j else (1.0 if (j - i) % q in residues else -1.0) for j in range(q)] for i in range(q)], dtype=torch.float64
    )
    skew = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    skew[0, 1:], skew[1:, 0], skew[1:, 1:] = 1.0, -1.0, jacobsthal
    return skew + torch.eye(q + 1, dtype=torch.float64)


def random_rotation(n: int, generator: torch.Generator) -> torch.Tensor:
    """An orthogonal n x n matrix in float64: a Hadamard matrix with random column signs, scaled by
    1 / sqrt(n) (QuaRot's), or where no Hadamard matrix of that order is built here, the Q of a
    Gaussian matrix's QR decomposition (SpinQuant's starting point)."""
    left, right, signs = _rotation_parts(n, generator)
    return torch.kron(left, right) * signs


def _rotation_parts(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``random_rotation(n, generator)`` as ``kron(left, right) * signs``: the Hadamard matrix's
    Kronecker factors split in two where the two orders add up least (640 = 20 x 32: a product with
    it costs 640 x (20 + 32) multiply-adds a token instead of 640 x 640), the signs scaled by
    1 / sqrt(n); a random orthogonal matrix, 1 and ones where there is no Hadamard matrix of that order."""
    factors = _hadamard_factors(n)
    if factors is None:
        q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
        return q * torch.sign(torch.diagonal(r)), torch.ones(1, 1, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    left, right = _halves(factors)
    return _kron(left), _kron(right), signs / math.sqrt(n)


def _halves(factors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The Kronecker factors cut in two where the two orders add up least."""
    orders = [int(f.shape[0]) for f in factors]
    split = min(range(len(factors) + 1), key=lambda t: math.prod(orders[:t]) + math.prod(orders[t:]))
    return factors[:split], factors[split:]


def turned_online(model: nn.Module, rotation: Rotation) -> bool:
    """Whether R1 of ``rotation`` turns ``model``'s stream as it runs: a layout with norms on its
    blocks' outputs (Gemma 2 / 3, OLMo 2), a product a token after each such norm."""
    if not rotation.residual:
        return False
    try:
        return bool(_decoder(model).post_norms)
    except InvalidSettingsError:
        return False


def online_problem(engine: Any, model: nn.Module, rotation: Rotation) -> str:
    """Why ``engine``'s runs cannot carry the products ``rotation`` computes on ``model`` as it runs
    (R4's on ``down_proj``'s input: ``engine.online_transform_problem()``; R1's after the norms on a
    block's output: ``engine.online_rotation_problem()``), said with what to ask instead; "" where they can."""
    down, residual = engine.online_transform_problem(), engine.online_rotation_problem()
    if rotation.down and down:
        return f"R4 (Rotation(down=True)) cannot be measured here: {down}"
    if residual and turned_online(model, rotation):
        return (
            "R1 on this model turns the stream after each norm on a block's output as the model runs, which cannot be "
            f"measured here: {residual}"
        )
    return ""


def matrix_words(model: nn.Module, rotation: Rotation) -> str:
    """Which matrix each rotation of ``rotation`` takes on ``model`` (its orders), and what an order
    without a Hadamard matrix here costs: folded rotations nothing at run time, R4's product a dense
    ``n x n`` one a token per block (a Hadamard one could run as a fast transform)."""
    sizes = {  # each read only where that rotation is asked: R2 alone needs no Llama layout
        "R1": (rotation.residual, lambda: _decoder(model).embedding.weight.shape[1]),
        "R2": (rotation.values, lambda: _value_projections(model)[0].head_dim),
        "R4": (rotation.down, lambda: _decoder(model).writers[0][-1].weight.shape[1]),
    }
    said = []
    for name, (asked, size_of) in sizes.items():
        if not asked:
            continue
        n = int(size_of())
        if hadamard(n) is not None:
            said.append(f"{name}: a Hadamard matrix of order {n} with random signs")
        elif name == "R4":
            said.append(
                f"{name}: no Hadamard matrix of order {n} is built here (not 2^a 12^b 20^c): a random orthogonal one, "
                f"its product {n * n:,} multiply-adds a token in each block (dense, as a Hadamard one runs here too)"
            )
        else:
            said.append(f"{name}: no Hadamard matrix of order {n} here: a random orthogonal one (folded: no cost at run time)")
        if name == "R1" and turned_online(model, rotation):
            said[-1] += f", {_online_words(_decoder(model), n)}"
    return "; ".join(said)


def _online_words(decoder: _Decoder, n: int) -> str:
    """What R1 computes as the model runs on a decoder with norms on its blocks' outputs."""
    tied = decoder.head.weight is decoder.embedding.weight
    count = len(decoder.post_norms) + (2 if tied else 0)
    where = f"the output of each of the {len(decoder.post_norms)} norms on a block's output"
    if tied:
        where += ", the embedding's output and the final norm's input (the head stays tied to the embedding)"
    factors = _hadamard_factors(n)
    if factors is None:
        each = f"{n:,} x {n:,} multiply-adds (a dense matrix: no Hadamard matrix of this order here)"
    else:
        left, right = (math.prod(int(f.shape[0]) for f in half) for half in _halves(factors))
        each = f"{n:,} x ({left} + {right}) multiply-adds (its Kronecker factors of orders {left} and {right})"
    return f"turned as the model runs at {where}: {count} products a token, each {each}"


class ExpertWeights:
    """A module's weight parameter (a router's ``weight``, experts' 3-d ``gate_up_proj`` or
    ``down_proj``) seen as a Linear's: the stream on its last axis where it reads it, on the one
    before where it writes it; no bias."""

    bias = None

    def __init__(self, owner: nn.Module, name: str) -> None:
        self.owner, self.name = owner, name

    @property
    def weight(self) -> torch.Tensor:
        return getattr(self.owner, self.name)


class TransposedLinear:
    """transformers' ``Conv1D`` (GPT-2's projections: ``x @ weight + bias``, the weight stored
    ``(inputs, outputs)``) seen as the Linear it computes: ``weight`` is the transposed view of the
    module's own, so what is written into it lands in the module."""

    def __init__(self, owner: nn.Module) -> None:
        self.owner = owner

    @property
    def weight(self) -> torch.Tensor:
        return self.owner.weight.t()

    @property
    def bias(self) -> torch.Tensor | None:
        return self.owner.bias


_Stream = nn.Linear | ExpertWeights | TransposedLinear  # what reads or writes the residual stream


@dataclass
class _NormRead:
    """A norm that reads the residual stream (``owner.name``, at ``path``) and the Linears that read
    its output; ``name`` None: Linears that read the stream as it is (OLMo 2's attention and MLP)."""

    owner: nn.Module
    name: str | None
    path: str
    readers: list[_Stream]

    @property
    def norm(self) -> nn.Module | None:
        return getattr(self.owner, self.name) if self.name is not None else None

    def replace(self, module: nn.Module) -> None:
        setattr(self.owner, self.name, module)


@dataclass
class _Decoder:
    layout: str
    embeddings: list[nn.Embedding]  # what writes the stream first: the tokens' (a head may be tied to it), positions'
    layers: list[nn.Module]
    head: nn.Linear
    norms: list[_NormRead]  # each block's in order, the final norm last
    writers: list[list[_Stream]]  # each block's Linears (or experts) that write the stream, the MLP's last
    post_norms: list[_NormRead]  # norms on each block's output before the residual add (no Linear reads them)

    @property
    def embedding(self) -> nn.Embedding:
        return self.embeddings[0]


@dataclass(frozen=True)
class _Layout:
    """Where a decoder family keeps what R1 folds into: its blocks, the embeddings that start the
    stream, the final norm, each block's norms with the Linears that read them (alternatives, the
    first a block has all of; a norm None: they read the stream as it is), the Linears that write the
    stream (paths inside a block), and the norms on a block's output before the residual add."""

    name: str
    blocks: str
    embeddings: tuple[str, ...]
    final_norm: str
    norms: tuple[tuple[str | None, tuple[tuple[str, ...], ...]], ...]
    writers: tuple[tuple[str, ...], ...]  # each writer's paths, the first a block has
    absent: tuple[str, ...] = ()  # modules that change the stream's width where they exist
    post_norms: tuple[str, ...] = ()  # where present, R1 turns their outputs as the model runs (``_rotate_residual``)


_QKV = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",))
_GATE_UP = (("mlp.gate_proj", "mlp.up_proj"),)
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
LAYOUTS = (
    _Layout(  # Gemma 2, Gemma 3: sandwich norms, each a `1 + w` RMS norm (tried before Llama's, whose names it shares)
        "Gemma",
        "model.layers",
        ("model.embed_tokens",),
        "model.norm",
        (("input_layernorm", _QKV[:1]), ("pre_feedforward_layernorm", _GATE_UP)),
        (("self_attn.o_proj",), ("mlp.down_proj",)),
        post_norms=_POST_NORMS,
    ),
    _Layout(  # OLMo 2: attention and MLP read the stream as it is, a norm follows each
        "OLMo 2",
        "model.layers",
        ("model.embed_tokens",),
        "model.norm",
        ((None, _QKV[:1]), (None, _GATE_UP)),
        (("self_attn.o_proj",), ("mlp.down_proj",)),
        post_norms=_POST_NORMS,
    ),
    _Layout(  # Llama, Mistral, Qwen, Granite, SmolLM, StableLM; Phi-3's fused projections
        "Llama",
        "model.layers",
        ("model.embed_tokens",),
        "model.norm",
        (
            ("input_layernorm", _QKV),
            (
                "post_attention_layernorm",
                (("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",), ("mlp.gate.weight", "mlp.experts.gate_up_proj")),
            ),
        ),
        (("self_attn.o_proj",), ("mlp.down_proj", "mlp.experts.down_proj")),  # Qwen3-MoE: a router and 3-d experts
    ),
    _Layout(  # Phi: attention and MLP read one norm in parallel
        "Phi",
        "model.layers",
        ("model.embed_tokens",),
        "model.final_layernorm",
        (("input_layernorm", (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"),)),),
        (("self_attn.dense",), ("mlp.fc2",)),
    ),
    _Layout(  # GPT-NeoX (Pythia): a norm each for attention and MLP, in parallel or not
        "GPT-NeoX",
        "gpt_neox.layers",
        ("gpt_neox.embed_in",),
        "gpt_neox.final_layer_norm",
        (("input_layernorm", (("attention.query_key_value",),)), ("post_attention_layernorm", (("mlp.dense_h_to_4h",),))),
        (("attention.dense",), ("mlp.dense_4h_to_h",)),
    ),
    _Layout(  # LFM2: short convolutions or attention between the stream's Linears, block by block
        "LFM2",
        "model.layers",
        ("model.embed_tokens",),
        "model.embedding_norm",
        (("operator_norm", (_QKV[0], ("conv.in_proj",))), ("ffn_norm", (("feed_forward.w1", "feed_forward.w3"),))),
        (("self_attn.out_proj", "conv.out_proj"), ("feed_forward.w2",)),
    ),
    _Layout(  # GPT-2: LayerNorms, learned positions, Conv1D projections (TransposedLinear)
        "GPT-2",
        "transformer.h",
        ("transformer.wte", "transformer.wpe"),
        "transformer.ln_f",
        (("ln_1", (("attn.c_attn",),)), ("ln_2", (("mlp.c_fc",),))),
        (("attn.c_proj",), ("mlp.c_proj",)),
    ),
    _Layout(  # OPT: learned positions add to the stream
        "OPT",
        "model.decoder.layers",
        ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
        "model.decoder.final_layer_norm",
        (("self_attn_layer_norm", _QKV[:1]), ("final_layer_norm", (("fc1",),))),
        (("self_attn.out_proj",), ("fc2",)),
        absent=("model.decoder.project_in", "model.decoder.project_out"),
    ),
)


def rotation_problems(model: nn.Module) -> dict[str, str]:
    """Which rotations cannot be folded into ``model``, each with why (empty: R1 and R2 both apply).
    R1 needs the Llama layout (pre-norm blocks, RMS norms with a scale alone); R2 only each block's
    value and output projections. ``rotate(..., example_inputs)`` checks the result itself."""
    problems: dict[str, str] = {}
    try:
        decoder = _decoder(model)
    except InvalidSettingsError as error:
        problems["R1"] = str(error)
    else:
        found = _residual_problem(decoder)
        if found:
            problems["R1"] = found
    try:
        _value_projections(model)
    except InvalidSettingsError as error:
        problems["R2"] = str(error)
    return problems


def _residual_problem(decoder: _Decoder) -> str:
    for index, layer in enumerate(decoder.layers):
        extra = [name for name, child in layer.named_children() if _is_norm(child)]
        known = {read.name for read in decoder.norms + decoder.post_norms if read.owner is layer}
        extra = [name for name in extra if name not in known]
        if extra:
            return (
                f"block {index} has a norm on a block's output before the residual add ({', '.join(extra)}): the stream "
                "it writes is normalised, which a rotation of the stream does not commute with"
            )
    norms = _norms(decoder)
    for norm_name, norm in norms:
        if _rms_scale(norm) is None and not _is_layer_norm(norm):
            return (
                f"{norm_name} ({type(norm).__name__}) is neither an RMS norm with a scale alone (w or 1 + w) nor a "
                "LayerNorm with a scale and bias: the rotation of the stream does not commute with what it computes"
            )
    layer_norms = [name for name, norm in norms if _is_layer_norm(norm)]
    if layer_norms and len(layer_norms) < len(norms):  # centring the stream for the LayerNorms would move the RMS norms
        return (
            f"the stream's norms mix LayerNorms ({', '.join(layer_norms[:2])}{', ...' if len(layer_norms) > 2 else ''}) "
            "and RMS norms: a LayerNorm becomes an RMS norm only on a stream centred for every norm that reads it"
        )
    return ""


def rotate(model: nn.Module, rotation: Rotation = Rotation(), example_inputs: Any = None) -> nn.Module:
    """A copy of ``model`` with ``rotation`` folded into its weights (``model`` is not changed): the
    same logits to float round-off. InvalidSettingsError naming why for a model it does not apply to.
    It checks itself (``check``): the rotated copy's output against the model's on ``example_inputs``
    (a batch, or a tuple of the model's arguments) and on token ids drawn in its embedding's range.
    A rotation that leaves a product computed as the model runs (``turned_online``) makes a model
    whose state dict is refused (``online_state_refused``): a checkpoint would not hold it."""
    rotated = _rotated(model, rotation)
    check(model, rotated, rotation, example_inputs)
    return rotated


def _rotated(model: nn.Module, rotation: Rotation) -> nn.Module:
    """``rotate`` without its check."""
    problems = rotation_problems(model)
    wanted = {"R1": rotation.residual, "R2": rotation.values}
    refused = {name: why for name, why in problems.items() if wanted[name]}
    if refused:
        raise InvalidSettingsError("; ".join(f"{name} does not apply: {why}" for name, why in refused.items()))
    rotated = copy.deepcopy(model)
    decoder = _decoder(rotated) if rotation.residual or rotation.down else None
    generator = torch.Generator().manual_seed(rotation.seed)
    with torch.no_grad():
        if rotation.residual:
            # a layout already turning its stream as it runs keeps a tied head tied (Gemma's: 262k rows)
            tied = bool(decoder.post_norms) and decoder.head.weight is decoder.embedding.weight
            if not tied:
                _untie_head(rotated, decoder)
            _layer_norms_as_rms(decoder)
            _fold_norms(decoder, final=not tied)
            _rotate_residual(decoder, _rotation_parts(decoder.embedding.weight.shape[1], generator), tied)
        if rotation.values:
            values = _value_projections(rotated)
            _rotate_values(values, random_rotation(values[0].head_dim, generator))
        if rotation.down:
            if any(isinstance(written[-1], ExpertWeights) for written in decoder.writers):
                raise InvalidSettingsError(
                    "R4 multiplies the input of each MLP's output projection as the model runs, and this model's experts "
                    "keep theirs in one 3-d parameter (no one projection an expert to multiply): a session's copy holds "
                    "each expert as a Linear and takes R4 (session.apply(..., rotation=Rotation(down=True))), or "
                    "Rotation(down=False)"
                )
            _rotate_down(decoder, generator)
    for module in rotated.modules():
        if any(name in module._buffers for name in (ONLINE_HADAMARD, *ONLINE_ROTATION)):
            module.register_state_dict_post_hook(_online_state_refused)
    return rotated


# below the model's own round-off in its dtype by more than this, a low-precision model's rotated
# weights are refused: each weight is rounded again after the rotation, which cost 1 to 2.5 dB on the
# tiny model of every family of docs/ENGINES.md's table in bfloat16 and float16 (9.4 dB for Qwen3-MoE in
# float16, whose routing flips where a rounding moves a router's score)
LOW_PRECISION_MARGIN_DB = 12.0
_WIDE = (torch.float32, torch.float64)


def check(model: nn.Module, rotated: nn.Module, rotation: Rotation, example_inputs: Any = None) -> float:
    """The rotated model's output SQNR (dB) against ``model``'s, the least over ``example_inputs``
    and a batch of token ids drawn in the embedding's range (``_drawn_tokens``); InvalidSettingsError
    naming the model's family and the gap where it is below float round-off (``FLOAT_ROUNDOFF_DB``): a
    layout the folds do not commute with, whatever its modules are named. A model in a lower precision
    (bfloat16, float16) has that checked on a float32 copy rotated alike, then its own rotated output
    against the float32 model's: refused where its round-off is more than ``LOW_PRECISION_MARGIN_DB``
    below the unrotated model's own, naming both."""
    batches = [] if example_inputs is None else [example_inputs]
    drawn = _drawn_tokens(model)
    if drawn is not None:
        batches.append(drawn)
    if not batches:
        raise InvalidSettingsError(
            "rotate() checks the rotated model by its outputs and found no embedding to draw token ids for: pass "
            "example_inputs= (a batch the model takes)"
        )
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    wide, wide_rotated = (model, rotated) if dtype in _WIDE else (_widened(model), _rotated(_widened(model), rotation))
    found_db = min(_sqnr(wide, wide_rotated, batch) for batch in batches)
    if not is_float_output(found_db):
        family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise InvalidSettingsError(
            f"{rotation.words} changes what this {family} model computes: the rotated model's output is {found_db:.1f} dB "
            f"from the original's ({'in float32, ' if dtype not in _WIDE else ''}on the example input and drawn tokens), "
            f"where float round-off keeps {FLOAT_ROUNDOFF_DB:.0f} dB or more. Its layout does not commute with the "
            "rotations; quantize it unrotated"
        )
    if dtype in _WIDE:
        return found_db
    own = min(_sqnr(wide, model, batch) for batch in batches)
    found_db = min(_sqnr(wide, rotated, batch) for batch in batches)
    if found_db < own - LOW_PRECISION_MARGIN_DB:
        raise InvalidSettingsError(
            f"{rotation.words} commutes with this model's layout (checked in float32), but in {dtype} its rotated weights, "
            f"rounded again, put the output {found_db:.1f} dB from the float32 model's where the model's own {dtype} "
            f"round-off keeps {own:.1f} dB: rotate a float32 copy (model.float()) and quantize that"
        )
    return found_db


def _sqnr(reference: nn.Module, other: nn.Module, batch: Any) -> float:
    with torch.no_grad():
        expected, found = (output_tensor(call_with(m, batch)).float() for m in (reference, other))
    return sqnr_db(expected, found)


def _widened(model: nn.Module) -> nn.Module:
    """A float32 copy of ``model``."""
    return copy.deepcopy(model).float()


def _drawn_tokens(model: nn.Module) -> tuple[torch.Tensor] | None:
    """A batch of 16 token ids drawn (seeded) in the range of ``model``'s input embedding, where it has one."""
    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        return None
    ids = torch.randint(0, embedding.num_embeddings, (1, 16), generator=torch.Generator().manual_seed(0))
    return (ids.to(embedding.weight.device),)


def _online_state_refused(module: nn.Module, state: Any, prefix: str, metadata: Any) -> None:
    """A state-dict hook on a module a rotation turns as the model runs: its state dict is refused."""
    if _STATE_READ.get():
        return
    raise InvalidSettingsError(
        f"{prefix.rstrip('.') or 'this module'} computes a rotation as the model runs (a hook reading its buffers "
        f"{', '.join(n for n in (ONLINE_HADAMARD, *ONLINE_ROTATION) if n in module._buffers)}): a state dict or a "
        "checkpoint holds the weights and buffers, not the hook, so a model loaded from it would compute something "
        "else. Save the float model and rotate it again after loading (rotate(model, Rotation(seed=...)) gives this "
        "model), or use a rotation folded in whole (R1 and R2 on a Llama-layout model with an untied head, without R4)"
    )


_STATE_READ: contextvars.ContextVar[bool] = contextvars.ContextVar("rotated state read", default=False)


@contextlib.contextmanager
def state_read() -> Iterator[None]:
    """Within: a rotated model's state dict is read (to count its bytes), not refused."""
    token = _STATE_READ.set(True)
    try:
        yield
    finally:
        _STATE_READ.reset(token)


# ---- the layout ----------------------------------------------------------------------------------
def _module_at(root: nn.Module, path: str) -> nn.Module | None:
    found: Any = root
    for part in path.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found if isinstance(found, nn.Module) else None


def _decoder(model: nn.Module) -> _Decoder:
    """``model``'s stream in the first of ``LAYOUTS`` it fits; InvalidSettingsError naming what a
    block lacks for the layout whose blocks, embeddings and final norm it has, or that none fits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lacking = ""
    for layout in LAYOUTS:
        blocks = _module_at(model, layout.blocks)
        embeddings = [_module_at(model, path) for path in layout.embeddings]
        final_norm = _module_at(model, layout.final_norm)
        if not isinstance(blocks, nn.ModuleList) or not len(blocks) or final_norm is None or not isinstance(head, nn.Linear):
            continue
        if not all(isinstance(e, nn.Embedding) for e in embeddings) or any(_module_at(model, p) for p in layout.absent):
            continue
        found = _blocks_in(layout, list(blocks))
        if isinstance(found, str):
            lacking = lacking or found
            continue
        norms, writers, post_norms = found
        owner_path, _, name = layout.final_norm.rpartition(".")
        norms.append(_NormRead(_module_at(model, owner_path), name, layout.final_norm, [head]))
        return _Decoder(layout.name, embeddings, list(blocks), head, norms, writers, post_norms)
    if lacking:
        raise InvalidSettingsError(lacking)
    known = "; ".join(f"{layout.name}'s: {layout.blocks}, {layout.final_norm}" for layout in LAYOUTS)
    raise InvalidSettingsError(
        f"{type(model).__name__} is not a decoder in a layout the rotations are written for ({known}; an output embedding)"
    )


def _blocks_in(layout: _Layout, blocks: list[nn.Module]) -> tuple[list[_NormRead], list[list[_Stream]], list[_NormRead]] | str:
    """Each block's norms with their readers, its writers and its output norms in ``layout``; what
    the first block that does not fit lacks, said, where one does not."""
    norms, writers, post_norms = [], [], []
    for index, layer in enumerate(blocks):
        named = [name for name, _ in layout.norms if name is not None] + list(layout.post_norms)
        missing = [name for name in named if _module_at(layer, name) is None]
        read = [(name, _linears(layer, choices)) for name, choices in layout.norms]
        missing += [
            " / ".join(", ".join(c) for c in choices)
            for (_, choices), (_, r) in zip(layout.norms, read, strict=True)
            if r is None
        ]
        written = [next(filter(None, (_streams_at(layer, path) for path in paths)), None) for paths in layout.writers]
        missing += [" / ".join(paths) for paths, w in zip(layout.writers, written, strict=True) if w is None]
        if missing:
            return f"block {index} ({type(layer).__name__}) has no {'; no '.join(missing)}: not the {layout.name} layout"
        prefix = f"{layout.blocks}.{index}"
        norms.extend(_NormRead(layer, name, f"{prefix}.{name}" if name else prefix, linears) for name, linears in read)
        writers.append([w for each in written for w in each])  # type: ignore[union-attr]
        post_norms.extend(_NormRead(layer, name, f"{prefix}.{name}", []) for name in layout.post_norms)
    return norms, writers, post_norms


def _stream_at(owner: nn.Module, path: str) -> _Stream | None:
    """The Linear at ``path`` inside ``owner``, or the weight parameter there (``ExpertWeights``); None."""
    found = _module_at(owner, path)
    if isinstance(found, nn.Linear):
        return found
    if found is not None and is_transposed_linear(found):
        return TransposedLinear(found)
    parent, _, name = path.rpartition(".")
    holder = _module_at(owner, parent) if parent else owner
    weight = getattr(holder, name, None) if holder is not None else None
    return ExpertWeights(holder, name) if isinstance(weight, nn.Parameter) and weight.dim() >= 2 else None


def _linears(owner: nn.Module | None, layouts: tuple[tuple[str, ...], ...]) -> list[_Stream] | None:
    """What the first of ``layouts`` (paths inside ``owner``) names, where ``owner`` has all of it; None where it has none."""
    for paths in layouts:
        found = [_streams_at(owner, path) if owner is not None else None for path in paths]
        if all(found):
            return [stream for each in found for stream in each]  # type: ignore[union-attr]
    return None


def _streams_at(owner: nn.Module, path: str) -> list[_Stream] | None:
    """What reads or writes the stream at ``path``: one ``_stream_at``, or each expert's Linear where
    ``path`` is the ``gate_up_proj`` / ``down_proj`` of an ``ExpertLinears`` (the session's copy of
    3-d expert weights); None where there is nothing."""
    parent, _, name = path.rpartition(".")
    holder = _module_at(owner, parent) if parent else owner
    if isinstance(holder, ExpertLinears) and isinstance(getattr(holder, name, None), nn.ModuleList):
        return list(getattr(holder, name))
    found = _stream_at(owner, path)
    return [found] if found is not None else None


def _norms(decoder: _Decoder) -> list[tuple[str, nn.Module]]:
    """The norms that read the stream (a block whose Linears read it as it is has none), by path."""
    return [(read.path, read.norm) for read in decoder.norms if read.norm is not None]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm)


def _is_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm(x)`` is its scale times ``x / rms(x)``, checked on a probe with the scale as it is."""
    return _scaled_rms(norm, offset=0.0)


def _rms_scale(norm: nn.Module) -> tuple[torch.Tensor, float] | None:
    """What an RMS norm multiplies ``x / rms(x)`` by, and the weight that makes that 1: its weight
    and 1 (Llama's), or ``1 + weight`` and 0 (Gemma's); None for any other norm."""
    if _is_rms_norm(norm):
        return norm.weight.detach().double(), 1.0
    if _scaled_rms(norm, offset=1.0):
        return 1.0 + norm.weight.detach().double(), 0.0
    return None


def _scaled_rms(norm: nn.Module, offset: float) -> bool:
    """Whether ``norm(x)`` is ``(offset + weight) * x / rms(x)``, on a probe with the weight as it is."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        return False
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(3, weight.shape[0], generator=generator, dtype=torch.float32, device="cpu").to(weight.device) * 3 + 1
    with torch.no_grad():
        found = norm(probe)
    expected = (offset + weight) * probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + _eps(norm))
    return bool(torch.allclose(found.float(), expected.float(), rtol=1e-4, atol=1e-5))


def _is_layer_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is torch's LayerNorm over the last dimension with a scale (a bias or none)."""
    return (
        isinstance(norm, nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and isinstance(norm.weight, torch.Tensor)
        and norm.weight.dim() == 1
    )


class UnitRMSNorm(nn.Module):
    """``x / rms(x)``, what a LayerNorm computes on a stream whose mean is 0 once its scale and bias
    are folded into the Linears that read it (``_layer_norms_as_rms``); its scale stays 1."""

    def __init__(self, width: int, eps: float, like: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width, dtype=like.dtype, device=like.device))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * scaled.to(x.dtype)


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)) or 1e-6)


# ---- the folds -----------------------------------------------------------------------------------
def _untie_head(model: nn.Module, decoder: _Decoder) -> None:
    if decoder.head.weight is decoder.embedding.weight:
        decoder.head.weight = nn.Parameter(decoder.head.weight.detach().clone())
        old = getattr(model, "config", None)
        if old is not None and getattr(old, "tie_word_embeddings", False):
            config = copy.deepcopy(old)
            config.tie_word_embeddings = False  # a later tie_weights() must not undo the rotation
            for module in model.modules():  # every module that shared the config (the inner model's too)
                if getattr(module, "config", None) is old:
                    module.config = config


def _layer_norms_as_rms(decoder: _Decoder) -> None:
    """Where the stream's norms are LayerNorms (StableLM, Phi, GPT-NeoX, OPT), as QuaRot does: every
    row of the embeddings and every Linear that writes the stream centred (its outputs' mean over the
    stream's width taken out: ``W -> C W``, ``b -> C b``, ``C = I - 1 1^T / n``), so the stream's mean
    is 0 wherever a norm reads it and each LayerNorm is ``x / rms(x)`` times its scale plus its bias;
    the bias is folded into the biases of the Linears that read it (``b' = b_r + W_r b``, made where
    they had none), the scale left for ``_fold_norms``, the norm replaced by a ``UnitRMSNorm``."""
    if not all(_is_layer_norm(read.norm) for read in decoder.norms):  # RMS norms (a mix is refused: _residual_problem)
        return

    def centred(linear: _Stream) -> None:  # the stream on the weight's next to last axis
        weight = linear.weight.double()
        linear.weight.copy_((weight - weight.mean(-2, keepdim=True)).to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_((linear.bias.double() - linear.bias.double().mean()).to(linear.bias.dtype))

    for embedding in decoder.embeddings:
        rows = embedding.weight
        rows.copy_((rows.double() - rows.double().mean(1, keepdim=True)).to(rows.dtype))
    for written in decoder.writers:
        for linear in written:
            centred(linear)
    for read in decoder.norms:
        norm = read.norm
        bias = norm.bias.detach().double() if norm.bias is not None else None
        if bias is not None and bool(bias.any()):
            if any(linear.bias is None and not isinstance(linear, nn.Linear) for linear in read.readers):
                raise InvalidSettingsError(f"{read.path}'s bias cannot fold into readers that have no bias: R1 does not apply")
            for linear in read.readers:
                added = linear.weight.double() @ bias.to(linear.weight.device)
                if linear.bias is None:
                    linear.bias = nn.Parameter(added.to(linear.weight.dtype), requires_grad=linear.weight.requires_grad)
                else:
                    linear.bias.copy_((linear.bias.double() + added).to(linear.bias.dtype))
        replacement = UnitRMSNorm(norm.weight.shape[0], float(norm.eps), norm.weight)
        replacement.weight.copy_(norm.weight.detach())  # folded into the readers next, as an RMS norm's scale
        read.replace(replacement)


def _fold_norms(decoder: _Decoder, final: bool = True) -> None:
    """Each norm's scale (``w``, or Gemma's ``1 + w``) into the Linears that read its output; the
    norm then multiplies by 1. ``final=False``: the final norm left as it is (a tied head reads it)."""
    for read in decoder.norms:
        norm = read.norm
        if norm is None or (not final and read.owner not in decoder.layers):
            continue
        scale, unit = _rms_scale(norm) or (norm.weight.detach().double(), 1.0)  # a LayerNorm made a UnitRMSNorm
        for linear in read.readers:
            linear.weight.copy_((linear.weight.double() * scale.to(linear.weight.device)[None, :]).to(linear.weight.dtype))
        norm.weight.fill_(unit)


def _rotate_residual(decoder: _Decoder, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tied: bool = False) -> None:
    """The stream turned by ``Q = kron(left, right) * signs`` (``parts``): what writes it writes
    ``h Q``, what reads it takes ``Q`` back. A block whose output passes a norm before the residual
    add (``post_norms``) keeps its writers; that norm's output is turned as the model runs (``_turned``:
    a product by each Kronecker factor, ``n x (left + right)`` multiply-adds a token). ``tied``: the
    head stays tied to the embedding, which keeps its rows: the embedding's output is turned as the
    model runs, and the final norm's input turned back (``_turned_back``)."""
    q = torch.kron(parts[0], parts[1]) * parts[2]

    def reads(linear: nn.Linear) -> None:  # y = x W^T with x -> x Q: W -> W Q
        linear.weight.copy_((linear.weight.double() @ q.to(linear.weight.device)).to(linear.weight.dtype))

    def writes(linear: nn.Linear) -> None:  # y -> y Q: W -> Q^T W, b -> b Q
        q_here = q.to(linear.weight.device)
        linear.weight.copy_((q_here.T @ linear.weight.double()).to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_((linear.bias.double() @ q_here).to(linear.bias.dtype))

    shared: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # one set per device, read by every hook

    def online(module: nn.Module, like: torch.Tensor) -> None:
        found = shared.setdefault((like.device, like.dtype), [part.to(like.device, like.dtype) for part in parts])
        for name, part in zip(ONLINE_ROTATION, found, strict=True):
            module.register_buffer(name, part)

    for embedding in decoder.embeddings:
        rows = embedding.weight
        if tied:
            online(embedding, rows)
            embedding.register_forward_hook(_turned)
        else:
            rows.copy_((rows.double() @ q.to(rows.device)).to(rows.dtype))
    for written in decoder.writers if not decoder.post_norms else []:
        for linear in written:
            writes(linear)
    for ending in decoder.post_norms:
        online(ending.norm, ending.norm.weight)
        ending.norm.register_forward_hook(_turned)
    for read in decoder.norms:  # the head among the final norm's readers
        if tied and read.owner not in decoder.layers:
            online(read.norm, read.norm.weight)
            read.norm.register_forward_pre_hook(_turned_back)
            continue
        for linear in read.readers:
            reads(linear)


def _turned(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """``output Q``: each row of width a x b seen as an a x b matrix X, ``left^T X right``, times the signs."""
    left, right, signs = (getattr(module, name).to(output.dtype) for name in ONLINE_ROTATION)
    return _by_factors(output, left, right) * signs


def _turned_back(module: nn.Module, args: tuple) -> tuple:
    """``x Q^T``: the signs first, then ``left X right^T``."""
    x = args[0]
    left, right, signs = (getattr(module, name).to(x.dtype) for name in ONLINE_ROTATION)
    return (_by_factors(x * signs, left.T, right.T), *args[1:])


def _by_factors(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``x kron(left, right)`` row by row, as two plain matrix products over every row at once (a
    batched product would broadcast the factors, which a program's constant folding then stores
    once per row): ``X right`` on the rows of each a x b grid, then ``left^T`` on its columns."""
    a, b = left.shape[0], right.shape[0]
    rows = x.reshape(-1, b) @ right  # (rows x a) x b
    columns = rows.reshape(-1, a, b).transpose(1, 2).reshape(-1, a) @ left  # (rows x b) x a
    return columns.reshape(-1, b, a).transpose(1, 2).reshape(x.shape)


@dataclass(frozen=True)
class _Values:
    """Where one block's attention computes its values: ``rows`` of ``writer``'s output (all of
    ``v_proj``'s; the last ``kv heads x head_dim`` of a fused ``qkv_proj``; the last third of each
    head's rows of GPT-NeoX's ``query_key_value``), read by ``output`` (``o_proj``; Phi's and
    GPT-NeoX's ``dense``, OPT's and LFM2's ``out_proj``)."""

    writer: _Stream
    rows: slice | torch.Tensor  # the value rows in head order: a run of them, or their indices
    output: _Stream
    head_dim: int


# where decoders keep their numbered blocks, what a block calls its attention, and what the
# attention calls the projection of its heads' values back to the stream
BLOCK_LISTS = tuple(dict.fromkeys(layout.blocks for layout in LAYOUTS))
ATTENTIONS = ("self_attn", "attention", "attn")
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


def _blocks(model: nn.Module) -> list[nn.Module]:
    for path in BLOCK_LISTS:
        found = _module_at(model, path)
        if isinstance(found, nn.ModuleList) and len(found):
            return list(found)
    return []


def _value_projections(model: nn.Module) -> list[_Values]:
    """Every attention block's ``_Values``: ``v_proj`` and its output projection (Llama, Gemma,
    OLMo, Qwen, Phi, OPT, LFM2 ...), or Phi-3's fused ``qkv_proj`` (queries, keys, values in that
    order). Blocks without attention (LFM2's convolutions) have none."""
    layers = _blocks(model)
    if not layers:
        where = ", ".join(BLOCK_LISTS)
        raise InvalidSettingsError(
            f"{type(model).__name__} has no numbered blocks ({where}): R2 rotates each block's attention values"
        )
    found = []
    for index, layer in enumerate(layers):
        attention = next((getattr(layer, name) for name in ATTENTIONS if isinstance(getattr(layer, name, None), nn.Module)), None)
        if attention is None:
            continue
        output = next(filter(None, (_stream_at(attention, name) for name in OUTPUT_PROJECTIONS)), None)
        head_dim = getattr(attention, "head_dim", None)
        v_proj = _stream_at(attention, "v_proj")
        fused = next(filter(None, (_stream_at(attention, name) for name in ("qkv_proj", "c_attn"))), None)
        interleaved, head_size = _stream_at(attention, "query_key_value"), getattr(attention, "head_size", None)
        kv_heads = (
            getattr(attention, "num_key_value_heads", None)
            or getattr(getattr(attention, "config", None), "num_key_value_heads", None)
            or getattr(attention, "num_heads", None)  # GPT-2: as many key-value heads as queries
        )
        if v_proj is not None and output is not None and head_dim:
            found.append(_Values(v_proj, slice(0, v_proj.weight.shape[0]), output, int(head_dim)))
        elif fused is not None and output is not None and head_dim and kv_heads:
            width = int(kv_heads) * int(head_dim)
            rows = fused.weight.shape[0]
            found.append(_Values(fused, slice(rows - width, rows), output, int(head_dim)))
        elif interleaved is not None and output is not None and head_size:
            size = int(head_size)  # each head's rows: its queries, keys and values, head_size each
            heads = interleaved.weight.shape[0] // (3 * size)
            rows = torch.cat([torch.arange(3 * size * head + 2 * size, 3 * size * (head + 1)) for head in range(heads)])
            found.append(_Values(interleaved, rows.to(interleaved.weight.device), output, size))
        else:
            raise InvalidSettingsError(
                f"block {index}'s attention ({type(attention).__name__}) has no v_proj (or fused qkv_proj with its key-value "
                f"heads) and output projection ({', '.join(OUTPUT_PROJECTIONS)}) Linears with a head_dim: R2 rotates the "
                "values each head hands its output projection"
            )
    if not found:
        raise InvalidSettingsError(
            f"{type(model).__name__}'s blocks have no attention ({', '.join(ATTENTIONS)}): R2 has nothing to rotate"
        )
    return found


def _rotate_values(values: list[_Values], r: torch.Tensor) -> None:
    """Each head's values times R: the value rows of every head R^T W, o_proj's columns of every head W R."""
    d = r.shape[0]
    for found in values:
        v, o, rows = found.writer, found.output, found.rows
        r_here = r.to(v.weight.device)
        weight = v.weight[rows].double()
        turned = torch.einsum("ji,hjk->hik", r_here, weight.view(-1, d, weight.shape[1])).reshape(weight.shape)
        v.weight[rows] = turned.to(v.weight.dtype)
        if v.bias is not None:
            v.bias[rows] = (v.bias[rows].double().view(-1, d) @ r_here).reshape(-1).to(v.bias.dtype)
        columns = o.weight.double().view(o.weight.shape[0], -1, d)  # (out, heads, head_dim)
        o.weight.copy_((columns @ r_here).reshape(o.weight.shape).to(o.weight.dtype))


def _rotate_down(decoder: _Decoder, generator: torch.Generator) -> None:
    """The MLP's output projection's input (``down_proj``'s, or each expert's) times a normalised
    Hadamard matrix H as the model runs, its weight W H."""
    downs = [down for written in decoder.writers for down in written[1:]]  # after the attention's writer: the MLP's
    size = downs[0].weight.shape[1]
    found = hadamard(size)
    h = found / math.sqrt(size) if found is not None else random_rotation(size, generator)
    shared: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # one matrix per device, read by every block
    for down in downs:
        weight = down.weight
        weight.copy_((weight.double() @ h.to(weight.device)).to(weight.dtype))
        online = shared.setdefault((weight.device, weight.dtype), h.to(weight.device, weight.dtype))
        module = down.owner if isinstance(down, TransposedLinear) else down
        module.register_buffer(ONLINE_HADAMARD, online)
        module.register_forward_pre_hook(_online_hadamard)


def _online_hadamard(module: nn.Module, args: tuple) -> tuple:
    x = args[0]
    return (x @ getattr(module, ONLINE_HADAMARD).to(x.dtype), *args[1:])
