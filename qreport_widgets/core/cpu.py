"""Which SIMD level each numeric library runs at on this CPU: figures measured on a CPU with
AVX-512 are not those of one without, and a benchmark or test run says which it had."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class CpuSimd:
    """The CPU's model and SIMD extensions, and the level torch's kernels, fbgemm (x86's int8
    kernels) and NumPy each run at: ``forced`` names the settings that lowered one of them."""

    model: str
    extensions: tuple[str, ...]  # of AVX2, AVX-512, AVX512-VNNI: what the CPU has
    aten: str  # torch's dispatch: DEFAULT (no SIMD), AVX2, AVX512
    fbgemm: str
    numpy: str
    threads: int
    forced: tuple[str, ...] = ()

    @property
    def has_avx512(self) -> bool:
        return "AVX-512" in self.extensions

    def __str__(self) -> str:
        has = ", ".join(self.extensions) or "no AVX2"
        said = f"{self.model} ({has}): torch {self.aten}, fbgemm {self.fbgemm}, NumPy {self.numpy}; {self.threads} threads"
        return f"{said}; set: {', '.join(self.forced)}" if self.forced else said


# what lowers each library's level below what the CPU has (tools/without-avx512.env sets them)
SETTINGS = (
    "ATEN_CPU_CAPABILITY",
    "FBGEMM_ENABLE_INSTRUCTIONS",
    "MKL_ENABLE_INSTRUCTIONS",
    "NPY_DISABLE_CPU_FEATURES",
    "OPENBLAS_CORETYPE",
    "OMP_NUM_THREADS",
)


def cpu_simd() -> CpuSimd:
    """This process's CPU and what each library picked on it."""
    flags = _cpu_flags()
    extensions = tuple(
        name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-VNNI", "avx512_vnni")) if flag in flags
    )
    forced = tuple(f"{name}={os.environ[name]}" for name in SETTINGS if os.environ.get(name))
    return CpuSimd(
        model=_cpu_model(),
        extensions=extensions,
        aten=torch.backends.cpu.get_cpu_capability(),
        fbgemm=_fbgemm_level(flags),
        numpy=_numpy_level(),
        threads=torch.get_num_threads(),
        forced=forced,
    )


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them (empty elsewhere: NumPy's view stands in)."""
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    features = _numpy_features()
    names = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512_CLX": "avx512_vnni"}
    return {flag for name, flag in names.items() if features.get(name)}


def _cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _fbgemm_level(flags: set[str]) -> str:
    """fbgemm reads CPUID itself and takes its best kernels unless FBGEMM_ENABLE_INSTRUCTIONS caps them."""
    capped = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
    if capped:
        return capped
    if {"avx512f", "avx512_vnni"} <= flags:
        return "AVX512_VNNI"
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "none (reference kernels)"


def numpy_has_avx512() -> bool:
    """Whether NumPy's AVX-512 kernels run here (its sort is then several times faster)."""
    features = _numpy_features()
    return bool(features.get("X86_V4") or features.get("AVX512_SKX"))


def _numpy_features() -> dict[str, bool]:
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    return dict(getattr(getattr(core, "_multiarray_umath", None), "__cpu_features__", {}))


def _numpy_level() -> str:
    """The highest of NumPy's dispatch targets this CPU runs (NPY_DISABLE_CPU_FEATURES takes some away)."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    umath = getattr(core, "_multiarray_umath", None)
    features = _numpy_features()
    found = [name for name in getattr(umath, "__cpu_dispatch__", []) if features.get(name)]
    return found[-1] if found else "baseline"
