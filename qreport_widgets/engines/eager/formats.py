"""The formats of the eager engine, as torchao configs: which module can take which, the
configuration of a run (one ``FqnToConfig``), its code, and a model's size as deployed.

Facts from torchao 0.18 (checked on this package's test models): ``Int8Tensor`` implements
linear and embedding, not convolution; ``IntxWeightOnlyConfig`` takes 2-d and 4-d weights (Linear,
Embedding, Conv2d) whose rows divide into groups; ``Int8DynamicActivationIntxWeightConfig`` takes
Linear weights only. On an x86 CPU, int4 weights stay unpacked in int8 (``IntxUnpackedToInt8Tensor``)
and run as dequantize-then-float-matmul; the packed layouts need ARM KleidiAI, torchao's low-bit
C++ kernels or CUDA.

Each format has a torchao config per target. On ``"x86"`` (the model runs in this process) int8
dynamic is ``Int8DynamicActivationInt8WeightConfig`` and int8 weight-only ``Int8WeightOnlyConfig``.
On ``"xnnpack"`` (the model is lowered to an ExecuTorch program, as ExecuTorch's LLM export does)
every format is one of the two configs XNNPACK and ExecuTorch's kernels take: a Linear
``Int8DynamicActivationIntxWeightConfig`` with int4 grouped ("8da4w") or int8 per-row ("8da8w")
weights, an Embedding ``IntxWeightOnlyConfig`` with int4 grouped or int8 per-row weights (its
lookups become ``embedding_4bit`` / ``embedding_byte``). XNNPACK delegates grouped int4 only in
groups of a multiple of 32, and no weight-only Linear. On ``"llama.cpp"`` (the model is written as a
GGUF file) the formats are those same configs: their int4 / int8 values are written as ``Q4_0`` /
``Q8_0`` blocks (``targets/llamacpp``), whose matrix kernels quantize activations to 8 bits as 8da4w's do.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import MissingExtraError
from ..settings import (
    ALGORITHM_FORMATS,
    ALGORITHMS,
    AWQ,
    DATA_ALGORITHMS,
    DEFAULT_GROUP_SIZE,
    FORMATS,
    GROUP_SIZES,
    GROUPED_FORMATS,
    HQQ,
    LEARNED,
    RTN,
    ModuleSettings,
)

INT8_DYNAMIC, INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY, INT8_DYNAMIC_INT4 = FORMATS[1:]
QUANTIZED_FORMATS = FORMATS[1:]
TARGETS = X86, XNNPACK, LLAMACPP = ("x86", "xnnpack", "llama.cpp")
# what XNNPACK's program runs, per module type (ExecuTorch's LLM export: Linear 8da4w / 8da8w, Embedding 4w / 8w);
# llama.cpp's CPU kernels alike: a Q4_0 / Q8_0 matrix multiplies activations it quantizes to 8 bits, a
# token's embedding row is looked up and dequantized
XNNPACK_LINEAR = (INT8_DYNAMIC, INT8_DYNAMIC_INT4)
XNNPACK_EMBEDDING = (INT8_WEIGHT_ONLY, INT4_WEIGHT_ONLY)
# the targets whose runs leave the process as a file (a program, a GGUF), in the formats above
FILE_TARGETS = (XNNPACK, LLAMACPP)
LLAMACPP_GROUP = 32  # Q4_0's block
NO_CONV_INT8 = "torchao's int8 tensors have no convolution (int4-weight-only applies to a Conv2d)"


@functools.cache
def torchao_eager() -> types.SimpleNamespace:
    """torchao's ``quantize_`` and the configs of the formats, imported once; a clear error naming
    the extra when torchao is missing."""
    pytree_log = logging.getLogger("torch.utils._pytree")  # torchao registers an Enum torch now handles
    level = pytree_log.level
    try:
        pytree_log.setLevel(logging.ERROR)
        # torchao prints a line per optional CUDA kernel it cannot load on a CPU machine
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from torchao.quantization import (
                FqnToConfig,
                Int8DynamicActivationInt8WeightConfig,
                Int8DynamicActivationIntxWeightConfig,
                Int8WeightOnlyConfig,
                IntxWeightOnlyConfig,
                quantize_,
            )
            from torchao.quantization.granularity import PerAxis, PerGroup, PerRow
            from torchao.quantization.quant_primitives import MappingType
            from torchao.quantization.quantize_.workflows import Int8Tensor, IntxUnpackedToInt8Tensor
            from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
                IntxChooseQParamsAlgorithm,
            )
            from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
                IntxUnpackedToInt8TensorActivationQuantization,
            )
            from torchao.utils import TorchAOBaseTensor
    except ImportError as error:
        raise MissingExtraError(
            f"the eager engine needs torchao ({error}); install it with: pip install 'qreport-widgets[eager]'"
        ) from error
    finally:
        pytree_log.setLevel(level)
    return types.SimpleNamespace(
        quantize_=quantize_,
        FqnToConfig=FqnToConfig,
        PerAxis=PerAxis,
        PerGroup=PerGroup,
        PerRow=PerRow,
        MappingType=MappingType,
        Int8DynamicActivationInt8WeightConfig=Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig=Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig=Int8WeightOnlyConfig,
        IntxWeightOnlyConfig=IntxWeightOnlyConfig,
        Int8Tensor=Int8Tensor,
        IntxUnpackedToInt8Tensor=IntxUnpackedToInt8Tensor,
        IntxChooseQParamsAlgorithm=IntxChooseQParamsAlgorithm,
        # the dynamic int8 activations of an int4-weight Linear (8da4w): asymmetric, per token
        PerTokenActivations=IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN,
        TorchAOBaseTensor=TorchAOBaseTensor,
    )


def ao_config(name: str, group_size: int = 0, algorithm: str = "", target: str = X86) -> Any:
    """The torchao config of one format (not "float") on ``target``; ``algorithm`` "" (round to
    nearest) or "hqq" (GPTQ and AWQ are not torchao configs here: ``algorithms.choose``)."""
    ao = torchao_eager()
    group = group_size or DEFAULT_GROUP_SIZE
    if algorithm not in ("", HQQ) or (algorithm and name not in ALGORITHM_FORMATS):
        raise ValueError(f"no torchao config for {name!r} with weight algorithm {algorithm!r}")
    hqq = {"intx_choose_qparams_algorithm": "hqq_scale_only"} if algorithm == HQQ else {}
    if name == INT8_DYNAMIC and target in FILE_TARGETS:
        return ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=ao.PerAxis(0))
    if name == INT8_DYNAMIC:
        return ao.Int8DynamicActivationInt8WeightConfig()
    if name == INT8_WEIGHT_ONLY and target in FILE_TARGETS:
        return ao.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=ao.PerAxis(0))
    if name == INT8_WEIGHT_ONLY:
        return ao.Int8WeightOnlyConfig()
    if name == INT4_WEIGHT_ONLY:
        return ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(group), **hqq)
    if name == INT8_DYNAMIC_INT4:
        return ao.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=ao.PerGroup(group), **hqq)
    raise ValueError(f"no torchao config for format {name!r}")


def config_code(name: str, group_size: int = 0, algorithm: str = "", target: str = X86) -> str:
    """``ao_config(name, group_size, algorithm, target)`` as Python (the names ``CODE_IMPORTS`` imports)."""
    group = group_size or DEFAULT_GROUP_SIZE
    hqq = ', intx_choose_qparams_algorithm="hqq_scale_only"' if algorithm == HQQ else ""
    if target in FILE_TARGETS and name == INT8_DYNAMIC:
        return "Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))"
    if target in FILE_TARGETS and name == INT8_WEIGHT_ONLY:
        return "IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))"
    return {
        INT8_DYNAMIC: "Int8DynamicActivationInt8WeightConfig()",
        INT8_WEIGHT_ONLY: "Int8WeightOnlyConfig()",
        INT4_WEIGHT_ONLY: f"IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup({group}){hqq})",
        INT8_DYNAMIC_INT4: (
            f"Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup({group}){hqq})"
        ),
    }[name]


CODE_IMPORTS = (
    "import torch\n"
    "from torchao.quantization import (\n"
    "    FqnToConfig,\n"
    "    Int8DynamicActivationInt8WeightConfig,\n"
    "    Int8DynamicActivationIntxWeightConfig,\n"
    "    Int8WeightOnlyConfig,\n"
    "    IntxWeightOnlyConfig,\n"
    "    quantize_,\n"
    ")\n"
    "from torchao.quantization.granularity import PerAxis, PerGroup\n"
)


def offered(module: nn.Module, target: str = X86) -> tuple[dict[str, str], tuple[int, ...]]:
    """What torchao can apply to ``module`` for ``target``: format -> why not ("" where it applies;
    "float" always), and the group sizes its weight's rows divide into (for the int4 formats)."""
    weight = getattr(module, "weight", None)
    width = int(weight.shape[1]) if isinstance(weight, torch.Tensor) and weight.dim() >= 2 else 0
    # llama.cpp stores a group of 64 or 128 as blocks of 32 sharing its scale: the same bytes as groups of
    # 32, rounded coarser, so its formats group by 32 alone
    sizes_offered = (LLAMACPP_GROUP,) if target == LLAMACPP else GROUP_SIZES
    groups = tuple(g for g in sizes_offered if width and width % g == 0)
    sizes = ", ".join(map(str, GROUP_SIZES))
    no_groups = f"int4 weights are grouped along rows of {width}, which no group size ({sizes}) divides"
    int4 = "" if groups else no_groups
    if isinstance(module, nn.Linear):
        formats = {"float": "", INT8_DYNAMIC: "", INT8_WEIGHT_ONLY: "", INT4_WEIGHT_ONLY: int4, INT8_DYNAMIC_INT4: int4}
    elif isinstance(module, nn.Embedding):
        no_activation = "an embedding looks rows up: it has no activations to quantize (use a weight-only format)"
        formats = {
            "float": "",
            INT8_DYNAMIC: no_activation,
            INT8_WEIGHT_ONLY: "",
            INT4_WEIGHT_ONLY: int4,
            INT8_DYNAMIC_INT4: no_activation,
        }
    elif isinstance(module, nn.Conv2d):
        dynamic_int4 = "torchao's dynamic int8 + int4 format takes Linear weights only"
        formats = {
            "float": "",
            INT8_DYNAMIC: NO_CONV_INT8,
            INT8_WEIGHT_ONLY: NO_CONV_INT8,
            INT4_WEIGHT_ONLY: int4,
            INT8_DYNAMIC_INT4: dynamic_int4,
        }
    else:
        kind = type(module).__name__
        why = f"torchao's formats take Linear, Embedding and Conv2d weights, not a {kind}"
        return {"float": "", **dict.fromkeys(QUANTIZED_FORMATS, why)}, ()
    if target in FILE_TARGETS:
        formats = {name: why or _file_refuses(module, name, target) for name, why in formats.items()}
    return formats, groups


