"""Mixed precision: per-module choices by deployed size and simulated quality, and a verified fit.

``size_front`` finds the front without a real run per candidate. In the simulation (calibrated
once) each module alone takes each choice its engine offers (``Engine.size_choices``: on the eager
engine float and every format with its group sizes; on FX and PT2E int8 or float); the output noise
power a choice adds to the start's, and the bytes it adds, are taken as additive over modules.
Per module, the choices on the lower convex hull of (bytes, noise) are the ones worth taking;
walking every module's hull steps in order of noise removed per byte, from every module at its
smallest, gives a chain from the smallest model to the best. Up to ``MAX_SIMULATED`` points of the
chain are then simulated whole (the modules' interactions included) beside the uniform choices
(all float, all int8, all int4 ...). Errors that compound (int4 blocks of a decoder, one after the
other) make a step worth less or more once other steps are taken than it was alone: on fronts of at
most ``IN_CONTEXT_UNITS`` units the chain is walked again with every step re-measured given the
steps before (``_walked_in_context``), and its points join the others. The front is the simulated
points each better than every smaller one, every module float aside (that is the float model, not a
quantization of it): better by the session's metric where it has one (perplexity: the judge the user
named; the output SQNR need not follow it, e.g. a decoder whose head reads a quantized embedding),
else by output SQNR.
``fit`` confirms a point with a real run, and steps along the front when it misses. A fit under a
size budget never answers with a point above it, so on a front whose single choices are estimated it
simulates whole only the points within the budget (and the smallest, its answer when none fits); one
without a target takes the best point within it, so only the largest of those; one with a target the
smallest meeting it, found by halving along the chain's points within it (``size_front(budget=)``).
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.calibration import rows_holding, sequence_shape
from ..core.metrics import Metric
from ..core.progress import Progress, quiet
from ..core.shortcuts import Shortcut, checking, confirmed
from ..engines.contract import Variant
from ..engines.settings import DEFAULT_GROUP_SIZE, ModuleSettings, Setting, TunableModule, module_blocks
from ..errors import QReportError
from .diagnosis import MAX_EXTRA_RUNS, meets_target, target_words, unit_neighbours, units_of
from .search import SHORTLIST, FloatSearch
from .truth import SIMULATION_ERROR_DB

if TYPE_CHECKING:
    from ..engines.rotation import Rotation
    from .real import RealRuns
    from .run import RunResult
    from .runner import Runner
    from .simulation import Simulated

# more single choices than this (a decoder: every module, every format and group size) and only
# keeping each module float is simulated whole; the other choices are estimated (``_estimated_alone``)
ESTIMATED_BEYOND = 240
# on such a front the single choices and the in-context search, which only rank steps, are simulated on
# this many evaluation batches (the points of the front on all of them): a 135M decoder's front
# simulates about 700 variants to rank, each a whole model's pass per batch; where the output is a
# large vocabulary's logits, those passes compute a sample of them (``Simulated.head_sample``): Gemma
# 3's 262,144-row head is three quarters of a pass
RANKED_ON = 1
# and on the first rows of each such batch that hold this many positions (a decoder's sequences of
# tokens; a batch of shorter rows whole): SmolLM2's ranking on one sequence of 256 instead of two
# costs half, its order against four batches' about as sure (``docs/SCALE.md``)
RANKED_POSITIONS = 256
MAX_SIMULATED = 40  # points of the chain simulated whole (evenly spread over its sizes)
# a fit under a size budget, on such a front, simulates whole only the points within the budget (and the
# smallest point, its answer when none fits); one without a target, only this many of the largest of them
# beside the uniform choices within it: the fit runs the best of them, and the front's other points cannot be
# its answer (``size_front(budget=)``)
FIT_POINTS = 6
# fronts of at most this many units (a decoder's blocks, a small model's modules) walk their chain
# again with each step measured in context (``_walked_in_context``), in at most this many simulations a step
IN_CONTEXT_UNITS = 24
IN_CONTEXT_PER_STEP = 4
BASELINE = "baseline"


@dataclass(frozen=True)
class Option:
    """One module's choice: its deployed bytes and the output noise it adds to the start's, alone."""

    choice: ModuleSettings
    bytes: int
    noise: float  # relative output noise power (10^(-SQNR/10)) added with this choice alone; 0 at the start


@dataclass(frozen=True)
class SizeFront:
    """The front (sorted by size, each point better than every smaller one: by the session's metric
    where it has one, else by output SQNR) and the uniform
    choices (one row each, labelled ``all <choice>``, and the baseline), all simulated."""

    points: pd.DataFrame
    uniform: pd.DataFrame
    notes: tuple[str, ...] = ()  # how it was measured where a fit's run should say so (a head's rows sampled)


def choice_words(choice: ModuleSettings) -> str:
    """A choice as the front's ``formats`` column counts it: "float", a format, "int8 per-channel"."""
    if choice.keep_float:
        return "float"
    if choice.format:
        return choice.quantized_format
    return "int8 " + ("dynamic" if choice.dynamic else "per-channel" if choice.per_channel else "per-tensor")


def variant_of(settings: Mapping[str, ModuleSettings], start: Mapping[str, ModuleSettings]) -> Variant:
    """The simulation's Variant of ``settings`` (module -> choice) against the start."""
    float_modules, other, formats = set(), set(), set()
    for fqn, choice in settings.items():
        first = start[fqn]
        if choice == first:
            continue
        if choice.keep_float:
            float_modules.add(fqn)
        elif choice.format:
            formats.add((fqn, choice))
        elif choice.per_channel != first.per_channel:
            other.add(fqn)
    return Variant(frozenset(float_modules), frozenset(other), frozenset(formats))


