"""The engine's simulation of the starting configuration, calibrated once, and what variants of it give.

Every estimate (sensitivity, the trade-off, reach's plan, the size front, verified suggestions,
the truth check) is measured here: a variant keeps some modules float or changes their settings,
and costs forward passes, no calibration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from ..core.calibration import batch_rows, leading_rows
from ..core.metrics import sqnr_of
from ..core.progress import Progress, quiet, steps
from ..core.shortcuts import Shortcut, checking, confirmed, tensors_equal
from ..engines.contract import Simulation, Variant
from .runner import Runner

# a pass computing the head's sample of rows alone gives the float model's output there to float round-off
SAMPLED_AGREEMENT_DB = 60.0
_UNCHECKED: Any = object()


class Simulated:
    """The simulation of ``runner``'s starting configuration (built on first use, then kept; it
    shares the float weights, so it is refused like the float model once they were changed in place)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._simulation: Simulation | None = None
        self.version = 0  # counts the changes made to the simulation after it was built (real kernels adopted)
        # output SQNR and (None when not asked) metric of each variant simulated at this version, per
        # number of evaluation batches it was simulated on (None: all)
        # (and, where ranking passes read a sample of the output's columns, that sample's size)
        self._known: dict[tuple[Any, Variant], tuple[float, float | None]] = {}
        self._known_version = 0
        self._confirmed: set[tuple[Any, Variant]] = set()  # known entries the check mode found as computed afresh
        self._head: tuple[str, torch.Tensor] | None = _UNCHECKED  # what ``head_sample`` found
        # (batch, rows or None) -> (columns or None, its reference there): the head's sample, the first rows
        self._parts: dict[tuple[int, int | None], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._cut: dict[tuple[int, int], Any] = {}  # (batch, rows) -> the evaluation batch cut to its first rows, kept

    def simulation(self, progress: Progress | None = None) -> Simulation:
        runner = self.runner
        float_model = runner.float_model  # checks the weights first
        if self._simulation is None:
            runner.ensure_room(
                "simulation", "building the simulation (sensitivity, reach, fit and the truth check measure in it)"
            )
            prepared = runner.calibrated_start("sensitivity: calibrating", progress)
            engine = runner.engine
            simulator = engine.simulator(
                prepared, runner.modules, float_model, runner.example_inputs, runner.calibrate_quietly, runner.calibration_key
            )
            self._simulation = simulator
        return self._simulation

    def rest(self) -> None:
        """Lets the simulation drop what it rebuilds on its next use (``Simulation.rest``)."""
        if self._simulation is not None:
            self._simulation.rest()

    def run_real_kernels(self, quantized: torch.nn.Module, names: list[str]) -> list[str]:
        """The simulation runs ``quantized``'s kernels for ``names`` from now on (see
        ``Simulation.run_real_kernels``); what was estimated before is stale (``version``)."""
        before = set(self.simulation().run_real_kernels(quantized, []))
        adopted = self.simulation().run_real_kernels(quantized, names)
        if set(adopted) != before:
            self.version += 1
        return adopted

    def simulate(self, variant: Variant | Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric of ``variant`` (or with those modules kept float)."""
        simulation, runner = self.simulation(), self.runner
        outputs = simulation.outputs(runner.eval_data, variant)
        sqnr, metric = runner.output_sqnr(outputs), None
        if runner.metric_from_outputs:  # the same pass gives both
            metric = runner.metric.of_outputs(runner.eval_data, outputs)  # type: ignore[union-attr]
        elif runner.eval_fn is not None:
            with torch.no_grad():
                metric = float(runner.eval_fn(simulation.model))
        return sqnr, metric

    def head_sample(self) -> tuple[str, torch.Tensor] | None:
        """A decoder head whose rows are the model output's columns, and the sample of its rows a
        ranking pass may compute alone (``Simulation.head_sample``); None where the simulation offers
        none, or where the output is not that sample of columns as it is: checked once, on the first
        evaluation batch, the simulated model float but for its head's rows sampled, against the
        float model's output there (a softmax after the head, for one, would not agree)."""
        if self._head is not _UNCHECKED:
            return self._head
        self._head = None
        simulation, runner = self.simulation(), self.runner
        reference = runner.reference_outputs()[0]
        offer = getattr(simulation, "head_sample", None)
        found = offer(int(reference.shape[-1])) if offer is not None and reference.dim() else None
        if found is None:
            return None
        head, columns = found
        try:
            with simulation.rows_sampled(head, columns):  # type: ignore[attr-defined]
                ((terms,),) = simulation.outputs_each(
                    runner.eval_data[:1],
                    [Variant(frozenset(simulation.tunable))],
                    reduce=lambda i, out: runner.output_terms(i, out, self._reference_part(i, columns)),
                )
        except ValueError:  # the output has other columns than the head's sampled rows
            return None
        finally:
            simulation.configure(())
        if sqnr_of(*terms) >= SAMPLED_AGREEMENT_DB:
            self._head = (head, columns)
        return self._head

    def _reference_part(self, index: int, columns: torch.Tensor | None, rows: int | None = None) -> torch.Tensor:
        """The float model's output on evaluation batch ``index`` at ``columns`` (the head's sample;
        None: all) of its first ``rows`` rows (None: all), kept."""
        kept = self._parts.get((index, rows))
        if kept is None or kept[0] is not columns:
            reference = self.runner.reference_outputs()[index]
            reference = reference if rows is None else reference[:rows]
            kept = self._parts[index, rows] = (
                columns,
                reference if columns is None else reference[..., columns.to(reference.device)],
            )
        return kept[1]

    def _rows_of(self, data: Sequence[Any], rows: int) -> list[Any] | None:
        """``data`` (the first evaluation batches) each cut to its first ``rows`` rows, the same
        objects every call (a pass's replay knows its batches by identity); None where a batch, or
        the float model's output on it, does not lead with its rows (``leading_rows``)."""
        reference = self.runner.reference_outputs()
        cut = []
        for index, batch in enumerate(data):
            if (index, rows) not in self._cut:
                found = leading_rows(batch, rows)
                leads = reference[index].dim() > 0 and reference[index].shape[0] == batch_rows(batch)
                self._cut[index, rows] = found if leads else None
            cut.append(self._cut[index, rows])
        return None if any(batch is None for batch in cut) else cut

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | None = None,
        desc: str = "simulating",
        metric: bool = True,
        batches: int | None = None,
        sampled_columns: bool = False,
        rows: int | None = None,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each ``v`` in ``variants``, without the metric unless ``metric``.
        ``batches``: on the first ``batches`` evaluation batches only (a ranking among many variants,
        at a fraction of the cost; the output SQNR and a metric read from the outputs).
        ``sampled_columns`` (without the metric): where the output is a decoder head's rows
        (``head_sample``), the output SQNR of that head's sample of them, which the head computes
        alone: a ranking at a fraction of a large vocabulary's cost. ``rows`` (without the metric): on
        the first ``rows`` rows (a decoder's sequences) of each of those batches, where every one of
        them and the float model's output on it lead with their rows (else on the whole batches).

        Each variant recomputes only what it changes (one step per variant and batch), for its
        output SQNR and for a metric computed from the outputs (perplexity; ``Metric.from_outputs``),
        both from that one pass; a variant simulated before (by sensitivity, the search, the size
        front) is not simulated again until the simulation changes (``version``). An ``eval_fn``
        that needs the whole model costs a whole pass more per variant (one step per variant)."""
        simulation, runner = self.simulation(), self.runner
        with_metric = metric and runner.eval_fn is not None
        if batches is not None and with_metric and not runner.metric_from_outputs:
            raise ValueError("an eval_fn that reads the whole model cannot be simulated on some evaluation batches")
        data = runner.eval_data if batches is None else runner.eval_data[:batches]
        if self._known_version != self.version:
            self._known, self._known_version, self._confirmed = {}, self.version, set()
        whole_model = with_metric and not runner.metric_from_outputs  # the user's eval_fn reads the simulated model
        head = self.head_sample() if sampled_columns and not with_metric else None
        cut = self._rows_of(data, rows) if rows is not None and not with_metric else None
        data = data if cut is None else cut
        read = (batches, None if head is None else len(head[1]), None if cut is None else rows)
        keys = [(read, Variant.of(variant)) for variant in variants]
        # each once, those not known yet (or known without the metric now asked for)
        new = list(dict.fromkeys(k for k in keys if k not in self._known or (with_metric and self._known[k][1] is None)))
        reads = runner.metric if with_metric else None

        def reduce(index: int, output: object) -> tuple[tuple[float, float], tuple[float, ...] | None]:
            terms = None if reads is None else tuple(reads.batch_terms(data[index], output))  # type: ignore[misc]
            part = None
            if head is not None or cut is not None:
                part = self._reference_part(index, None if head is None else head[1], None if cut is None else rows)
            return runner.output_terms(index, output, part), terms

        def measured(asked: list[tuple[Any, Variant]], step: Progress | None) -> list[tuple[float, float | None]]:
            if not asked:
                return []
            if whole_model:  # a whole pass a variant, then the user's function on the simulated model
                results = []
                with steps(len(asked), desc, "step", step) as each_step:
                    for _, variant in asked:
                        results.append(self.simulate(variant))
                        each_step()
                return results
            sampling = simulation.rows_sampled(*head) if head is not None else nullcontext()  # type: ignore[attr-defined]
            with sampling, steps(len(asked) * len(data), desc, "step", step) as each_step:
                found = simulation.outputs_each(data, [variant for _, variant in asked], each_step, reduce)
            return [
                (
                    sqnr_of(*map(sum, zip(*(power for power, _ in each), strict=True))),
                    None if reads is None else float(reads.combine([terms for _, terms in each])),  # type: ignore[misc]
                )
                for each in found
            ]

        try:
            self._known.update(zip(new, measured(new, progress), strict=True))
            if checking(runner.engine.checks_shortcuts):  # those known before, simulated again (each once a version)
                again = [key for key in dict.fromkeys(keys) if key not in new and key not in self._confirmed]
                self._confirmed.update(again)
                confirmed(
                    Shortcut.KNOWN_VARIANTS,
                    [self._known[key] for key in again],
                    lambda: measured(again, quiet),
                    _results_equal(with_metric),
                    f"{len(again)} variants simulated before",
                )
        finally:
            simulation.configure(())
        return [(self._known[key][0], self._known[key][1] if with_metric else None) for key in keys]

    def local_sqnr(self) -> dict[str, float]:
        """Each module's own error (dB) on the inputs the float model gives it, on the first evaluation batch."""
        return self.simulation().local_sqnr(self.runner.eval_data[0])


def _results_equal(with_metric: bool) -> Callable[[list, list], bool]:
    """Whether two lists of (output SQNR, metric) are the same; the metric only where it was asked for."""

    def same(kept: list, again: list) -> bool:
        return tensors_equal([r[0] for r in kept], [r[0] for r in again]) and (
            not with_metric or tensors_equal([r[1] for r in kept], [r[1] for r in again])
        )

    return same