def _file_refuses(module: nn.Module, name: str, target: str) -> str:
    """Why ``target``'s file (an ExecuTorch program with XNNPACK, a GGUF) does not run ``module`` in
    format ``name`` ("" where it does)."""
    if name == "float":
        return ""
    if target == LLAMACPP:
        width = int(module.weight.shape[1]) if getattr(module, "weight", None) is not None and module.weight.dim() > 1 else 0
        if width % 32:
            return f"llama.cpp's Q4_0 / Q8_0 blocks are 32 inputs of a row, and this one's rows are {width} long: it stays F16"
        if isinstance(module, nn.Linear) and name not in XNNPACK_LINEAR:
            return (
                "llama.cpp multiplies a quantized matrix with activations it quantizes to 8 bits per block of 32: "
                "int8-dynamic-int4-weight (Q4_0) or int8-dynamic (Q8_0)"
            )
        if isinstance(module, nn.Embedding) and name not in XNNPACK_EMBEDDING:
            return (
                "llama.cpp looks an embedding's rows up and dequantizes them: int4-weight-only (Q4_0) or int8-weight-only (Q8_0)"
            )
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return "a GGUF file holds a decoder's Linear and Embedding weights in block formats; this module stays float"
        return ""
    if isinstance(module, nn.Linear) and name not in XNNPACK_LINEAR:
        return (
            "XNNPACK delegates a Linear with dynamically quantized int8 activations only (int8-dynamic, "
            "int8-dynamic-int4-weight): weight-only Linears would run in ExecuTorch's portable kernels"
        )
    if isinstance(module, nn.Embedding) and name not in XNNPACK_EMBEDDING:
        return "ExecuTorch quantizes an embedding's weights only (int8-weight-only, int4-weight-only)"
    if isinstance(module, nn.Conv2d):
        return (
            "the eager engine's XNNPACK target quantizes Linears and Embeddings: "
            "for convolutions use engine='pt2e', target='xnnpack'"
        )
    return ""