class MixedPrecision:
    """The size front of ``runner``'s modules, found once in ``simulated``, and fits confirmed by ``real`` runs."""

    def __init__(self, runner: Runner, simulated: Simulated, real: RealRuns) -> None:
        self.runner, self.simulated, self.real = runner, simulated, real
        # (per block, budget) -> front: the whole front (budget None), or a fit's within its budget
        self._fronts: dict[tuple[bool, Budget | None], SizeFront] = {}
        self._simulation_version = simulated.version

    def front(self, progress: Progress | None = None, by_block: bool = False, budget: Budget | None = None) -> SizeFront:
        """The size front (per module, else per block), built once per simulation. ``budget``: a
        fit's (``fit_budget``), which may simulate whole only the points that can be its answer
        (``size_front``); the whole front where it was built already."""
        if self._simulation_version != self.simulated.version:  # built once per simulation
            self._simulation_version = self.simulated.version
            self._fronts.clear()
        key = (by_block, None) if (by_block, None) in self._fronts else (by_block, budget)
        if key not in self._fronts:
            self._fronts[key] = size_front(self.runner, self.simulated, self.real, progress, by_block=by_block, budget=budget)
        return self._fronts[key]

    def computed(self) -> dict[str, pd.DataFrame]:
        """The front's table where it was asked for (per module, else per block; the whole front
        before a fit's), nothing computed."""
        ordered = sorted(self._fronts, key=lambda key: (key[0], key[1] is not None))
        return {"size_front": self._fronts[ordered[0]].points.copy()} if ordered else {}

    def check_goal(self, max_size_bytes: float | None, target_sqnr_db: float | None, target_metric: float | None) -> None:
        """A fit's goal refused before any front is built: none given, or one only the float model meets
        (an infinite SQNR). A metric target the float model misses is not refused: a quantized model can
        score better than its float model (rounding noise lowered a tiny decoder's perplexity here)."""
        if target_metric is not None and self.runner.eval_fn is None:
            raise ValueError("target_metric needs the session's eval_fn (pass eval_fn= to analyze() or the session)")
        if max_size_bytes is None and target_sqnr_db is None and target_metric is None:
            raise ValueError("fit() needs max_size_bytes, target_sqnr_db, target_metric or a combination")
        if target_sqnr_db is not None and not math.isfinite(target_sqnr_db):
            raise ValueError(f"target_sqnr_db={target_sqnr_db}: only the float model's output has an infinite SQNR")

    def fit(
        self,
        max_size_bytes: float | None = None,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        progress: Progress | None = None,
        by_block: bool = False,
        apply: Callable[..., RunResult] | None = None,
    ) -> RunResult:
        """``fit()`` on the front, the run in its place in the history with the notes added.
        ``apply``: where the fit's real runs are made when not by ``real`` (a rotated twin's are the
        session's, rotated): the kernels they find differing are handed to this front's simulation."""
        self.check_goal(max_size_bytes, target_sqnr_db, target_metric)
        kernels = self.real.truth(quiet).real_kernels  # a real run may find more (``RealRuns.adopt_kernels``)
        goal = (max_size_bytes, target_sqnr_db, target_metric, progress, self.runner.metric)

        def fitted() -> RunResult:
            front = self.front(progress, by_block, fit_budget(max_size_bytes, target_sqnr_db, target_metric))
            found = fit(apply or self.real.apply, front, *goal).noted(*front.notes)
            if apply is not None:  # ``real.apply`` adopts its runs' kernels itself
                self.real.adopt_kernels(found)
            return found

        calls = self.runner.metric_calls
        found = fitted()
        adopted = self.real.adopted_since(kernels)
        if adopted:  # a broken kernel the baseline's inputs hid: the front again, with it
            said = self.real.adopted_words("the first fit's real run", adopted)
            found = fitted().noted(f"{said}; the front was simulated again with them and this is its fit")
        spent = self.runner.metric_calls - calls
        if spent:  # the user's eval_fn (a task accuracy) may be the costly part; first, leaving the verdict where it was
            said = (
                f"this fit scored {spent} model{'s' if spent > 1 else ''} with the session's eval_fn (the front's points "
                "it simulated whole and its real runs; the front's single choices are ranked by output SQNR alone)"
            )
            found = replace(found, notes=(said, *found.notes))
        return self.real.annotated(found)


@dataclass(frozen=True)
class Budget:
    """What a fit's front may be cut to (``fit_budget``): the size budget, and the fit's target where it
    gives one. With a target, the answer is the smallest point meeting it within the budget (any point
    within it can be); without, the best point within it (only the largest can be)."""

    max_size_bytes: float
    target_sqnr_db: float | None = None
    target_metric: float | None = None

    @property
    def targeted(self) -> bool:
        return self.target_sqnr_db is not None or self.target_metric is not None


def fit_budget(max_size_bytes: float | None, target_sqnr_db: float | None, target_metric: float | None) -> Budget | None:
    """The ``Budget`` a fit's front may be cut to (``size_front(budget=)``); None without a size budget
    (a target alone: the smallest point meeting it may lie anywhere on the front)."""
    if max_size_bytes is None:
        return None
    return Budget(max_size_bytes, target_sqnr_db, target_metric)


