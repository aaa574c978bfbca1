"""Diagnosis and verification against fakes of the parts they are given (a runner, real runs, the
diagnosis the verifier reads): no model, no engine; each fake's numbers follow a formula the test knows.
The simulation part (``Simulated``) is the real one, over a fake engine's simulation."""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd
import torch

from qreport_widgets.core.features import SuggestionKind
from qreport_widgets.core.metrics import FLOAT_ROUNDOFF_DB, power_terms, sqnr_db
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.settings import ModuleSettings, Setting, TunableModule
from qreport_widgets.observe.records import Suggestion
from qreport_widgets.tune.diagnosis import Diagnosis, ceiling_reached, meets_target
from qreport_widgets.tune.run import RunResult
from qreport_widgets.tune.simulation import Simulated
from qreport_widgets.tune.truth import TruthCheck
from qreport_widgets.tune.verify import KERNEL_CHECK, REAL_RUN, SIMULATED, Verifier

NOISE = {"a": 0.10, "b": 0.30, "c": 0.01}  # each quantized module adds this much error to the output
BATCHES = [torch.linspace(-1.0, 1.0, 64).reshape(8, 8) + i for i in range(3)]
REAL_SHORTFALL_DB = 0.3  # real runs come out this much below the simulation
RESIDUAL = 0.002  # the error left with every module float


def simulated_db(float_modules) -> float:
    error = RESIDUAL + sum(level for name, level in NOISE.items() if name not in set(float_modules))
    return sqnr_db(torch.cat([b.flatten() for b in BATCHES]), torch.cat([(b + error).flatten() for b in BATCHES]))


class FakeSimulation:
    tunable = list(NOISE)
    others: list[str] = []

    def __init__(self) -> None:
        self.model = torch.nn.Identity()
        self.variant = Variant()

    def configure(self, variant=()) -> None:
        self.variant = Variant.of(variant)

    def outputs(self, batches, variant=()):
        variant = Variant.of(variant)
        error = RESIDUAL + sum(level for name, level in NOISE.items() if name not in variant.float_modules)
        return [b + error for b in batches]

    def outputs_each(self, batches, variants, step=None, reduce=None):
        found = []
        for variant in variants:
            outputs = self.outputs(batches, variant)
            found.append(outputs if reduce is None else [reduce(i, o) for i, o in enumerate(outputs)])
            for _ in batches:
                step()
        return found

    def local_sqnr(self, batch) -> dict[str, float]:
        return {name: -20 * math.log10(level) for name, level in NOISE.items()}

    def run_real_kernels(self, quantized, names) -> list[str]:
        return []


class FakeEngine:
    checks_shortcuts = False  # the environment asks the check mode, where it does

    def simulator(self, prepared, modules, float_model, example_inputs, calibrate, data_key=None):
        return FakeSimulation()


class FakeRunner:
    """A Runner's face: the data, no metric, a float model without modules, the fake engine."""

    eval_fn = None
    metric = None
    eval_data = BATCHES
    example_inputs = ()
    float_model = torch.nn.Identity()
    engine = FakeEngine()

    @property
    def modules(self):
        return list(MODULES)

    def current_settings(self):
        return {m.fqn: m.current for m in MODULES}

    def calibrated_start(self, desc, progress):
        return torch.nn.Identity()

    def calibrate_quietly(self, model) -> None:
        pass

    def calibration_key(self) -> str | None:
        return None  # a calibration the fake engine does not see

    def ensure_room(self, step, doing, settings=None) -> None:
        pass  # the fake engine's simulation costs nothing

    def output_sqnr(self, outputs) -> float:
        return sqnr_db(torch.cat([b.flatten() for b in BATCHES]), torch.cat([o.flatten() for o in outputs]))

    def output_terms(self, index, output, reference=None) -> tuple[float, float]:
        return power_terms(BATCHES[index] if reference is None else reference, output)

    def equalization_float_error(self, settings) -> float:
        return math.nan


