"""The Tune tab's controller and views against a fake session: no analyze(), no model run.

The fake answers the ``TuningSession`` protocol with runs whose numbers follow from the settings
(one dB per per-channel module), so each test knows what the controller must say.
"""

from __future__ import annotations

import datetime
import math

import numpy as np
import pandas as pd
import pytest

from qreport_widgets.core.features import SuggestionKind
from qreport_widgets.engines.settings import ModuleSettings, Setting, TunableModule, validate_all, with_suggestions
from qreport_widgets.errors import InvalidSettingsError
from qreport_widgets.observe.frame import ReportFrame
from qreport_widgets.observe.records import Suggestion
from qreport_widgets.tune.diagnosis import ReachPlan
from qreport_widgets.tune.run import RunResult
from qreport_widgets.tune.search import SearchPath
from qreport_widgets.tune.truth import TruthCheck
from qreport_widgets.tune.verify import SIMULATED, Candidate, Verdict, VerifiedSuggestions
from qreport_widgets.widgets.protocols import ReportSource, TuningSession
from qreport_widgets.widgets.tune_controller import FAILED_RUN, GREEN, RED, TuneController, time_left
from qreport_widgets.widgets.tuning import TuningPanel

MODULES = [
    TunableModule("conv", "Conv2d", ModuleSettings(), {Setting.DYNAMIC: "dynamic activations are for Linear layers"}),
    TunableModule("fc1", "Linear", ModuleSettings()),
    TunableModule("fc2", "Linear", ModuleSettings()),
]
BASE_DB = 20.0


class FakeSource:
    """A report with one per-channel suggestion for fc1 and no channel statistics."""

    model_name, detectors, batches, saved_at, graph = "Fake", ["PerChannelDetector"], 4, None, None

    def frame(self) -> ReportFrame:
        return ReportFrame.from_features({})

    def text_reports(self) -> dict[str, str]:
        return {}

    def suggestions(self) -> list[Suggestion]:
        return [Suggestion("fc1", "PerChannelDetector", SuggestionKind.PER_CHANNEL, "weights vary per channel")]