def size_front(
    runner: Runner,
    simulated: Simulated,
    real: RealRuns,
    progress: Progress | None = None,
    by_block: bool = False,
    budget: Budget | None = None,
) -> SizeFront:
    """The size front of ``runner``'s modules, anchored to the baseline's real size; see the module's
    docstring. ``by_block``: every module of a block (``module_blocks``) takes the same choice, so the
    units chosen for are the blocks (a block whose modules start differently is split by start).
    ``budget``: for a fit under that size (``fit_budget``) on a front whose single choices are
    estimated, only the points that can be its answer are simulated whole: with a target, those
    ``_halved`` asks for among the chain's points ``pareto()`` simulates within the budget (the
    whole front's answer where the chain's quality rises with its size), and the in-context
    search's within it; without one, the ``FIT_POINTS`` largest of the chain's and the search's
    within it; in both, the chain's smallest (the answer when none fits) and the uniform choices
    within the budget. The search is not run where the start with its cheapest unit kept float
    does not fit the budget (its points keep units float from the start), and the walk in context
    stops at the budget; the notes say so."""
    engine, modules = runner.engine, runner.modules
    broken = set(real.truth(quiet).disagreeing)
    choices = {m.fqn: engine.size_choices(m) or _kernel_fix(m, broken) for m in modules}
    refused: dict[str, list[str]] = {}  # what the target cannot build: the reason -> "module in choice"
    for fqn, found in choices.items():
        for choice in found[1:]:
            why = engine.unbuildable(runner.float_model.get_submodule(fqn), choice)
            if why:
                refused.setdefault(why, []).append(f"{fqn} in {choice_words(choice)}")
                found.remove(choice)
    choices = {fqn: found for fqn, found in choices.items() if len(found) > 1}
    if not choices:
        raise QReportError("no module can change its size on this engine's configuration (nothing quantized has weights)")
    baseline = real.baseline(progress)
    runner.ensure_room("size front", "the size front (every format of every module, simulated)")
    if not baseline.ok:
        raise QReportError(f"the size front is anchored to the baseline's real size, and the baseline failed: {baseline.error}")
    units = _block_units(choices) if by_block else {fqn: [fqn] for fqn in choices}
    offered = {unit: _shared(choices, members) for unit, members in units.items()}

    def spread(point: Mapping[str, ModuleSettings]) -> dict[str, ModuleSettings]:
        return {fqn: choice for unit, choice in point.items() for fqn in units[unit]}

    start_units = {unit: found[0] for unit, found in offered.items()}
    start = spread(start_units)
    singles = [(unit, c) for unit, found in offered.items() for c in found[1:]]
    estimate = not by_block and len(singles) > ESTIMATED_BEYOND and hasattr(simulated.simulation(), "local_noise")
    ranked_on = RANKED_ON if estimate else None  # evaluation batches the ranking reads (None: all)
    whole = [(unit, c) for unit, c in singles if c.keep_float or not estimate]
    variants = [Variant(), *(variant_of(spread({unit: c}), start) for unit, c in whole)]
    ranking = _ranked(ranked_on, runner)
    each_alone = simulated.simulate_each(variants, progress, "size front: each choice alone", metric=False, **ranking)
    (start_db, _), *measured = each_alone
    each = dict(zip(whole, measured, strict=True))
    notes: tuple[str, ...] = tuple(
        f"the size front left out what the target cannot build ({why}): "
        + ", ".join(held[:4])
        + (", ..." if len(held) > 4 else "")
        for why, held in refused.items()
    )
    if estimate:  # the units are the modules
        each |= _estimated_alone(runner, simulated, choices, start, each, start_db, progress, ranked_on)
        notes = tuple(
            f"the size front ranked {fqn}'s choices on {sample:,} of its {rows:,} rows (each row's error is its own: "
            "the sample's, scaled to every row); the choices it points to were simulated whole"
            for fqn, (sample, rows) in getattr(simulated.simulation(), "sampled", {}).items()
        )
        read_off = getattr(simulated.simulation(), "read_off", 0)
        if read_off:
            notes += (
                f"the size front measured HQQ, GPTQ and AWQ at one group size a module and ranked their {read_off} choices at "
                "the other sizes by round to nearest's there, times their ratio to it where measured; the choices it points "
                "to were simulated whole",
            )
        head = simulated.head_sample()
        if head is not None:
            fqn, columns = head
            notes += (
                f"the size front ranked single choices and steps on {len(columns):,} of the output's "
                f"{simulated.runner.reference_outputs()[0].shape[-1]:,} columns ({fqn}'s rows, computed alone); "
                "its points were simulated whole",
            )
        if ranking["rows"] is not None:
            rows, length = sequence_shape(runner.eval_data[0]) or (0, 0)
            batches = "the first evaluation batch" if ranked_on == 1 else f"each of the first {ranked_on} evaluation batches"
            notes += (
                f"the size front ranked single choices and steps on {ranking['rows']} of the {rows} sequences "
                f"({length:,} tokens each) of {batches}; its points were simulated whole on every batch",
            )
    alone = [each[single] for single in singles]
    start_noise = _noise(start_db)
    float_model = runner.float_model
    sizes = {fqn: {c: engine.module_bytes(float_model.get_submodule(fqn), c) for c in found} for fqn, found in choices.items()}
    start_model = baseline.deployed_bytes - sum(sizes[fqn][c] for fqn, c in start.items())

    def size_of(point: Mapping[str, ModuleSettings]) -> int:
        return int(start_model + sum(sizes[fqn][c] for fqn, c in point.items()))

    limit = budget.max_size_bytes if budget is not None and estimate else math.inf  # the fit's budget the points are cut to
    unit_sizes = {unit: {c: sum(sizes[fqn][c] for fqn in units[unit]) for c in found} for unit, found in offered.items()}
    options = {unit: [Option(found[0], unit_sizes[unit][found[0]], 0.0)] for unit, found in offered.items()}
    for (unit, c), (sqnr, _) in zip(singles, alone, strict=True):
        if not math.isnan(sqnr):
            options[unit].append(Option(c, unit_sizes[unit][c], _noise(sqnr) - start_noise))
    hulls = {unit: _hull(found) for unit, found in options.items()}
    chain = _chain(hulls)
    picked = _spread(chain, MAX_SIMULATED)
    # every point of the in-context search keeps a unit float from the start: the smallest, the cheapest float unit
    cheapest_float = min(
        (unit_sizes[unit][c] - unit_sizes[unit][found[0]] for unit, found in offered.items() for c in found[1:] if c.keep_float),
        default=0,
    )
    unsearched = size_of(start) + cheapest_float > limit
    if unsearched:
        searched = []  # none of the search's points fits
    else:
        searched = _searched_points(runner, simulated, real, start_units, offered, units, alone=each, ranked_on=ranked_on)

    def measure(points: Sequence[Mapping[str, ModuleSettings]]) -> list[float]:
        variants = [variant_of(spread(p), start) for p in points]
        return [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, "size front: formats in context", metric=False)]

    walked = (
        _walked_in_context(hulls, measure, lambda point: size_of(spread(point)) <= limit)
        if len(hulls) <= IN_CONTEXT_UNITS
        else []
    )
    extra = [p for p in searched + walked if p not in chain]
    extra_points = [spread(dict(p)) for p in dict.fromkeys(tuple(p.items()) for p in extra)]
    uniform = _uniform(choices)
    metric = runner.eval_fn is not None
    if math.isinf(limit):
        picked_points = [spread(chain[i]) for i in picked] + extra_points
    else:
        smallest = spread(chain[0])
        extra_within = [p for p in extra_points if size_of(p) <= limit]
        if budget.targeted:  # the smallest point meeting the target within the budget, halving along the chain
            chain_within = [p for p in (spread(chain[i]) for i in picked) if size_of(p) <= limit]
            goal = (budget.target_sqnr_db, budget.target_metric, runner.metric)
            probed = _halved(
                chain_within,
                lambda p: simulated.simulate_each([variant_of(p, start)], progress, "size front: halving", metric=metric)[0],
                lambda sqnr, value: meets_target(sqnr, value, *goal),
                engine.checks_shortcuts,
            )
            within = [chain_within[at] for at in sorted(probed)] + extra_within
            kind = (
                f"the smallest, {len(probed)} of the {len(chain_within)} chain points within it that pareto() simulates, "
                "halving towards the smallest meeting the target (taken to rise with size; where the largest missed, every "
                "smaller point until one met)"
            )
        else:  # the best point within the budget: the largest within it
            chain_within = [point for point in map(spread, chain) if size_of(point) <= limit]
            chain_largest = _largest_within([chain_within[i] for i in _spread(chain_within, MAX_SIMULATED)], size_of, FIT_POINTS)
            within = chain_largest + _largest_within(extra_within, size_of, FIT_POINTS)
            kind = "the largest within it, the smallest"
        picked_points = [smallest, *(p for p in within if p != smallest)]
        uniform = {label: p for label, p in uniform.items() if size_of(p) <= limit}
        notes += (
            f"for a budget of {_kb(limit)}, the size front simulated whole the {len(picked_points) + len(uniform)} points "
            f"that can be the fit's answer ({kind}, and the uniform choices within it), not every point pareto() simulates"
            + ("; the walk in context stopped at the budget" if len(hulls) <= IN_CONTEXT_UNITS else "")
            + ("; the in-context search was not run: its points, which keep modules float, are all larger" if unsearched else ""),
        )
    pool = picked_points + list(uniform.values())  # the halving's points are known: not simulated again
    results = simulated.simulate_each([variant_of(p, start) for p in pool], progress, "size front: points", metric=metric)

    def row(point: Mapping[str, ModuleSettings], result: tuple[float, float | None]) -> dict[str, Any]:
        sqnr, value = result
        return {
            "size_bytes": size_of(point),
            "simulated_output_sqnr_db": sqnr,
            **({"simulated_metric": value} if metric else {}),
            "formats": _formats(point),
            "settings": dict(point),
        }

    rows = [row(p, r) for p, r in zip(pool, results, strict=True)]
    uniform_rows = rows[len(picked_points) :]
    table = pd.DataFrame(uniform_rows, index=pd.Index(list(uniform), name="choice"))
    quantized = [r for r in rows if not all(c.keep_float for c in r["settings"].values())]  # the float model is no point
    return SizeFront(_front(quantized, (runner.metric or Metric()) if metric else None), table, notes)