def algorithms_offered(module: nn.Module, target: str = X86, folded: bool = False, in_block: bool = True) -> dict[str, str]:
    """The weight algorithms ``module``'s int4 weights can take on ``target``: algorithm -> why not
    ("" where it applies; round-to-nearest wherever int4 does). ``folded``: an AWQ scale of the
    module's input folds into the op before it (``folds``), which XNNPACK needs: its program has no
    op to divide by it. ``in_block``: the module sits in a numbered block (``model.layers.3``),
    whose output the learned rounding matches."""
    formats = offered(module, target)[0]
    if all(formats.get(name) != "" for name in ALGORITHM_FORMATS):
        return {}
    if isinstance(module, nn.Linear):
        found = dict.fromkeys(ALGORITHMS, "")
        if target in FILE_TARGETS and not folded:
            found[AWQ] = (
                "AWQ's input scales fold into the norm or Linear before a Linear, and none writes this one's input "
                f"alone: the file would divide by them, an op {'llama.cpp' if target == LLAMACPP else 'XNNPACK'} is not given"
            )
        if not in_block:
            found[LEARNED] = "the learned rounding matches a block's output (model.layers.3), and this Linear sits in no block"
        return found
    data = "GPTQ, AWQ and the learned rounding weigh a Linear's weights by its input activations"
    if isinstance(module, nn.Embedding):
        return {RTN: "", HQQ: "", **dict.fromkeys(DATA_ALGORITHMS, data + "; an embedding looks rows up")}
    hqq = "torchao's HQQ takes 2-d weights (Linear, Embedding)"
    return {RTN: "", HQQ: hqq, **dict.fromkeys(DATA_ALGORITHMS, data)}


