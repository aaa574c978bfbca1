"""What the eager engine is built from: ``build_engine("eager", ...)`` or ``engine_named("eager", EagerOptions(...))``."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import ALGORITHMS, group_size_problem
from .formats import FILE_TARGETS, INT8_DYNAMIC, LLAMACPP, LLAMACPP_GROUP, QUANTIZED_FORMATS, TARGETS, XNNPACK_LINEAR


@dataclass(frozen=True)
class EagerOptions:
    """The eager engine's options; a ValueError for a format or group size torchao's formats do not take.

    Args:
        format: the starting format of every ``nn.Linear`` (the baseline's); other modules start
            float. None: ``"int8-dynamic"``, torchao's int8 dynamic activation, int8 weight format.
        group_size: the starting group size of an int4 ``format`` (``GROUP_SIZES``: 32, 64 or 128);
            None: ``DEFAULT_GROUP_SIZE``. A Linear whose rows it does not divide starts float.
        algorithms: the int4 weight algorithms the size front and ``fit`` weigh (``ALGORITHMS``);
            None: ``SEARCHED_ALGORITHMS``, all but ``"learned"`` (minutes a decoder: name it to weigh it).
            GPTQ and AWQ cost seconds a module per group size (on a 134M decoder, a minute each over
            every Linear): ``("rtn", "hqq")`` keeps a large model's ``fit`` short.
            Any algorithm can still be chosen per module by hand.
        target: ``"x86"`` (default), ``"xnnpack"``: every run is an ExecuTorch program lowered to
            XNNPACK and measured in ExecuTorch's runtime, or ``"llama.cpp"``: every run is a GGUF file
            measured in llama.cpp; ``format`` then one of ``XNNPACK_LINEAR`` (8da8w: Q8_0, 8da4w: Q4_0).
        learned_start: the values the ``"learned"`` rounding starts from on each block: ``"rtn"``
            (round to nearest's, on the full-range grid where the kernels take it) or ``"gptq"``
            (GPTQ's on the block's inputs); None: ``learned.LEARNED_START`` (``"rtn"``). Checked by
            ``LearnedRounding``, which the engine makes of it.
        formats: the quantized formats the size front and ``fit`` weigh besides float (``FORMATS``):
            ``("int4-weight-only", "int8-weight-only")`` for a run ``save_pretrained`` will write (the
            weight-only formats a compressed-tensors checkpoint holds). None: every format the
            target runs. The start's format is kept whatever this says.
    """

    format: str | None = None
    group_size: int | None = None
    algorithms: tuple[str, ...] | None = None
    target: str | None = None
    learned_start: str | None = None
    formats: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            object.__setattr__(self, "target", TARGETS[0])
        if self.target not in TARGETS:
            raise ValueError(f"target must be {' or '.join(map(repr, TARGETS))}, got {self.target!r}")
        if self.target in FILE_TARGETS and (self.format or INT8_DYNAMIC) not in XNNPACK_LINEAR:
            runs = "XNNPACK runs" if self.target == "xnnpack" else "llama.cpp's kernels run"
            raise ValueError(
                f"format={self.format!r} with target={self.target!r}: {runs} a Linear with int8 dynamic activations, "
                f"format must be {' or '.join(map(repr, XNNPACK_LINEAR))} (other formats per module: Embeddings take "
                "int8-weight-only / int4-weight-only)"
            )
        if self.target == LLAMACPP and self.group_size not in (None, LLAMACPP_GROUP):
            raise ValueError(
                f"group_size={self.group_size!r} with target='llama.cpp': Q4_0's blocks are {LLAMACPP_GROUP} inputs; a group of "
                f"64 or 128 would take the same bytes in a GGUF file, rounded coarser: use group_size={LLAMACPP_GROUP}"
            )
        if self.format is not None and self.format not in QUANTIZED_FORMATS:
            raise ValueError(f"format must be one of {', '.join(QUANTIZED_FORMATS)}, got {self.format!r}")
        if self.group_size is not None:
            problem = group_size_problem(self.format or INT8_DYNAMIC, self.group_size)
            if problem:
                start = repr(self.format) if self.format else f"{INT8_DYNAMIC!r} (the default)"
                raise ValueError(f"group_size={self.group_size!r} with format={start}: {problem}")
        for field_name, allowed in (("algorithms", ALGORITHMS), ("formats", QUANTIZED_FORMATS)):
            given = getattr(self, field_name)
            if given is None:
                continue
            named = (given,) if isinstance(given, str) else tuple(given)  # one name alone, or several
            if not named or any(name not in allowed for name in named):
                raise ValueError(f"{field_name} must name some of {', '.join(allowed)}, got {given!r}")
            object.__setattr__(self, field_name, named)