class FakeSession:
    """Runs cost nothing: output SQNR is BASE_DB plus one dB per per-channel module, minus ten per
    float module; per-layer SQNR is that value per module."""

    def __init__(self, *, module_notes: dict[str, str] | None = None) -> None:
        self.history: list[RunResult] = []
        self.metric = None  # no eval_fn
        self.module_notes = module_notes or {}
        self.fail_with: Exception | None = None
        self.broken_run = ""  # when set, apply() returns a failed run with this error
        self.truth = TruthCheck(BASE_DB, BASE_DB + 0.2)  # the simulation agrees
        self.pinned: set[int] = set()

    @property
    def modules(self) -> list[TunableModule]:
        return list(MODULES)

    def current_settings(self) -> dict[str, ModuleSettings]:
        return {m.fqn: m.current for m in MODULES}

    def suggested_settings(self, suggestions):
        return with_suggestions(MODULES, suggestions)

    def verified_suggestions(self, suggestions, *, nan_metric=(), progress=None) -> VerifiedSuggestions:
        for done in (1, 2):
            progress(done, 2)
        baseline = self.baseline()
        verdicts = [
            Verdict(Candidate("fc1", Setting.PER_CHANNEL, "PerChannelDetector"), 1.0, SIMULATED, True),
            Verdict(Candidate("fc2", Setting.KEEP_FLOAT, "search"), -0.5, SIMULATED, False, "it loses 0.50 dB"),
        ]
        settings = {**self.current_settings(), "fc1": ModuleSettings(per_channel=True)}
        run = self.apply(settings, label="accept all (verified)", record=False)
        return VerifiedSuggestions(baseline.output_sqnr_db, verdicts, settings, run)

    def migrations(self) -> dict:
        return {}

    def settings_as_code(self, settings) -> str:
        validate_all(MODULES, settings)
        return "".join(f"# {fqn}: {s}\n" for fqn, s in settings.items() if s != ModuleSettings())

    def baseline(self, progress=None) -> RunResult:
        if not self.history:
            self.history.append(self._run(self.current_settings(), "baseline", progress))
        return self.history[0]

    def apply(self, settings, *, label=None, progress=None, record=True, rotation=None) -> RunResult:
        validate_all(MODULES, settings)
        assert rotation is None  # the panel offers no rotation to a model it does not apply to
        if self.fail_with is not None:
            raise self.fail_with
        result = self._run(settings, label or f"run {len(self.history) + 1}", progress)
        if result.ok and record:
            self.history.append(result)
        return result

    def rotation_problems(self) -> dict[str, str]:
        return {"R1": "not a decoder", "R2": "not a decoder"}

    def truth_check(self, progress=None) -> TruthCheck:
        self.baseline(progress)
        return self.truth

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        runs = pd.DataFrame([{"run": r.label, "output SQNR (dB)": r.output_sqnr_db} for r in self.history])
        return runs, pd.DataFrame({r.label: r.per_layer_sqnr_db for r in self.history})

    def keep(self, run, keep=True) -> RunResult:
        (self.pinned.add if keep else self.pinned.discard)(run)
        return self.history[run]

    def kept(self, run) -> bool:
        return run in self.pinned

    def sensitivity(self, progress=None) -> pd.DataFrame:
        for done in range(1, 4):
            progress(done, 3)
        gains = {"fc2": 2.0, "fc1": 1.0, "conv": 0.1}
        return pd.DataFrame({"output_sqnr_gain_db": gains}).rename_axis("module")

    def tradeoff(self, progress=None) -> pd.DataFrame:
        progress(1, 1)
        return pd.DataFrame({"added": ["", "fc2", "fc1", "conv"], "simulated_output_sqnr_db": [20.0, 22.0, 23.0, 23.1]})

    def blocks(self) -> dict[str, list[str]]:
        return {"layers.0": ["conv", "fc1"], "fc2": ["fc2"]}

    def block_sensitivity(self, progress=None) -> pd.DataFrame:
        progress(1, 1)
        table = pd.DataFrame(
            {"modules": [1, 2], "output_sqnr_gain_db": [2.0, 1.1], "simulated_output_sqnr_db": [22.0, 21.1]},
            index=pd.Index(["fc2", "layers.0"], name="block"),
        )
        return table

    def pareto(self, progress=None, *, by_block=False) -> pd.DataFrame:
        if self.fail_with is not None:
            raise self.fail_with
        for done in range(1, 4):
            progress(done, 3)
        float_fc2 = {"fc2": ModuleSettings(keep_float=True)}
        return pd.DataFrame(
            {
                "size_bytes": [1000, 1400],
                "simulated_output_sqnr_db": [20.0, 22.0],
                "formats": ["3 int8", "2 int8, 1 float"],
                "settings": [{}, float_fc2],
            }
        )

    def uniform_points(self, progress=None, *, by_block=False) -> pd.DataFrame:
        return pd.DataFrame(
            {"size_bytes": [1000], "simulated_output_sqnr_db": [20.0], "formats": ["3 int8"], "settings": [{}]},
            index=pd.Index(["baseline"], name="choice"),
        )

    def computed(self) -> dict[str, pd.DataFrame]:
        return {}  # the fake keeps no diagnosis

    def plan_reach(self, target_sqnr_db=None, target_metric=None, *, by_block=False, progress=None) -> ReachPlan:
        if by_block:  # fc2, then the block of conv and fc1
            met = target_sqnr_db <= 23.1
            path = SearchPath(20.0, None, [], ("fc2", "layers.0") if met else ("fc2",), 23.1, None, met)
            return ReachPlan(target_sqnr_db, None, ["fc2", "conv", "fc1"], 3 if met else 1, 23.1, met, [20.0, 22.0, 23.1], path)
        curve = [20.0, 22.0, 23.0, 23.1]
        count = next((i for i, db in enumerate(curve) if db >= target_sqnr_db), None)
        met = count is not None
        count = count if met else 3
        return ReachPlan(target_sqnr_db, None, ["fc2", "fc1", "conv"], count, curve[count], met, curve)

    def _run(self, settings, label, progress) -> RunResult:
        for done in range(1, 4):
            if progress is not None:
                progress(done, 3)
        if self.broken_run and label != "baseline":
            return RunResult(None, None, math.nan, pd.Series(dtype=float), 0, math.nan, 0.1, self.broken_run, label)
        layers = {fqn: BASE_DB + s.per_channel - 10 * s.keep_float for fqn, s in settings.items()}
        return RunResult(
            None,
            None,
            BASE_DB + sum(s.per_channel - 10 * s.keep_float for s in settings.values()),
            pd.Series(layers, dtype=float),
            1000,
            1.0,
            0.1,
            label=label,
            settings=settings,
            notes=("latency: of a fake",),
            module_notes=self.module_notes if label != "baseline" else {},
            baseline=label == "baseline",
        )