Choice = tuple[str, int, str]  # (format, group size or 0, weight algorithm or "")


@dataclass(frozen=True)
class EagerConfig:
    """One run's formats: module -> (format, group size, weight algorithm) for the modules quantized
    (the rest float), applied by one ``quantize_(copy, FqnToConfig(...))``, then GPTQ / AWQ for the
    modules whose algorithm reads the calibration inputs (``needs_data``). ``linears``: a format for
    every Linear not named (the start, before a model is known; ``resolved`` names them), with
    ``group_size`` when it is an int4 format (0: ``DEFAULT_GROUP_SIZE``). ``target``: whose torchao
    configs the formats are (``ao_config``): ``"x86"``, or ``"xnnpack"`` / ``"llama.cpp"`` for a file
    (an ExecuTorch program, a GGUF)."""

    formats: Mapping[str, Choice] = field(default_factory=dict)
    linears: str = ""
    group_size: int = 0
    target: str = X86

    def save_pretrained(self, model: nn.Module, path: Any, tokenizer: Any, overwrite: bool, quant_method: str) -> Any:
        """``model``, a run's of this configuration, as a Hugging Face checkpoint folder in
        compressed-tensors' or torchao's form (``checkpoint.py``; ``RunResult.save_pretrained`` calls it)."""
        from ...errors import CheckpointError
        from .checkpoint import save_pretrained

        if self.target != X86:
            raise CheckpointError(
                f"the run was made for {self.target}: its artifact is a file of that target's "
                "(run.quantized_model.write(path)); a checkpoint comes from a session on target='x86'"
            )
        return save_pretrained(model, path, tokenizer, overwrite, quant_method, self.fqn_to_config(layouts=True))

    def resolved(self, model: nn.Module) -> EagerConfig:
        """Every module named: ``linears``' format given to each Linear it applies to (int4: each
        whose rows divide into its group size)."""
        if not self.linears:
            return self
        group = (self.group_size or DEFAULT_GROUP_SIZE) if self.linears in GROUPED_FORMATS else 0
        chosen = {
            fqn: (self.linears, group, "")
            for fqn, module in model.named_modules()
            if isinstance(module, nn.Linear) and _takes(module, self.linears, group, self.target)
        }
        return EagerConfig({**chosen, **self.formats}, target=self.target)

    @classmethod
    def of(cls, settings: Mapping[str, ModuleSettings], target: str = X86) -> EagerConfig:
        """The quantized modules of ``settings`` with their formats (group size only where it counts)."""
        chosen = {}
        for fqn, choice in settings.items():
            if choice.keep_float or not choice.format:
                continue
            group = (choice.group_size or DEFAULT_GROUP_SIZE) if choice.format in GROUPED_FORMATS else 0
            chosen[fqn] = (choice.format, group, choice.algorithm)
        return cls(chosen, target=target)

    @property
    def needs_data(self) -> dict[str, tuple[str, int]]:
        """The modules whose weight algorithm reads their inputs on the calibration batches: algorithm, group size."""
        return {fqn: (algorithm, group) for fqn, (_, group, algorithm) in self.formats.items() if algorithm in DATA_ALGORITHMS}

    def fqn_to_config(self, layouts: bool = False) -> Any:
        """torchao's config of every module but those ``needs_data`` names; with ``layouts``, theirs
        too, as their format rounded to nearest (the layout their values are held in)."""
        ao = torchao_eager()
        return ao.FqnToConfig(
            {
                fqn: ao_config(name, group, "" if algorithm in DATA_ALGORITHMS else algorithm, target=self.target)
                for fqn, (name, group, algorithm) in self.formats.items()
                if layouts or algorithm not in DATA_ALGORITHMS
            }
        )

    def as_code(self, learned_start: str | None = None) -> str:
        """Python that builds this configuration (``learned_start``: the learned rounding's start, where not the default)."""
        entries = "".join(
            f"    {fqn!r}: {config_code(*choice, target=self.target)},\n"
            for fqn, choice in self.formats.items()
            if choice[2] not in DATA_ALGORITHMS
        )
        code = (
            "# module -> format (modules not named stay float); quantize_ changes model in place\n"
            f"config = FqnToConfig({{\n{entries}}})\n"
            "quantize_(model, config, filter_fn=None)\n"
        )
        code += TARGET_CODE.get(self.target, "")
        imports = TARGET_IMPORTS.get(self.target, "")
        data = self.needs_data
        if not data:
            return f"{CODE_IMPORTS}{imports}\n{code}"
        learns = any(algorithm == LEARNED for algorithm, _ in data.values())
        started = f", learned_start={learned_start!r}" if learns and learned_start not in (None, RTN) else ""
        choices = "".join(
            f"    {fqn!r}: ({algorithm!r}, {group}{_format_argument(self.formats[fqn][0])}),\n"
            for fqn, (algorithm, group) in data.items()
        )
        return (
            f"{CODE_IMPORTS}{imports}from qreport_widgets import quantize_weights\n\n"
            "# first, on the float model: int4 weights chosen by GPTQ / AWQ from one pass over the\n"
            "# calibration batches the session calibrated on (module -> (algorithm, group size[, format]))\n"
            f"quantize_weights(model, {{\n{choices}}}, calibration_batches{started})\n{code}"
        )