class FakeReal:
    """Real runs REAL_SHORTFALL_DB below the simulation."""

    def __init__(self) -> None:
        self.runs: list[frozenset[str]] = []

    def checked(self, progress=None) -> None:
        pass

    def truth(self, progress=None) -> TruthCheck:
        return TruthCheck(0.0, 0.0)  # no kernel to distrust

    def adopted_since(self, kernels) -> list[str]:
        return []  # no run finds a broken kernel

    def unverified_note(self):
        return None

    def annotated(self, result):
        return result

    def baseline(self, progress=None) -> RunResult:
        return self.apply({}, label="baseline")

    def apply(self, settings, *, label=None, progress=None, record=True) -> RunResult:
        floats = frozenset(fqn for fqn, s in settings.items() if s.keep_float)
        self.runs.append(floats)
        real = simulated_db(floats) - REAL_SHORTFALL_DB
        return RunResult(None, None, real, pd.Series(dtype=float), 0, 1.0, 0.0, label=label or "", settings=settings)


def diagnosis_of(real: FakeReal) -> Diagnosis:
    runner = FakeRunner()
    return Diagnosis(runner, Simulated(runner), real)


def test_sensitivity_ranks_by_the_simulated_gain_and_reach_steps_past_a_short_real_run():
    host = FakeReal()
    diagnosis = diagnosis_of(host)
    table = diagnosis.sensitivity(progress=lambda done, total: None)
    assert list(table.index) == ["b", "a", "c"]  # the noisiest module first
    assert math.isclose(table.at["b", "output_sqnr_gain_db"], simulated_db({"b"}) - simulated_db(()), rel_tol=1e-5)
    assert math.isclose(table.at["c", "local_sqnr_db"], 40.0)
    curve = diagnosis.tradeoff(progress=lambda done, total: None)
    assert list(curve["added"]) == ["", "b", "a", "c"]
    # a target the simulation meets with "b" float by less than the real runs' shortfall
    target = simulated_db({"b"}) - 0.1
    result = diagnosis.reach(target, progress=lambda done, total: None)
    # the real run fell short: the search went on from it, aiming higher; the smaller set it ran is not run again
    assert host.runs == [frozenset({"b"}), frozenset({"b", "a"})]
    assert result.ok and result.output_sqnr_db >= target and "met with 2 of 3 modules float (b, a)" in result.notes[-1]
    assert diagnosis.sensitivity() is not table and diagnosis.sensitivity().equals(table)  # computed once, copies out


def test_a_target_out_of_reach_runs_the_best_point_and_says_so():
    host = FakeReal()
    result = diagnosis_of(host).reach(500.0, progress=lambda done, total: None)
    said = " ".join(result.notes)
    # the best point is every module float: its run is the ceiling too, so no other run
    assert "out of reach in simulation" in said and host.runs == [frozenset(NOISE)]
    assert "the most this engine reaches on this model is" in said and "keeps the search's best" in result.notes[-1]


MODULES = [TunableModule(name, "Linear", ModuleSettings()) for name in NOISE]
GAINS = {  # what each candidate does to the output SQNR, in a real run or the simulation
    ("a", Setting.DYNAMIC): 0.8,
    ("b", Setting.DYNAMIC): -0.4,
    ("c", Setting.DYNAMIC): 0.05,
    ("a", Setting.PER_CHANNEL): 0.6,
    ("b", Setting.PER_CHANNEL): 0.02,
    ("c", Setting.PER_CHANNEL): 0.0,
    ("b", Setting.KEEP_FLOAT): 2.0,
}


def gain_of(settings) -> float:
    return sum(
        GAINS.get((fqn, setting), 0.0)
        for fqn, s in settings.items()
        for setting in Setting
        if s != ModuleSettings() and setting.of(s) and setting.of(s) != setting.of(ModuleSettings())
    )