def _ranked(ranked_on: int | None, runner: Runner) -> dict[str, Any]:
    """What a ranking pass reads (``Simulated.simulate_each``'s arguments): the first ``ranked_on``
    evaluation batches, of each the first rows holding ``RANKED_POSITIONS`` positions, a large head's
    sample of columns; None: all of it."""
    if ranked_on is None:
        return {"batches": None, "sampled_columns": False, "rows": None}
    return {"batches": ranked_on, "sampled_columns": True, "rows": rows_holding(runner.eval_data[0], RANKED_POSITIONS)}


def _halved(
    points: Sequence[Mapping[str, ModuleSettings]],
    simulate: Callable[[Mapping[str, ModuleSettings]], tuple[float, float | None]],
    meets: Callable[[float, float | None], bool],
    check: bool = False,
) -> dict[int, tuple[float, float | None]]:
    """The positions of ``points`` (smallest first) simulated to find the smallest that ``meets`` the
    target, and their results: the largest first, then halving the stretch between the largest point
    known to miss and the smallest known to meet it (about ``log2(len(points))`` simulated), which finds
    the smallest where the points' quality rises with their size, as a chain's output SQNR does. Where
    the largest misses, every smaller point is simulated, smallest first, until one meets: a front read
    by a metric (perplexity) need not rise with size, and "none meets" is said only of points all
    simulated. ``check`` (the check mode, ``core.shortcuts``): every point is simulated as well, and the
    smallest meeting the target among them must be the halving's."""
    probed: dict[int, tuple[float, float | None]] = {}

    def met(at: int) -> bool:
        if at not in probed:
            probed[at] = simulate(points[at])
        return meets(*probed[at])

    low, high = 0, len(points) - 1
    if high < 0:
        return probed
    if not met(high):
        for at in range(high):  # smallest first: the first that meets is the answer
            if met(at):
                break
    else:
        while low < high:
            middle = (low + high) // 2
            if met(middle):
                high = middle
            else:
                low = middle + 1
    if checking(check):

        def smallest(results: Mapping[int, tuple[float, float | None]]) -> int | None:
            return min((at for at, result in results.items() if meets(*result)), default=None)

        confirmed(
            Shortcut.HALVING,
            smallest(probed),
            lambda: smallest({at: simulate(point) for at, point in enumerate(points)}),
            operator.eq,
            lambda halved, every: (
                f"of {len(points)} points (smallest first), halving found #{halved} the smallest meeting the target and "
                f"simulating every point found #{every}: the points' quality does not rise with their size here"
            ),
        )
    return probed


def _block_units(choices: Mapping[str, list[ModuleSettings]]) -> dict[str, list[str]]:
    """The blocks of the modules with choices (``module_blocks``), a block whose modules start
    differently split by how they start (``model.layers.0 [int8-weight-only]``)."""
    units: dict[str, list[str]] = {}
    for block, members in module_blocks(choices).items():
        starts = list(dict.fromkeys(choices[fqn][0] for fqn in members))
        for first in starts:
            unit = block if len(starts) == 1 else f"{block} [{choice_words(first)}]"
            units[unit] = [fqn for fqn in members if choices[fqn][0] == first]
    return units


def _shared(choices: Mapping[str, list[ModuleSettings]], members: Sequence[str]) -> list[ModuleSettings]:
    """The choices every module of ``members`` offers (they start alike), the start first."""
    first, *others = members
    return [c for c in choices[first] if all(c in choices[fqn] for fqn in others)]