def _format_argument(name: str) -> str:
    return "" if name == INT4_WEIGHT_ONLY else f", {name!r}"


XNNPACK_IMPORTS = (
    "from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackDynamicallyQuantizedPartitioner\n"
    "from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower\n"
    "from executorch.runtime import Runtime\n"
)
# the quantized model lowered as ExecuTorch's LLM export lowers a decoder, its .pte written and run
XNNPACK_CODE = (
    "\n"
    "program = to_edge_transform_and_lower(\n"
    "    torch.export.export(model, example_inputs),\n"
    "    partitioner=[XnnpackDynamicallyQuantizedPartitioner()],\n"
    ").to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))\n"
    'with open("model.pte", "wb") as file:\n'
    "    file.write(program.buffer)\n"
    "import executorch.kernels.quantized  # noqa: F401  (the runtime's quantized embedding kernels)\n"
    "loaded = Runtime.get().load_program(program.buffer)  # keep it: its method executes from it\n"
    'method = loaded.load_method("forward")\n'
    "outputs = method.execute(list(example_inputs))\n"
)
LLAMACPP_IMPORTS = "from qreport_widgets.targets.llamacpp import LlamaCppModel, write_gguf\n"
# the quantized model written tensor by tensor in llama.cpp's formats, and run by llama.cpp
LLAMACPP_CODE = (
    "\n"
    "# tokenizer_from: the GGUF file the model was loaded from (else a vocabulary of bytes)\n"
    'write_gguf(model, "model.gguf", tokenizer_from=None)\n'
    'llama = LlamaCppModel("model.gguf")\n'
    "logits = llama.logits(example_inputs[0])\n"
)
TARGET_IMPORTS = {XNNPACK: XNNPACK_IMPORTS, LLAMACPP: LLAMACPP_IMPORTS}
TARGET_CODE = {XNNPACK: XNNPACK_CODE, LLAMACPP: LLAMACPP_CODE}


