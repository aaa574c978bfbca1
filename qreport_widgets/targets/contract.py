"""What every target's artifact is to the engines above: a ``Deployed`` model.

A run on a target ends as the file that target runs (an ExecuTorch ``.pte``, a GGUF), loaded in the
target's own runtime and called like the model it came from, so the output SQNR, the metric and the
latency of the run are the runtime's. It keeps that model (``reference``: the quantized model the file
was made from, whose layers per-layer SQNR and the conversions read), says its bytes, and writes its
file where the user asks.
"""

from __future__ import annotations

import os

import torch


class Deployed(torch.nn.Module):
    """A target's artifact, called like the model it was made from (its runtime computes the output).

    Subclasses set ``reference`` (not a submodule: its tensors are not the artifact's) and define
    ``artifact_bytes`` and ``write``. ``last_call_s``: the runtime's own seconds on the last call,
    where it times itself (0: the caller's clock is the latency)."""

    reference: torch.nn.Module
    last_call_s: float = 0.0
    suffix = ""  # the file name's ending users give it (".pte", ".gguf")

    @property
    def artifact_bytes(self) -> int:
        """The file's bytes: the run's deployed size."""
        raise NotImplementedError

    def write(self, path: str | os.PathLike[str]) -> int:
        """Save the file as ``path``; the bytes written."""
        raise NotImplementedError
