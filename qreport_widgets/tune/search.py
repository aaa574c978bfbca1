"""Which modules to keep float, chosen in context: each pick by what it gains given the picks before.

One-at-a-time gains (``sensitivity()``) are not additive: where errors compound they hide each
other. Three broken kernels in series each leave the output garbage while the two others stay
broken, so each alone gains nothing, and together they give back 30 dB. ``FloatSearch`` is a greedy
forward selection measured in the simulation after every pick:

- at each step a shortlist is re-measured with the picks so far kept float: the top of the
  one-at-a-time ranking, every module whose kernel disagrees with its reference, and the dataflow
  neighbours of the last pick; the one gaining most is picked;
- when no single module gains, the reverse view: every disagreeing kernel kept float together,
  pruned of those that cost nothing; then the shortlist widens to every module not yet picked,
  re-measured in context in rounds of the one-at-a-time order (a round stops the widening at its
  first gain); then pairs of the shortlist's best. "Out of reach" is only said once every module
  not picked was re-measured with the picks and none gains;
- once the target is met, the picks are pruned (one pass, earliest first: a pick whose removal
  still meets the target goes), and the one-at-a-time walk is checked against it, so the search
  never keeps more modules float than that walk would for the same target;
- a far target (every module float meets it) that the forward search has not met within half its
  budget: the fewest modules of the one-at-a-time order that meet it are found by halving, taken,
  and pruned (least harmful alone first) with the rest of the budget.

Every simulated set is kept (``measured``), so a set is simulated once, and ``reach()`` can look
for a smaller set within the simulation's error after its real run.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pandas as pd

SHORTLIST = 6  # modules of the one-at-a-time ranking re-measured at every step
PAIRS_FROM = 4  # when no single module gains, pairs among this many of the shortlist's best
WIDEN_ROUND = 8  # modules beyond the shortlist re-measured per round when it runs dry
# a run given no budget simulates at most this many times the modules there are (at least
# SEARCH_FLOOR sets), then stops at the next step: a sensitivity() pass's sets, plus the floor's walk
SEARCH_BUDGET = 1
# where the target is in reach but not at the start: the forward search may spend this share of the budget
# (1 / PREFIX_SHARE), then the prefix of the one-at-a-time order that meets is taken and pruned with the rest
PREFIX_SHARE = 2
SEARCH_FLOOR = 40
MIN_STEP_DB = 0.05  # a pick must gain this much given the picks before it
MIN_STEP_METRIC = 1e-4  # or, for a metric target, this much of the metric
NEGLIGIBLE_DB = 0.1  # out of reach, a larger float set must be this much better to be the best
NEGLIGIBLE_METRIC = 1e-3

Measure = Callable[[Sequence[frozenset[str]]], list[tuple[float, float | None]]]
Meets = Callable[[float, float | None], bool]


class Action:
    """What a step of the path did (plain strings: they are the path table's ``action`` column)."""

    ADD = "add"
    WIDENED = "add, widened"  # found beyond the shortlist, once none of it gained
    TOGETHER = "add together"
    DROP = "drop"
    WALK = "one-at-a-time walk"
    REAL = "real run"
    CEILING = "every module float"  # the most the engine reaches: a real run


@dataclass(frozen=True)
class Step:
    """One step of the path: ``modules`` added (or dropped), what that gained given the float set
    before it, and the simulated output after it."""

    action: str
    modules: tuple[str, ...]
    gain_db: float
    simulated_db: float
    simulated_metric: float | None
    float_count: int  # modules float after the step
    why: str
    real_db: float | None = None  # a real run's output SQNR at this point


@dataclass
class SearchPath:
    """What the search did: its steps, the float set it ends on and what that cost.

    ``chosen`` is in the order the modules were picked; ``measured`` maps every simulated float set
    to its (output SQNR, metric); ``simulated`` counts them, ``seconds`` is the search's wall time."""

    start_db: float
    start_metric: float | None
    steps: list[Step]
    chosen: tuple[str, ...]
    simulated_db: float
    simulated_metric: float | None
    met: bool
    measured: dict[frozenset[str], tuple[float, float | None]] = field(default_factory=dict, repr=False)
    simulated: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def frame(self, real_db: float | None = None, real_metric: float | None = None) -> pd.DataFrame:
        """The path as a table, one row per step (the start first): ``action``, ``modules``, the
        ``gain_db`` given the steps before, the cumulative ``simulated_output_sqnr_db`` (and
        ``simulated_metric``), ``float_count`` and ``why``; ``real_output_sqnr_db`` on the last row
        when a real run measured the chosen point."""
        rows = [
            {
                "action": "start",
                "modules": "",
                "gain_db": math.nan,
                "simulated_output_sqnr_db": self.start_db,
                "simulated_metric": self.start_metric,
                "float_count": 0,
                "why": "the starting configuration",
                "real_output_sqnr_db": math.nan,
            }
        ]
        for step in self.steps:
            rows.append(
                {
                    "action": step.action,
                    "modules": ", ".join(step.modules),
                    "gain_db": step.gain_db,
                    "simulated_output_sqnr_db": step.simulated_db,
                    "simulated_metric": step.simulated_metric,
                    "float_count": step.float_count,
                    "why": step.why,
                    "real_output_sqnr_db": math.nan if step.real_db is None else step.real_db,
                }
            )
        table = pd.DataFrame(rows)
        table.index.name = "step"
        if table["simulated_metric"].isna().all():
            table = table.drop(columns="simulated_metric")
        if real_db is not None:
            table.loc[table.index[-1], "real_output_sqnr_db"] = real_db
            if real_metric is not None:
                table["real_metric"] = math.nan
                table.loc[table.index[-1], "real_metric"] = real_metric
        return table

    def sets(self) -> list[frozenset[str]]:
        """The float set after each step, in order."""
        found, kept = [], frozenset()
        for step in self.steps:
            if step.action in (Action.WALK, Action.CEILING):
                kept = frozenset(step.modules)
            elif step.action == Action.DROP:
                kept = kept - set(step.modules)
            else:
                kept = kept | set(step.modules)
            found.append(kept)
        return found

    def smaller(self, fits: Callable[[float, float | None], bool]) -> list[frozenset[str]]:
        """Simulated float sets smaller than ``chosen`` for which ``fits(sqnr, metric)``, fewest
        modules first, then the best simulated."""
        size = len(self.chosen)
        found = [(s, r) for s, r in self.measured.items() if len(s) < size and fits(*r)]
        return [s for s, _ in sorted(found, key=lambda item: (len(item[0]), -_finite(item[1][0])))]


class FloatSearch:
    """Greedy forward selection of float modules, in context; see the module's docstring.

    Args:
        measure: simulated (output SQNR, metric) of each float set, in order.
        ranking: the tunable modules, most harmful alone first (``sensitivity()``'s order).
        disagreeing: modules whose quantized kernel computes something else than its reference.
        neighbours: module -> the tunable modules it reads from or feeds.
        meets: whether a simulated (SQNR, metric) meets the target; None: no target, the search
            goes on while something gains.
        by_metric: choose by the metric's gain (a metric-only target) instead of the SQNR's.
        higher_is_better: the metric's direction (a perplexity gains as it falls).
        others: further modules the search may keep float, not ranked (ops whose kernel agrees with
            its reference): re-measured only once the shortlist and the ranking run dry.
    """

    def __init__(
        self,
        measure: Measure,
        ranking: Sequence[str],
        disagreeing: Iterable[str] = (),
        neighbours: Mapping[str, Iterable[str]] | None = None,
        meets: Meets | None = None,
        by_metric: bool = False,
        higher_is_better: bool = True,
        others: Iterable[str] = (),
    ) -> None:
        self._measure, self.ranking = measure, list(ranking)
        known = set(self.ranking)
        self.others = [m for m in others if m not in known]
        self.everything = [*self.ranking, *self.others]  # every module the search may keep float
        self.disagreeing = [m for m in disagreeing if m in known]
        self.neighbours = {m: [n for n in found if n in known] for m, found in (neighbours or {}).items()}
        self.meets, self.by_metric = meets, by_metric
        self._sign = 1.0 if higher_is_better else -1.0
        self.measured: dict[frozenset[str], tuple[float, float | None]] = {}
        self.simulated = 0
        self._cursor = 0  # where the next widening starts down ``everything`` (each one resumes the last)
        self._cut = False  # whether the budget stopped this run

    # ---- measuring -------------------------------------------------------------------------------
    def measure(self, sets: Sequence[Iterable[str]]) -> list[tuple[float, float | None]]:
        """Each set's simulated (SQNR, metric), simulating only the sets not measured before."""
        keys = [frozenset(s) for s in sets]
        new = list(dict.fromkeys(k for k in keys if k not in self.measured))
        if new:
            for key, found in zip(new, self._measure(new), strict=True):
                self.measured[key] = found
            self.simulated += len(new)
        return [self.measured[k] for k in keys]

    def _score(self, result: tuple[float, float | None]) -> float:
        sqnr, metric = result
        if not self.by_metric:
            return _finite(sqnr)
        return _finite(math.nan if metric is None else self._sign * metric)  # higher is better here

    def _gain(self, before: tuple[float, float | None], after: tuple[float, float | None]) -> float:
        """The SQNR gain in dB (what the path shows), whatever the search chooses by."""
        return _finite(after[0]) - _finite(before[0])

    def _gains_enough(self, before: tuple[float, float | None], after: tuple[float, float | None]) -> bool:
        least = MIN_STEP_METRIC if self.by_metric else MIN_STEP_DB
        return self._score(after) - self._score(before) >= least

    def _met(self, result: tuple[float, float | None]) -> bool:
        return self.meets is not None and self.meets(*result)

    # ---- the search -------------------------------------------------------------------------------
    def aiming(self, meets: Meets | None, by_metric: bool = False) -> FloatSearch:
        """This search with another target, sharing what was measured."""
        other = copy.copy(self)
        other.meets, other.by_metric, other.simulated = meets, by_metric, 0
        return other

    def best(self) -> frozenset[str]:
        """The best float set measured so far: the fewest modules among those within
        ``NEGLIGIBLE_DB`` (or ``NEGLIGIBLE_METRIC``) of the best, then the better."""
        top = max(self._score(r) for r in self.measured.values())
        close = NEGLIGIBLE_METRIC if self.by_metric else NEGLIGIBLE_DB
        near = [s for s, r in self.measured.items() if self._score(r) >= top - close]
        return min(near, key=lambda s: (len(s), -self._score(self.measured[s])))

    def known(self, results: Mapping[frozenset[str], tuple[float, float | None]]) -> FloatSearch:
        """Take sets the caller measured already (in the same simulation) as measured."""
        self.measured.update(results)
        return self

    def run(
        self,
        start: Sequence[str] = (),
        most: int | None = None,
        budget: int | None = None,
        floor: bool = True,
        widen: bool = True,
    ) -> SearchPath:
        """Search from ``start`` kept float (default nothing). ``most`` caps the float set's size
        (default: every module); ``budget`` the sets simulated (the search stops at the next step);
        ``floor``: end on the one-at-a-time order's point where it is better (the size front has
        that order already, and leaves it out); ``widen``: re-measure every module once the shortlist
        runs dry (the size front's chain, which has its budget spent on each format, does not)."""
        began = time.perf_counter()
        if budget is None:
            budget = self.simulated + max(SEARCH_BUDGET * len(self.everything), SEARCH_FLOOR)
        most = len(self.everything) if most is None else most
        chosen: list[str] = list(start)
        (origin,) = self.measure([chosen])
        current = origin
        steps: list[Step] = []
        notes: list[str] = []
        prefix_from: tuple[float, float | None] | None = None  # every module float, when that meets the target
        whole_budget = budget
        if floor and self.meets is not None and not self._met(origin):
            (ceiling,) = self.measure([self.everything])
            if not self._met(ceiling):  # out of reach in simulation: the search only looks for a set near the top
                budget = min(budget, self.simulated + len(self.everything))
                notes.append(
                    f"every module float simulates at {ceiling[0]:.2f} dB, short of the target: the search "
                    f"looked for the fewest modules near that within {len(self.everything)} simulated sets"
                )
            elif not start:
                # in reach: the forward search has part of the budget; where it falls short, the prefix of the
                # order that meets is found by halving and pruned with the rest (far targets need most modules
                # float, which one pick at a time reaches slowly)
                prefix_from = ceiling
                budget = min(budget, self.simulated + max(len(self.everything) // PREFIX_SHARE, SEARCH_FLOOR))
        last: str | None = chosen[-1] if chosen else None
        tried_group = False
        self._cursor, self._cut = 0, False
        while not self._met(current) and len(chosen) < most:
            if self.simulated >= budget:
                self._cut = True
                notes.append(self._stopped_words(current, budget))
                break
            shortlist = self._shortlist(chosen, last)
            results = self.measure([[*chosen, m] for m in shortlist])
            ordered = sorted(zip(shortlist, results, strict=True), key=lambda pair: -self._score(pair[1]))
            name, best = ordered[0] if ordered else ("", current)
            if ordered and self._gains_enough(current, best):
                chosen, last = [*chosen, name], name
                steps.append(self._step(Action.ADD, (name,), current, best, len(chosen), self._why(name, chosen)))
                current = best
                continue
            group = [m for m in self.disagreeing if m not in chosen]
            if group and not tried_group and len(chosen) + len(group) <= most:  # the reverse view
                tried_group = True
                (together,) = self.measure([[*chosen, *group]])
                if self._gains_enough(current, together):
                    why = "the disagreeing kernels together: alone each gains nothing while the others stay broken"
                    chosen, last = [*chosen, *group], group[-1]
                    steps.append(self._step(Action.TOGETHER, tuple(group), current, together, len(chosen), why))
                    current = together
                    chosen, current = self._prune(chosen, current, steps, keep_met=self._met(current), only=group)
                    continue
            widened = self._widen(chosen, current, shortlist, budget) if widen else None
            if widened is not None:
                name, best, looked = widened
                chosen, last = [*chosen, name], name
                beyond = f"beyond the shortlist: the best of {looked} more re-measured once none of it gained"
                why = f"{self._why(name, chosen)}; {beyond}"
                steps.append(self._step(Action.WIDENED, (name,), current, best, len(chosen), why))
                current = best
                continue
            pair = self._best_pair([m for m, _ in ordered[:PAIRS_FROM]], chosen, current) if len(chosen) + 2 <= most else None
            if pair is None:
                notes.append(self._stuck_words(current, len(self.everything) - len(chosen)))
                break
            names, result = pair
            why = "a pair: neither gains alone given the picks before"
            chosen, last = [*chosen, *names], names[-1]
            steps.append(self._step(Action.TOGETHER, names, current, result, len(chosen), why))
            current = result
        prefix = self._fewest_prefix(prefix_from) if prefix_from is not None and not self._met(current) else None
        from_prefix = prefix is not None and prefix[0] <= most
        if from_prefix:
            count, result = prefix
            notes.append(
                f"the first {count} modules of the one-at-a-time order meet the target (found by halving): taken, "
                "then pruned within the search's budget"
            )
            chosen, current = list(self.everything[:count]), result
            why = f"the first {count} of the one-at-a-time order (then the ops not ranked) meet the target, found by halving"
            steps.append(self._step(Action.WALK, tuple(chosen), origin, result, count, why))
        if self._met(current) and len(chosen) > 1:
            if from_prefix:  # the least harmful alone first, within what the forward search left
                chosen, current = self._prune(chosen, current, steps, keep_met=True, budget=whole_budget, latest_first=True)
            else:
                chosen, current = self._prune(chosen, current, steps, keep_met=True)
        walk = self._walk(len(chosen)) if floor and self._met(current) and not start and not from_prefix else None
        if walk is not None:
            count, result = walk
            chosen, current = self.ranking[:count], result
            why = "the one-at-a-time order meets the target with fewer modules float: taken"
            steps.append(self._step(Action.WALK, tuple(chosen), origin, result, count, why))
        further = self._walk_further(current, most) if floor and not self._met(current) and not start else None
        if further is not None:
            count, result = further
            chosen, current = self.ranking[:count], result
            why = "out of reach: the one-at-a-time order, its small gains added up, goes further: taken"
            steps.append(self._step(Action.WALK, tuple(chosen), origin, result, count, why))
        return SearchPath(
            origin[0],
            origin[1],
            steps,
            tuple(chosen),
            current[0],
            current[1],
            self._met(current),
            dict(self.measured),
            self.simulated,
            time.perf_counter() - began,
            notes,
        )

    def _shortlist(self, chosen: Sequence[str], last: str | None) -> list[str]:
        """Not yet chosen: the ranking's top ``SHORTLIST``, the disagreeing kernels and ``last``'s neighbours."""
        taken = set(chosen)
        top = [m for m in self.ranking if m not in taken][:SHORTLIST]
        near = self.neighbours.get(last, []) if last is not None else []
        return list(dict.fromkeys([*top, *(m for m in self.disagreeing if m not in taken), *(m for m in near if m not in taken)]))

    def _widen(
        self, chosen: Sequence[str], current: tuple[float, float | None], looked: Sequence[str], budget: int
    ) -> tuple[str, tuple[float, float | None], int] | None:
        """Once none of the shortlist gains: the modules not yet picked nor on it, re-measured with the
        picks in rounds of ``WIDEN_ROUND`` down the one-at-a-time order (the others last), starting
        where the last widening stopped; the best of the first round where one gains, and how many
        were re-measured. None when none gains, or when the search spent its ``budget``."""
        order = self.everything[self._cursor :] + self.everything[: self._cursor]
        rest = [m for m in order if m not in chosen and m not in looked]
        tried = 0
        for start in range(0, len(rest), WIDEN_ROUND):
            if self.simulated >= budget:
                self._cut = True
                return None
            names = rest[start : start + WIDEN_ROUND]
            results = self.measure([[*chosen, m] for m in names])
            tried += len(names)
            name, best = max(zip(names, results, strict=True), key=lambda pair: self._score(pair[1]))
            if self._gains_enough(current, best):
                self._cursor = (self.everything.index(names[-1]) + 1) % len(self.everything)
                return name, best, tried
        return None

    def _why(self, name: str, chosen: Sequence[str]) -> str:
        """Why ``name`` was on the shortlist (the ranking, a disagreeing kernel, a neighbour of the pick before)."""
        reasons = [f"#{self.ranking.index(name) + 1} alone" if name in self.ranking else "an op not ranked (its kernel agrees)"]
        if name in self.disagreeing:
            reasons.append("its kernel disagrees")
        before = chosen[-2] if len(chosen) > 1 else None
        if before is not None and name in self.neighbours.get(before, []):
            reasons.append(f"next to {before}")
        return "; ".join(reasons)

    def _best_pair(
        self, names: Sequence[str], chosen: Sequence[str], current: tuple[float, float | None]
    ) -> tuple[tuple[str, str], tuple[float, float | None]] | None:
        pairs = list(itertools.combinations(names, 2))
        if not pairs:
            return None
        results = self.measure([[*chosen, *pair] for pair in pairs])
        pair, best = max(zip(pairs, results, strict=True), key=lambda item: self._score(item[1]))
        return (pair, best) if self._gains_enough(current, best) else None

    def _prune(
        self,
        chosen: list[str],
        current: tuple[float, float | None],
        steps: list[Step],
        keep_met: bool,
        only: Sequence[str] | None = None,
        budget: int | None = None,
        latest_first: bool = False,
    ) -> tuple[list[str], tuple[float, float | None]]:
        """One pass, earliest first (or ``latest_first``): drop each module (of ``only``, or any) whose
        removal still meets the target (``keep_met``) or costs less than a step's least gain; until
        ``budget`` sets are simulated."""
        order = reversed(chosen) if latest_first else chosen
        for name in [m for m in order if only is None or m in only]:
            if len(chosen) <= 1 or (budget is not None and self.simulated >= budget):
                break
            rest = [m for m in chosen if m != name]
            (without,) = self.measure([rest])
            fine = self._met(without) if keep_met else not self._gains_enough(without, current)
            if fine:
                why = "the target is still met without it" if keep_met else "it gains nothing given the others"
                steps.append(self._step(Action.DROP, (name,), current, without, len(rest), why))
                chosen, current = rest, without
        return chosen, current

    def _fewest_prefix(self, ceiling: tuple[float, float | None]) -> tuple[int, tuple[float, float | None]]:
        """The fewest modules of ``everything``'s order (the ranking, then the ops not ranked) that
        meet the target, by halving between none (not met) and all (``ceiling``, met): about
        log2(modules) sets; the order's gains need not add up, so this is a count that meets, not
        always the fewest."""
        low, high, found = 0, len(self.everything), ceiling
        while high - low > 1:
            middle = (low + high) // 2
            (result,) = self.measure([self.everything[:middle]])
            if self._met(result):
                high, found = middle, result
            else:
                low = middle
        return high, found

    def _walk(self, count: int) -> tuple[int, tuple[float, float | None]] | None:
        """The fewest modules of the one-at-a-time order that meet the target, when fewer than ``count``."""
        for fewer in range(count):
            (result,) = self.measure([self.ranking[:fewer]])
            if self._met(result):
                return fewer, result
        return None

    def _walk_further(self, current: tuple[float, float | None], most: int) -> tuple[int, tuple[float, float | None]] | None:
        """Where no set meets the target: the best point of the one-at-a-time order up to its last
        module that gains alone, when better than ``current`` (many small gains the search's
        ``MIN_STEP_DB`` steps over)."""
        singles = self.measure([[m] for m in self.ranking])
        (start,) = self.measure([()])
        helpful = min(sum(self._score(r) > self._score(start) for r in singles), most)
        if helpful < 2:
            return None
        points = self.measure([self.ranking[:count] for count in range(1, helpful + 1)])
        count, best = max(enumerate(points, 1), key=lambda item: (self._score(item[1]), -item[0]))
        return (count, best) if self._score(best) > self._score(current) else None

    def _step(
        self,
        action: str,
        modules: tuple[str, ...],
        before: tuple[float, float | None],
        after: tuple[float, float | None],
        count: int,
        why: str,
    ) -> Step:
        return Step(action, modules, self._gain(before, after), after[0], after[1], count, why)

    def _stopped_words(self, current: tuple[float, float | None], budget: int) -> str:
        return (
            f"the search stopped at {current[0]:.2f} dB after {self.simulated} simulated sets, its budget "
            f"({budget} sets for {len(self.everything)} modules)"
        )

    def _stuck_words(self, current: tuple[float, float | None], left: int) -> str:
        least = f"{MIN_STEP_METRIC:g} of the metric" if self.by_metric else f"{MIN_STEP_DB:g} dB"
        every = "as many as the budget allowed" if self._cut else "every one"
        return (
            f"the search stopped at {current[0]:.2f} dB: of the {left} modules not kept float, {every} re-measured with "
            f"the picks so far gains less than {least}, nor do the disagreeing kernels together or any pair of the best"
        )


def _finite(value: float) -> float:
    return -math.inf if math.isnan(value) else value