def choice_words(name: str, group: int, algorithm: str = "") -> str:
    """One module's format in words: "int4-weight-only (group 128, gptq)"."""
    if not group:
        return name
    return f"{name} (group {group}, {algorithm})" if algorithm else f"{name} (group {group})"


def _takes(module: nn.Module, name: str, group: int, target: str = X86) -> bool:
    formats, groups = offered(module, target)
    return formats.get(name) == "" and (not group or group in groups)


def rows_of(module: nn.Linear | nn.Embedding, rows: slice | torch.Tensor) -> nn.Linear | nn.Embedding:
    """A plain Linear or Embedding (``module``'s kind, columns, dtype and device) holding ``rows`` of
    its weight (and bias): a few rows quantized for a size, or a head's sample for its noise."""
    weight, bias = module.weight.detach(), getattr(module, "bias", None)
    kept = weight[rows]
    if isinstance(module, nn.Embedding):
        copied: nn.Linear | nn.Embedding = nn.Embedding(kept.shape[0], kept.shape[1], dtype=kept.dtype, device=kept.device)
    else:
        copied = nn.Linear(kept.shape[1], kept.shape[0], bias=bias is not None, dtype=kept.dtype, device=kept.device)
    with torch.no_grad():
        copied.weight.copy_(kept)
        if bias is not None:
            copied.bias.copy_(bias.detach()[rows])
    return copied.requires_grad_(False)


def deployed_bytes(model: nn.Module, unpacked_embeddings: bool = False) -> int:
    """The model's weights as a packed layout stores them: int8 one byte per value, int4 half a
    byte, plus each scale and zero point in its own dtype; float tensors as they are.
    ``unpacked_embeddings``: an Embedding's int4 values one byte each, as the x86 target holds them
    and its checkpoints write them (``checkpoint.py``: transformers cannot load a packed Embedding),
    so an int4 embedding is no smaller than an int8 one there."""
    ao = torchao_eager()
    total = 0
    seen: set[int] = set()
    unpacked = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if unpacked_embeddings else set()
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, ao.IntxUnpackedToInt8Tensor):
            bits = 8 if id(tensor) in unpacked else _bits(tensor.target_dtype)
            total += (tensor.qdata.numel() * bits + 7) // 8 + _bytes(tensor.scale) + _zero_point_bytes(tensor)
        elif isinstance(tensor, ao.Int8Tensor):
            total += tensor.qdata.numel() + _bytes(tensor.scale) + _zero_point_bytes(tensor)
        else:
            total += _bytes(tensor)
    return total