@pytest.fixture
def session() -> FakeSession:
    return FakeSession()


def test_the_fakes_answer_the_protocols(session):
    assert isinstance(session, TuningSession) and isinstance(FakeSource(), ReportSource)


def test_the_size_front_is_kept_and_said_and_a_failure_or_cancel_leaves_nothing(session):
    controller = TuneController(session, FakeSource())
    session.fail_with = RuntimeError("no front here")
    assert not controller.front() and "no front here" in controller.front_status and controller.points is None
    session.fail_with = None
    controller.observe(lambda _change: controller.cancel(), "progress")
    assert not controller.front() and "cancelled" in controller.front_status and controller.points is None
    controller.unobserve_all("progress")
    assert controller.front() and len(controller.points) == 2 and list(controller.uniform.index) == ["baseline"]
    assert "2 points from 1.0 KB (20.00 dB) to 1.4 KB (22.00 dB)" in controller.front_status and not controller.busy


def test_apply_runs_the_baseline_first_then_says_the_change_in_colour(session):
    controller = TuneController(session, FakeSource())
    result = controller.apply({**session.current_settings(), "fc1": ModuleSettings(per_channel=True)})
    assert [r.label for r in session.history] == ["baseline", "apply 1"] and result is session.history[-1]
    assert f"<b style='color:{GREEN}'>+1.00 dB</b> vs the baseline (20.00 dB)" in controller.status
    assert "latency: of a fake" in controller.status and not controller.error and not controller.busy
    worse = controller.apply({**session.current_settings(), "fc2": ModuleSettings(keep_float=True)})
    assert worse.output_sqnr_db == 10.0 and f"color:{RED}'>-10.00 dB" in controller.status
    assert "worse than the baseline" in controller.status and "best so far: apply 1 (21.00 dB)" in controller.status


def test_settings_the_engine_refuses_are_an_error_and_nothing_runs(session):
    controller = TuneController(session, FakeSource())
    assert controller.apply({"conv": ModuleSettings(dynamic=True)}) is None
    assert "conv: dynamic activations are for Linear layers" in controller.error and not session.history


def test_busy_frames_every_action_and_is_undone_when_it_fails(session):
    controller = TuneController(session, FakeSource())
    seen = []
    controller.observe(lambda change: seen.append(change["new"]), "busy")
    session.baseline()
    session.fail_with = RuntimeError("the kernel died")
    assert controller.apply(session.current_settings()) is None
    assert seen == [True, False] and controller.status == FAILED_RUN
    assert "RuntimeError(&#x27;the kernel died&#x27;)" in controller.error
    session.fail_with, session.broken_run = None, "CalibrationError: batch 3 failed"
    result = controller.apply(session.current_settings())
    assert not result.ok and controller.status == FAILED_RUN and "batch 3 failed" in controller.error
    assert len(session.history) == 1 and seen == [True, False, True, False]


