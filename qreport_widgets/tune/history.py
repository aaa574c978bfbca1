"""The runs a session recorded, which of them keep their quantized models, and the runs compared."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..engines.settings import ModuleSettings
from ..errors import ModelReleasedError
from .run import ReleasedModel, RunResult

FLOAT_REFERENCE = "float model"  # the runs table's first row where the session has a metric

if TYPE_CHECKING:
    from ..engines.executorch import DecodeSpeed


class History:
    """The recorded runs, in order (``runs``: the list ``session.history`` is).

    The quantized models of the latest run and of pinned runs are kept; recording a run releases
    the others' (``ReleasedModel``), their measurements staying. The baseline is the run whose
    ``baseline`` field is set.
    """

    def __init__(self) -> None:
        self.runs: list[RunResult] = []
        self._pinned: set[int] = set()  # positions whose quantized model is kept
        self._decode: dict[int, DecodeSpeed] = {}  # position -> its decode speed, where one was measured

    @property
    def baseline(self) -> RunResult | None:
        """The starting configuration's run, if one was recorded."""
        return next((run for run in self.runs if run.baseline), None)

    def next_label(self) -> str:
        return f"run {len(self.runs) + 1}"

    def unique_label(self, label: str) -> str:
        """``label``, or ``label (2)``, ``(3)``... where a recorded run has it: the runs table, the
        per-layer columns and every lookup by label name one run each."""
        taken = {run.label for run in self.runs}
        candidates = itertools.chain([label], (f"{label} ({n})" for n in itertools.count(2)))
        return next(candidate for candidate in candidates if candidate not in taken)

    def record(self, run: RunResult) -> RunResult:
        """Add a successful run and release the models of every run but it and the pinned ones."""
        if run.ok:
            self.runs.append(run)
            for i, older in enumerate(self.runs[:-1]):
                if i not in self._pinned and isinstance(older.quantized_model, torch.nn.Module):
                    released = ReleasedModel(older.label, f"when {run.label!r} was recorded")
                    self.runs[i] = replace(older, quantized_model=released)
        return run

    def annotated(self, result: RunResult) -> RunResult:
        """``result``, a copy of a recorded run with notes added, put in that run's place."""
        for i, run in enumerate(self.runs):
            if result.ok and run.quantized_model is result.quantized_model and run.label == result.label:
                self.runs[i] = result
        return result

    def keep(self, run: int | RunResult, keep: bool = True) -> RunResult:
        """Pin a run (its position or the run) so its quantized model is kept; ``keep=False`` unpins
        it (released at the next run)."""
        index = self.position(run)
        found = self.runs[index]
        if keep and isinstance(found.quantized_model, ReleasedModel):
            raise ModelReleasedError(
                f"{found.quantized_model.why}; pin a run while it is the latest, or apply its settings again "
                "(session.apply(run.settings)) and pin that run"
            )
        (self._pinned.add if keep else self._pinned.discard)(index)
        return found

    def record_decode(self, run: RunResult, speed: DecodeSpeed) -> DecodeSpeed:
        """``speed``, measured on ``run``'s program, kept for the runs table."""
        self._decode[self.position(run)] = speed
        return speed

    def kept(self, run: int | RunResult) -> bool:
        """Whether a run is pinned."""
        return self.position(run) in self._pinned

    def position(self, run: int | RunResult) -> int:
        if isinstance(run, int):
            if not -len(self.runs) <= run < len(self.runs):
                raise IndexError(f"no run {run} in a history of {len(self.runs)} run(s)")
            return run % len(self.runs)
        for i, recorded in enumerate(self.runs):
            if recorded is run:
                return i
        raise ValueError(f"{run.label!r} is not a run of this session's history")

    def compare(
        self, start: Mapping[str, ModuleSettings], metric_column: str | None, tokens: int | None = None
    ) -> tuple[pd.DataFrame, pd.DataFrame]:
        """One row per run (metrics as columns; the session's own metric under ``metric_column``, when
        it has one), and per-layer SQNR with one column per run. ``tokens``: the tokens of an
        evaluation batch (a language model's), for the latency per token; the decode speed per
        generated token where one was measured."""
        per_token = {}
        if tokens:
            per_token["prefill (ms / token)"] = [r.latency_ms / tokens for r in self.runs]
        if self._decode:
            per_token["decode (ms / token)"] = [
                self._decode[i].decode_ms if i in self._decode else math.nan for i in range(len(self.runs))
            ]
        rows = [
            {
                "run": r.label,
                **({metric_column: r.eval_metric} if metric_column else {}),  # the metric the session is about, first
                "changes": r.changes(start),
                "output SQNR (dB)": r.output_sqnr_db,
                "mean batch SQNR (dB)": r.mean_batch_sqnr_db,
                "quantized layers": r.quantized_layers,
                "size (KB)": r.size_bytes / 1024,
                "deployed size (KB)": r.deployed_bytes / 1024,
                "latency (ms, 1 thread)": r.latency_ms,
                "latency spread (ms)": r.latency_spread_ms,
                **{column: values[i] for column, values in per_token.items()},
                "duration (s)": r.duration_s,
                "model": self._model_state(i, r),
            }
            for i, r in enumerate(self.runs)
        ]
        layers = pd.DataFrame({r.label: r.per_layer_sqnr_db for r in self.runs})
        return pd.DataFrame(rows), layers

    @staticmethod
    def with_float_reference(runs: pd.DataFrame, metric_column: str, value: float) -> pd.DataFrame:
        """``runs`` (``compare``'s table) with the float model as its first row: its metric, the
        reference the runs' metrics and a relative target (``max_metric_loss``) are read against."""
        row = {column: math.nan for column in runs.columns}
        row.update({"run": FLOAT_REFERENCE, "changes": "every module float", metric_column: value, "model": "the float model"})
        row["output SQNR (dB)"] = row["mean batch SQNR (dB)"] = math.inf
        row["quantized layers"] = 0
        return pd.concat([pd.DataFrame([row], columns=runs.columns), runs], ignore_index=True)

    def _model_state(self, index: int, run: RunResult) -> str:
        """What the history holds of a run's quantized model, in the runs table's words."""
        if index in self._pinned:
            return "pinned"
        return "released" if isinstance(run.quantized_model, ReleasedModel) else "kept"