def _estimated_alone(
    runner: Runner,
    simulated: Simulated,
    choices: Mapping[str, list[ModuleSettings]],
    start: Mapping[str, ModuleSettings],
    alone: Mapping[tuple[str, ModuleSettings], tuple[float, float | None]],
    start_db: float,
    progress: Progress | None,
    ranked_on: int | None = None,
) -> dict[tuple[str, ModuleSettings], tuple[float, float | None]]:
    """Each quantized choice alone, most of them estimated (simulated on what ``_ranked(ranked_on)``
    reads, as ``start_db`` was; None: all). Per module, the noise each choice puts
    on the module's own output is measured in one pass over the first evaluation batch; the choice
    with the most is simulated whole, and the output noise of the others is read off the line
    through what is known whole (kept float, the start format, that coarsest choice) against that
    own noise. A module with nothing to read from has all its choices simulated whole."""
    local = simulated.simulation().local_noise(runner.eval_data[0], choices)
    start_noise = _noise(start_db)
    quantized = {fqn: [c for c in options[1:] if not c.keep_float] for fqn, options in choices.items()}
    anchors, exact = [], []
    for fqn, options in quantized.items():
        if options and all((fqn, c) in local for c in (start[fqn], *options)):
            anchors.append((fqn, max(options, key=lambda c, fqn=fqn: local[fqn, c])))
        else:
            exact += [(fqn, c) for c in options]
    whole = anchors + exact
    measured = simulated.simulate_each(
        [variant_of({fqn: c}, start) for fqn, c in whole],
        progress,
        "size front: each module's coarsest choice",
        metric=False,
        **_ranked(ranked_on, runner),
    )
    found = dict(zip(whole, measured, strict=True))
    for fqn, anchor in anchors:
        kept_float = next((alone[fqn, c] for c in choices[fqn] if c.keep_float and (fqn, c) in alone), None)
        known = [(local[fqn, start[fqn]], start_noise), (local[fqn, anchor], _noise(found[fqn, anchor][0]))]
        if kept_float is not None and not math.isnan(kept_float[0]):
            known.append((0.0, _noise(kept_float[0])))
        if any(math.isnan(noise) for _, noise in known):
            continue
        own, noise = zip(*sorted(known), strict=True)
        for choice in quantized[fqn]:
            if choice != anchor:
                estimate = float(np.interp(local[fqn, choice], own, noise))
                found[fqn, choice] = (-10.0 * math.log10(estimate) if estimate > 0 else math.inf, None)
    missing = [(fqn, c) for fqn, options in quantized.items() for c in options if (fqn, c) not in found]
    if missing:
        variants = [variant_of({fqn: c}, start) for fqn, c in missing]
        measured = simulated.simulate_each(variants, progress, metric=False, **_ranked(ranked_on, runner))
        found |= dict(zip(missing, measured, strict=True))
    return found


def _kernel_fix(module: TunableModule, broken: set[str]) -> list[ModuleSettings]:
    """A module whose kernel computes something else than its reference may be kept float on the
    front too (weighted or not: its float op is the fix)."""
    if module.fqn not in broken or module.current.keep_float or not module.allows(Setting.KEEP_FLOAT):
        return []
    return [module.current, ModuleSettings(keep_float=True)]


def _searched_points(
    runner: Runner,
    simulated: Simulated,
    real: RealRuns,
    start: Mapping[str, ModuleSettings],
    choices: Mapping[str, list[ModuleSettings]],
    units: Mapping[str, Sequence[str]],
    alone: Mapping[tuple[str, ModuleSettings], tuple[float, float | None]],
    ranked_on: int | None = None,
) -> list[dict[str, ModuleSettings]]:
    """The points of the in-context search's path (``search.py``): units (modules, or blocks of
    them: ``units``) kept float one pick after the other, each by what it gains given the picks
    before, so that modules that only help together (broken kernels in series) reach the front. It
    starts from the single choices measured already, and simulates about as many sets as there are
    units that can be kept float (at least ``2 * SHORTLIST``), on what ``_ranked(ranked_on)`` reads
    (as ``alone`` was; None: all). ``start``, ``choices`` and the points are per unit."""
    floats = {unit: c for unit, found in choices.items() for c in found if c.keep_float}
    if len(floats) < 2:
        return []
    gains = {unit: _finite(alone.get((unit, c), (math.nan, None))[0]) for unit, c in floats.items()}
    ranking = sorted(floats, key=lambda unit: -gains[unit])

    def measure(sets: Sequence[frozenset[str]]) -> list[tuple[float, float | None]]:
        variants = [Variant(float_modules=frozenset(fqn for unit in s for fqn in units[unit])) for s in sets]
        return simulated.simulate_each(
            variants,
            quiet,
            "size front: in-context search",
            metric=False,
            **_ranked(ranked_on, runner),
        )

    truth = real.truth(quiet)
    neighbours = unit_neighbours(runner.float_model, {unit: units[unit] for unit in ranking})
    search = FloatSearch(measure, ranking, units_of(truth.disagreeing, units), neighbours)
    search.known({frozenset([unit]): alone[unit, c] for unit, c in floats.items() if (unit, c) in alone})
    # the chain is the one-at-a-time order; the front keeps its search within the shortlist and its budget
    path = search.run(budget=max(len(floats), 2 * SHORTLIST), floor=False, widen=False)
    points = []
    for kept in path.sets():
        points.append({unit: floats[unit] if unit in kept else first for unit, first in start.items()})
    return points


@dataclass(frozen=True)
class FirstPoint:
    """The front point a fit runs first, by the simulation: the smallest point when none fits the
    budget (``reach``: "budget"), the best within it when none meets the target there ("target"),
    else the smallest meeting the target, or the best within the budget without one (""); ``at``
    its position in ``fitting``, the points within the budget (all of them where none fits)."""

    fitting: pd.DataFrame
    at: int
    reach: str

    @property
    def point(self) -> pd.Series:
        return self.fitting.iloc[self.at]


def first_point(
    front: SizeFront,
    max_size_bytes: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric | None = None,
) -> FirstPoint:
    """Where ``fit`` starts on ``front`` for the goal given; see ``FirstPoint``."""
    points = front.points
    fitting = points if max_size_bytes is None else points[points["size_bytes"] <= max_size_bytes]
    if fitting.empty:
        return FirstPoint(points, 0, "budget")
    if target_sqnr_db is None and target_metric is None:
        return FirstPoint(fitting, len(fitting) - 1, "")
    metrics = fitting["simulated_metric"] if "simulated_metric" in fitting else pd.Series(None, index=fitting.index)
    ok = [
        meets_target(s, m, target_sqnr_db, target_metric, measures)
        for s, m in zip(fitting["simulated_output_sqnr_db"], metrics, strict=True)
    ]
    return FirstPoint(fitting, ok.index(True), "") if any(ok) else FirstPoint(fitting, len(fitting) - 1, "target")