def test_a_click_while_an_action_runs_is_dropped_and_counted(session):
    controller = TuneController(session, FakeSource())
    controller.apply(session.current_settings())
    controller._lock.acquire()  # a click handled on the kernel's other thread while a run goes on
    try:
        assert controller.apply(session.current_settings()) is None
        assert controller.accept_all() is None and not controller.rank()
    finally:
        controller._lock.release()
    assert controller.ignored == 3 and "1 click made while the run was in progress ignored" in controller.status
    controller.apply(session.current_settings())
    assert controller.ignored == 0 and len(session.history) == 3


def test_a_click_sent_during_the_last_run_is_dropped_after_it():
    session = FakeSession()
    ticks = iter([0.0, 5.0, 100.0, 101.0])  # the kernel's clock: the first run takes 5 s
    controller = TuneController(session, FakeSource(), clock=lambda: next(ticks))
    start = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    controller.apply(session.current_settings(), start)
    queued = start + datetime.timedelta(seconds=1)  # clicked 1 s in: an older kernel hands it over afterwards
    assert controller.apply(session.current_settings(), queued) is None and len(session.history) == 2
    later = start + datetime.timedelta(seconds=60)
    assert controller.apply(session.current_settings(), later) is not None and len(session.history) == 3


def test_progress_and_status_follow_the_session_steps(session):
    controller = TuneController(session, FakeSource())
    steps = []
    controller.observe(lambda change: steps.append((change["new"], controller.status)), "progress")
    controller.apply(session.current_settings())
    assert (3, 3) in [p for p, _ in steps]
    assert "baseline: calibrating 2/3" in [s for _, s in steps] and "apply 1: calibrating 3/3" in [s for _, s in steps]


def test_the_panel_shows_runs_and_the_modules_that_did_not_carry_out_their_settings():
    session = FakeSession(module_notes={"fc2": "asked per-channel weights, the converted graph has float"})
    panel = TuningPanel(FakeSource(), session)
    bars = panel.layers.bars
    panel.rows["fc2"].settings = ModuleSettings(per_channel=True)
    panel.apply.click()
    assert panel.rows["fc2"].run_note.startswith("asked per-channel") and "last run: asked" in panel.rows["fc2"].why.value
    assert "last run" not in panel.rows["fc1"].why.value
    assert "1 module(s) did not carry out their settings" in panel.status.value
    assert "baseline" in panel.history.value and panel.layers in panel.children
    panel.apply.click()
    assert panel.layers.bars is bars and bars.y.shape == (3, 3)  # the marks are updated in place
    np.testing.assert_allclose(bars.y[:, 2], [20.0, 21.0, 21.0])  # fc2's SQNR per run
    assert not panel.apply.disabled and panel.progress.layout.visibility == "hidden"
    assert panel.restore_from.options == ("baseline", "apply 1", "apply 2")


def test_accept_all_puts_measured_settings_and_verdicts_in_the_rows(session):
    panel = TuningPanel(FakeSource(), session)
    panel.accept.click()
    assert panel.rows["fc1"].settings.per_channel and panel.rows["fc1"].weight.value == "per-channel"
    assert "per-channel weights: +1.00 dB (simulated)" in panel.rows["fc1"].why.value
    assert "keep float: -0.50 dB (simulated), not suggested: it loses 0.50 dB" in panel.rows["fc2"].why.value
    assert "Accept all (measured)" in panel.status.value and "+1.00 dB" in panel.status.value
    assert "# fc1: ModuleSettings(" in panel.code.value


