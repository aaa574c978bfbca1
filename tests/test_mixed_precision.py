"""The size front and fit() against real runs: on the digits CNN under FX (int8 or float per module)
and on transformers under the eager engine (float, int8, int4 with group sizes, dynamic), the
front is a front, its sizes and simulated SQNR are what real runs measure, fit() meets a budget or a
target with a real run and says when it cannot; reach() and fit() with a metric target on fresh
sessions."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from hf_models import VOCAB, tiny_llama

import qreport_widgets as qw
from qreport_widgets import ModuleSettings, QuantizationSession
from qreport_widgets.core.shortcuts import ENVIRONMENT, ShortcutMismatchError
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.engines.eager import simulate
from qreport_widgets.engines.eager.simulate import dequantized_weight, format_key
from qreport_widgets.engines.settings import DEFAULT_GROUP_SIZE
from qreport_widgets.tune import mixed, simulation

quiet = lambda done, total: None  # noqa: E731
AGREEMENT_DB = 0.5  # a front point's simulated output SQNR and a real run of its settings
SIZE_AGREEMENT = 0.01  # a front point's estimated deployed size and a real run's


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


def digits_session(name: str, cache, engine: str = "fx") -> QuantizationSession:
    model, data = trained_digits_model(name, cache)
    return QuantizationSession(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy, engine=engine
    )


def assert_a_front(front, higher_is_better: bool = True) -> None:
    """Sizes rise, and every point is better than every smaller one: by the metric where the front
    has one (ties by output SQNR), else by output SQNR."""
    assert front["size_bytes"].is_monotonic_increasing and front["size_bytes"].is_unique
    sqnr = front["simulated_output_sqnr_db"]
    if "simulated_metric" not in front:
        assert sqnr.diff().dropna().gt(0).all()
        return
    sign = 1 if higher_is_better else -1
    quality = list(zip(sign * front["simulated_metric"], sqnr, strict=True))
    assert all(a < b for a, b in zip(quality, quality[1:], strict=False)), quality


def test_the_front_ranks_its_points_by_the_sessions_metric_where_it_has_one():
    """A decoder whose head reads a quantized embedding: as tensors grow, the logits' SQNR falls while
    perplexity improves. Ranked by SQNR the front would keep only the smallest point; ranked by the
    metric (lower is better) it keeps each point that lowers perplexity, and a higher-is-better metric
    keeps the other way round."""
    rows = [
        {"size_bytes": size, "simulated_output_sqnr_db": sqnr, "simulated_metric": ppl, "formats": "", "settings": {}}
        for size, sqnr, ppl in ((79, 16.2, 17.5), (90, 15.5, 16.4), (95, 15.6, 16.9), (117, 14.0, 15.4))
    ]
    by_sqnr = mixed._front([{k: v for k, v in r.items() if k != "simulated_metric"} for r in rows])
    assert list(by_sqnr["size_bytes"]) == [79]
    perplexity = mixed._front(rows, qw.Metric("perplexity", higher_is_better=False))
    assert list(perplexity["size_bytes"]) == [79, 90, 117]
    assert_a_front(perplexity, higher_is_better=False)
    accuracy = mixed._front(rows, qw.Metric("accuracy"))
    assert list(accuracy["size_bytes"]) == [79]
    unmeasured = [*rows[:1], {**rows[1], "simulated_metric": math.nan}]
    assert list(mixed._front(unmeasured, qw.Metric("perplexity", higher_is_better=False))["size_bytes"]) == [79]


def assert_points_agree_with_real_runs(session, front) -> None:
    for _, point in front.iterrows():
        run = session.apply(point["settings"], progress=quiet, record=False)
        assert run.ok, run.error
        assert run.deployed_bytes == pytest.approx(point["size_bytes"], rel=SIZE_AGREEMENT)
        if math.isfinite(point["simulated_output_sqnr_db"]):
            assert run.output_sqnr_db == pytest.approx(point["simulated_output_sqnr_db"], abs=AGREEMENT_DB), point["formats"]


def test_the_fx_front_of_the_digits_cnn_agrees_with_real_runs_and_fit_meets_budgets_and_targets(cache):
    session = digits_session("cnn", cache)
    front = session.pareto(progress=quiet)
    assert_a_front(front)
    assert front.iloc[0]["formats"] == "5 int8 per-channel" and front.iloc[-1]["formats"] == "4 float, 1 int8 per-channel"
    # the in-context search's point between the chain's: conv1, fc1 and fc2 float, better than the chain's 3 float
    searched = front.iloc[-2]
    assert {fqn for fqn, s in searched["settings"].items() if s.keep_float} == {"conv1", "fc1", "fc2"}
    assert searched["simulated_output_sqnr_db"] > front.iloc[-3]["simulated_output_sqnr_db"]
    assert set(front.columns) >= {"size_bytes", "simulated_output_sqnr_db", "simulated_metric", "settings"}
    assert_points_agree_with_real_runs(session, front)
    uniform = session.uniform_points()
    assert list(uniform.index) == ["baseline", "all float"]
    assert uniform.loc["baseline", "size_bytes"] == session.baseline().deployed_bytes

    budget = (front.iloc[0]["size_bytes"] + front.iloc[-1]["size_bytes"]) / 2
    fitted = session.fit(max_size_bytes=budget, progress=quiet)
    best = front[front["size_bytes"] <= budget].iloc[-1]
    assert fitted.ok and fitted.deployed_bytes <= budget and "fits:" in fitted.notes[-1]
    assert fitted.output_sqnr_db == pytest.approx(best["simulated_output_sqnr_db"], abs=AGREEMENT_DB)
    assert fitted.settings == best["settings"] and session.history[-1] is fitted

    target = front.iloc[2]["simulated_output_sqnr_db"] - 0.5
    met = session.fit(target_sqnr_db=target, progress=quiet)
    assert met.output_sqnr_db >= target and "met" in met.notes[-1]
    assert met.settings == front.iloc[2]["settings"]  # the smallest point that meets it
    assert "out of reach" in session.fit(target_sqnr_db=999.0, progress=quiet).notes[-1]
    tiny = session.fit(max_size_bytes=100, progress=quiet)
    assert "out of reach" in tiny.notes[-1] and tiny.settings == front.iloc[0]["settings"]
    with pytest.raises(ValueError, match="needs max_size_bytes"):
        session.fit()


def test_reach_and_fit_with_a_metric_target_on_fresh_sessions(cache):
    baseline = digits_session("cnn", cache).baseline(progress=quiet)
    target = baseline.eval_metric - 0.01  # the int8 start meets it: nothing need be kept float
    reached = digits_session("cnn", cache).reach(target_metric=target, progress=quiet)
    assert reached.eval_metric >= target and not any(s.keep_float for s in reached.settings.values())
    assert "met with 0 of" in reached.notes[-1]
    fitted = digits_session("cnn", cache).fit(target_metric=target, progress=quiet)
    assert fitted.eval_metric >= target and "met" in fitted.notes[-1]
    assert not any(s.keep_float for s in fitted.settings.values())


def uniform_and_split(session, front_modules: list[str], first: str, second: str) -> dict[str, ModuleSettings]:
    half = len(front_modules) // 2
    return {fqn: ModuleSettings(format=first if i < half else second) for i, fqn in enumerate(front_modules)}


# digits bert: 33 s for what the tiny llama cases show in a few seconds; `make test-slow` runs it
@pytest.mark.parametrize(
    "name", [pytest.param("digits bert", marks=pytest.mark.slow), "tiny llama", "tiny llama, most choices estimated"]
)
def test_the_eager_front_beats_naive_splits_and_all_int4_at_the_same_size(name, cache, monkeypatch):
    if name.endswith("estimated"):  # as on a decoder with hundreds of single choices
        monkeypatch.setattr(mixed, "ESTIMATED_BEYOND", 0)
    if name == "digits bert":
        session = digits_session("bert", cache, engine="eager")
    else:
        model, batches = tiny_llama()
        session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    front = session.pareto(progress=quiet)
    assert_a_front(front)
    uniform = session.uniform_points()
    int8, int4 = "all int8-weight-only", "all int4-weight-only (group 32)"
    assert {int8, int4} <= set(uniform.index)
    modules = list(front.iloc[0]["settings"])
    runs = {label: session.apply(uniform.loc[label, "settings"], label=label, progress=quiet) for label in (int8, int4)}
    halfway = (runs[int8].deployed_bytes + runs[int4].deployed_bytes) / 2
    fitted = session.fit(max_size_bytes=halfway, progress=quiet)
    assert fitted.deployed_bytes <= halfway
    assert fitted.output_sqnr_db >= runs[int4].output_sqnr_db + 3.0
    for first, second in (("int8-weight-only", "int4-weight-only"), ("int4-weight-only", "int8-weight-only")):
        naive = session.apply(uniform_and_split(session, modules, first, second), progress=quiet)
        same_size = session.fit(max_size_bytes=naive.deployed_bytes, progress=quiet)
        assert same_size.deployed_bytes <= naive.deployed_bytes
        assert same_size.output_sqnr_db > naive.output_sqnr_db, (first, same_size.notes[-1])
    near = front.iloc[:: max(1, len(front) // 4)]  # a few points along the front
    assert_points_agree_with_real_runs(session, near)
    assert torch.isfinite(torch.tensor(front["simulated_output_sqnr_db"].iloc[:-1].to_numpy())).all()


def test_estimated_single_choices_read_each_modules_own_error_and_land_near_whole_simulations(monkeypatch):
    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    name = "model.layers.1.mlp.down_proj"
    int4, int8 = ModuleSettings(format="int4-weight-only", group_size=32), ModuleSettings(format="int8-weight-only")
    module = session.float_model.get_submodule(name)
    seen = []
    handle = module.register_forward_hook(lambda _m, args, output: seen.append((args[0], output)))
    with torch.no_grad():
        session.float_model(*session.eval_data[0])
    handle.remove()
    given, expected = seen[0]
    own = session.simulation().local_noise(session.eval_data[0], {name: [int4, int8, ModuleSettings(keep_float=True)]})
    for choice in (int4, int8):
        direct = torch.nn.functional.linear(given, dequantized_weight(module, format_key(choice))) - expected
        assert own[name, choice] == pytest.approx(float(direct.double().pow(2).sum()), rel=1e-5)
    assert own[name, ModuleSettings(keep_float=True)] == 0.0
    assert own[name, int4] > own[name, int8] > 0

    found = {}
    estimate = mixed._estimated_alone

    def kept(*args):
        found.update(estimate(*args))
        return found

    monkeypatch.setattr(mixed, "ESTIMATED_BEYOND", 0)
    monkeypatch.setattr(mixed, "_estimated_alone", kept)
    monkeypatch.setattr(simulate, "HEAD_ROWS", VOCAB // 4)  # the head's choices ranked on half its rows
    monkeypatch.setattr(simulate, "SAMPLED_ROWS", VOCAB // 2)
    front = session.pareto(progress=quiet)
    said = f"the size front ranked lm_head's choices on {VOCAB // 2} of its {VOCAB} rows"
    assert [note for note in session.parts.mixed.front(quiet).notes if note.startswith(said)]
    fitted = session.fit(max_size_bytes=front["size_bytes"].median(), progress=quiet)
    assert [note for note in fitted.notes if note.startswith(said)], fitted.notes
    # what only ranks read the first evaluation batch (the head's sampled rows: ``head_sample``), the points every batch
    # (the tiny decoder's rows of 16 tokens hold fewer than RANKED_POSITIONS: its batches are read whole)
    assert {read for read, _ in session.parts.simulated._known} == {(mixed.RANKED_ON, VOCAB // 2, None), (None, None, None)}
    said = f"the size front ranked single choices and steps on {VOCAB // 2} of the output's {VOCAB} columns (lm_head's rows"
    assert [note for note in fitted.notes if note.startswith(said)], fitted.notes
    start = {m.fqn: m.current for m in session.modules}
    singles = list(found)
    assert len(singles) > 4 * len(session.modules)  # every format and group size of every module
    whole = session.simulate_each([mixed.variant_of({fqn: c}, start) for fqn, c in singles], metric=False)
    # each measured from the start as its measure reads it (the ranking's: one batch, half the output's columns)
    ((ranked_start, _),) = session.parts.simulated.simulate_each(
        [mixed.Variant()], quiet, metric=False, batches=1, sampled_columns=True
    )
    ((whole_start, _),) = session.simulate_each([mixed.Variant()], metric=False)
    gaps = sorted(
        abs((found[single][0] - ranked_start) - (sqnr - whole_start)) for single, (sqnr, _) in zip(singles, whole, strict=True)
    )
    assert gaps[len(gaps) // 2] < 0.2 and gaps[int(0.9 * len(gaps))] < 1.0  # median, 90th percentile (dB)
    assert DEFAULT_GROUP_SIZE in {c.group_size for _, c in singles}


def test_a_fit_under_a_budget_simulates_whole_only_the_points_that_can_be_its_answer(monkeypatch):
    """A size budget: no point above it is the answer, so a large front (estimated single choices)
    simulates whole only points within it, the smallest (the answer when none fits) and the uniform
    choices within it, and skips the in-context search where the start with its cheapest module kept
    float does not fit (the search's points keep modules float) and only there. Without a target the
    best point within the budget is the answer: only the largest points are simulated; with one, the
    smallest meeting it: the chain's points within the budget halved towards it. Either way the run is
    the whole front's fit's."""
    monkeypatch.setattr(mixed, "ESTIMATED_BEYOND", 0)
    model, batches = tiny_llama()

    def session() -> QuantizationSession:
        return QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")

    labels: list[tuple[str, int]] = []
    each = simulation.Simulated.simulate_each

    def counted(self, variants, progress=None, label="", **given):
        labels.append((label, len(variants)))
        return each(self, variants, progress, label, **given)

    def simulated_points() -> int:
        return sum(count for label, count in labels if label == "size front: points")

    monkeypatch.setattr(simulation.Simulated, "simulate_each", counted)
    whole = session()
    front = whole.pareto(progress=quiet)
    every_point = simulated_points()
    baseline, cut = whole.baseline().deployed_bytes, session()
    halfway = (baseline + front["size_bytes"].max()) / 2
    # a byte above the baseline's: the start fits, keeping any module float does not; halfway to the front's
    # largest point: it leaves room
    for budget, searched in ((baseline + 1, False), (halfway, True)):
        assert front["size_bytes"].iloc[0] < budget < front["size_bytes"].max()
        expected = whole.fit(max_size_bytes=budget, progress=quiet)
        labels.clear()
        fitted = cut.fit(max_size_bytes=budget, progress=quiet)
        assert fitted.deployed_bytes == expected.deployed_bytes <= budget
        assert fitted.output_sqnr_db == pytest.approx(expected.output_sqnr_db, abs=1e-6)
        assert 0 < simulated_points() <= 2 * mixed.FIT_POINTS + len(whole.uniform_points()) < len(front)
        assert any(label == "size front: in-context search" for label, _ in labels) == searched
        said = [note for note in fitted.notes if note.startswith(f"for a budget of {budget / 1024:,.1f} KB, the size front")]
        assert said and ("in-context search was not run" in said[0]) != searched, fitted.notes
    # a target within the budget: the smallest point meeting it, which any point within the budget can be
    within = front[front["size_bytes"] <= halfway]
    target = float(within["simulated_output_sqnr_db"].iloc[len(within) // 2])
    expected = whole.fit(max_size_bytes=halfway, target_sqnr_db=target, progress=quiet)
    labels.clear()
    fitted = session().fit(max_size_bytes=halfway, target_sqnr_db=target, progress=quiet)
    assert fitted.deployed_bytes == expected.deployed_bytes <= halfway
    assert fitted.output_sqnr_db == pytest.approx(expected.output_sqnr_db, abs=1e-6)
    assert 0 < simulated_points() < every_point
    assert any("halving towards the smallest meeting the target" in note for note in fitted.notes), fitted.notes
    # a target alone: the smallest point meeting it may lie anywhere, the whole front
    assert not mixed.fit_budget(baseline, None, None).targeted
    assert mixed.fit_budget(baseline, 30.0, None) == mixed.Budget(baseline, target_sqnr_db=30.0)
    assert mixed.fit_budget(baseline, None, 2.0).targeted
    assert mixed.fit_budget(None, 30.0, None) is None


def test_halving_along_a_chain_finds_its_smallest_point_meeting_the_target_in_few_simulations(shortcuts_as_taken):
    """``_halved`` simulates the chain's largest point first, then halves: on a chain whose quality
    rises with its size, the smallest point meeting the target, found in about log2 of the points'
    simulations; where even the largest misses, "none meets" only once every point was simulated."""
    points = [{"m": ModuleSettings(format="int4-weight-only", group_size=32, keep_float=False)} for _ in range(40)]
    quality = [10.0 + at for at in range(len(points))]
    asked: list[int] = []

    def simulate(point):
        at = next(at for at, p in enumerate(points) if p is point)
        asked.append(at)
        return quality[at], None

    for target in (10.0, 23.5, 49.0, 49.5):
        asked.clear()
        probed = mixed._halved(points, simulate, lambda sqnr, _value, target=target: sqnr >= target)
        meeting = [at for at in probed if quality[at] >= target]
        expected = next((at for at, q in enumerate(quality) if q >= target), None)
        assert (min(meeting) if meeting else None) == expected
        assert asked[0] == len(points) - 1 and len(asked) == len(set(asked))
        assert len(asked) <= 7 if expected is not None else len(asked) == len(points)  # "none meets": all were simulated
        assert all(probed[at] == (quality[at], None) for at in asked)
    assert mixed._halved([], simulate, lambda *_: True) == {}


def test_halving_where_the_largest_point_misses_simulates_the_smaller_ones_and_the_check_mode_proves_its_answer(
    monkeypatch, shortcuts_as_taken
):
    """A front read by a metric need not rise with size: where the largest point misses the target,
    the smaller ones are simulated, smallest first, until one meets (not "none meets"); and the check
    mode simulates every point and raises where the halving's answer is not the smallest meeting."""
    points = [{"m": ModuleSettings(format="int4-weight-only", group_size=32)} for _ in range(9)]
    quality = [10.0, 11.0, 30.0, 12.0, 13.0, 31.0, 14.0, 15.0, 16.0]  # rises, but not at every step

    def simulate(point):
        return quality[next(at for at, p in enumerate(points) if p is point)], None

    def smallest_meeting(probed, target):
        return min((at for at, (sqnr, _) in probed.items() if sqnr >= target), default=None)

    assert smallest_meeting(mixed._halved(points, simulate, lambda sqnr, _v: sqnr >= 29.0), 29.0) == 2
    assert smallest_meeting(mixed._halved(points, simulate, lambda sqnr, _v: sqnr >= 40.0), 40.0) is None
    # the largest meets 15.5, halving then finds #8; the check mode finds #2 meets it too, and says so
    assert smallest_meeting(mixed._halved(points, simulate, lambda sqnr, _v: sqnr >= 15.5), 15.5) == 8
    with pytest.raises(ShortcutMismatchError, match="halving found #8 .* found #2"):
        mixed._halved(points, simulate, lambda sqnr, _v: sqnr >= 15.5, check=True)
    monkeypatch.setenv(ENVIRONMENT, "1")
    rising = [{"m": ModuleSettings(format="int4-weight-only", group_size=32)} for _ in range(9)]
    probed = mixed._halved(
        rising, lambda p: (10.0 + next(i for i, q in enumerate(rising) if q is p), None), lambda s, _v: s >= 14
    )
    assert smallest_meeting(probed, 14) == 4  # where quality rises with size, the check finds nothing


def test_a_heads_choices_are_measured_on_a_sample_of_its_rows_each_quantized_as_the_whole_head_would_be(monkeypatch):
    """A Linear of more than HEAD_ROWS rows (a decoder's head over a vocabulary) has each choice's own
    noise measured on SAMPLED_ROWS of its rows and scaled to every row: every row sampled, it is the
    whole head's, to round-off, for every format and algorithm; half of them, near it, in its order."""
    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    simulation, batch = session.simulation(), session.eval_data[0]
    int4 = [ModuleSettings(format="int4-weight-only", group_size=32, algorithm=a) for a in ("", "hqq", "gptq", "awq")]
    others = [ModuleSettings(format="int8-weight-only"), ModuleSettings(format="int8-dynamic"), ModuleSettings(keep_float=True)]
    options = {"lm_head": int4 + others}
    whole = simulation.local_noise(batch, options)
    assert simulation.sampled == {}
    monkeypatch.setattr(simulate, "HEAD_ROWS", VOCAB // 4)
    monkeypatch.setattr(simulate, "SAMPLED_ROWS", VOCAB)
    every = simulation.local_noise(batch, options)
    assert simulation.sampled == {"lm_head": (VOCAB, VOCAB)}
    for choice in options["lm_head"]:
        assert every["lm_head", choice] == pytest.approx(whole["lm_head", choice], rel=1e-4), choice
    monkeypatch.setattr(simulate, "SAMPLED_ROWS", VOCAB // 2)
    half = simulation.local_noise(batch, options)
    assert simulation.sampled == {"lm_head": (VOCAB // 2, VOCAB)}
    for choice in options["lm_head"]:
        assert half["lm_head", choice] == pytest.approx(whole["lm_head", choice], rel=0.2), choice
    ranked = sorted(options["lm_head"], key=lambda choice: whole["lm_head", choice])
    assert sorted(options["lm_head"], key=lambda choice: half["lm_head", choice])[:2] == ranked[:2]  # float, int8
    assert whole["lm_head", int4[0]] > whole["lm_head", others[0]] > 0
    # another module's GPTQ weight found in the same call: the head's inputs gathered in its pass, one in all
    runs = []
    calibrate = simulation._calibrate
    simulation._calibrate = lambda model, gathered: (runs.append(1), calibrate(model, gathered))
    both = simulation.local_noise(batch, {**options, "model.layers.0.mlp.down_proj": [int4[2]]})
    assert len(runs) == 1 and ("model.layers.0.mlp.down_proj", int4[2]) in both
    for choice in options["lm_head"]:
        assert both["lm_head", choice] == pytest.approx(half["lm_head", choice], rel=1e-6), choice


def test_costly_algorithms_are_measured_at_one_group_size_and_read_off_round_to_nearest_at_the_others():
    """HQQ, GPTQ and AWQ are measured at one group size a module (the start's, else the default); at
    the others a choice's own noise is round to nearest's there times the algorithm's ratio to it
    where measured: exact where measured, near the measured noise where read off."""
    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    simulation, batch, name = session.simulation(), session.eval_data[0], "model.layers.1.mlp.down_proj"
    choice = lambda algorithm, group: ModuleSettings(format="int4-weight-only", group_size=group, algorithm=algorithm)  # noqa: E731
    options = [choice(a, g) for a in ("rtn", "hqq", "gptq", "awq") for g in (32, 64, 128)] + [ModuleSettings(keep_float=True)]
    start = ModuleSettings(format="int8-weight-only")
    assert set(simulate.one_group_estimates(options, start)) == {choice(a, g) for a in ("hqq", "gptq", "awq") for g in (64, 128)}
    assert {c.group_size for c in simulate.one_group_estimates(options, choice("gptq", 64))} == {32, 128}
    found = simulation.local_noise(batch, {name: options})
    assert simulation.read_off == 6
    for algorithm in ("hqq", "gptq", "awq"):
        alone = {
            g: simulation.local_noise(batch, {name: [choice(algorithm, g)]})[name, choice(algorithm, g)] for g in (32, 64, 128)
        }
        assert simulation.read_off == 0
        assert found[name, choice(algorithm, 32)] == pytest.approx(alone[32], rel=1e-6)
        for group in (64, 128):
            read = found[name, choice("rtn", group)] * found[name, choice(algorithm, 32)] / found[name, choice("rtn", 32)]
            assert found[name, choice(algorithm, group)] == pytest.approx(read, rel=1e-9)
            assert found[name, choice(algorithm, group)] == pytest.approx(alone[group], rel=0.15), (algorithm, group)


def test_the_gptq_and_awq_weights_of_many_variants_are_found_in_one_calibration_run():
    """Variants that each take GPTQ / AWQ weights not found yet (a front's points) have them all
    found before the passes, in one run over the calibration batches, not one a variant; each
    variant's output is what it is simulated alone."""
    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    simulation = session.simulation()
    runs = []
    calibrate = simulation._calibrate
    simulation._calibrate = lambda model, gathered: (runs.append(1), calibrate(model, gathered))
    start = {m.fqn: m.current for m in session.modules}
    names = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj"]
    variants = [
        mixed.variant_of({name: ModuleSettings(format="int4-weight-only", group_size=32, algorithm=algorithm)}, start)
        for name in names
        for algorithm in ("gptq", "awq")
    ]
    together = session.parts.simulated.simulate_each(variants, quiet, metric=False)
    assert len(runs) == 1
    apart = [simulation.outputs(session.eval_data, variant) for variant in variants]
    assert [sqnr for sqnr, _ in together] == pytest.approx(
        [session.parts.simulated.runner.output_sqnr(o) for o in apart], abs=1e-6
    )
    assert len(runs) == 1  # found once, kept


class _Probabilities(torch.nn.Module):
    """A decoder whose output is its logits' softmax: a column of it is not one row of the head."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(ids).logits.softmax(-1)


def test_ranking_passes_compute_a_sample_of_a_large_heads_rows_and_read_those_output_columns(monkeypatch):
    """Where the output is a head's rows (a decoder's logits over a vocabulary of more than HEAD_ROWS),
    a pass that only ranks may compute SAMPLED_ROWS of them: every row sampled, each variant's
    output SQNR is the whole output's; half of them, near it and in the same order. An output that
    is not the head's rows as they are (a softmax after it) is never sampled."""
    monkeypatch.setattr(simulate, "HEAD_ROWS", VOCAB // 4)
    monkeypatch.setattr(simulate, "SAMPLED_ROWS", VOCAB)
    model, batches = tiny_llama()
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
    variants = [mixed.Variant(), *(mixed.Variant(frozenset([m.fqn])) for m in session.modules)]
    simulated = session.parts.simulated
    whole = [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1)]
    every = [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1, sampled_columns=True)]
    head, columns = simulated.head_sample()
    assert head == "lm_head" and columns.tolist() == list(range(VOCAB))
    assert every == pytest.approx(whole, abs=1e-4)
    monkeypatch.setattr(simulate, "SAMPLED_ROWS", VOCAB // 2)
    simulated._head = simulation._UNCHECKED
    half = [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1, sampled_columns=True)]
    assert len(simulated.head_sample()[1]) == VOCAB // 2
    assert half == pytest.approx(whole, abs=0.5)
    gains = lambda found: [sqnr - found[0] for sqnr in found[1:]]  # noqa: E731  # what keeping each float gains
    assert gains(half) == pytest.approx(gains(whole), abs=0.15)
    assert max(range(len(variants) - 1), key=gains(half).__getitem__) == max(
        range(len(variants) - 1), key=gains(whole).__getitem__
    )
    # the simulation's head is the float model's again: whole passes are what they were
    assert [sqnr for sqnr, _ in simulated.simulate_each(variants[1:3], quiet, metric=False)] == [
        sqnr for sqnr, _ in session.simulate_each(variants[1:3], metric=False)
    ]
    probabilities = QuantizationSession(
        _Probabilities(tiny_llama()[0]), batches[0], batches[:4], eval_data=batches[4:], engine="eager"
    )
    simulated = probabilities.parts.simulated
    assert simulated.head_sample() is None
    assert simulated.simulate_each(variants[:1], quiet, metric=False, batches=1, sampled_columns=True) == simulated.simulate_each(
        variants[:1], quiet, metric=False, batches=1
    )


def test_a_ranking_pass_may_read_the_first_rows_of_its_batches_as_if_they_were_the_batch(monkeypatch):
    """``simulate_each(rows=)``: each variant's output SQNR on the first rows (sequences) of the
    evaluation batches is the one a session whose evaluation batch is those rows gives; a batch that
    does not lead with its rows is read whole."""
    from qreport_widgets.core.calibration import leading_rows, rows_holding

    model, batches = tiny_llama()
    eval_data = batches[4:]
    session = QuantizationSession(model, batches[0], batches[:4], eval_data=eval_data, engine="eager")
    variants = [mixed.Variant(), *(mixed.Variant(frozenset([m.fqn])) for m in session.modules[:3])]
    simulated = session.parts.simulated
    on_rows = [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1, rows=1)]
    first = leading_rows(eval_data[0], 1)
    assert first[0].shape == (1, 16) and torch.equal(first[0], eval_data[0][0][:1])
    alone = QuantizationSession(model, batches[0], batches[:4], eval_data=[first], engine="eager")
    expected = [sqnr for sqnr, _ in alone.parts.simulated.simulate_each(variants, quiet, metric=False)]
    assert on_rows == pytest.approx(expected, abs=1e-6)
    whole = [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1)]
    assert on_rows != pytest.approx(whole, abs=1e-3)  # another read, kept apart from the whole batch's
    assert [sqnr for sqnr, _ in simulated.simulate_each(variants, quiet, metric=False, batches=1, rows=1)] == on_rows
    assert leading_rows((torch.zeros(4, 3), torch.zeros(3)), 1) is None  # tensors of other first dimensions
    assert leading_rows((torch.zeros(1, 3),), 1) is None and leading_rows(torch.tensor(2.0), 1) is None
    assert leading_rows({"ids": torch.zeros(4, 3), "mask": torch.ones(4, 3)}, 2)["mask"].shape == (2, 3)
    # the ranking reads the first rows holding RANKED_POSITIONS tokens; rows shorter than that: the batch whole
    ids = torch.zeros(2, 256, dtype=torch.long)
    assert rows_holding((ids,), 256) == 1 and rows_holding((torch.zeros(4, 100, dtype=torch.long),), 256) == 3
    assert rows_holding((ids[:, :16],), 256) is None and rows_holding((ids[0],), 256) is None
    # an image batch (its second dimension is channels, not positions) and float features are not cut
    assert rows_holding((torch.zeros(100, 3, 8, 8),), 256) is None and rows_holding((torch.zeros(4, 100),), 256) is None
    assert mixed._ranked(1, session.parts.runner)["rows"] is None  # the tiny decoder's 4 rows of 16 tokens
    monkeypatch.setattr(mixed, "RANKED_POSITIONS", 32)
    assert mixed._ranked(1, session.parts.runner) == {"batches": 1, "sampled_columns": True, "rows": 2}
    monkeypatch.setattr(mixed, "ESTIMATED_BEYOND", 0)  # the front ranks on 2 of the 4 rows, its points on every batch
    before = set(simulated._known)
    session.pareto(progress=quiet)
    assert {read[2] for read, _ in set(simulated._known) - before} == {2, None}
    said = "the size front ranked single choices and steps on 2 of the 4 sequences (16 tokens each) of the first evaluation batch"
    assert [note for note in session.parts.mixed.front(quiet).notes if note.startswith(said)]


def test_the_size_pane_draws_the_front_puts_a_point_in_the_rows_and_a_budget_selects_the_best_under_it(cache):
    import qreport_widgets as qw

    model, data = trained_digits_model("cnn", cache)
    report = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy, progress=False
    )
    tuning = report.widget().tuning
    pane = tuning.front
    assert pane.figure not in pane.children and pane.budget.disabled
    pane.compute.click()
    front = report.session.pareto()
    assert pane.figure in pane.children and not pane.budget.disabled and "points from" in pane.status.value
    assert list(pane.points.x) == pytest.approx(list(front["size_bytes"] / 1024))
    assert list(pane.points.y) == pytest.approx(list(front["simulated_output_sqnr_db"]))
    assert len(pane.uniform_marks.x) == 2 and "all float" in pane.uniform_text.value  # the baseline and all float
    assert len(pane.runs.x) == 1  # the baseline, run to anchor the sizes

    pane.points.selected = [2]  # a click on the third point
    assert {fqn for fqn, row in tuning.rows.items() if row.settings.keep_float} == {
        fqn for fqn, s in front.iloc[2]["settings"].items() if s.keep_float
    }
    assert "Point 3 of" in pane.chosen.value and "Apply" in pane.chosen.value
    tuning.apply.click()
    assert len(pane.runs.x) == 2 and pane.runs.y[-1] == pytest.approx(front.iloc[2]["simulated_output_sqnr_db"], abs=0.5)

    budget = front.iloc[3]["size_bytes"] / 1024 + 0.5
    pane.budget.value = budget
    assert list(pane.points.selected) == [3] and list(pane.budget_line.x) == [budget, budget]
    assert tuning.settings() == {**report.session.current_settings(), **front.iloc[3]["settings"]}
    pane.budget.value = 1.0
    assert "No point fits" in pane.chosen.value

    pane.axis.value = "your metric"
    assert list(pane.points.y) == pytest.approx(list(front["simulated_metric"])) and pane.figure.axes[1].label == "metric"