class FakeVerifiable:
    """Real runs and a diagnosis whose gains add up (GAINS), simulated and real alike."""

    def __init__(self, truth: TruthCheck | None = None) -> None:
        self.trials: list[dict] = []
        self.truth_found = truth or TruthCheck(20.0, 20.2)

    # the diagnosis' face
    def sensitivity(self, progress=None, *, metric=True):
        gains = {name: GAINS.get((name, Setting.KEEP_FLOAT), 0.0) for name in NOISE}
        return pd.DataFrame({"output_sqnr_gain_db": gains}).sort_values("output_sqnr_gain_db", ascending=False)

    def simulate_each(self, variants, progress=None, desc="", metric=True):
        found = []
        for variant in variants:
            settings = {
                name: ModuleSettings(
                    keep_float=name in variant.float_modules,
                    per_channel=name in variant.other_weights,
                    dynamic=name in variant.dynamic,
                )
                for name in variant.float_modules | variant.other_weights | variant.dynamic
            }
            found.append((20.0 + gain_of(settings), None))
        return found

    # real runs' face
    def baseline(self, progress=None):
        return RunResult(None, None, 20.0, pd.Series(dtype=float), 0, 1.0, 0.0, label="baseline")

    def apply(self, settings, *, label=None, progress=None, record=True, check_kernels=False):
        self.trials.append(dict(settings))
        return replace(self.baseline(), output_sqnr_db=20.0 + gain_of(settings), label=label or "", settings=settings)

    def truth(self, progress=None):
        return self.truth_found


class NoMigrations:
    def found(self):
        return {}


def verifier_of(session: FakeVerifiable) -> Verifier:
    return Verifier(FakeRunner(), session, session, NoMigrations())


def test_the_verifier_offers_what_helps_and_measures_accept_all_as_a_whole():
    session = FakeVerifiable()
    verifier = verifier_of(session)
    suggestions = [Suggestion("b", "DynamicStaticDetector", SuggestionKind.DYNAMIC, "non-stationary")]
    verified = verifier.verify(verifier.candidates(suggestions), progress=lambda done, total: None)
    table = verified.frame().set_index(["module", "setting"])
    assert table.loc[("b", Setting.DYNAMIC), "measured"] == SIMULATED and not table.loc[("b", Setting.DYNAMIC), "offered"]
    assert table.loc[("a", Setting.PER_CHANNEL), "measured"] == SIMULATED and table.loc[("a", Setting.PER_CHANNEL), "offered"]
    assert not table.loc[("c", Setting.DYNAMIC), "offered"]  # a search's find must gain 0.5 dB
    offered = {(v.candidate.module_fqn, v.candidate.setting) for v in verified.offered}
    assert offered == {("a", Setting.DYNAMIC), ("a", Setting.PER_CHANNEL)}
    # keeping b float gains 2 dB, measured and shown, but that is a trade for reach / fit, not Accept all
    assert table.loc[("b", Setting.KEEP_FLOAT), "gain_db"] == 2.0 and not table.loc[("b", Setting.KEEP_FLOAT), "offered"]
    assert not verified.settings["b"].keep_float and verified.settings["a"] == ModuleSettings(dynamic=True, per_channel=True)
    assert math.isclose(verified.accept_all_gain_db, 0.8 + 0.6)
    assert session.trials[-1] == {name: s for name, s in verified.settings.items() if s != ModuleSettings()}


def test_a_simulation_that_disagrees_with_the_real_model_hands_every_candidate_to_real_runs():
    unreliable = TruthCheck(5.0, 20.0, corrected_db=20.0)  # 15 dB apart, no kernel to blame
    session = FakeVerifiable(unreliable)
    verifier = verifier_of(session)
    verified = verifier.verify(verifier.candidates([]), progress=lambda done, total: None)
    tried = verified.frame()[lambda t: t["measured"] != "not tried"]
    assert len(tried) and (tried["measured"] == REAL_RUN).all()
    assert any("every candidate measured by a real run" in note for note in verified.notes)
    assert not unreliable.reliable and "unverified" in unreliable.status