def fit(
    apply: Callable[..., RunResult],
    front: SizeFront,
    max_size_bytes: float | None = None,
    target_sqnr_db: float | None = None,
    target_metric: float | None = None,
    progress: Progress | None = None,
    measures: Metric | None = None,
) -> RunResult:
    """The best front point under ``max_size_bytes``, or the smallest that meets the target (within
    the budget when both are given), confirmed by a real run; see ``QuantizationSession.fit`` (which
    checks the arguments); ``apply(settings, label=, progress=)`` is a real run; ``measures``: what
    ``target_metric`` is a target of (its direction)."""
    measures = measures or Metric()
    points = front.points
    label = "fit " + _goal_words(max_size_bytes, target_sqnr_db, target_metric, measures)
    first = first_point(front, max_size_bytes, target_sqnr_db, target_metric, measures)
    fitting = first.fitting
    if first.reach == "budget":
        smallest = first.point
        result = apply(smallest["settings"], label=label, progress=progress)
        return result.noted(
            f"out of reach: the smallest point of the front takes {_kb(smallest['size_bytes'])}, "
            f"more than the {_kb(max_size_bytes)} budget; this run is that point"
        )
    targeted = target_sqnr_db is not None or target_metric is not None

    def meets(sqnr: float, metric: float | None) -> bool:
        return meets_target(sqnr, metric, target_sqnr_db, target_metric, measures)

    def fits(run: RunResult) -> bool:
        return max_size_bytes is None or run.deployed_bytes <= max_size_bytes

    if first.reach == "target":
        best = first.point
        result = apply(best["settings"], label=label, progress=progress)
        where = f" within {_kb(max_size_bytes)}" if max_size_bytes is not None else ""
        target = target_words(target_sqnr_db, target_metric, measures)
        return result.noted(
            f"{target} is out of reach{where} on the front: its best point there in simulation is {_point_words(best, measures)} "
            f"(the front's points are chosen by output SQNR{_NOT_FOLLOWED if target_metric is not None else ''}); "
            f"this run is that point, {_run_words(result, target_sqnr_db, measures)}"
        )
    at = first.at  # smallest meeting, or the largest that fits
    runs = 0
    result = apply(fitting.iloc[at]["settings"], label=label, progress=progress)
    failed: dict[int, str] = {}  # points whose real run failed (the target could not build them), and why
    while runs < MAX_EXTRA_RUNS:  # the real run failed or misses: step along the front
        if not result.ok:
            failed[at] = result.error or "failed"
            found = _untried(at, failed, len(fitting), larger_first=targeted)
            if found is None:
                break
            at = found
        elif not fits(result) and at > 0:
            at -= 1
        elif targeted and not meets(result.output_sqnr_db, result.eval_metric) and at + 1 < len(fitting):
            at = _corrected_step(fitting, at, result, meets)
        else:
            break
        if at in failed:
            break
        runs += 1
        result = apply(fitting.iloc[at]["settings"], label=label, progress=progress)
    closer = targeted and target_metric is None and at > 0 and at - 1 not in failed
    if closer and result.ok and meets(result.output_sqnr_db, result.eval_metric):
        smaller = fitting.iloc[at - 1]  # within the simulation's error of the target: it may meet it for real
        if smaller["simulated_output_sqnr_db"] >= target_sqnr_db - SIMULATION_ERROR_DB:
            run = apply(smaller["settings"], label=label, progress=progress)
            if run.ok and meets(run.output_sqnr_db, run.eval_metric) and fits(run):
                result, at = run, at - 1
    failures = tuple(
        f"the real run of point {point + 1} of the points within the budget failed ({why.strip().splitlines()[-1][:300]})"
        for point, why in failed.items()
    )
    if failed:
        failures += (f"the fit ran point {at + 1} instead" if result.ok else "no point the fit tried could be run",)
    if not result.ok:
        return result.noted(*failures)
    result = result.noted(*failures)
    point = fitting.iloc[at]
    verdicts = []
    if max_size_bytes is not None:
        verdicts.append(
            f"fits: {_kb(result.deployed_bytes)} of {_kb(max_size_bytes)}"
            if fits(result)
            else f"does not fit: {_kb(result.deployed_bytes)} for {_kb(max_size_bytes)}"
        )
    if targeted:
        ok = meets(result.output_sqnr_db, result.eval_metric)
        verdicts.append(f"{target_words(target_sqnr_db, target_metric, measures)} {'met' if ok else 'not met by the real run'}")
    said = "; ".join(verdicts)
    return result.noted(
        f"{said}, {_run_words(result, target_sqnr_db, measures)} (simulated {point['simulated_output_sqnr_db']:.2f} dB); "
        f"point {at + 1} of {len(points)} on the front: {point['formats']}"
    )


def weighed_fit(
    plain_fit: Callable[[], RunResult],
    rotated_fit: Callable[[], RunResult],
    fronts: tuple[SizeFront, SizeFront],
    rotation: Rotation,
    max_size_bytes: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric | None = None,
) -> RunResult:
    """A fit that weighs the float model rotated against not (``QuantizationSession.fit(rotation=...)``):
    the fit (``plain_fit`` / ``rotated_fit``, real runs) on whichever front (``fronts``: plain,
    rotated) the simulation ranks first (``_rank`` of the point each fit starts at); when that run
    fits the budget and meets the target (without one: fits), it is the answer and the other front
    is weighed in simulation only, its notes saying so; else the other fit runs too and the better
    real run is returned (``better_fit``)."""
    goal = (max_size_bytes, target_sqnr_db, target_metric)
    plain_front, rotated_front = fronts
    rotated_first = _simulated_rank(rotated_front, *goal, measures) > _simulated_rank(plain_front, *goal, measures)
    run = rotated_fit() if rotated_first else plain_fit()
    targeted = target_sqnr_db is not None or target_metric is not None
    fits = max_size_bytes is None or run.deployed_bytes <= max_size_bytes
    if run.ok and fits and (not targeted or meets_target(run.output_sqnr_db, run.eval_metric, *goal[1:], measures)):
        other = first_point(plain_front if rotated_first else rotated_front, *goal, measures).point
        which = f"rotated ({rotation.words})" if rotated_first else "not rotated"
        other_words = "not rotated" if rotated_first else "rotated"
        return run.noted(
            f"weighed with and without rotation: {which} chosen; the {other_words} front's fit, in simulation only "
            f"(ranked behind, and this run met the goal): {_point_words(other, measures or Metric())}"
        )
    other_run = plain_fit() if rotated_first else rotated_fit()
    plain, rotated = (other_run, run) if rotated_first else (run, other_run)
    return better_fit(plain, rotated, rotation, *goal, measures)