def test_after_a_real_run_misses_a_metric_target_fit_runs_the_first_point_the_miss_leaves_meeting_it():
    """Points of the trained byte decoder's 8da4w front on the XNNPACK target (simulated SQNR and
    perplexity, in SQNR order: the perplexity is not monotone along it). The smallest point meeting
    perplexity <= 5.07 in simulation (5.068) ran at 5.0745 in ExecuTorch's runtime; the next run is the
    first larger point whose simulated perplexity, moved by that miss, still meets it, not the next
    point (5.0775 simulated: certain to miss too)."""
    from qreport_widgets.core.metrics import Metric
    from qreport_widgets.tune.diagnosis import meets_target
    from qreport_widgets.tune.run import RunResult

    front = pd.DataFrame(
        {
            "size_bytes": [621_696, 628_864, 630_912, 633_984, 635_008, 663_168, 672_384],
            "simulated_output_sqnr_db": [29.07, 29.20, 29.37, 29.52, 29.60, 30.43, 30.76],
            "simulated_metric": [5.0681, 5.0775, 5.0724, 5.0794, 5.0747, 5.0589, 5.0599],
        }
    )
    perplexity = Metric("perplexity", higher_is_better=False)
    missed = RunResult(None, None, 29.05, pd.Series(dtype=float), 650_000, 50.0, 60.0, eval_metric=5.0745)

    def meets(sqnr, metric):
        return meets_target(sqnr, metric, None, 5.07, perplexity)

    assert mixed._corrected_step(front, 0, missed, meets) == 5
    # with no point left that the miss lets meet it, the next point
    assert mixed._corrected_step(front.iloc[:5], 0, missed, meets) == 1


