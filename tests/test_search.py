"""The in-context search: modules that only help together are found together.

The fixture is a trained digits model (seconds) with three PReLUs in series whose slopes are
negative, under FX x86: torch's quantized PReLU kernel applies the slope to positive inputs too, so
each broken PReLU leaves the output garbage while the others stay broken. One at a time each gains
nothing; together they give back about 33 dB. A fourth PReLU after them agrees with its reference
on the baseline (its input is all zero there) and is found broken by the first real run.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo import ARCHITECTURES

import qreport_widgets as qw
from qreport_widgets.core.metrics import is_float_output
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.tune.diagnosis import meets_target
from qreport_widgets.tune.search import (
    MIN_STEP_DB,
    PAIRS_FROM,
    PREFIX_SHARE,
    SEARCH_BUDGET,
    SEARCH_FLOOR,
    SHORTLIST,
    WIDEN_ROUND,
    Action,
    FloatSearch,
)
from qreport_widgets.tune.truth import KERNEL_AGREEMENT_DB, SIMULATION_ERROR_DB

# real runs of x86's int8 kernels decide these outcomes: `make test` runs them again as a CPU without
# AVX-512 and on one thread
pytestmark = pytest.mark.kernels

BROKEN = ["prelu1", "prelu2", "prelu3"]  # broken on the baseline's inputs
HIDDEN = "prelu4"  # broken too, once the three before it are float
QUIET = lambda done, total: None  # noqa: E731


@pytest.fixture(scope="module")
def trained(digits_cache):
    return trained_digits_model("prelu_chain", digits_cache)


def analyzed(trained):
    model, data = trained
    return qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)


@pytest.fixture(scope="module")
def report(trained):
    return analyzed(trained)


def test_one_at_a_time_each_broken_prelu_gains_nothing_and_the_old_walk_is_blind(report):
    session = report.session
    baseline = session.baseline(progress=QUIET)
    truth = session.truth_check()
    assert baseline.output_sqnr_db < 2 and truth.disagreeing == BROKEN and truth.reliable
    ranking = session.sensitivity(progress=QUIET, metric=False)
    assert (ranking.loc[BROKEN, "output_sqnr_gain_db"].abs() < 0.1).all()  # alone: nothing
    assert (ranking["output_sqnr_gain_db"] < 0.1).all()  # and nothing else gains either
    ((together, _),) = session.simulate_each([BROKEN], metric=False)
    assert together > 30  # together: the simulated model
    # the one-at-a-time walk keeps the most harmful alone float, in order: never more than 0.5 dB
    order = list(ranking.index)
    walk = session.simulate_each([order[:count] for count in range(4)], metric=False)
    assert max(sqnr for sqnr, _ in walk) < 2


def test_reach_keeps_the_broken_kernels_float_and_nothing_else_confirmed_by_a_real_run(trained):
    session = analyzed(trained).session  # a fresh session: nothing ranked or measured before
    run = session.reach(target_sqnr_db=25, progress=QUIET)
    assert run.ok and run.output_sqnr_db >= 25
    kept = {name for name, s in run.settings.items() if s.keep_float}
    assert kept == {*BROKEN, HIDDEN}
    assert all(type(run.quantized_model.get_submodule(name)) is nn.PReLU for name in kept)
    said = " ".join(run.notes)
    assert "met with 4 of" in run.notes[-1] and f"that the baseline hid: {HIDDEN}" in said
    assert "the search went on from it" in said
    path = session.search_path()
    assert list(path["action"]) == ["start", Action.TOGETHER, Action.REAL, Action.ADD]
    assert path["modules"].iloc[1] == ", ".join(BROKEN) and path["modules"].iloc[-1] == HIDDEN
    assert path["simulated_output_sqnr_db"].iloc[1] > 30 and path["gain_db"].iloc[1] > 30
    # the real run at the first chosen point, and at the end, in the table
    assert path["real_output_sqnr_db"].iloc[2] < 2 and path["real_output_sqnr_db"].iloc[-1] == run.output_sqnr_db
    assert abs(path["simulated_output_sqnr_db"].iloc[-1] - run.output_sqnr_db) <= SIMULATION_ERROR_DB
    assert list(path["float_count"]) == [0, 3, 3, 4]
    # the fourth PReLU's kernel is now known broken, and the simulation runs it
    truth = session.truth_check()
    assert truth.disagreeing == [*BROKEN, HIDDEN] and HIDDEN in truth.real_kernels
    assert truth.kernels[HIDDEN] < KERNEL_AGREEMENT_DB


def test_a_second_reach_plans_with_what_the_first_found(report):
    session = report.session
    session.reach(target_sqnr_db=25, progress=QUIET)
    plan = session.plan_reach(target_sqnr_db=25, progress=QUIET)
    assert plan.met and set(plan.float_modules) == {*BROKEN, HIDDEN} and plan.path is not None
    assert abs(plan.simulated_sqnr_db - session.history[-1].output_sqnr_db) <= SIMULATION_ERROR_DB


def test_a_target_out_of_reach_in_simulation_gets_the_ceilings_real_run(trained):
    """200 dB is past every simulated point; the real run with every module float computes the float
    model's output (FX quantizes nothing else here): bit for bit, or within float round-off where its
    kernels sum in another order than the float model's own run (a CPU without AVX-512 at another
    thread count: 136 dB), so it meets the target and is returned."""
    session = analyzed(trained).session
    run = session.reach(target_sqnr_db=200, progress=QUIET)
    said = " ".join(run.notes)
    assert run.ok and "out of reach in simulation" in said and "in-context search" in said
    assert "the most this engine reaches on this model is the float model's output" in said
    assert "met by the real run with every module float" in run.notes[-1] and is_float_output(run.output_sqnr_db)
    assert {name for name, s in run.settings.items() if s.keep_float} == {m.fqn for m in session.modules}
    path = session.search_path()
    assert path["action"].iloc[-1] == Action.CEILING and is_float_output(path["real_output_sqnr_db"].iloc[-1])
    assert "every module float simulates at" in said  # out of reach in simulation: the search's budget shrinks


def test_reach_widens_past_its_shortlist_and_goes_on_from_a_real_run_that_falls_short(trained):
    """42 dB needs the pooling op kept float, which no ranking holds (its kernel agrees), and then the
    fourth PReLU, which the real run finds broken: the search widens to the pool once its shortlist
    gains nothing, the real run falls 42 dB short of its simulation, and the search goes on from it.
    Before widening this target was "out of reach" with a real run at 0.6 dB."""
    session = analyzed(trained).session
    run = session.reach(target_sqnr_db=42, progress=QUIET)
    assert run.ok and run.output_sqnr_db >= 42 and "met with 9 of 10" in run.notes[-1]
    kept = {name for name, s in run.settings.items() if s.keep_float}
    assert {*BROKEN, HIDDEN, "pool"} <= kept
    path = session.search_path()
    actions = list(path["action"])
    widened = actions.index(Action.WIDENED)
    assert path["modules"].iloc[widened] == "pool" and "beyond the shortlist" in path["why"].iloc[widened]
    assert actions.index(Action.REAL) > widened and path["real_output_sqnr_db"].iloc[actions.index(Action.REAL)] < 2
    assert HIDDEN in set(path["modules"].iloc[actions.index(Action.REAL) + 1 :])


def test_accept_all_offers_the_kernel_fixes_together_and_measures_them_in_one_real_run(trained):
    report = analyzed(trained)
    verified = report.session.verified_suggestions(report.suggestions(), progress=QUIET)
    fixes = [v for v in verified.offered if v.candidate.setting == "keep_float"]
    assert {v.candidate.module_fqn for v in fixes} == {*BROKEN, HIDDEN}
    assert all(v.gain_db > 30 and set(v.together) == {*BROKEN, HIDDEN} for v in fixes)
    assert "float too" in fixes[0].text
    assert verified.accept_all is not None and verified.accept_all.output_sqnr_db > 30
    assert any("the baseline hid" in note for note in verified.notes)


def test_fit_finds_the_kernel_fixes_on_the_size_front(trained):
    session = analyzed(trained).session
    run = session.fit(target_sqnr_db=25, progress=QUIET)
    assert run.ok and run.output_sqnr_db >= 25
    assert {name for name, s in run.settings.items() if s.keep_float} == {*BROKEN, HIDDEN}
    assert "met" in " ".join(run.notes)


# ---- the search on its own ----------------------------------------------------------------------
def _noise_model(interacting: dict[frozenset[str], float], alone: dict[str, float]):
    """A made-up output: SQNR from noise terms, where a set of modules only removes its noise together."""

    def measure(sets):
        found = []
        for kept in sets:
            noise = 1e-4 + sum(n for m, n in alone.items() if m not in kept)
            noise += sum(n for group, n in interacting.items() if not group <= kept)
            found.append((-10 * math.log10(noise), None))
        return found

    return measure


def test_the_search_finds_a_pair_that_only_helps_together():
    measure = _noise_model({frozenset({"c", "d"}): 1.0}, {"a": 0.01, "b": 0.005})
    meets = lambda s, m: meets_target(s, m, 20.0, None)  # noqa: E731
    path = FloatSearch(measure, ["a", "b", "c", "d", "e"], meets=meets).run()
    assert path.met and set(path.chosen) == {"c", "d", "a"}  # the pair, then the largest single noise
    assert any(step.action == Action.TOGETHER and set(step.modules) == {"c", "d"} for step in path.steps)


def test_the_search_stops_when_nothing_gains_and_says_so():
    measure = _noise_model({}, {"a": 0.01})
    path = FloatSearch(measure, ["a", "b"], meets=lambda s, m: s >= 60).run()
    assert not path.met and path.chosen == ("a",) and "stopped" in path.notes[-1]
    assert path.steps[0].gain_db >= MIN_STEP_DB


def test_a_module_past_the_shortlist_is_found_by_widening():
    """The one module that matters is 10th of 30 in the one-at-a-time order (its noise hid behind the
    ranking's) and no neighbour of anything: the search widens in rounds and finds it."""
    names = [f"m{i}" for i in range(30)]
    measure = _noise_model({}, {"m9": 0.05})
    path = FloatSearch(measure, names, meets=lambda s, m: s >= 30).run()
    assert path.met and path.chosen == ("m9",)
    (step,) = path.steps
    assert step.action == Action.WIDENED and "the best of 8 more re-measured" in step.why
    # the start, every module float (the target is in reach), the shortlist's 6, then the first round
    # of 8 (which holds m9), and no more
    assert path.simulated == 1 + 1 + 6 + 8


def test_an_op_not_ranked_is_a_unit_too():
    measure = _noise_model({}, {"relu": 0.05})
    path = FloatSearch(measure, ["a", "b"], meets=lambda s, m: s >= 30, others=["relu"]).run()
    assert path.met and path.chosen == ("relu",) and "an op not ranked" in path.steps[0].why


def test_out_of_reach_is_said_once_every_module_was_re_measured():
    names = [f"m{i}" for i in range(200)]
    measure = _noise_model({}, {name: 1e-7 * (i % 3) for i, name in enumerate(names)})  # none gains 0.05 dB, nor a pair
    search = FloatSearch(measure, names, meets=lambda s, m: s >= 200)
    path = search.run(floor=False)
    assert not path.met and "every one re-measured" in path.notes[-1]
    # the start, the shortlist, every other module once, the pairs of the shortlist's best
    assert search.simulated == 1 + SHORTLIST + (len(names) - SHORTLIST) + PAIRS_FROM * (PAIRS_FROM - 1) // 2


def test_a_search_that_goes_on_gaining_stops_at_its_budget_and_says_so():
    names = [f"m{i}" for i in range(50)]
    measure = _noise_model({}, dict.fromkeys(names, 0.01))  # every pick gains about 0.1 dB, never enough
    assert SEARCH_BUDGET * len(names) >= SEARCH_FLOOR
    search = FloatSearch(measure, names, meets=lambda s, m: s >= 200)
    path = search.run(floor=False)
    budget = SEARCH_BUDGET * len(names)
    assert not path.met and f"after {search.simulated} simulated sets, its budget ({budget} sets for 50" in path.notes[-1]
    assert budget <= search.simulated <= budget + SHORTLIST + WIDEN_ROUND  # it stops at the next step


def test_a_far_target_in_reach_is_met_by_the_orders_prefix_found_by_halving_then_pruned():
    """80 modules, each a little noise: the target needs all but a few float, which one pick at a
    time (about 0.2 dB a step) would reach after hundreds of sets. The forward search spends its share
    of the budget, then the fewest of the one-at-a-time order that meet (by halving: 7 sets) are
    taken and pruned, latest first, with the rest of the budget."""
    names = [f"m{i}" for i in range(80)]
    noise = {name: 0.01 * (1 + (i % 5) / 10) for i, name in enumerate(names)}  # the ranking's order: most first
    ranking = sorted(names, key=lambda m: -noise[m])
    measure = _noise_model({}, noise)
    (target,) = [db for db, _ in measure([frozenset(ranking[:72])])]
    search = FloatSearch(measure, ranking, meets=lambda s, m: s >= target)
    path = search.run()
    assert path.met and len(path.chosen) <= 72
    assert any(step.action == Action.WALK and "found by halving" in step.why for step in path.steps)
    assert "meet the target (found by halving)" in " ".join(path.notes)
    whole = 1 + 1 + max(SEARCH_BUDGET * len(names), SEARCH_FLOOR)  # the start, every module float, the budget
    assert search.simulated <= whole + SHORTLIST + WIDEN_ROUND + math.ceil(math.log2(len(names)))
    assert len(names) // PREFIX_SHARE < search.simulated  # the forward search had its share first


def test_each_set_is_simulated_once():
    calls = []
    inner = _noise_model({}, {"a": 0.01, "b": 0.001})

    def measure(sets):
        calls.extend(sets)
        return inner(sets)

    search = FloatSearch(measure, ["a", "b", "c"], meets=lambda s, m: s >= 100)
    search.run()
    other = search.aiming(lambda s, m: s >= 100)
    other.run()
    assert len(calls) == len(set(calls)) == search.simulated + other.simulated


@pytest.mark.parametrize("name", ["resnet", "mobilenet_v3"])
def test_on_the_zoo_the_search_never_keeps_more_float_than_the_old_walk(name):
    build, data = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = build().eval()
    batches = data(3)
    report = qw.analyze(model, batches[0], batches[:2], eval_data=batches[2:], progress=False)
    session = report.session
    order = list(session.sensitivity(progress=QUIET, metric=False).index)
    curve = [sqnr for sqnr, _ in session.simulate_each([order[:count] for count in range(len(order) + 1)], metric=False)]
    for count in (2, 5, 10):  # targets the one-at-a-time walk meets with a few, some, many modules float
        target = max(curve[: count + 1])
        walk = next(c for c, sqnr in enumerate(curve) if sqnr >= target)
        plan = session.plan_reach(target_sqnr_db=target, progress=QUIET)
        assert plan.met and len(plan.float_modules) <= walk, (count, plan.float_modules)


def test_the_tune_tabs_propose_shows_the_path_and_sets_the_rows(trained):
    report = analyzed(trained)
    tuning = report.widget().tuning
    pane = tuning.sensitivity
    tuning.apply.click()  # the baseline (its truth check names the broken kernels)
    pane.target.value = 25.0
    pane.reach.click()
    status = pane.status.value
    assert "reach" in status and "The search's path" in status and "add together" in status
    assert "prelu1, prelu2, prelu3" in status and "the disagreeing kernels together" in status
    assert {fqn for fqn, row in tuning.rows.items() if row.keep_float.value} == set(BROKEN)
    tuning.apply.click()  # the real run finds the fourth PReLU broken: the simulation runs it from now on
    run = report.session.history[-1]
    assert run.output_sqnr_db < 2 and f"that the baseline hid: {HIDDEN}" in " ".join(run.notes)
    pane.reach.click()  # and Propose, planned again, keeps it float too
    assert {fqn for fqn, row in tuning.rows.items() if row.keep_float.value} == {*BROKEN, HIDDEN}
    tuning.apply.click()
    assert report.session.history[-1].output_sqnr_db >= 25