def better_fit(
    plain: RunResult,
    rotated: RunResult,
    rotation: Rotation,
    max_size_bytes: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric | None = None,
) -> RunResult:
    """Of a fit on the float model and one on it rotated (``QuantizationSession.fit(rotation=...)``),
    the better by ``_rank``; its notes name the other."""
    measures = measures or Metric()
    goal = (max_size_bytes, target_sqnr_db, target_metric)

    def rank(run: RunResult) -> tuple:
        return _rank(run.ok, run.deployed_bytes, run.output_sqnr_db, run.eval_metric, *goal, measures)

    chosen, other = (rotated, plain) if rank(rotated) > rank(plain) else (plain, rotated)
    which = f"rotated ({rotation.words})" if chosen is rotated else "not rotated"
    other_words = "rotated" if other is rotated else "not rotated"
    if other.ok:
        described = _run_words(other, target_sqnr_db, measures)
    else:
        described = f"failed: {other.error}"
    return chosen.noted(f"weighed with and without rotation: {which} chosen; the {other_words} fit: {described}")


def _rank(
    ok: bool,
    size: float,
    sqnr: float,
    metric: float | None,
    max_size_bytes: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric,
) -> tuple:
    """How good a fit is (larger is better): one that fits the budget before one that does not;
    with a target, one that meets it, then the fewer bytes; without, the better metric (the output
    SQNR without one)."""
    fits = max_size_bytes is None or size <= max_size_bytes
    met = meets_target(sqnr, metric, target_sqnr_db, target_metric, measures)
    if metric is not None and not math.isnan(metric):
        quality = metric if measures.higher_is_better else -metric
    else:
        quality = sqnr
    if target_sqnr_db is not None or target_metric is not None:
        return (ok, fits, met, -size if met else quality)
    return (ok, fits, quality)


def _simulated_rank(
    front: SizeFront,
    max_size_bytes: float | None,
    target_sqnr_db: float | None,
    target_metric: float | None,
    measures: Metric | None,
) -> tuple:
    """``_rank`` of the point a fit on ``front`` starts at, by its simulated numbers."""
    point = first_point(front, max_size_bytes, target_sqnr_db, target_metric, measures).point
    metric = point.get("simulated_metric")
    metric = None if metric is None or pd.isna(metric) else float(metric)
    goal = (max_size_bytes, target_sqnr_db, target_metric)
    return _rank(True, point["size_bytes"], point["simulated_output_sqnr_db"], metric, *goal, measures or Metric())


_NOT_FOLLOWED = ", which the metric need not follow"


def _untried(at: int, failed: Mapping[int, str], count: int, larger_first: bool) -> int | None:
    """The point to run after point ``at``'s real run failed: the nearest one not failed yet, the
    larger side first where the fit has a target (a larger point meets it too), else the smaller (a
    smaller point fits the budget too); None where every point failed."""
    sides = [range(at + 1, count), range(at - 1, -1, -1)]
    for side in sides if larger_first else sides[::-1]:
        for point in side:
            if point not in failed:
                return point
    return None


def _corrected_step(fitting: pd.DataFrame, at: int, result: RunResult, meets: Callable[[float, float | None], bool]) -> int:
    """The next point to run after point ``at``'s real run ``result`` missed the target: the first
    larger point whose simulated numbers, moved by what the real run differed from its own point's,
    meet the target (a perplexity front is not monotone along its SQNR order, and the simulation's
    bias on a point carries to its neighbours); the next point when none does."""
    point = fitting.iloc[at]
    sqnr_shift = result.output_sqnr_db - point["simulated_output_sqnr_db"]
    simulated_metric = point.get("simulated_metric")
    has_metric = result.eval_metric is not None and simulated_metric is not None and not pd.isna(simulated_metric)
    metric_shift = result.eval_metric - simulated_metric if has_metric else 0.0
    for index in range(at + 1, len(fitting)):
        candidate = fitting.iloc[index]
        metric = candidate.get("simulated_metric")
        moved = None if metric is None or pd.isna(metric) else metric + metric_shift
        if meets(candidate["simulated_output_sqnr_db"] + sqnr_shift, moved):
            return index
    return at + 1


# ---- the search -------------------------------------------------------------------------------------
def _noise(sqnr_db: float) -> float:
    """Output noise power relative to the reference's, from an SQNR in dB."""
    return 0.0 if math.isinf(sqnr_db) and sqnr_db > 0 else 10.0 ** (-sqnr_db / 10.0)


def _hull(options: Sequence[Option]) -> list[Option]:
    """The options worth taking, smallest first: least noise per size, each less noisy than the one
    before, on the lower convex hull of (bytes, noise) so that the noise each byte removes falls."""
    least: dict[int, Option] = {}
    for option in options:  # the start first: it wins ties of size and noise
        if option.bytes not in least or option.noise < least[option.bytes].noise:
            least[option.bytes] = option
    hull: list[Option] = []
    for option in sorted(least.values(), key=lambda o: o.bytes):
        if hull and option.noise >= hull[-1].noise:
            continue
        while len(hull) >= 2 and _gain(hull[-2], hull[-1]) <= _gain(hull[-1], option):
            hull.pop()
        hull.append(option)
    return hull


def _gain(smaller: Option, larger: Option) -> float:
    """Noise removed per byte added from ``smaller`` to ``larger``."""
    return (smaller.noise - larger.noise) / max(larger.bytes - smaller.bytes, 1)


def _chain(hulls: Mapping[str, list[Option]]) -> list[dict[str, ModuleSettings]]:
    """Every module at its smallest, then each hull step in order of noise removed per byte."""
    steps = [(_gain(h[i], h[i + 1]), order, i, fqn) for order, (fqn, h) in enumerate(hulls.items()) for i in range(len(h) - 1)]
    point = {fqn: h[0].choice for fqn, h in hulls.items()}
    chain = [dict(point)]
    for _, _, i, fqn in sorted(steps, key=lambda s: (-s[0], s[1], s[2])):
        point[fqn] = hulls[fqn][i + 1].choice
        chain.append(dict(point))
    return chain