def test_a_fit_whose_real_run_fails_runs_the_next_point_and_says_so():
    """A point the target cannot build (its real run fails: on XNNPACK once, an embedding's padding
    index left a dequantize op the program could not serialise) is not the fit's answer: the fit runs
    the next point (the larger with a target, the smaller without) and its notes say which failed."""
    from qreport_widgets.tune.run import RunResult

    settings = [{"m": ModuleSettings(format="int4-weight-only", group_size=g)} for g in (32, 64, 128, 256)]
    points = pd.DataFrame(
        {
            "size_bytes": [100, 200, 300, 400],
            "simulated_output_sqnr_db": [20.0, 25.0, 30.0, 35.0],
            "formats": ["a", "b", "c", "d"],
            "settings": settings,
        }
    )
    front = mixed.SizeFront(points, pd.DataFrame())
    broken = {1, 3}  # positions whose real runs fail
    ran = []

    def apply(chosen, label="", progress=None):
        at = next(i for i, s in enumerate(settings) if s is chosen)
        ran.append(at)
        if at in broken:
            return RunResult(
                None, None, math.nan, pd.Series(dtype=float), 0, math.nan, 1.0, error="LoweringError: Missing out variants"
            )
        return RunResult(
            None, None, 20.0 + 5 * at, pd.Series(dtype=float), 100 * (at + 1), 1.0, 1.0, deployed_bytes=100 * (at + 1)
        )

    targeted = mixed.fit(apply, front, max_size_bytes=450, target_sqnr_db=24.0)
    assert targeted.ok and ran == [1, 2] and targeted.output_sqnr_db == 30.0
    assert any("point 2 of the points within the budget failed (LoweringError" in n for n in targeted.notes), targeted.notes
    assert any("the fit ran point 3 instead" in n for n in targeted.notes)
    ran.clear()
    largest = mixed.fit(apply, front, max_size_bytes=450)  # no target: the largest within the budget, else smaller
    assert largest.ok and ran == [3, 2] and largest.deployed_bytes == 300
    broken.update({0, 2})
    ran.clear()
    failed = mixed.fit(apply, front, max_size_bytes=450)
    assert not failed.ok and len(ran) == 1 + mixed.MAX_EXTRA_RUNS
    assert any("no point the fit tried could be run" in n for n in failed.notes)