def test_reset_restore_and_bulk_edit_the_rows(session):
    panel = TuningPanel(FakeSource(), session)
    panel.rows["fc2"].settings = ModuleSettings(keep_float=True)
    panel.apply.click()
    panel.reset.click()
    assert not panel.rows["fc2"].settings.keep_float and not panel.rows["fc2"].keep_float.value
    panel.restore_from.value = "apply 1"
    panel.restore.click()
    assert panel.rows["fc2"].keep_float.value and "hold the settings of apply 1" in panel.status.value
    panel.restore_from.value = "baseline"
    assert panel.pin.description == "Pin its model" and not panel.pin.disabled
    panel.pin.click()
    assert (
        session.kept(0)
        and panel.pin.description == "Unpin its model"
        and "baseline: its quantized model is kept" in panel.status.value
    )
    panel.pin.click()
    assert not session.kept(0) and "unpinned" in panel.status.value
    panel.filter.value = "fc"
    assert [row.fqn for row in panel.rows_box.children] == ["fc1", "fc2"] and "2 of 3 shown" in panel.shown.value
    panel.bulk["per-channel"].click()
    assert panel.rows["fc1"].settings.per_channel and not panel.rows["conv"].settings.per_channel


def test_a_row_is_one_value_and_its_listeners_never_see_it_half_updated(session):
    panel = TuningPanel(FakeSource(), session)
    row = panel.rows["fc1"]
    seen = []
    row.observe(lambda change: seen.append(change["new"]), "settings")
    whole = ModuleSettings(per_channel=True, keep_float=True, observer="percentile")
    row.settings = whole
    assert seen == [whole]  # one change, not one per control
    assert (row.weight.value, row.keep_float.value, row.observer.value) == ("per-channel", True, "percentile")
    row.activation.value = "dynamic"  # a user's edit: the trait follows; the row says why it cannot run
    assert seen[-1] == ModuleSettings(dynamic=True, per_channel=True, keep_float=True, observer="percentile")
    assert "activation observer is for static activations" in row.why.value


def test_sensitivity_and_propose_draw_and_set_the_rows(session):
    panel = TuningPanel(FakeSource(), session)
    pane = panel.sensitivity
    pane.compute.click()
    assert list(pane.bars.x) == ["fc2", "fc1", "conv"] and pane.target.value == 23.0  # the simulated baseline + 3 dB
    assert "Most harmful one at a time: <b>fc2</b>" in pane.status.value and not pane.compute.disabled
    pane.order.value = "most harmful first"
    assert [row.fqn for row in panel.rows_box.children] == ["fc2", "fc1", "conv"]
    pane.reach.click()
    assert {fqn for fqn, row in panel.rows.items() if row.settings.keep_float} == {"fc2", "fc1"}
    assert "2 module(s) float reach 23.00 dB" in pane.status.value
    pane.target.value = 40.0
    pane.reach.click()
    assert "40 dB is out of reach" in pane.status.value and all(row.keep_float.value for row in panel.rows.values())


def test_by_block_the_panes_rank_propose_and_filter_whole_blocks(session):
    panel = TuningPanel(FakeSource(), session)
    pane, controller = panel.sensitivity, panel.controller
    assert panel.block.layout.display != "none" and [v for _, v in panel.block.options] == ["", "layers.0"]
    pane.compute.click()
    assert pane.figures in pane.children and len(pane.figures.children) == 2  # bars and the trade-off
    panel.unit.value = True  # blocks
    assert controller.by_block and controller.table is None and pane.figures not in pane.children
    assert "now work with blocks" in pane.status.value and pane.order.disabled
    pane.compute.click()
    assert list(pane.bars.x) == ["fc2", "layers.0"] and pane.figures.children == (pane.bars_figure,)
    assert "each block kept float whole" in pane.bars_figure.title
    pane.order.value = "most harmful first"  # the rows follow the blocks' order
    assert [row.fqn for row in panel.rows_box.children] == ["fc2", "conv", "fc1"]
    pane.target.value = 23.0
    pane.reach.click()
    assert {fqn for fqn, row in panel.rows.items() if row.settings.keep_float} == {"fc2", "conv", "fc1"}
    assert "2 block(s) (3 modules) float reach 23.10 dB" in pane.status.value and "fc2, layers.0" in pane.status.value
    panel.block.value = "layers.0"  # one block's rows: the buttons on the right set it
    assert {row.fqn for row in panel.rows_box.children} == {"conv", "fc1"}
    panel.bulk["reset"].click()
    assert not panel.rows["conv"].settings.keep_float and panel.rows["fc2"].settings.keep_float
    panel.focus("fc2")  # a row outside the block: the block filter opens
    assert panel.block.value == "" and panel.rows_box.children[0].fqn == "fc2"