def _walked_in_context(
    hulls: Mapping[str, list[Option]],
    measure: Callable[[Sequence[Mapping[str, ModuleSettings]]], list[float]],
    fits: Callable[[Mapping[str, ModuleSettings]], bool] = lambda _point: True,
) -> list[dict[str, ModuleSettings]]:
    """The chain walked again with every step measured in context: from every unit at its smallest,
    each step moves the unit whose next hull choice removes the most output noise per byte with the
    others as chosen so far (simulated whole), not as it did alone. Lazily: the candidate ahead by its
    last known gain is re-measured in the current point, and taken when it stays ahead of every other
    candidate's last known gain (which starts as its gain alone); errors that compound across blocks
    thus reorder the steps. Costs about two simulations a step, at most ``IN_CONTEXT_PER_STEP``.
    Every step adds bytes: the walk stops at the first point ``fits`` refuses (a fit's budget)."""
    position = dict.fromkeys(hulls, 0)
    point = {unit: hull[0].choice for unit, hull in hulls.items()}
    (noise,) = [_noise(db) for db in measure([point])]
    known = {unit: _gain(hull[0], hull[1]) for unit, hull in hulls.items() if len(hull) > 1}
    walked = []
    while known:
        measured_here: set[str] = set()
        while True:
            unit = max(known, key=lambda u: (known[u], u in measured_here))
            if unit in measured_here or len(measured_here) >= IN_CONTEXT_PER_STEP:
                break
            here = position[unit]
            moved = {**point, unit: hulls[unit][here + 1].choice}
            (after,) = [_noise(db) for db in measure([moved])]
            added = max(hulls[unit][here + 1].bytes - hulls[unit][here].bytes, 1)
            gain = (noise - after) / added
            known[unit] = gain if math.isfinite(gain) else -math.inf
            measured_here.add(unit)
        unit = max(measured_here, key=lambda u: known[u])
        position[unit] += 1
        point = {**point, unit: hulls[unit][position[unit]].choice}
        if not fits(point):
            break
        (noise,) = [_noise(db) for db in measure([point])]  # known already: the step's own simulation
        walked.append(dict(point))
        hull, here = hulls[unit], position[unit]
        if here + 1 < len(hull):
            known[unit] = _gain(hull[here], hull[here + 1])
        else:
            del known[unit]
    return walked


def _spread(chain: Sequence[Any], most: int) -> list[int]:
    """Up to ``most`` indices of ``chain``, evenly spread, the first and last among them."""
    if len(chain) <= most:
        return list(range(len(chain)))
    return sorted({int(round(i)) for i in np.linspace(0, len(chain) - 1, most)})


def _largest_within(
    points: Sequence[dict[str, ModuleSettings]], size_of: Callable[[Mapping[str, ModuleSettings]], int], most: int
) -> list[dict[str, ModuleSettings]]:
    """The ``most`` largest of ``points`` (all within a budget already), largest first, each once."""
    unique = {tuple(p.items()): p for p in points}
    return sorted(unique.values(), key=size_of, reverse=True)[:most]


def _uniform(choices: Mapping[str, list[ModuleSettings]]) -> dict[str, dict[str, ModuleSettings]]:
    """The baseline, and for each choice the modules offer (int4 with its default group size), every
    module that offers it taking it (the others as they start)."""
    start = {fqn: found[0] for fqn, found in choices.items()}
    found: dict[str, dict[str, ModuleSettings]] = {BASELINE: start}
    kinds = {}
    for options in choices.values():
        for choice in options:
            if choice.group_size in (0, DEFAULT_GROUP_SIZE):
                kinds.setdefault(choice_words(choice), choice)
    for words, choice in kinds.items():
        point = {fqn: choice if choice in options else start[fqn] for fqn, options in choices.items()}
        if point != start:
            found[f"all {words}"] = point
    return found


def _formats(point: Mapping[str, ModuleSettings]) -> str:
    counts = Counter(choice_words(c) for c in point.values())
    return ", ".join(f"{n} {words}" for words, n in sorted(counts.items(), key=lambda item: -item[1]))


def _front(rows: list[dict[str, Any]], measures: Metric | None = None) -> pd.DataFrame:
    """The rows each better than every smaller one, smallest first: by ``simulated_metric`` in
    ``measures``' direction where given (ties and unmeasured points by output SQNR), else by output
    SQNR."""

    def quality(row: dict[str, Any]) -> tuple[float, float]:
        sqnr = _finite(row["simulated_output_sqnr_db"])
        if measures is None:
            return (sqnr, 0.0)
        value = row.get("simulated_metric")
        value = -math.inf if value is None or math.isnan(value) else value if measures.higher_is_better else -value
        return (value, sqnr)

    ordered = sorted(rows, key=lambda r: (r["size_bytes"], tuple(-q for q in quality(r))))
    kept: list[dict[str, Any]] = []
    best = (-math.inf, -math.inf)
    for row in ordered:
        if quality(row) > best:
            kept.append(row)
            best = quality(row)
    table = pd.DataFrame(kept)
    table.index.name = "point"
    return table


def _finite(value: float) -> float:
    return -math.inf if math.isnan(value) else value


# ---- words -------------------------------------------------------------------------------------------
def _kb(size: float | None) -> str:
    return "?" if size is None else f"{size / 1024:,.1f} KB"


def _goal_words(max_size_bytes: float | None, target_sqnr_db: float | None, target_metric: float | None, measures: Metric) -> str:
    parts = [f"<= {_kb(max_size_bytes)}"] if max_size_bytes is not None else []
    target = target_words(target_sqnr_db, target_metric, measures)
    return " and ".join(parts + ([target] if target else []))


def _point_words(point: pd.Series, measures: Metric) -> str:
    metric = f", {measures.name} {point['simulated_metric']:.4g}" if "simulated_metric" in point else ""
    return f"{point['simulated_output_sqnr_db']:.2f} dB{metric} at {_kb(point['size_bytes'])}"


def _run_words(result: RunResult, target_sqnr_db: float | None, measures: Metric) -> str:
    short = ""
    if target_sqnr_db is not None and result.ok and result.output_sqnr_db < target_sqnr_db:
        short = f", {target_sqnr_db - result.output_sqnr_db:.2f} dB short"
    metric = f", {measures.name} {result.eval_metric:.4g}" if result.eval_metric is not None else ""
    return f"real {result.output_sqnr_db:.2f} dB{metric} at {_kb(result.deployed_bytes)}{short}"
