"""A run's model as a Hugging Face checkpoint that transformers loads, in the forms vLLM serves.

``save_pretrained(model, path, ...)`` (what ``run.save_pretrained`` calls through the run's
``EagerConfig``) writes an eager-engine run's transformers model (the x86 target: the model runs
in this process) as a folder in one of two forms.

``quant_method="compressed-tensors"`` (the default): the form llm-compressor writes
(``quant_method: "compressed-tensors"``, ``format: "pack-quantized"``):

- each int4 / int8 weight-only Linear's values packed into int32 words along the input dimension
  by ``compressed_tensors``' own packer (``weight_packed``), its group or row scales
  (``weight_scale``) and its shape (``weight_shape``), the values exactly those the run computes
  with: round to nearest, HQQ, GPTQ, AWQ (its scales folded into the op before) or the learned
  rounding alike;
- a quantized Embedding's values one to a byte (int8, the ``int-quantized`` form) with its
  scales: transformers initialises an Embedding's ``weight`` as it loads, so an Embedding cannot
  be packed (the run's size counts an int4 embedding's values a byte each on x86 too); one whose
  ``forward`` takes more than the ids (OPT's positions), which compressed-tensors' quantized
  forward would call with one input, as its dequantized weight;
- one config group per (bits, group size, form), its targets the modules by name (the folder's
  ``format`` is ``mixed-precision`` where it holds both forms); float Linears in ``ignore``;
  everything else (norms, biases, float modules, weights a rotation or AWQ changed) as the run's
  model holds it;
- ``config.json`` with its ``quantization_config``, the generation config, the tokenizer given.

It refuses int8 dynamic activations (torchao's are asymmetric per token; a compressed-tensors
checkpoint with the same int4 values would run them symmetric in vLLM and not at all in
transformers).

``quant_method="torchao"``: the form transformers saves a model quantized through ``TorchAoConfig``
in: torchao's own tensors flattened by its safetensors support, the config's ``quant_type`` the
run's formats (``FqnToConfig``). transformers loads them back into the same torchao tensors, so
the same kernels run, dynamic activations included; torchao holds int4 values one to a byte on
x86, and so does the folder.

Both refuse, before anything is written, naming the module and what to do: an AWQ input scale
divided as the model runs, a rotation computed as the model runs (R4), a module the session holds
in a layout of its own, runs of another target (their artifacts are ``.pte`` / ``.gguf`` files:
``run.quantized_model.write``). The folder is written beside ``path`` and renamed into place:
nothing is half written, and an existing ``path`` is kept unless ``overwrite``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import shutil
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import CheckpointError, MissingExtraError, QReportWarning
from ..folds import INPUT_SCALE
from ..rotation import ONLINE_HADAMARD, ONLINE_ROTATION

WEIGHTS = "model.safetensors"
COMPRESSED_TENSORS, TORCHAO = "compressed-tensors", "torchao"  # the two forms, as their configs' quant_method
_ABSENT = object()
# Linears' form, Embeddings', and that of an Embedding whose forward takes more than the ids (OPT's
# positions: a mask, an offset), which compressed-tensors' quantized forward would call with one input
PACKED, ONE_A_BYTE, DEQUANTIZED = "pack-quantized", "int-quantized", "dense"

Scheme = tuple[int, int | None, str]  # bits, group size (None: one scale a row), form


def save_pretrained(
    model: nn.Module, path: str | os.PathLike, tokenizer: Any, overwrite: bool, quant_method: str, torchao_config: Any
) -> Path:
    """Write ``model``, an x86 run's, to the folder ``path`` in ``quant_method``'s form
    (``COMPRESSED_TENSORS`` or ``TORCHAO``; see the module's docstring); returns it. ``tokenizer``:
    the model's tokenizer (anything with ``save_pretrained``), written beside it, or None;
    ``torchao_config``: torchao's ``FqnToConfig`` of the run's formats (what ``TORCHAO`` names)."""
    destination = Path(path)
    if quant_method not in (COMPRESSED_TENSORS, TORCHAO):
        raise CheckpointError(f"quant_method={quant_method!r}: a checkpoint is {COMPRESSED_TENSORS!r} or {TORCHAO!r}")
    if tokenizer is not None and not hasattr(tokenizer, "save_pretrained"):
        given = type(tokenizer).__name__
        raise CheckpointError(f"tokenizer= takes a transformers tokenizer (it has save_pretrained), not {given}")
    if not hasattr(model, "config") or not hasattr(model.config, "to_dict"):
        raise CheckpointError(
            f"the run's model is a {type(model).__name__}, not a transformers model: a Hugging Face checkpoint "
            "needs its config (from_pretrained / from_config models)"
        )
    if destination.exists() and not overwrite:
        raise CheckpointError(f"{destination} exists; pass overwrite=True to replace it")
    _refuse_transforms_run_as_the_model_runs(model, quant_method)
    if quant_method == TORCHAO:
        _check_layout(model, model.state_dict(), {})
        _refuse_embeddings_torchao_leaves_unset(model)
        write = functools.partial(_write_torchao, model, torchao_config=torchao_config)
    else:
        write = _compressed_tensors_writer(model)
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        write(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        if destination.exists():
            shutil.rmtree(destination) if destination.is_dir() else destination.unlink()
        os.replace(partial, destination)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return destination


def _compressed_tensors_writer(model: nn.Module) -> Callable[[Path], None]:
    """What writes ``model`` to a folder in compressed-tensors' form, everything checked first."""
    pack = _packer()
    modules = _quantized_modules(model)
    state = model.state_dict()
    _check_layout(model, state, modules)
    _warn_of_embeddings(model, modules)
    head = _tied_float_head(model, modules)
    tensors = _tensors(model, state, modules, head, pack)
    config = _config(model, modules, head)

    def write(folder: Path) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(folder)

    return write


def _write_torchao(model: nn.Module, folder: Path, *, torchao_config: Any) -> None:
    """``model`` saved by transformers as it saves a model quantized through ``TorchAoConfig``: each
    torchao tensor flattened into its parts (torchao's safetensors support), the config naming the
    formats, ``tie_word_embeddings`` off where the run quantized the head apart from the embedding.
    The run's model is lent a quantizer and those config entries for the call."""
    from transformers import TorchAoConfig
    from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer

    embeddings = any(isinstance(m, nn.Embedding) and _quantized(m.weight) for m in model.modules())
    config = TorchAoConfig(quant_type=torchao_config, include_input_output_embeddings=embeddings)
    tied = _head_reading_embedding(model) is not None  # else the run quantized the head apart from its embedding
    with (
        _lent(model, hf_quantizer=TorchAoHfQuantizer(config)),
        _lent(model.config, quantization_config=config, tie_word_embeddings=tied),
    ):
        model.save_pretrained(folder, safe_serialization=True)


@contextlib.contextmanager
def _lent(target: Any, **values: Any) -> Iterator[None]:
    """Within: ``target``'s attributes set to ``values``; after, each as it was (or absent again)."""
    before = {name: getattr(target, name, _ABSENT) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            delattr(target, name) if value is _ABSENT else setattr(target, name, value)


def _refuse_embeddings_torchao_leaves_unset(model: nn.Module) -> None:
    """CheckpointError for a quantized Embedding holding a buffer it does not save (Gemma's scale of
    its rows): transformers (5.23) loads a torchao-quantized Embedding without initialising such a
    buffer, so the loaded model would compute with whatever memory it held."""
    for fqn, module in model.named_modules():
        unsaved = sorted(getattr(module, "_non_persistent_buffers_set", ()))
        if isinstance(module, nn.Embedding) and _quantized(module.weight) and unsaved:
            raise CheckpointError(
                f"{fqn} ({type(module).__name__}) is quantized and holds {', '.join(unsaved)}, a buffer it does not save: "
                "transformers loads a torchao-quantized embedding without setting it again. Save with "
                "quant_method='compressed-tensors', or keep the embedding float for the torchao form"
            )


def _refuse_transforms_run_as_the_model_runs(model: nn.Module, quant_method: str) -> None:
    """CheckpointError naming the first module that transforms its input as the model runs: a
    checkpoint holds weights, and the class's forward applies no rotation or input scale."""
    for fqn, module in model.named_modules():
        if any(name in module._buffers for name in (ONLINE_HADAMARD, *ONLINE_ROTATION)):
            raise CheckpointError(
                f"{fqn} multiplies its input by a rotation as the model runs (R4): a checkpoint holds weights only; "
                "apply with Rotation(down=False) to save it"
            )
        if INPUT_SCALE in module._buffers:
            raise CheckpointError(
                f"{fqn}: AWQ divides its input by a scale as the model runs (the op before cannot take it), and a "
                f"{quant_method} checkpoint holds no input scale; choose another algorithm for it (gptq, learned)"
            )


def _warn_of_embeddings(model: nn.Module, modules: dict[str, Scheme]) -> None:
    """A QReportWarning for each quantized Embedding: vLLM's compressed-tensors schemes quantize
    Linears (and experts) alone; and for one written as its dequantized weight."""
    for fqn, (bits, _, form) in modules.items():
        weight = model.get_submodule(fqn).weight
        if form == ONE_A_BYTE:
            words = f"{fqn} is quantized: its int{bits} values are written one to a byte"
            why = "transformers loads them; vLLM quantizes Linears alone, so keep the embedding float to serve it there"
        elif form == DEQUANTIZED:
            held = weight.numel() * weight.dtype.itemsize
            words = f"{fqn} is written as its dequantized weight ({held:,} bytes, the run's values)"
            kind = type(model.get_submodule(fqn)).__name__
            why = f"{kind}'s forward takes more than the ids, and a quantized Embedding's takes the ids alone"
        else:
            continue
        warnings.warn(f"{words}: {why}", QReportWarning, stacklevel=4)


def _check_layout(model: nn.Module, state: dict[str, torch.Tensor], modules: dict[str, Scheme]) -> None:
    """CheckpointError where the run's model is not laid out as its transformers class: tensors the
    class has no name or another shape for (a mixture of experts the session holds one Linear an
    expert), or a packed module the class holds as another type (GPT-2's Conv1D, which the session
    holds as a Linear): transformers would load the checkpoint without them, or not at all."""
    with torch.device("meta"):
        fresh = type(model)(copy.deepcopy(model.config))
    known = fresh.state_dict()
    cls = type(model).__name__
    unknown = [name for name in state if name not in known]
    if unknown:
        raise CheckpointError(
            f"{unknown[0]} ({len(unknown)} tensors like it) is the session's own layout: {cls} has no parameter of "
            "that name, so transformers would load the checkpoint without it. The session holds a mixture of experts "
            "one Linear an expert, and save_pretrained does not write experts back into their 3-d parameters"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(known[name].shape):
            raise CheckpointError(
                f"{name} is {tuple(tensor.shape)} in the run's model and {tuple(known[name].shape)} in {cls}: the session "
                "holds that module in its own layout (a Conv1D as a Linear), and a checkpoint must be the class's"
            )
    declared = dict(fresh.named_modules())
    for fqn in modules:
        held = type(model.get_submodule(fqn))
        if not isinstance(declared.get(fqn), held):
            raise CheckpointError(
                f"{fqn} ({type(declared.get(fqn)).__name__}) holds a quantized weight in the session's {held.__name__}: "
                f"{cls} holds it as that type, which compressed-tensors does not quantize; keep it float to save the run"
            )


def _packer() -> Callable[[torch.Tensor, int], torch.Tensor]:
    """compressed-tensors' own packer of int values into int32 words (values, bits) -> packed."""
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError as error:
        raise MissingExtraError(
            "save_pretrained writes the compressed-tensors format and needs its package: "
            "pip install 'qreport-widgets[checkpoint]' (or pip install compressed-tensors)"
        ) from error
    return pack_to_int32


def _quantized_modules(model: nn.Module) -> dict[str, Scheme]:
    """Each quantized module -> its ``Scheme``; CheckpointError naming the first module the format
    cannot hold."""
    found = {}
    for fqn, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not _quantized(weight):
            continue
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise CheckpointError(
                f"{fqn} ({type(module).__name__}) holds a quantized weight; compressed-tensors quantizes Linear and "
                "Embedding weights"
            )
        found[fqn] = (*_scheme_of(fqn, weight), _form(module))
    return found


def _form(module: nn.Linear | nn.Embedding) -> str:
    if isinstance(module, nn.Linear):
        return PACKED
    inputs = [p for p in inspect.signature(type(module).forward).parameters.values() if p.name != "self"]
    return ONE_A_BYTE if len(inputs) == 1 and inputs[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else DEQUANTIZED


def _quantized(weight: Any) -> bool:
    """Whether ``weight`` is one of torchao's quantized tensors (``formats.is_quantized_weight``'s
    test; that module reaches this one through ``EagerConfig.save_pretrained``, so importing it
    here would make an import cycle)."""
    from torchao.utils import TorchAOBaseTensor

    return isinstance(weight, TorchAOBaseTensor)


def _scheme_of(fqn: str, weight: torch.Tensor) -> tuple[int, int | None]:
    """A quantized weight's (bits, group size, None for one scale a row); CheckpointError for what
    the format cannot hold."""
    kind = type(weight).__name__
    if kind == "IntxUnpackedToInt8Tensor":
        if weight.activation_quantization is not None:
            raise CheckpointError(_dynamic_words(fqn, "int8-dynamic-int4-weight", "int4-weight-only"))
        bits = {torch.int4: 4, torch.int8: 8}.get(weight.target_dtype)
    elif kind == "Int8Tensor":
        if weight.act_quant_kwargs is not None:
            raise CheckpointError(_dynamic_words(fqn, "int8-dynamic", "int8-weight-only"))
        bits = 8
    else:
        raise CheckpointError(f"{fqn}: a {kind} weight has no compressed-tensors form here (int4 / int8 weight-only do)")
    if bits is None:
        raise CheckpointError(f"{fqn}: {weight.target_dtype} values have no compressed-tensors form here (int4 / int8 do)")
    zero = getattr(weight, "zero_point", None)
    if zero is not None and bool(zero.any()):
        raise CheckpointError(f"{fqn}: its values have zero points; the checkpoint holds symmetric values only")
    group = int(weight.block_size[-1])
    return bits, None if group == weight.shape[-1] else group


def _dynamic_words(fqn: str, format: str, instead: str) -> str:
    return (
        f"{fqn} is {format}: it quantizes its input to int8 per token as it runs, asymmetric as torchao does, and "
        "a compressed-tensors checkpoint would run it symmetric in vLLM and not at all in transformers; choose "
        f"{instead} for it (the same weight values) or write another target's file (target='xnnpack' / 'llama.cpp')"
    )


def _tensors(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    modules: dict[str, Scheme],
    head: str | None,
    pack: Callable[[torch.Tensor, int], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: each packed module's three, each Embedding's values (int8) and
    scales, every other entry of the state dict as it is, but a float ``head``'s weight, which
    reads its embedding's tensor (transformers ties it again on load)."""
    written = {}
    left_out = {f"{fqn}.weight" for fqn in modules} | ({f"{head}.weight"} if head else set())
    for name, tensor in state.items():
        if name not in left_out:
            written[name] = tensor.detach().cpu().contiguous().clone()
    for fqn, (bits, _, form) in modules.items():
        weight = model.get_submodule(fqn).weight
        weight = weight.data if isinstance(weight, nn.Parameter) else weight
        if form == DEQUANTIZED:
            written[f"{fqn}.weight"] = weight.dequantize().detach().cpu().contiguous()
            continue
        values = weight.qdata.to(torch.int8).cpu()
        written[f"{fqn}.weight_scale"] = weight.scale.detach().cpu().reshape(values.shape[0], -1).to(weight.dtype).contiguous()
        if form == PACKED:
            written[f"{fqn}.weight_packed"] = pack(values, bits)
            written[f"{fqn}.weight_shape"] = torch.tensor(values.shape)
        else:
            written[f"{fqn}.weight"] = values.contiguous()
    return written


def _head_reading_embedding(model: nn.Module) -> tuple[str, str] | None:
    """(head, embedding) names where the model's head weight is its embedding's tensor, else None."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is None or outputs is None or outputs.weight is not inputs.weight:
        return None
    names = {id(module): fqn for fqn, module in model.named_modules()}
    return names[id(outputs)], names[id(inputs)]


def _tied_float_head(model: nn.Module, modules: dict[str, Scheme]) -> str | None:
    """The head's name where it reads its float embedding's tensor, else None. A quantized embedding
    a head reads is written twice, once for each (tie_word_embeddings off): the format packs modules,
    and ties parameters."""
    tied = _head_reading_embedding(model)
    return tied[0] if tied is not None and tied[1] not in modules else None


def _config(model: nn.Module, modules: dict[str, Scheme], head: str | None) -> Any:
    """The model's config with its ``quantization_config``; ``tie_word_embeddings`` off unless a
    float ``head`` reads its embedding's tensor."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    groups: dict[Scheme, list[str]] = defaultdict(list)
    for fqn, scheme in modules.items():
        if scheme[2] != DEQUANTIZED:
            groups[scheme].append(fqn)
    schemes = {}
    ordered = sorted(groups.items(), key=lambda item: (item[0][2], item[0][0], item[0][1] or 0))
    for index, ((bits, group, form), targets) in enumerate(ordered):
        strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
        weights = QuantizationArgs(num_bits=bits, type="int", symmetric=True, **strategy)
        schemes[f"group_{index}"] = QuantizationScheme(targets=targets, weights=weights, format=form)
    forms = {form for _, _, form in groups}
    float_linears = [fqn for fqn, module in model.named_modules() if isinstance(module, nn.Linear) and fqn not in modules]
    quantization = QuantizationConfig(
        config_groups=schemes,
        format=forms.pop() if len(forms) == 1 else "mixed-precision",
        quantization_status="compressed",
        ignore=float_linears,
    )
    config = copy.deepcopy(model.config)
    config.quantization_config = quantization.model_dump(exclude_none=True)
    config.quantization_config["quant_method"] = "compressed-tensors"
    if head is not None:
        config.tie_word_embeddings = True  # its tensor is written once: transformers ties it again
    elif getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False  # written apart: the run quantized them apart, or packed both
    return config
