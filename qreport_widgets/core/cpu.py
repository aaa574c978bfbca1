"""Which SIMD level each numeric library runs at on this CPU: figures measured on a CPU with
AVX-512 are not those of one without, and a benchmark or test run says which it had."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    def __str__(self) -> str:
        has = ", ".join(self.extensions) or "no AVX2"
        said = f"{self.model} ({has}): torch {self.aten}, fbgemm {self.fbgemm}, NumPy {self.numpy}; {self.threads} threads"
        return f"{said}; set: {', '.join(self.forced)}" if self.forced else said


# what lowers each library's level below what the CPU has (tools/without-avx512.env sets them), and the thread count
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
    info = _cpuinfo()
    flags = set(info.get("flags", "").split()) or _numpy_flags()
    extensions = tuple(
        name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-VNNI", "avx512_vnni")) if flag in flags
    )
    forced = tuple(f"{name}={os.environ[name]}" for name in SETTINGS if os.environ.get(name))
    return CpuSimd(
        model=info.get("model name") or platform.processor() or platform.machine(),
        extensions=extensions,
        aten=torch.backends.cpu.get_cpu_capability(),
        fbgemm=_fbgemm_level(flags),
        numpy=_numpy_level(),
        threads=torch.get_num_threads(),
        forced=forced,
    )


def numpy_has_avx512() -> bool:
    """Whether NumPy's AVX-512 kernels run here (its sort is then several times faster)."""
    features = _numpy_umath_attribute("__cpu_features__", {})
    return bool(features.get("X86_V4") or features.get("AVX512_SKX"))


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of Linux's /proc/cpuinfo (empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return {}
    found: dict[str, str] = {}
    for line in info.read_text(errors="replace").splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        found[key.strip()] = value.strip()
    return found


def _numpy_flags() -> set[str]:
    """The flags Linux would name, as NumPy sees the CPU (where /proc/cpuinfo is not there)."""
    features = _numpy_umath_attribute("__cpu_features__", {})
    names = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512_CLX": "avx512_vnni"}
    return {flag for name, flag in names.items() if features.get(name)}


def _fbgemm_level(flags: set[str]) -> str:
    """fbgemm reads CPUID itself and takes its best kernels unless FBGEMM_ENABLE_INSTRUCTIONS caps them."""
    capped = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS")
    if capped:
        return capped
    if {"avx512f", "avx512_vnni"} <= flags:
        return "AVX512_VNNI"
    return "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "none (reference kernels)"


def _numpy_level() -> str:
    """The highest of NumPy's dispatch targets this CPU runs (NPY_DISABLE_CPU_FEATURES takes some away)."""
    features = _numpy_umath_attribute("__cpu_features__", {})
    found = [name for name in _numpy_umath_attribute("__cpu_dispatch__", []) if features.get(name)]
    return found[-1] if found else "baseline"


def _numpy_umath_attribute(name: str, default: Any) -> Any:
    """One of NumPy's CPU tables (``numpy._core`` from NumPy 2, ``numpy.core`` before)."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    return getattr(getattr(core, "_multiarray_umath", None), name, default)
