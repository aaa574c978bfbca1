"""Which module hurts, and the fewest float modules that meet a target: the session's diagnosis.

``Diagnosis`` is given the runner (modules, data, the user's metric), the simulation and the real
runs. Everything here is estimated in the engine's simulation (calibrated once, forward passes
only), after the baseline checked it against the real model, except ``reach()``, which confirms
with a real run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import pandas as pd

from ..core.progress import Progress
from ..engines.contract import Variant
from ..engines.settings import FORMATS, ModuleSettings
from .truth import SIMULATION_ERROR_DB

if TYPE_CHECKING:
    from ..engines.contract import Simulation
    from .real import RealRuns
    from .run import RunResult
    from .runner import Runner
    from .simulation import Simulated


MAX_EXTRA_RUNS = 3  # real runs reach() may spend on fewer modules than the simulation asked for
REACH_CHUNK = 4  # points of the trade-off curve reach() simulates at a time, stopping at the target


@dataclass
class ReachPlan:
    """The float modules reach() would try for a target, decided in simulation."""

    target_sqnr_db: float | None
    target_metric: float | None
    order: list[str]  # most harmful first
    float_count: int
    simulated_sqnr_db: float
    met: bool  # whether the simulation meets the target with ``float_modules``
    curve: list[float] = field(default_factory=list)  # simulated output SQNR with 0, 1, ... of ``order`` float

    @property
    def float_modules(self) -> list[str]:
        return self.order[: self.float_count]

    @property
    def target(self) -> str:
        return target_words(self.target_sqnr_db, self.target_metric)

    def near(self, count: int) -> bool:
        """Whether a real run with ``count`` modules float might meet the SQNR target although the
        simulation says it falls short: within the simulation's error (``SIMULATION_ERROR_DB``).
        Metric targets have no known error band: False."""
        if self.target_metric is not None or self.target_sqnr_db is None or count >= len(self.curve):
            return False
        return self.curve[count] >= self.target_sqnr_db - SIMULATION_ERROR_DB

    def meets(self, sqnr: float, metric: float | None) -> bool:
        return meets_target(sqnr, metric, self.target_sqnr_db, self.target_metric)


def meets_target(sqnr: float, metric: float | None, target_sqnr_db: float | None, target_metric: float | None) -> bool:
    """Whether an output SQNR and a metric meet the targets given (None: no target)."""
    sqnr_ok = target_sqnr_db is None or sqnr >= target_sqnr_db
    return sqnr_ok and (target_metric is None or (metric is not None and metric >= target_metric))


def target_words(target_sqnr_db: float | None, target_metric: float | None) -> str:
    """The targets in words: "output SQNR >= 30 dB and metric >= 0.9"."""
    parts = [f"output SQNR >= {target_sqnr_db:g} dB"] if target_sqnr_db is not None else []
    return " and ".join(parts + ([f"metric >= {target_metric:g}"] if target_metric is not None else []))


class Diagnosis:
    """Sensitivity, trade-off and reach; the rankings are computed once, since the simulation never changes."""

    def __init__(self, runner: Runner, simulated: Simulated, real: RealRuns) -> None:
        self.runner, self.simulated, self.real = runner, simulated, real
        self._sensitivity: dict[bool, pd.DataFrame] = {}  # with and without the metric
        self._tradeoff: pd.DataFrame | None = None

    def computed(self) -> dict[str, pd.DataFrame]:
        """What was computed so far, nothing more: ``sensitivity`` and ``tradeoff`` where asked for."""
        found = {}
        if self._sensitivity:
            found["sensitivity"] = self._sensitivity.get(True, next(iter(self._sensitivity.values()))).copy()
        if self._tradeoff is not None:
            found["tradeoff"] = self._tradeoff.copy()
        return found

    def simulation(self, progress: Progress | None = None) -> Simulation:
        """The simulation, once the baseline checked it against the real model."""
        self.real.checked(progress)
        return self.simulated.simulation(progress)

    def simulate(self, variant: Variant | Iterable[str] = ()) -> tuple[float, float | None]:
        """Simulated output SQNR (dB) and ``eval_fn`` metric of ``variant`` (or with those modules kept float)."""
        self.simulation()
        return self.simulated.simulate(variant)

    def simulate_each(
        self,
        variants: Sequence[Variant | Iterable[str]],
        progress: Progress | None = None,
        desc: str = "simulating",
        metric: bool = True,
    ) -> list[tuple[float, float | None]]:
        """``simulate(v)`` for each variant; see ``Simulated.simulate_each``."""
        self.simulation(progress)
        return self.simulated.simulate_each(variants, progress, desc, metric)

    def sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which module hurts: for each tunable module, the output SQNR gained when only it stays
        float, estimated by simulation (calibrated once, forward passes only), most harmful first.

        Columns: ``output_sqnr_gain_db``; ``metric_gain`` (with ``eval_fn``); ``local_sqnr_db``, the
        module's own error on the inputs the float model gives it (not accumulated from earlier
        layers); ``simulated_output_sqnr_db``. ``progress(done, total)`` is called as the work
        advances (calibration batches, then simulated steps). ``metric=False`` leaves ``eval_fn``
        out: each module then costs a replayed part of a pass instead of a whole pass.
        """
        metric = metric and self.runner.eval_fn is not None
        if metric in self._sensitivity or (not metric and True in self._sensitivity):
            return self._sensitivity.get(metric, self._sensitivity.get(True)).copy()
        names = list(self.simulation(progress).tunable)
        local = self.simulated.local_sqnr()
        variants = [[]] + [[name] for name in names]
        (base_sqnr, base_metric), *each = self.simulate_each(variants, progress, "sensitivity", metric=metric)
        rows = [
            {
                "module": name,
                "output_sqnr_gain_db": sqnr - base_sqnr,
                **({"metric_gain": metric - base_metric} if metric is not None and base_metric is not None else {}),
                "local_sqnr_db": local.get(name, math.nan),
                "simulated_output_sqnr_db": sqnr,
            }
            for name, (sqnr, metric) in zip(names, each, strict=True)
        ]
        empty = ["module", "output_sqnr_gain_db", "local_sqnr_db", "simulated_output_sqnr_db"]
        table = pd.DataFrame(rows, columns=None if rows else empty)
        table = table.set_index("module").sort_values("output_sqnr_gain_db", ascending=False, kind="stable")
        self._sensitivity[metric] = table
        return table.copy()

    def format_sensitivity(self, progress: Progress | None = None) -> pd.DataFrame:
        """What each format costs where: for each module the start quantizes, on an engine with
        formats (eager), the simulated output SQNR (dB) when it alone takes each format it allows
        (the others as they start); NaN where a format does not apply. Sorted by ``cost_db``, what
        its starting format costs (float minus start: the gain of keeping it float), most first.
        Empty on engines without formats. Computed in the simulation, no real run."""
        modules = [m for m in self.runner.modules if m.formats and not m.current.keep_float]
        columns = ["float", *FORMATS[1:]]
        if not modules:
            return pd.DataFrame(columns=[*columns, "start", "cost_db"], dtype=float)
        variants: list[Variant] = [Variant()]
        cells: list[tuple[str, str]] = []
        for module in modules:
            for name in columns:
                if module.format_allowed(name) and (name == "float" or name != module.current.format):
                    variants.append(Variant(settings=frozenset({(module.fqn, ModuleSettings(format=name))})))
                    cells.append((module.fqn, name))
        (start, _), *each = self.simulate_each(variants, progress, "format sensitivity", metric=False)
        table = pd.DataFrame(math.nan, index=pd.Index([m.fqn for m in modules], name="module"), columns=columns)
        for (fqn, name), (sqnr, _) in zip(cells, each, strict=True):
            table.loc[fqn, name] = sqnr
        for module in modules:
            table.loc[module.fqn, module.current.format] = start
        table["start"] = [m.current.quantized_format for m in modules]
        table["cost_db"] = table["float"] - start
        return table.sort_values("cost_db", ascending=False, kind="stable")

    def tradeoff(self, progress: Progress | None = None) -> pd.DataFrame:
        """The trade-off curve: keeping the most harmful modules float one after the other (the
        sensitivity ranking), the simulated output SQNR (and metric) after each step.

        One row per number of float modules, from 0: ``added`` (the module made float at that step),
        ``simulated_output_sqnr_db`` and, with ``eval_fn``, ``simulated_metric``.
        """
        if self._tradeoff is not None:
            return self._tradeoff.copy()
        order = list(self.sensitivity(progress).index)
        points = self.simulate_each([order[:count] for count in range(len(order) + 1)], progress, "trade-off")
        rows = [
            {
                "float_modules": count,
                "added": order[count - 1] if count else "",
                "simulated_output_sqnr_db": sqnr,
                **({"simulated_metric": metric} if metric is not None else {}),
            }
            for count, (sqnr, metric) in enumerate(points)
        ]
        self._tradeoff = pd.DataFrame(rows).set_index("float_modules")
        return self._tradeoff.copy()

    def reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        progress: Progress | None = None,
    ) -> RunResult:
        """The fewest modules kept float (most harmful first) that meet the target, confirmed by a real run.

        The simulation picks the count; a real prepare -> calibrate -> convert run confirms it, and
        if the real run falls short the next modules are added (up to three more real runs). When
        no count meets the target even in simulation, the run of the best simulated point is
        returned. Either way ``notes`` say whether the target was met, and the run's ``settings``
        name the float modules.
        """
        plan = self.plan_reach(target_sqnr_db, target_metric, progress=progress)
        order, count, target, meets = plan.order, plan.float_count, plan.target, plan.meets
        label = f"reach {target}"
        if not plan.met:
            result = self._float_run(order[:count], label, progress)
            return self._unverified(
                result.noted(
                    f"{target} is out of reach: even in simulation the best is {plan.simulated_sqnr_db:.2f} dB "
                    f"with {count} module(s) float; this run keeps those float",
                )
            )
        result = self._float_run(order[:count], label, progress)
        for _ in range(3):  # the real run may fall short of the simulated one: add the next module
            if not result.ok or meets(result.output_sqnr_db, result.eval_metric) or count >= len(order):
                break
            count += 1
            result = self._float_run(order[:count], label, progress)
        # or need fewer than simulated: the smallest count within the simulation's error that meets it for real
        if result.ok and meets(result.output_sqnr_db, result.eval_metric):
            for fewer in [c for c in range(count) if plan.near(c)][:MAX_EXTRA_RUNS]:
                run = self._float_run(order[:fewer], label, progress)
                if run.ok and meets(run.output_sqnr_db, run.eval_metric):
                    count, result = fewer, run
                    break
        verdict = "met" if result.ok and meets(result.output_sqnr_db, result.eval_metric) else "not met by the real run"
        floats = ", ".join(order[:count]) or "none"
        return self._unverified(result.noted(f"{target}: {verdict} with {count} of {len(order)} modules float ({floats})"))

    def _unverified(self, result: RunResult) -> RunResult:
        """``result`` with a note when the simulation does not match the real model, in its run's place."""
        status = self.real.unverified_note()
        if status is not None:
            result = result.noted(f"{status}: the plan was simulated, each step is a real run")
        return self.real.annotated(result)

    def plan_reach(
        self, target_sqnr_db: float | None = None, target_metric: float | None = None, *, progress: Progress | None = None
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone: the fewest most-harmful modules to keep
        float for the target, or the best point of the trade-off curve when none meets it."""
        if target_sqnr_db is None and target_metric is None:
            raise ValueError("reach() needs target_sqnr_db, target_metric or both")
        if target_metric is not None and self.runner.eval_fn is None:
            raise ValueError("target_metric needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
        ranking = self.sensitivity(progress, metric=target_metric is not None)
        order = list(ranking.index)
        if target_metric is None and self._tradeoff is None:  # SQNR only: a few points at a time, up to the target
            helpful = int((ranking["output_sqnr_gain_db"] > 0).sum())  # or up to the last helpful module
            sqnrs: list[float] = []
            while len(sqnrs) <= helpful and not (sqnrs and max(sqnrs) >= target_sqnr_db):
                counts = range(len(sqnrs), min(len(sqnrs) + REACH_CHUNK, helpful + 1))
                points = self.simulate_each([order[:count] for count in counts], progress, "reach", metric=False)
                sqnrs += [sqnr for sqnr, _ in points]
            curve = pd.DataFrame({"simulated_output_sqnr_db": sqnrs})
        else:  # a metric target reads the whole curve, with the metric at every point
            curve = self.tradeoff(progress)
        plan = ReachPlan(target_sqnr_db, target_metric, order, 0, math.nan, False, list(curve["simulated_output_sqnr_db"]))
        metrics = curve["simulated_metric"] if "simulated_metric" in curve else pd.Series(math.nan, index=curve.index)
        for count in curve.index:
            if plan.meets(curve.at[count, "simulated_output_sqnr_db"], metrics[count]):
                plan.float_count, plan.met = int(count), True
                break
        else:
            plan.float_count = int(curve["simulated_output_sqnr_db"].idxmax())
        plan.simulated_sqnr_db = float(curve.at[plan.float_count, "simulated_output_sqnr_db"])
        return plan

    def _float_run(self, float_modules: Sequence[str], label: str, progress: Progress | None) -> RunResult:
        if not float_modules:  # the starting configuration: its run is known
            baseline = self.real.baseline(progress)
            return replace(baseline, label=label, settings={}, baseline=False) if baseline.ok else baseline
        keep = {name: ModuleSettings(keep_float=True) for name in float_modules}
        return self.real.apply(keep, label=label, progress=progress)