def test_the_chain_walked_in_context_takes_the_step_that_helps_given_the_steps_before():
    """Three units, each smaller or larger. Alone, a helps most, then b, then c; with a larger, c
    removes almost all that is left and b nearly nothing (their errors compound with a's): the walk
    takes a, then c, then b, where the chain of gains alone takes a, b, c. About two simulations a step."""
    small, large = ModuleSettings(format="int4-weight-only"), ModuleSettings(format="int8-weight-only")
    alone = {"a": 0.5, "b": 0.4, "c": 0.3}  # noise each removes alone (of 1.0), for 10 bytes
    hulls = {unit: [mixed.Option(small, 0, removed), mixed.Option(large, 10, 0.0)] for unit, removed in alone.items()}
    noise_of = {(): 1.0, ("a",): 0.5, ("b",): 0.6, ("c",): 0.7, ("a", "b"): 0.45, ("a", "c"): 0.1, ("b", "c"): 0.2}
    noise_of[("a", "b", "c")] = 0.0
    asked = []

    def measure(points):
        asked.extend(points)
        noises = [noise_of[tuple(u for u, c in p.items() if c == large)] for p in points]
        return [-10 * math.log10(n) if n else math.inf for n in noises]

    walked = mixed._walked_in_context(hulls, measure)
    larger = [tuple(u for u, c in point.items() if c == large) for point in walked]
    assert larger == [("a",), ("a", "c"), ("a", "b", "c")]
    chained = [tuple(u for u, c in point.items() if c == large) for point in mixed._chain(hulls)[1:]]
    assert chained == [("a",), ("a", "b"), ("a", "b", "c")]
    distinct = {tuple(p.items()) for p in asked}
    assert len(distinct) <= 1 + len(walked) * mixed.IN_CONTEXT_PER_STEP and len(distinct) == 5  # {}, a, ab, ac, abc


