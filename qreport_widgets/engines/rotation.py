"""Rotations folded into a decoder's weights: the float model computes the same function, while its
weights and the activations its Linears read lose their outlier channels (QuaRot, SpinQuant).

- **R1**, the residual stream: every norm's scale folded into the Linears that read it, then the
  stream rotated by an orthogonal ``Q`` (a Hadamard matrix with random signs): the embedding's rows
  and every Linear that writes the stream (``o_proj``, ``down_proj``) produce ``h Q``, every Linear
  that reads it (``q/k/v_proj``, ``gate/up_proj``, the head) takes ``Q`` back in its weight. An RMS
  norm with unit scale commutes with ``Q``, so nothing between them changes. A head tied to the
  embedding unties: the final norm's scale folds into the head alone.
- **R2**, each head's values: ``v_proj`` produces every head's values times ``R`` (head size),
  ``o_proj`` takes ``R`` back in that head's columns; attention mixes values linearly, so its
  output carries the same ``R``.
- **R4**, ``down_proj``'s input (off by default): a normalised Hadamard matrix ``H`` applied to the
  input as the model runs (a forward pre-hook multiplying by a buffer, ``ONLINE_HADAMARD``) and
  taken back in the weight (``W H``). It is computed, not folded: a matrix product per token, which an
  exported program carries too.

R1 is written for the layouts of ``LAYOUTS``: Llama's (Mistral, Qwen2, SmolLM, StableLM and their
kin, Phi-3's fused projections, Qwen3-MoE's router and 3-d experts), Phi's parallel blocks,
GPT-NeoX's, LFM2's (convolution blocks too), OPT's and GPT-2's (``Conv1D``: ``TransposedLinear``):
pre-norm blocks with RMS norms or LayerNorms (made RMS norms on a centred stream). R2 is written
for any block whose attention has value and output projections (``v_proj``, or the value rows of a
fused ``qkv_proj`` / ``c_attn`` or of each head in GPT-NeoX's interleaved ``query_key_value``, and
``o_proj`` / ``out_proj`` / ``dense`` / ``c_proj``: Gemma 2 and 3 and OLMo 2 too).
``rotation_problems`` says why a model does not take one (a norm after a block's output, LayerNorms
mixed with RMS norms, a layout it does not know); ``rotate(..., example_inputs)`` checks the result
by the outputs themselves (``check``).
"""

from __future__ import annotations

import copy
import math
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
    factors: list[torch.Tensor] = []
    rest = n
    for prime in (_PALEY_20, _PALEY_12):  # 5 and 3 divide n only through these orders
        while rest > 0 and rest % (prime + 1) == 0:
            factors.append(_paley(prime))
            rest //= prime + 1
    if not _power_of_two(rest):
        return None
    result = torch.ones(1, 1, dtype=torch.float64)
    for factor in factors:
        result = torch.kron(result, factor)
    two = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while result.shape[0] < n:
        result = torch.kron(result, two)
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
    found = hadamard(n)
    if found is None:
        q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
        return q * torch.sign(torch.diagonal(r))
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.float64) * 2 - 1
    return found * signs / math.sqrt(n)


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
    return "; ".join(said)


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
    """A norm that reads the residual stream (``owner.name``, at ``path``) and the Linears that read its output."""

    owner: nn.Module
    name: str
    path: str
    readers: list[_Stream]

    @property
    def norm(self) -> nn.Module:
        return getattr(self.owner, self.name)

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

    @property
    def embedding(self) -> nn.Embedding:
        return self.embeddings[0]


@dataclass(frozen=True)
class _Layout:
    """Where a decoder family keeps what R1 folds into: its blocks, the embeddings that start the
    stream, the final norm, each block's norms with the Linears that read them (alternatives, the
    first a block has all of), and the Linears that write the stream (paths inside a block)."""

    name: str
    blocks: str
    embeddings: tuple[str, ...]
    final_norm: str
    norms: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]
    writers: tuple[tuple[str, ...], ...]  # each writer's paths, the first a block has
    absent: tuple[str, ...] = ()  # modules that change the stream's width where they exist


