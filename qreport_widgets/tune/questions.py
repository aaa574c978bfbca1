"""The session's questions answered on its simulation: which module or block hurts, what reaches a
target, the size front and the fit, each block's SQNR in a run. Half of the facade
``QuantizationSession`` (``session.py``): every method is one delegation to a part in
``self.parts`` (``parts.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import pandas as pd

from ..core.progress import Progress, shown
from ..engines.contract import Simulation, Variant
from ..engines.rotation import Rotation
from ..engines.settings import module_blocks
from .diagnosis import ReachPlan, metric_target
from .run import RunResult

if TYPE_CHECKING:
    from ..core.metrics import Metric
    from ..engines.settings import TunableModule
    from .parts import Parts

T = TypeVar("T")


class SimulatedQuestions:
    """The questions a ``QuantizationSession`` answers on the simulation (see ``session.py``)."""

    parts: Parts
    metric: Metric | None
    modules: list[TunableModule]

    def float_metric(self) -> float | None:
        """The session's metric (``eval_fn``) on the float model, computed once: what
        ``max_metric_loss`` / ``max_metric_gap`` targets are relative to. None without a metric."""
        return self.parts.runner.float_metric()

    # ---- diagnosis (diagnosis.py), on the simulation ----------------------------------------------
    def simulation(self, progress: Progress | bool | None = None) -> Simulation:
        """The starting configuration calibrated once, as a simulation in which modules can be kept
        float without calibrating again (checked against the real baseline when first built)."""
        return self.parts.diagnosis.simulation(shown(progress))

    def simulate(self, float_modules: Variant | Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric with ``float_modules`` kept float (or in a Variant)."""
        return self.parts.diagnosis.simulate(float_modules)

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | bool | None = None,
        desc: str = "simulating",
        metric: bool = True,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each variant; see ``Simulated.simulate_each``."""
        return self.parts.diagnosis.simulate_each(variants, shown(progress), desc, metric)

    def sensitivity(self, progress: Progress | bool | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which module hurts, one module at a time: the output SQNR gained when each module alone
        stays float, simulated; see ``Diagnosis.sensitivity``. Warns when the simulation does not
        match the real model."""
        return self._warned(self.parts.diagnosis.sensitivity(shown(progress), metric=metric))

    def block_sensitivity(self, progress: Progress | bool | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which block (``model.layers.3``) hurts: each kept float whole, simulated; see ``Diagnosis.block_sensitivity``."""
        return self._warned(self.parts.diagnosis.block_sensitivity(shown(progress), metric=metric))

    def blocks(self) -> dict[str, list[str]]:
        """The session's modules grouped by the numbered block that holds them (``model.layers.3`` of
        a decoder, ``layer1.0`` of a ResNet; a module in none is its own), forward order: the blocks
        ``block_sensitivity``, ``reach(by_block=True)`` and ``fit(by_block=True)`` work with (they
        take the modules there is something to choose for). Nothing is computed."""
        return module_blocks(m.fqn for m in self.modules)

    def block_sqnr(self, run: RunResult, batch: int = 0) -> pd.Series:
        """Each block's output SQNR (dB) in ``run``'s model against the float model's (rotated as the
        run was: a rotation turns the residual stream, an SQNR does not change under it), on
        evaluation batch ``batch``: where along the model a real run's error grows, and what a
        rotation bought block by block. An ExecuTorch program is read inside the runtime (lowered
        again with the blocks' outputs tapped). Empty where the engine keeps no block (FX, PT2E)."""
        return self.parts.rotations.block_sqnr(run, batch)

    def format_sensitivity(self, progress: Progress | bool | None = None) -> pd.DataFrame:
        """What each format costs where (eager engine); see ``Diagnosis.format_sensitivity``."""
        return self._warned(self.parts.diagnosis.format_sensitivity(shown(progress)))

    def tradeoff(self, progress: Progress | bool | None = None) -> pd.DataFrame:
        """The one-at-a-time ranking's modules kept float one after the other, simulated (not the
        in-context search: see ``search_path()``); see ``Diagnosis.tradeoff``."""
        return self._warned(self.parts.diagnosis.tradeoff(shown(progress)))

    def plan_reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        progress: Progress | bool | None = None,
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone; see ``Diagnosis.plan_reach``."""
        target_metric, _ = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        return self.parts.diagnosis.plan_reach(target_sqnr_db, target_metric, by_block=by_block, progress=shown(progress))

    def reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        progress: Progress | bool | None = None,
    ) -> RunResult:
        """The fewest modules kept float that meet the target, each picked by what it gains given the
        picks before (the in-context search), confirmed by a real run; ``by_block=True``: the fewest
        blocks (``blocks()``), each kept float whole; see ``Diagnosis.reach``.

        The metric's target is ``target_metric`` (absolute), or relative to the float model's metric
        (``float_metric()``): ``max_metric_loss=0.01`` lets it be at most 1% worse (lower accuracy,
        higher perplexity), ``max_metric_gap=0.5`` at most 0.5 worse in its own units."""
        target_metric, how = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        run = self.parts.diagnosis.reach(target_sqnr_db, target_metric, by_block=by_block, progress=shown(progress))
        return run if how is None else self.parts.real.annotated(run.noted(how))

    def search_path(self) -> pd.DataFrame:
        """The last ``reach()``'s in-context search as a table: each step's modules, its gain given
        the steps before, the cumulative simulated output SQNR, and the real run's SQNR at the
        chosen point; see ``SearchPath.frame``."""
        return self.parts.diagnosis.search_path()

    # ---- mixed precision (mixed.py), on the simulation --------------------------------------------
    def pareto(self, progress: Progress | bool | None = None, *, by_block: bool = False) -> pd.DataFrame:
        """The size front of per-module choices, smallest first, each point better than every smaller
        one: ``size_bytes`` (deployed), ``simulated_output_sqnr_db``, ``simulated_metric`` (with
        ``eval_fn``), ``formats`` and ``settings`` (for ``apply``). Simulated, computed once; see
        ``mixed.py``. ``by_block=True``: every module of a block (``blocks()``) takes the same choice."""
        return self._warned(self.parts.mixed.front(shown(progress), by_block).points.copy())

    def uniform_points(self, progress: Progress | bool | None = None, *, by_block: bool = False) -> pd.DataFrame:
        """The same choice on every module that offers it (``all float``, ``all int4-weight-only
        (group 32)`` ...) and the baseline, simulated as ``pareto()`` rows, indexed by label
        (computed with ``pareto(by_block=...)``'s front)."""
        return self.parts.mixed.front(shown(progress), by_block).uniform.copy()

    def fit(
        self,
        max_size_bytes: float | None = None,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        max_metric_loss: float | None = None,
        max_metric_gap: float | None = None,
        by_block: bool = False,
        rotation: Rotation | bool | None = None,
        progress: Progress | bool | None = None,
    ) -> RunResult:
        """A real run of the size front's best point within ``max_size_bytes`` (deployed bytes), or
        of its smallest point that meets ``target_sqnr_db`` / ``target_metric`` (within the budget
        when both are given). When the real run misses (too large, or short of the target) the next
        point along the front is run, up to three more runs; the notes say met, not met or out of
        reach, and by how far. ``by_block=True``: on the front where every module of a block
        (``blocks()``) takes the same choice. ``max_metric_loss`` / ``max_metric_gap``: a metric
        target relative to the float model's, as in ``reach``. Under a size budget, on a front whose
        single choices are estimated (a decoder's), only the points that can be the answer are
        simulated whole: with a target, the chain's points within the budget that halving towards the
        smallest meeting it asks for; without one, the largest within it; the smallest, the uniform
        choices within it (the notes say how many); ``pareto()`` simulates
        them all, and a fit after it takes that front.

        ``rotation``: weigh the float model rotated (``Rotation()``, or True for R1 + R2) against
        not, as one more choice: the rotated model's own front is simulated on a session of its own
        (kept for the next fit), and the fit runs first on the front whose starting point the
        simulation ranks better (the target met at fewer bytes, else the better metric within the
        budget). When that fit's real run fits the budget and meets the target, it is returned and
        the other front was weighed in simulation only; else the other fit runs too and the better
        real run is returned. Rotated runs are recorded here as rotated; the notes name the other."""
        target_metric, how = metric_target(self.metric, self.float_metric, target_metric, max_metric_loss, max_metric_gap)
        run = self.parts.rotations.fit((max_size_bytes, target_sqnr_db, target_metric), rotation, by_block, shown(progress))
        return run if how is None else self.parts.real.annotated(run.noted(how))

    def computed(self) -> dict[str, pd.DataFrame]:
        """The diagnoses computed so far, without computing any: ``sensitivity``, ``tradeoff`` and
        ``size_front`` (the ``pareto()`` table), where they were asked for (the HTML export shows them)."""
        return {**self.parts.diagnosis.computed(), **self.parts.mixed.computed()}

    def _warned(self, found: T) -> T:
        self.parts.real.warn_if_unverified()
        return found