def test_modules_whose_kernels_disagree_are_keep_float_candidates_of_their_own():
    kernels = pd.Series({"a": 5.0, "b": 70.0, "c": math.inf})
    truth = TruthCheck(5.0, 20.0, kernels, real_kernels=("a",), corrected_db=5.2)
    assert truth.disagreeing == ["a"] and truth.reliable and not truth.agrees
    assert any("a (5.0 dB)" in note for note in truth.notes)
    verifier = verifier_of(FakeVerifiable(truth))
    candidates = {(c.module_fqn, c.setting): c for c in verifier.candidates([])}
    assert candidates["a", Setting.KEEP_FLOAT].origin == KERNEL_CHECK
    assert "kernel differs" in candidates["a", Setting.KEEP_FLOAT].reason


def test_candidates_verdicts_and_runs_are_data():
    from qreport_widgets.tune.history import History
    from qreport_widgets.tune.run import Change, ReleasedModel
    from qreport_widgets.tune.verify import Candidate, Measured, Origin, Verdict

    found = Candidate("fc1", Setting.PER_CHANNEL, "PerChannelDetector")  # a detector's name: its origin is a detector
    assert found.origin is Origin.DETECTOR and found.detector == "PerChannelDetector" and found.source == "PerChannelDetector"
    searched = Candidate("fc1", Setting.DYNAMIC, "search")
    assert searched.origin is Origin.SEARCH and searched.searched and searched.source == "search"
    verdict = Verdict(found, 1.0, "simulated", True)
    assert verdict.measured is Measured.SIMULATED and verdict.text == "per-channel weights: +1.00 dB (simulated)"

    def run(label, settings, baseline=False):
        return RunResult(
            None,
            torch.nn.Identity(),
            20.0,
            pd.Series(dtype=float),
            0,
            1.0,
            0.0,
            label=label,
            settings=settings,
            baseline=baseline,
        )

    start = {"fc1": ModuleSettings(), "fc2": ModuleSettings(dynamic=True)}
    changed = run("apply 1", {"fc1": ModuleSettings(per_channel=True), "fc2": ModuleSettings()})
    assert changed.changed(start) == (Change("fc1", ("per_channel",)), Change("fc2", ("no dynamic",)))
    assert changed.changes(start) == "fc1: per_channel; fc2: no dynamic"
    assert run("x", dict(start)).changed(start) == () and run("x", None).changed(start) is None
    history = History()
    history.record(run("baseline", dict(start), baseline=True))
    history.record(changed)
    assert history.baseline.label == "baseline" and isinstance(history.baseline.quantized_model, ReleasedModel)
    assert history.runs[-1] is changed and history.next_label() == "run 3"


def test_float_round_off_is_the_float_models_output_not_a_finding():
    """136 dB is what the float model gives against itself on a CPU without AVX-512 at another
    thread count: the ceiling says it is the float model's output, any SQNR target is met by it,
    and a simulation at inf does not disagree with a real run there."""
    assert ceiling_reached(math.inf) == "the float model's output exactly"
    said = ceiling_reached(136.06)
    assert said.startswith("the float model's output, within float round-off (136.06 dB") and f"{FLOAT_ROUNDOFF_DB:g} dB" in said
    assert ceiling_reached(48.5) == "48.50 dB"
    assert meets_target(136.06, None, 200.0, None) and not meets_target(FLOAT_ROUNDOFF_DB - 1, None, 200.0, None)
    assert not meets_target(136.06, 0.5, 200.0, 0.9)  # the metric's target still counts
    assert TruthCheck(real_db=136.06, simulated_db=math.inf).agrees
    assert not TruthCheck(real_db=60.0, simulated_db=math.inf).agrees
    checked = TruthCheck(real_db=136.06, simulated_db=40.0, corrected_db=math.inf, real_kernels=("prelu",))
    assert not checked.agrees and checked.reliable