_QKV = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",))
LAYOUTS = (
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
        extra = [name for name in extra if name not in {read.name for read in decoder.norms if read.owner is layer}]
        if extra:
            return (
                f"block {index} has a norm on a block's output before the residual add ({', '.join(extra)}): the stream "
                "it writes is normalised, which a rotation of the stream does not commute with"
            )
    norms = _norms(decoder)
    for norm_name, norm in norms:
        if not _is_rms_norm(norm) and not _is_layer_norm(norm):
            return (
                f"{norm_name} ({type(norm).__name__}) is neither an RMS norm with a scale alone nor a LayerNorm with a "
                "scale and bias: the rotation of the stream does not commute with what it computes"
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
    same logits to float32 round-off. InvalidSettingsError naming why for a model it does not apply to.
    With ``example_inputs`` (a batch, or a tuple of the model's arguments) it checks itself: the
    rotated copy's output against the model's on them, refused below float round-off (``check``)."""
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
            _untie_head(rotated, decoder)
            _layer_norms_as_rms(decoder)
            _fold_norms(decoder)
            _rotate_residual(decoder, random_rotation(decoder.embedding.weight.shape[1], generator))
        if rotation.values:
            values = _value_projections(rotated)
            _rotate_values(values, random_rotation(values[0].head_dim, generator))
        if rotation.down:
            if any(isinstance(written[-1], ExpertWeights) for written in decoder.writers) or any(
                isinstance(m, ExpertLinears) for m in rotated.modules()
            ):
                raise InvalidSettingsError(
                    "R4 multiplies the input of each MLP's output projection as the model runs, and this model's MLPs are "
                    "a mixture of experts (no one projection to multiply): Rotation(down=False)"
                )
            _rotate_down(decoder, generator)
    if example_inputs is not None:
        check(model, rotated, rotation, example_inputs)
    return rotated


def check(model: nn.Module, rotated: nn.Module, rotation: Rotation, example_inputs: Any) -> float:
    """The rotated model's output SQNR (dB) against ``model``'s on ``example_inputs``; InvalidSettingsError
    naming the model's family and the gap where it is below float round-off (``FLOAT_ROUNDOFF_DB``): a layout
    the folds do not commute with, whatever its modules are named."""
    with torch.no_grad():
        expected, found = (output_tensor(call_with(m, example_inputs)).float() for m in (model, rotated))
    found_db = sqnr_db(expected, found)
    if not is_float_output(found_db):
        family = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
        raise InvalidSettingsError(
            f"{rotation.words} changes what this {family} model computes: the rotated model's output is {found_db:.1f} dB "
            f"from the original's on the example input, where float round-off keeps {FLOAT_ROUNDOFF_DB:.0f} dB or more. "
            "Its layout does not commute with the rotations; quantize it unrotated"
        )
    return found_db


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
        norms, writers = found
        owner_path, _, name = layout.final_norm.rpartition(".")
        norms.append(_NormRead(_module_at(model, owner_path), name, layout.final_norm, [head]))
        return _Decoder(layout.name, embeddings, list(blocks), head, norms, writers)
    if lacking:
        raise InvalidSettingsError(lacking)
    known = "; ".join(f"{layout.name}'s: {layout.blocks}, {layout.final_norm}" for layout in LAYOUTS)
    raise InvalidSettingsError(
        f"{type(model).__name__} is not a decoder in a layout the rotations are written for ({known}; an output embedding)"
    )


def _blocks_in(layout: _Layout, blocks: list[nn.Module]) -> tuple[list[_NormRead], list[list[_Stream]]] | str:
    """Each block's norms with their readers and its writers in ``layout``; what the first block
    that does not fit lacks, said, where one does not."""
    norms, writers = [], []
    for index, layer in enumerate(blocks):
        missing = [name for name, _ in layout.norms if _module_at(layer, name) is None]
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
        norms.extend(_NormRead(layer, name, f"{prefix}.{name}", linears) for name, linears in read)
        writers.append([w for each in written for w in each])  # type: ignore[union-attr]
    return norms, writers


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
    return [(read.path, read.norm) for read in decoder.norms]


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() or isinstance(module, nn.LayerNorm)


def _is_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm(x)`` is its scale times ``x / rms(x)``, checked on a probe with the scale as it is."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        return False
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(3, weight.shape[0], generator=generator, dtype=torch.float32, device="cpu").to(weight.device) * 3 + 1
    with torch.no_grad():
        found = norm(probe)
    expected = weight * probe * torch.rsqrt(probe.pow(2).mean(-1, keepdim=True) + _eps(norm))
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


def _fold_norms(decoder: _Decoder) -> None:
    """Each norm's scale into the Linears that read its output; the norm's scale becomes 1."""
    for read in decoder.norms:
        scale = read.norm.weight.detach().double()
        for linear in read.readers:
            linear.weight.copy_((linear.weight.double() * scale[None, :]).to(linear.weight.dtype))
        read.norm.weight.fill_(1.0)


def _rotate_residual(decoder: _Decoder, q: torch.Tensor) -> None:
    def reads(linear: nn.Linear) -> None:  # y = x W^T with x -> x Q: W -> W Q
        linear.weight.copy_((linear.weight.double() @ q.to(linear.weight.device)).to(linear.weight.dtype))

    def writes(linear: nn.Linear) -> None:  # y -> y Q: W -> Q^T W, b -> b Q
        q_here = q.to(linear.weight.device)
        linear.weight.copy_((q_here.T @ linear.weight.double()).to(linear.weight.dtype))
        if linear.bias is not None:
            linear.bias.copy_((linear.bias.double() @ q_here).to(linear.bias.dtype))

    for embedding in decoder.embeddings:
        rows = embedding.weight
        rows.copy_((rows.double() @ q.to(rows.device)).to(rows.dtype))
    for written in decoder.writers:
        for linear in written:
            writes(linear)
    for read in decoder.norms:  # the head among the final norm's readers
        for linear in read.readers:
            reads(linear)


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
    """The MLP's output projection's input (``down_proj``'s) times a normalised Hadamard matrix H as
    the model runs, its weight W H."""
    size = decoder.writers[0][-1].weight.shape[1]
    found = hadamard(size)
    h = found / math.sqrt(size) if found is not None else random_rotation(size, generator)
    shared: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # one matrix per device, read by every block
    for written in decoder.writers:
        down = written[-1]
        weight = down.weight
        weight.copy_((weight.double() @ h.to(weight.device)).to(weight.dtype))
        online = shared.setdefault((weight.device, weight.dtype), h.to(weight.device, weight.dtype))
        module = down.owner if isinstance(down, TransposedLinear) else down
        module.register_buffer(ONLINE_HADAMARD, online)
        module.register_forward_pre_hook(_online_hadamard)


def _online_hadamard(module: nn.Module, args: tuple) -> tuple:
    x = args[0]
    return (x @ getattr(module, ONLINE_HADAMARD).to(x.dtype), *args[1:])