def test_cancel_stops_the_ranking_at_its_next_step(session):
    panel = TuningPanel(FakeSource(), session)
    pane, controller = panel.sensitivity, panel.controller
    shown = []
    controller.observe(lambda change: shown.append(pane.cancel.layout.display), "progress")
    controller.observe(lambda change: pane.cancel.click(), "progress")  # clicked while it runs
    pane.compute.click()
    assert shown and set(shown) == {""}  # the Cancel button is there while it runs
    assert "cancelled" in pane.status.value and pane.table is None and pane.cancel.layout.display == "none"
    assert not controller.busy and not pane.compute.disabled


def test_without_a_session_the_panel_says_why():
    panel = TuningPanel(FakeSource(), None, unavailable="Live tuning is unavailable.", error="ValueError: no eval_data")
    assert panel.controller is None and panel.apply.disabled and "unavailable" in panel.status.value
    assert "no eval_data" in panel.error.value and "#b00" in panel.error.value


def test_settings_as_code_shows_why_settings_cannot_be_applied(session):
    controller = TuneController(session, FakeSource())
    assert controller.code({"conv": ModuleSettings(dynamic=True)}).startswith("# these settings cannot be applied: conv:")
    with pytest.raises(InvalidSettingsError):
        session.settings_as_code({"conv": ModuleSettings(dynamic=True)})


def test_the_tune_tab_says_in_red_where_the_real_model_and_its_simulation_disagree():
    session = FakeSession()
    controller = TuneController(session, FakeSource())
    controller.apply(session.current_settings())
    assert controller.truth == ""  # they agree: nothing to say
    session.truth = TruthCheck(
        BASE_DB - 12.0, BASE_DB, pd.Series({"fc1": 4.0}), real_kernels=("fc1",), corrected_db=BASE_DB - 11.8
    )
    panel = TuningPanel(FakeSource(), session)
    panel.apply.click()
    assert RED in panel.truth.value and "12.0 dB worse than its simulation" in panel.truth.value
    assert "fc1" in panel.truth.value and "real kernels" in panel.truth.value
    session.truth = TruthCheck(BASE_DB - 12.0, BASE_DB, corrected_db=BASE_DB)  # nothing to blame: unverified
    assert panel.controller.rank() and "Unverified" in panel.controller.ranking_status


def test_the_time_left_follows_the_pace_of_the_running_step():
    assert [time_left(10.0, 1, 5), time_left(10.0, 2, 0), time_left(10.0, 2, 4), time_left(60.0, 2, 4)] == [
        "",
        "",
        "about 20 s left",
        "about 2 min 00 s left",
    ]
    ticks = iter(range(0, 1000, 10))  # every report 10 s after the last
    controller = TuneController(FakeSession(), FakeSource())
    controller._pace_clock = lambda: float(next(ticks))
    report = controller._reporter("sensitivity", "simulating")
    for done in range(3):
        report(done, 10)
    assert controller.remaining == "about 1 min 20 s left" and "simulating 2/10 · about 1 min 20 s left" in controller.status
    report(0, 4)  # the next step (a new total) is timed afresh
    assert controller.remaining == ""
    report(1, 4), report(2, 4)
    assert controller.remaining == "about 20 s left"
