"""PerChannelDetector: weighted layers that could use per-channel weight quantization."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.ao.quantization.fake_quantize import FakeQuantizeBase

from ...core import features as F
from ...core.features import DetectorName, SuggestionKind
from ...errors import DetectorConfigError
from ..graph import ModelGraph
from .base import DetectorBase, DetectorResult, ObservationRequest, ReportContext, Suggestion, weighted_units

SUPPORTED_BACKENDS = ("fbgemm", "qnnpack", "onednn", "x86")
_PER_CHANNEL_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_PER_CHANNEL_SCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams)


@dataclass(frozen=True)
class PerChannelRecord:
    module_fqn: str
    supported: bool
    used: bool
    backend: str

    def columns(self) -> dict[str, object]:
        return {F.PER_CHANNEL_SUPPORTED: self.supported, F.PER_CHANNEL_USED: self.used, F.BACKEND: self.backend}


class PerChannelDetector(DetectorBase):
    """Finds Linear / Conv layers whose qconfig quantizes weights per tensor although the backend
    supports per-channel weights (usually a large accuracy gain for free).

    Args:
        backend: the quantized engine the model will run on.
    """

    name = DetectorName.PER_CHANNEL.value
    affects_qconfig = True

    def __init__(self, backend: str = torch.backends.quantized.engine) -> None:
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(SUPPORTED_BACKENDS)}, got {backend!r}")
        self.backend_chosen = backend

    def requests(self, graph: ModelGraph) -> list[ObservationRequest]:
        return []

    def analyze(self, context: ReportContext) -> DetectorResult:
        units = weighted_units(context.graph, _PER_CHANNEL_TYPES)
        schemes = context.graph.per_channel_weights  # an exported graph: what the starting quantizer does
        if schemes is not None:
            return self._result(
                [u.fqn for u in units if u.fqn not in schemes], [(u.fqn, schemes[u.fqn]) for u in units if u.fqn in schemes]
            )
        configured = [u for u in units if getattr(u.module, "qconfig", None) is not None]
        if units and not configured and not any(hasattr(u.module, "qconfig") for u in units):
            raise DetectorConfigError(
                "PerChannelDetector reads each layer's qconfig, and no layer has one. Pass the model "
                "returned by prepare_fx(model, qconfig_mapping, example_inputs), or drop this detector."
            )
        return self._result(
            [u.fqn for u in units if u not in configured], [(u.fqn, uses_per_channel(u.module.qconfig)) for u in configured]
        )

    def _result(self, left_float: list[str], used: list[tuple[str, bool]]) -> DetectorResult:
        notes = tuple(f"{fqn}: left in float by the starting configuration, per-channel does not apply" for fqn in left_float)
        records = tuple(PerChannelRecord(fqn, True, per_channel, self.backend_chosen) for fqn, per_channel in used)
        suggestions = tuple(
            Suggestion(
                r.module_fqn,
                self.name,
                SuggestionKind.PER_CHANNEL,
                f"weights are quantized per tensor; {self.backend_chosen} supports per-channel weights",
            )
            for r in records
            if r.supported and not r.used
        )
        return DetectorResult(self.name, records, notes, suggestions)

    def describe(self, result: DetectorResult) -> str:
        lines = [f"Per-channel weight quantization (backend {self.backend_chosen}):"]
        lines += [f"  {s.module_fqn} can use per-channel weights." for s in result.suggestions]
        if not result.suggestions:
            lines.append("  Every supported layer already uses per-channel weights.")
        else:
            lines.append("  Use a per-channel weight observer in their qconfig (e.g. default_per_channel_weight_observer).")
        return "\n".join(lines + [f"  note: {n}" for n in result.notes]) + "\n"


def uses_per_channel(qconfig) -> bool:
    weight = qconfig.weight()
    if isinstance(weight, FakeQuantizeBase):
        return bool(getattr(weight, "is_per_channel", False))
    return getattr(weight, "qscheme", None) in _PER_CHANNEL_SCHEMES
