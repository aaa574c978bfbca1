"""The engine's simulation of the starting configuration, calibrated once, and what variants of it give.

Every estimate (sensitivity, the trade-off, reach's plan, the size front, verified suggestions,
the truth check) is measured here: a variant keeps some modules float or changes their settings,
and costs forward passes, no calibration.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..core.metrics import sqnr_of
from ..core.progress import Progress, steps
from ..engines.contract import Simulation, Variant
from .runner import Runner


class Simulated:
    """The simulation of ``runner``'s starting configuration (built on first use, then kept; it
    shares the float weights, so it is refused like the float model once they were changed in place)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._simulation: Simulation | None = None
        self.version = 0  # counts the changes made to the simulation after it was built (real kernels adopted)
        self._known: dict[Variant, float] = {}  # output SQNR of each variant simulated at this version
        self._known_version = 0

    def simulation(self, progress: Progress | None = None) -> Simulation:
        runner = self.runner
        float_model = runner.float_model  # checks the weights first
        if self._simulation is None:
            runner.ensure_room(
                "simulation", "building the simulation (sensitivity, reach, fit and the truth check measure in it)"
            )
            prepared = runner.calibrated_start("sensitivity: calibrating", progress)
            engine = runner.engine
            simulator = engine.simulator(prepared, runner.modules, float_model, runner.example_inputs, runner.calibrate_quietly)
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
        sqnr = runner.output_sqnr(simulation.outputs(runner.eval_data, variant))
        metric = None
        if runner.eval_fn is not None:
            with torch.no_grad():
                metric = float(runner.eval_fn(simulation.model))
        return sqnr, metric

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | None = None,
        desc: str = "simulating",
        metric: bool = True,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each ``v`` in ``variants``, without the metric unless ``metric``.

        For the output SQNR alone each variant recomputes only what it changes (one step per variant
        and batch), and a variant simulated before (by sensitivity, the search, the size front) is
        not simulated again until the simulation changes (``version``); ``eval_fn`` needs the whole
        model, so with it each variant is a whole pass (one step per variant)."""
        simulation, runner = self.simulation(), self.runner
        if metric and runner.eval_fn is not None:
            try:
                with steps(len(variants), desc, "step", progress) as step:
                    found = []
                    for variant in variants:
                        found.append(self.simulate(variant))
                        step()
                    return found
            finally:
                simulation.configure(())
        if self._known_version != self.version:
            self._known, self._known_version = {}, self.version
        keys = [Variant.of(variant) for variant in variants]
        new = list(dict.fromkeys(key for key in keys if key not in self._known))  # each once, those not known yet
        try:
            with steps(len(new) * len(runner.eval_data), desc, "step", progress) as step:
                terms = simulation.outputs_each(runner.eval_data, new, step, runner.output_terms)
        finally:
            simulation.configure(())
        for key, each in zip(new, terms, strict=True):
            self._known[key] = sqnr_of(*map(sum, zip(*each, strict=True)))
        return [(self._known[key], None) for key in keys]

    def local_sqnr(self) -> dict[str, float]:
        """Each module's own error (dB) on the inputs the float model gives it, on the first evaluation batch."""
        return self.simulation().local_sqnr(self.runner.eval_data[0])