def test_on_a_decoder_the_front_walked_in_context_is_never_worse_and_somewhere_better_than_gains_alone(monkeypatch):
    """The tiny Llama's blocks: the front with the in-context walk against the same front from the
    chain of gains alone; at every size either front reaches, the walk's best is at least as good,
    somewhere by more than the simulation's error, and its new points are what real runs measure."""
    model, batches = tiny_llama()

    def front_of(walk: bool):
        monkeypatch.setattr(mixed, "IN_CONTEXT_UNITS", mixed.IN_CONTEXT_UNITS if walk else 0)
        session = QuantizationSession(model, batches[0], batches[:4], eval_data=batches[4:], engine="eager")
        return session, session.pareto(progress=quiet, by_block=True)

    session, walked = front_of(True)
    _, alone = front_of(False)
    assert_a_front(walked)
    sizes = sorted(set(walked["size_bytes"]) | set(alone["size_bytes"]))

    def best(front, size):
        under = front[front["size_bytes"] <= size]["simulated_output_sqnr_db"]
        return under.max() if len(under) else -math.inf

    gains = [best(walked, size) - best(alone, size) for size in sizes]
    assert min(gains) >= 0 and max(gains) > 0.5, gains
    chained = {tuple(sorted(p.items())) for p in alone["settings"]}
    new = walked[[tuple(sorted(p.items())) not in chained for p in walked["settings"]]]
    assert len(new) > 0
    assert_points_agree_with_real_runs(session, new)