def _bits(dtype: torch.dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    return int(name.removeprefix("int").removeprefix("uint")) if name.startswith(("int", "uint")) else torch.finfo(dtype).bits


def _zero_point_bytes(tensor: Any) -> int:
    """A symmetric format's zero points are all 0 and a packed layout leaves them out."""
    zero_point = getattr(tensor, "zero_point", None)
    return _bytes(zero_point) if isinstance(zero_point, torch.Tensor) and bool(zero_point.any()) else 0


def _bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def is_quantized_weight(weight: Any) -> bool:
    """Whether a module's weight is one of torchao's quantized tensors."""
    return isinstance(weight, torchao_eager().TorchAOBaseTensor)


_SCALE_FLOOR = torch.finfo(torch.float32).eps  # torchao's smallest int8 activation scale


# how a dynamic format's kernel rounds a Linear's input: per token (torchao, XNNPACK), or per block of
# 32 inputs as llama.cpp's Q8_0 (``input_rounding``, ``fake_quantized_input``)
TOKENS_SYMMETRIC, TOKENS_ASYMMETRIC, Q8_0_BLOCKS = "tokens, symmetric", "tokens, asymmetric", "Q8_0 blocks"
Rounding = str | None  # one of the three, or None: the input stays float


def full_range_grid(target: str) -> bool:
    """Whether round to nearest and GPTQ choose int4 values on the full-range grid on ``target``:
    llama.cpp's ``Q4_0`` rule (a group's extreme weight on -8, its scale negative where that weight
    is positive), which its kernels take and its own quantization uses; elsewhere torchao's (the
    largest magnitude over 7.5: XNNPACK's kernels take positive scales only, and x86's figures
    were measured on it)."""
    return target == LLAMACPP


def input_rounding(name: str, target: str = X86) -> Rounding:
    """How format ``name``'s kernel on ``target`` rounds a Linear's input (None: it multiplies it as it is)."""
    if name not in (INT8_DYNAMIC, INT8_DYNAMIC_INT4):
        return None
    if target == LLAMACPP:
        return Q8_0_BLOCKS  # a Q4_0 / Q8_0 matrix's vec_dot type is Q8_0
    return TOKENS_SYMMETRIC if name == INT8_DYNAMIC and target == X86 else TOKENS_ASYMMETRIC


def fake_quantized_input(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """``x`` rounded as ``rounding`` says, then dequantized (``x`` itself for None)."""
    if rounding is None:
        return x
    if rounding == Q8_0_BLOCKS:
        return q8_0_blocks(x)
    return fake_quantized_tokens(x, rounding == TOKENS_SYMMETRIC)


def q8_0_blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each block of 32 along its last dimension rounded as llama.cpp's CPU kernels round
    a Q4_0 / Q8_0 matrix's input (``quantize_row_q8_0``): d = the block's largest magnitude / 127,
    q = round(x * 127 / largest) (to even, as AVX rounds), back as q * d with d stored in fp16."""
    shape = x.shape
    blocks = x.float().reshape(*shape[:-1], shape[-1] // 32, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    step = (largest / 127.0).to(torch.float16).to(torch.float32)
    return blocks.mul(inverse).round_().mul_(step).reshape(shape).to(x.dtype)


def fake_quantized_tokens(x: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """``x`` with each row of its last dimension quantized to int8 as torchao's dynamic kernels do,
    then dequantized.

    On float32 the arithmetic of ``Int8Tensor.from_hp(x, PerRow())`` and its ``dequantize`` in the
    same order, on plain tensors (the same values, bit for bit; a third of the time of building
    the tensor subclass, which the simulation of int8 dynamic formats does on every Linear's input
    of every pass): a row's range is widened to hold 0; symmetric: scale = max(|low|, high) / 127.5,
    zero point 0; asymmetric: scale = (high - low) / 255, zero point = -128 - round(low / scale),
    clamped to [-128, 127]; the scale at least float32's eps; q = clamp(round(x * (1 / scale)) +
    zero point, -128, 127); back as (q - zero point) * scale. Other dtypes go through torchao."""
    if x.dtype == torch.float32:  # one pass for the range, one tensor made, the rest in place
        low, high = torch.aminmax(x, dim=-1, keepdim=True)
        low, high = low.clamp_(max=0.0), high.clamp_(min=0.0)
        if symmetric:
            scale = torch.clamp(torch.maximum(-low, high) / 127.5, min=_SCALE_FLOOR)
            return torch.mul(x, 1.0 / scale).round_().clamp_(-128, 127).mul_(scale)
        scale = torch.clamp((high - low) / 255.0, min=_SCALE_FLOOR)
        zero = torch.clamp(-128 - torch.round(low / scale), -128, 127)
        return torch.mul(x, 1.0 / scale).round_().add_(zero).clamp_(-128, 127).sub_(zero).mul_(scale)
    ao = torchao_eager()
    mapping = ao.MappingType.SYMMETRIC if symmetric else ao.MappingType.ASYMMETRIC
    return ao.Int8Tensor.from_hp(x, ao.PerRow(), mapping_type=mapping).dequantize().to(x.dtype)
