"""Which module hurts, and the fewest float modules that meet a target: the session's diagnosis.

``Diagnosis`` is given the runner (modules, data, the user's metric), the simulation and the real
runs. Everything here is estimated in the engine's simulation (calibrated once, forward passes
only), after the baseline checked it against the real model, except ``reach()``, which confirms
with a real run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..core.metrics import FLOAT_ROUNDOFF_DB, Metric, is_float_output
from ..core.progress import Progress, quiet
from ..engines.contract import Variant
from ..engines.settings import FORMATS, ModuleSettings, module_blocks
from .migration import input_producers
from .runner import identities
from .search import MIN_STEP_DB, Action, FloatSearch, SearchPath, Step
from .truth import SIMULATION_ERROR_DB

if TYPE_CHECKING:
    from ..engines.contract import Simulation
    from .real import RealRuns
    from .run import RunResult
    from .runner import Runner
    from .simulation import Simulated


MAX_EXTRA_RUNS = 3  # real runs reach() may spend on fewer modules than the simulation asked for


@dataclass
class ReachPlan:
    """The float modules reach() would try for a target, decided in simulation."""

    target_sqnr_db: float | None
    target_metric: float | None
    order: list[str]  # most harmful first
    float_count: int
    simulated_sqnr_db: float
    met: bool  # whether the simulation meets the target with ``float_modules``
    curve: list[float] = field(default_factory=list)  # simulated output SQNR at the start and after each step
    path: SearchPath | None = None  # what the in-context search did
    metric: Metric = field(default_factory=Metric)  # what target_metric is a target of, and its direction

    @property
    def float_modules(self) -> list[str]:
        return self.order[: self.float_count]

    @property
    def target(self) -> str:
        return target_words(self.target_sqnr_db, self.target_metric, self.metric)

    def meets(self, sqnr: float, metric: float | None) -> bool:
        return meets_target(sqnr, metric, self.target_sqnr_db, self.target_metric, self.metric)


def meets_target(
    sqnr: float,
    metric: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric | None = None,
) -> bool:
    """Whether an output SQNR and a metric meet the targets given (None: no target); the metric's
    target is met in ``measures``' direction (default: at or above it). An output within float
    round-off of the float model's is the float model's output, and meets any SQNR target."""
    sqnr_ok = target_sqnr_db is None or sqnr >= target_sqnr_db or is_float_output(sqnr)
    return sqnr_ok and (target_metric is None or (measures or Metric()).meets(metric, target_metric))


def ceiling_reached(sqnr: float) -> str:
    """A real run's output SQNR in words, for the most an engine reaches: the float model's output
    exactly, within float round-off (kernels that sum in another order), or so many dB."""
    if math.isinf(sqnr):
        return "the float model's output exactly"
    if is_float_output(sqnr):
        return (
            f"the float model's output, within float round-off ({sqnr:.2f} dB; at or above {FLOAT_ROUNDOFF_DB:g} dB "
            "an output differs from the float model's only by the order its kernels sum in)"
        )
    return f"{sqnr:.2f} dB"


def metric_target(
    metric: Metric | None,
    float_metric: Callable[[], float | None],
    target_metric: float | None,
    max_metric_loss: float | None,
    max_metric_gap: float | None,
) -> tuple[float | None, str | None]:
    """The metric's target: ``target_metric`` as given, or set from the float model's metric
    (``float_metric()``, asked only then) at most ``max_metric_loss`` (a fraction) or ``max_metric_gap``
    worse; and the words that say how a relative one was set (None for an absolute one)."""
    given = {"target_metric": target_metric, "max_metric_loss": max_metric_loss, "max_metric_gap": max_metric_gap}
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        raise ValueError(f"give one metric target, not {' and '.join(named)}")
    if max_metric_loss is None and max_metric_gap is None:
        return target_metric, None
    (name,) = named
    value = given[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if max_metric_loss is not None and max_metric_loss >= 1:
        raise ValueError(f"max_metric_loss is a fraction of the float model's metric (0.01: 1%), got {max_metric_loss!r}")
    reference = float_metric() if metric is not None else None
    if reference is None or metric is None:
        raise ValueError(f"{name} needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
    if not math.isfinite(reference):
        raise ValueError(f"the float model's metric is {reference}: {name} needs a finite one to be relative to")
    target = metric.allowing(reference, loss=max_metric_loss, gap=max_metric_gap)
    moved = f"{max_metric_loss:.2%}" if max_metric_loss is not None else f"{max_metric_gap:g}"
    return target, f"the target is the float model's {metric.name} {reference:.6g}, {moved} worse at most: {target:.6g}"


def target_words(target_sqnr_db: float | None, target_metric: float | None, measures: Metric | None = None) -> str:
    """The targets in words: "output SQNR >= 30 dB and metric >= 0.9", "perplexity <= 5.1"."""
    parts = [f"output SQNR >= {target_sqnr_db:g} dB"] if target_sqnr_db is not None else []
    return " and ".join(parts + ([(measures or Metric()).words(target_metric)] if target_metric is not None else []))


class Diagnosis:
    """Sensitivity, trade-off and reach; the rankings are computed once, since the simulation never changes."""

    def __init__(self, runner: Runner, simulated: Simulated, real: RealRuns) -> None:
        self.runner, self.simulated, self.real = runner, simulated, real
        self._sensitivity: dict[bool, pd.DataFrame] = {}  # with and without the metric
        self._block_sensitivity: dict[bool, pd.DataFrame] = {}
        self._tradeoff: pd.DataFrame | None = None
        self._searches: dict[tuple[bool, bool], FloatSearch] = {}  # (by the metric, over blocks)
        self._searched: tuple[SearchPath, RunResult] | None = None  # the last reach()'s path and run
        self._simulation_version = simulated.version

    def _fresh(self) -> None:
        """Drop what was estimated in a simulation that has changed since (real kernels adopted)."""
        if self._simulation_version != self.simulated.version:
            self._sensitivity.clear()
            self._block_sensitivity.clear()
            self._tradeoff, self._searches, self._simulation_version = None, {}, self.simulated.version

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

    @property
    def _metric(self) -> Metric:
        """What the session's eval_fn measures (higher is better when it did not say)."""
        return self.runner.metric or Metric()

    def sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which module hurts, one at a time: for each tunable module, the output SQNR gained when
        only it stays float (modules whose errors only matter together gain nothing here: the
        in-context search of ``reach()`` finds them), estimated by simulation (calibrated once,
        forward passes only), most harmful first.

        Columns: ``output_sqnr_gain_db``; ``metric_gain`` (with ``eval_fn``); ``local_sqnr_db``, the
        module's own error on the inputs the float model gives it (not accumulated from earlier
        layers); ``simulated_output_sqnr_db``. ``progress(done, total)`` is called as the work
        advances (calibration batches, then simulated steps). ``metric=False`` leaves ``eval_fn``
        out: each module then costs a replayed part of a pass instead of a whole pass.
        """
        metric = metric and self.runner.eval_fn is not None
        self._fresh()
        known = _ranked(self._sensitivity, metric)
        if known is not None:
            return known
        names = list(self.simulation(progress).tunable)
        local = self.simulated.local_sqnr()
        variants = [[]] + [[name] for name in names]
        (base_sqnr, base_metric), *each = self.simulate_each(variants, progress, "sensitivity", metric=metric)
        rows = [
            {
                "module": name,
                "output_sqnr_gain_db": sqnr - base_sqnr,
                **(
                    {"metric_gain": self._metric.gain(metric, base_metric)}
                    if metric is not None and base_metric is not None
                    else {}
                ),
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

    def block_sensitivity(self, progress: Progress | None = None, *, metric: bool = True) -> pd.DataFrame:
        """Which block hurts: the modules the start quantizes grouped by the numbered block that holds
        them (``module_blocks``: ``model.layers.3`` of a decoder; a module in none, an embedding or a
        head, is its own), each block kept float whole, simulated; most harmful first. Computed once
        per simulation; ``metric=False`` leaves ``eval_fn`` out.

        Columns: ``modules`` (how many), ``output_sqnr_gain_db``, ``metric_gain`` (with a metric),
        ``simulated_output_sqnr_db``; indexed by block."""
        metric = metric and self.runner.eval_fn is not None
        self._fresh()
        known = _ranked(self._block_sensitivity, metric)
        if known is not None:
            return known
        blocks = self.blocks(progress)
        variants = [[]] + [members for members in blocks.values()]
        (base_sqnr, base_metric), *each = self.simulate_each(variants, progress, "block sensitivity", metric=metric)
        rows = []
        for (block, members), (sqnr, value) in zip(blocks.items(), each, strict=True):
            row = {"block": block, "modules": len(members), "output_sqnr_gain_db": sqnr - base_sqnr}
            if value is not None and base_metric is not None:
                row["metric_gain"] = self._metric.gain(value, base_metric)
            rows.append({**row, "simulated_output_sqnr_db": sqnr})
        table = pd.DataFrame(
            rows, columns=None if rows else ["block", "modules", "output_sqnr_gain_db", "simulated_output_sqnr_db"]
        )
        table = table.set_index("block").sort_values("output_sqnr_gain_db", ascending=False, kind="stable")
        self._block_sensitivity[metric] = table
        return table.copy()

    def blocks(self, progress: Progress | None = None) -> dict[str, list[str]]:
        """The modules the simulation tunes, grouped by block (``module_blocks``), forward order."""
        return module_blocks(self.simulation(progress).tunable)

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
        self._fresh()
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
        by_block: bool = False,
        progress: Progress | None = None,
    ) -> RunResult:
        """The fewest modules kept float that meet the target, found by the in-context search and
        confirmed by a real run; ``by_block``: the fewest blocks (``module_blocks``), each kept float whole.

        The search (``search.py``) picks each module by what it gains given the picks before it, in
        the simulation; a real prepare -> calibrate -> convert run confirms the chosen set. When the
        real run falls short, the search goes on from that set for a target raised by the shortfall
        (up to three more real runs); when it meets the target, a smaller set the search simulated
        within the simulation's error is tried. When no set meets the target even in simulation,
        the run of the best simulated set is returned. ``notes`` say what happened, the run's
        ``settings`` name the float modules, and ``search_path()`` is the path as a table.
        """
        plan = self.plan_reach(target_sqnr_db, target_metric, by_block=by_block, progress=progress)
        path, target, meets = plan.path, plan.target, plan.meets
        assert path is not None
        label = f"reach {target}" + (" by block" if by_block else "")
        unit = "block" if by_block else "module"

        def modules(units: Iterable[str]) -> list[str]:  # a real run may make more modules tunable: asked each time
            return _members(units, self._units(by_block, progress))

        chosen = list(path.chosen)
        kernels = self.real.truth(quiet).real_kernels  # a real run may find more (``RealRuns.adopt_kernels``)
        result = self._float_run(modules(chosen), label, progress)
        said: list[str] = []
        adopted = self.real.adopted_since(kernels) if not plan.met else []
        if adopted:  # the run found broken kernels: plan again with them
            run_words = f"the real run with {len(chosen)} {unit}(s) float"
            said.append(f"{self.real.adopted_words(run_words, adopted)}; the search planned again with them")
            kernels = self.real.truth(quiet).real_kernels
            again = self.plan_reach(target_sqnr_db, target_metric, by_block=by_block, progress=progress)
            path, plan = again.path, again
            assert path is not None
            if frozenset(path.chosen) != frozenset(chosen):
                chosen = list(path.chosen)
                result = self._float_run(modules(chosen), label, progress)
        if not plan.met:
            return self._out_of_reach(plan, result, chosen, said, label, by_block, progress)
        tried = {frozenset(chosen)}  # the sets a real run measured
        runs = [(chosen, result)]
        for _ in range(MAX_EXTRA_RUNS):  # the real run falls short: search on from it, aiming higher
            if not result.ok or meets(result.output_sqnr_db, result.eval_metric):
                break
            more = self._search_on(path, result, chosen, plan, kernels, by_block, progress)
            if more is None:
                said.append("the search found nothing more to keep float in simulation")
                break
            path, words = more
            said.append(words)
            chosen = list(path.chosen)
            tried.add(frozenset(chosen))
            result = self._float_run(modules(chosen), label, progress)
            runs.append((chosen, result))
        last = result  # the run search_path() shows on its last row
        if not (result.ok and meets(result.output_sqnr_db, result.eval_metric)) and len(runs) > 1:
            chosen, result = self._best_of(runs, target_metric is not None)
            if result is not last:
                said.append(
                    f"none of the {len(runs)} real runs met it; the closest, with {len(chosen)} {unit}(s) float "
                    f"({result.output_sqnr_db:.2f} dB), is the one returned"
                )
        if result.ok and meets(result.output_sqnr_db, result.eval_metric) and target_metric is None:
            near = target_sqnr_db - SIMULATION_ERROR_DB  # a smaller set within the simulation's error may meet it for real
            smaller = [s for s in path.smaller(lambda sqnr, _metric: sqnr >= near) if s not in tried]
            for fewer in smaller[:MAX_EXTRA_RUNS]:
                ordered = [m for m in chosen if m in fewer] + sorted(fewer - set(chosen))
                run = self._float_run(modules(ordered), label, progress)
                if run.ok and meets(run.output_sqnr_db, run.eval_metric):
                    chosen, result, last = ordered, run, run
                    said.append(f"{len(fewer)} {unit}(s) float, within the simulation's error of the target, meet it for real")
                    break
        self._searched = (path, last)
        verdict = "met" if result.ok and meets(result.output_sqnr_db, result.eval_metric) else "not met by the real run"
        floats = ", ".join(chosen) or "none"
        if by_block:
            kept = f"{len(chosen)} of {len(self.blocks(progress))} blocks float ({floats}: {len(modules(chosen))} modules)"
        else:
            kept = f"{len(chosen)} of {len(self.runner.modules)} modules float ({floats})"
        return self._unverified(result.noted(*said, f"{target}: {verdict} with {kept}"))

    def _best_of(self, runs: list[tuple[list[str], RunResult]], by_metric: bool) -> tuple[list[str], RunResult]:
        """The real run closest to the target: the best metric (a metric target) or output SQNR."""
        done = [(chosen, run) for chosen, run in runs if run.ok] or runs[-1:]

        def score(run: RunResult) -> float:
            if by_metric:
                value = run.eval_metric if run.eval_metric is not None else math.nan
                return _finite(value if self._metric.higher_is_better else -value)
            return _finite(run.output_sqnr_db)

        return max(reversed(done), key=lambda item: score(item[1]))  # the later run of two equal ones

    def _out_of_reach(
        self,
        plan: ReachPlan,
        result: RunResult,
        chosen: list[str],
        said: list[str],
        label: str,
        by_block: bool,
        progress: Progress | None,
    ) -> RunResult:
        """No set meets the target in simulation: the ceiling said, from one real run with every unit
        the search may keep float; that run is returned when it meets the target (the simulation was
        wrong about it), else the best set's."""
        path, unit = plan.path, "block" if by_block else "module"
        assert path is not None
        units = self._units(by_block, progress)
        every = list(units)
        (ceiling,) = self._searcher(plan.target_metric is not None, by_block, progress).measure([every])
        words = [
            *said,
            f"{plan.target} is out of reach in simulation: the best the in-context search found is "
            f"{plan.simulated_sqnr_db:.2f} dB with {len(chosen)} {unit}(s) float",
            *path.notes,
        ]
        top = (
            self._float_run(_members(every, units), f"{label}: every {unit} float", progress)
            if set(chosen) != set(every)
            else result
        )
        if not top.ok:
            words.append(f"every {unit} float simulates at {_finite(ceiling[0]):.2f} dB; its real run failed")
            self._searched = (path, result)
            return self._unverified(result.noted(*words))
        left = still_quantized(top.quantized_model)
        reached = ceiling_reached(top.output_sqnr_db)
        ceiling_words = (
            f"the most this engine reaches on this model is {reached}: a real run with all {len(every)} "
            f"{unit}s float (simulated {_finite(ceiling[0]):.2f} dB)"
            + (f"; still quantized then: {', '.join(left)}" if left else "")
        )
        why = f"the ceiling: every {unit} the search may keep float, in a real run"
        last = _real_step(Action.CEILING, every, path, ceiling, why, top.output_sqnr_db)
        if plan.meets(top.output_sqnr_db, top.eval_metric):
            topped = replace(
                path, steps=[*path.steps, last], chosen=tuple(every), simulated_db=ceiling[0], simulated_metric=ceiling[1]
            )
            self._searched = (topped, top)
            met = f"{plan.target}: met by the real run with every {unit} float, which the simulation put short of it"
            return self._unverified(top.noted(*words, ceiling_words, met))
        self._searched = (path, result)
        kept = f"this run keeps the search's best {len(chosen)} {unit}(s) float"
        return self._unverified(result.noted(*words, ceiling_words, kept))

    def _search_on(
        self,
        path: SearchPath,
        result: RunResult,
        chosen: list[str],
        plan: ReachPlan,
        kernels: tuple[str, ...],
        by_block: bool,
        progress: Progress | None,
    ) -> tuple[SearchPath, str] | None:
        """The search continued from a real run that fell short, for the target raised by the
        shortfall; None when it adds nothing."""
        said = []
        adopted = self.real.adopted_since(kernels)
        if adopted:  # the simulation changed: what it measured before is stale (``_fresh``)
            found = self.real.adopted_words(f"the real run with {len(chosen)} module(s) float", adopted)
            said.append(f"{found}; the simulation runs them from now on")
        metric = plan.target_metric is not None
        (simulated,) = self._searcher(metric, by_block, progress).measure([chosen])
        shortfall = max(_finite(simulated[0]) - result.output_sqnr_db, 0.0)
        raised_db = None if plan.target_sqnr_db is None else plan.target_sqnr_db + shortfall + MIN_STEP_DB
        raised_metric = None
        measures = self._metric
        if plan.target_metric is not None:  # how much better the simulation looked than the run, in the metric
            gap = measures.gain(simulated[1] or 0.0, result.eval_metric if result.eval_metric is not None else 0.0)
            raised_metric = measures.stricter(plan.target_metric, max(_finite(gap), 0.0))
        search = self._searcher(metric, by_block, progress)
        raised = search.aiming(lambda s, m: meets_target(s, m, raised_db, raised_metric, measures), by_metric=raised_db is None)
        found = raised.run(start=chosen)
        if set(found.chosen) <= set(chosen) or not found.met:
            return None
        aim = f"the search went on from it, aiming at {target_words(raised_db, raised_metric, measures)}"
        if adopted:
            said.append(
                f"simulated with them, the {len(chosen)} module(s) float give {_finite(simulated[0]):.2f} dB against the "
                f"run's {result.output_sqnr_db:.2f} dB: {aim}"
            )
        else:
            beyond = "more than" if shortfall > SIMULATION_ERROR_DB else "within"
            said.append(
                f"the real run with {len(chosen)} module(s) float gave {result.output_sqnr_db:.2f} dB, "
                f"{shortfall:.2f} dB below its simulation ({beyond} the simulation's stated error of "
                f"{SIMULATION_ERROR_DB:g} dB): {aim}"
            )
        why = "re-simulated after the real run" + (f", which found {', '.join(adopted)} broken" if adopted else "")
        again = _real_step(Action.REAL, chosen, path, simulated, why, result.output_sqnr_db)
        steps = [*path.steps, again, *found.steps]
        merged = replace(found, steps=steps, start_db=path.start_db, start_metric=path.start_metric)
        merged.simulated += path.simulated
        merged.seconds += path.seconds
        return merged, "; ".join(said)

    def search_path(self) -> pd.DataFrame:
        """The last ``reach()``'s search as a table (see ``SearchPath.frame``), the real run's
        output SQNR on its last row; empty before any ``reach()``."""
        if self._searched is None:
            return SearchPath(math.nan, None, [], (), math.nan, None, False).frame().iloc[0:0]
        path, run = self._searched
        return path.frame(run.output_sqnr_db if run.ok else None, run.eval_metric if run.ok else None)

    def _unverified(self, result: RunResult) -> RunResult:
        """``result`` with a note when the simulation does not match the real model, in its run's place."""
        status = self.real.unverified_note()
        if status is not None:
            result = result.noted(f"{status}: the plan was simulated, each step is a real run")
        return self.real.annotated(result)

    def plan_reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        by_block: bool = False,
        progress: Progress | None = None,
    ) -> ReachPlan:
        """What reach() would try, from the simulation alone: the float modules the in-context search
        chose for the target, or the best set it found when none meets it. ``by_block``: the search
        picks blocks (``module_blocks``), each kept float whole; the plan's ``order`` names modules,
        its path blocks."""
        if target_sqnr_db is None and target_metric is None:
            raise ValueError("reach() needs target_sqnr_db, target_metric or both")
        if target_metric is not None and self.runner.eval_fn is None:
            raise ValueError("target_metric needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
        measures = self._metric
        search = self._searcher(target_metric is not None, by_block, progress).aiming(
            lambda s, m: meets_target(s, m, target_sqnr_db, target_metric, measures), by_metric=target_sqnr_db is None
        )
        path = search.run()
        if not path.met:  # the best set the search measured
            best = search.best()
            if best != frozenset(path.chosen):
                sqnr, metric = path.measured[best]
                named = tuple(m for m in search.ranking if m in best)
                path = replace(path, chosen=named, simulated_db=sqnr, simulated_metric=metric)
        chosen = list(path.chosen)
        units = self._units(by_block, progress)
        order = _members(chosen + [m for m in search.ranking if m not in chosen], units)
        curve = [path.start_db, *(step.simulated_db for step in path.steps)]
        floats = len(_members(chosen, units))
        return ReachPlan(target_sqnr_db, target_metric, order, floats, path.simulated_db, path.met, curve, path, measures)

    def _units(self, by_block: bool, progress: Progress | None) -> dict[str, list[str]]:
        """What the search picks: each module the simulation can keep float alone (those it ranks,
        then the other ops), or the blocks -> their modules."""
        if by_block:
            return self.blocks(progress)
        simulation = self.simulation(progress)
        passing = identities(self.runner.float_model)  # a dropout: nothing to keep float
        return {name: [name] for name in [*simulation.tunable, *simulation.others] if name not in passing}

    def _searcher(self, metric: bool, by_block: bool, progress: Progress | None) -> FloatSearch:
        """The in-context search over the tunable modules, or their blocks (each set measured with
        ``eval_fn`` when ``metric``), every set measured so far kept."""
        if by_block:
            ranking = self.block_sensitivity(progress, metric=metric)  # fresh
        else:
            ranking = self.sensitivity(progress, metric=metric)
        truth = self.real.truth(quiet)
        key = (metric, by_block)
        if key not in self._searches:
            units = self._units(by_block, progress)

            def measure(sets: Sequence[frozenset[str]]) -> list[tuple[float, float | None]]:
                variants = [Variant(float_modules=frozenset(_members(s, units))) for s in sets]
                return self.simulate_each(variants, progress, "in-context search", metric=metric)

            ranked = set(ranking.index)
            neighbours = unit_neighbours(self.runner.float_model, {u: m for u, m in units.items() if u in ranked})
            disagreeing = units_of(truth.disagreeing, units)
            others = [u for u in units if u not in ranked]
            search = FloatSearch(
                measure,
                list(ranking.index),
                disagreeing,
                neighbours,
                higher_is_better=self._metric.higher_is_better,
                others=others,
            )
            if not metric:  # the ranking simulated each unit alone already, in the same simulation
                search.known({frozenset([u]): (float(sqnr), None) for u, sqnr in ranking["simulated_output_sqnr_db"].items()})
            self._searches[key] = search
        return self._searches[key]

    def _float_run(self, float_modules: Sequence[str], label: str, progress: Progress | None) -> RunResult:
        if not float_modules:  # the starting configuration: its run is known
            baseline = self.real.baseline(progress)
            return replace(baseline, label=label, settings={}, baseline=False) if baseline.ok else baseline
        keep = {name: ModuleSettings(keep_float=True) for name in float_modules}
        return self.real.apply(keep, label=label, progress=progress)


def still_quantized(model: torch.nn.Module | None) -> list[str]:
    """The ops of a converted FX graph that still compute on quantized tensors (between a
    ``quantize_per_tensor`` and the ``dequantize`` that ends it: a permute, a view, an add the engine
    quantizes with no module of its own); empty for a model that is no graph."""
    if not isinstance(model, torch.fx.GraphModule):
        return []
    starts = {torch.quantize_per_tensor, torch.quantize_per_channel, torch.quantize_per_tensor_dynamic}
    found: list[str] = []
    frontier = [n for n in model.graph.nodes if n.op == "call_function" and n.target in starts]
    seen = set(frontier)
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in seen or (user.op == "call_method" and user.target == "dequantize"):
                continue
            if user.op == "call_function" and user.target is torch.dequantize:
                continue
            seen.add(user)
            if user.op != "output":
                found.append(str(user.target) if user.op == "call_module" else user.name)
                frontier.append(user)
    return found


def dataflow_neighbours(model: torch.nn.Module, names: Sequence[str]) -> dict[str, set[str]]:
    """Module -> the modules among ``names`` it reads its input from or feeds (where ``torch.fx``
    traces the float model and a module's input is another module's output)."""
    found: dict[str, set[str]] = {name: set() for name in names}
    for consumer, producer in input_producers(model, names).items():
        if producer in found:
            found[consumer].add(producer)
            found[producer].add(consumer)
    return found


def unit_neighbours(model: torch.nn.Module, units: Mapping[str, Sequence[str]]) -> dict[str, set[str]]:
    """Unit (a module, or a block of modules) -> the other units it reads its input from or feeds
    (``dataflow_neighbours`` of their modules)."""
    unit_of = {name: unit for unit, members in units.items() for name in members}
    found: dict[str, set[str]] = {unit: set() for unit in units}
    for name, others in dataflow_neighbours(model, list(unit_of)).items():
        found[unit_of[name]] |= {unit_of[other] for other in others} - {unit_of[name]}
    return found


def units_of(names: Iterable[str], units: Mapping[str, Sequence[str]]) -> list[str]:
    """The units holding any of ``names``, first-seen order."""
    unit_of = {name: unit for unit, members in units.items() for name in members}
    return list(dict.fromkeys(unit_of[name] for name in names if name in unit_of))


def _real_step(
    action: str, units: Sequence[str], path: SearchPath, simulated: tuple[float, float | None], why: str, real_db: float
) -> Step:
    """A step of ``path`` where a real run measured ``units`` kept float: its simulated point, gained
    against the path's last, and the run's SQNR."""
    gain = _finite(simulated[0]) - _finite(path.simulated_db)
    return Step(action, tuple(units), gain, simulated[0], simulated[1], len(units), why, real_db)


def _finite(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def _ranked(tables: Mapping[bool, pd.DataFrame], metric: bool) -> pd.DataFrame | None:
    """A copy of the ranking computed before with (True) or without the metric, where there is one
    (one with the metric serves a ranking without it too)."""
    found = tables.get(metric, None if metric else tables.get(True))
    return None if found is None else found.copy()


def _members(units: Iterable[str], members: Mapping[str, Sequence[str]]) -> list[str]:
    """The modules of ``units`` (modules or blocks), in their order."""
    return [name for unit in units for name in members[unit]]
