"""The Tune tab's logic, without a widget: what runs when a button is pressed, and what it says.

``TuneController`` owns the run lock, the stale-click rule, the baseline-before-Apply policy, the
verification and sensitivity calls and the status text with its colours. Its shared state
(status, error, busy, progress) is declared as traits, which the views link to their widgets; its
actions return what the views draw (a run, the verified suggestions, a reach plan). It imports no
widget library but traitlets, so tests drive it against a fake session without a browser.
"""

from __future__ import annotations

import datetime
import html
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from traitlets import Bool, Float, HasTraits, Int, Tuple, Unicode

from ..core.metrics import is_float_output
from ..core.progress import Progress, Stopped
from ..engines.settings import ModuleSettings, validate_all
from ..errors import InvalidSettingsError, ModelReleasedError
from ..tune.run import ReleasedModel
from ..tune.truth import KERNEL_AGREEMENT_DB
from ..tune.verify import nan_equalization_metric

if TYPE_CHECKING:
    import pandas as pd

    from ..tune.diagnosis import ReachPlan
    from ..tune.run import RunResult
    from ..tune.search import SearchPath
    from ..tune.truth import TruthCheck
    from ..tune.verify import VerifiedSuggestions
    from .protocols import ReportSource, TuningSession

RED, GREEN, GREY = "#b00", "#070", "#444"
UNVERIFIED = f"<span style='color:{RED}'>Unverified: the simulation differs from the real model here.</span>"
T = TypeVar("T")
FAILED_RUN = "<i>Run failed; the previous results are kept.</i>"


class Cancelled(Stopped):
    """Raised from a progress report after ``TuneController.cancel()``: the computation stops."""


class TuneController(HasTraits):
    """Runs the Tune tab's long actions one at a time against a tuning session.

    Args:
        session: what runs (a QuantizationSession, or anything offering ``TuningSession``).
        source: the report the suggestions come from.
        clock: seconds, for the stale-click rule (``time.monotonic``; tests pass their own).
    """

    status = Unicode(help="the Tune status line (HTML): progress while busy, then what the last action found")
    error = Unicode(help="the last action's error (HTML, red); empty when it went well")
    ranking_status = Unicode(help="the sensitivity pane's status line (HTML)")
    front_status = Unicode(help="the size front pane's status line (HTML)")
    truth = Unicode(help="where the real model and its simulation disagree, in red (HTML; empty when they agree)")
    busy = Bool(False, help="a long action is running: every long action's button is disabled")
    cancellable = Bool(False, help="the running action stops at its next step when cancel() is called")
    progress = Tuple(Int(), Int(), default_value=(0, 1), help="(done, total) of the running action")
    remaining = Unicode(help="the running step's time left, estimated from its pace so far ('about 40 s left'; '' early on)")
    target = Float(0.0, help="the output SQNR (dB) Propose aims for; set to the simulated baseline + 3 dB by the first ranking")
    ignored = Int(0, help="clicks dropped because an action was running, since the last Apply began")
    by_block = Bool(False, help="rank, propose and fit whole blocks (model.layers.3) instead of modules")
    rotate = Bool(False, help="Apply quantizes the float model with rotations R1 + R2 folded into its weights")

    def __init__(self, session: TuningSession, source: ReportSource, *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.session, self.source, self._clock = session, source, clock
        self._pace_clock: Callable[[], float] = time.monotonic  # times the steps for the time left
        self.table: pd.DataFrame | None = None  # the sensitivity ranking, once computed
        self.curve: pd.DataFrame | None = None  # the trade-off curve, once computed
        self.points: pd.DataFrame | None = None  # the size front, once computed
        self.uniform: pd.DataFrame | None = None  # the uniform choices beside it
        self._lock = threading.Lock()
        self._cancel = False
        self._final_status = ""
        self._last_run: tuple[datetime.datetime | None, float] = (None, 0.0)
        self._show_truth()  # a session with runs already: its verdict from the start
        self.observe(self._on_unit_change, "by_block")

    # ---- actions -------------------------------------------------------------------------------
    def apply(self, settings: Mapping[str, ModuleSettings], sent: datetime.datetime | None = None) -> RunResult | None:
        """Run ``settings`` (the baseline first, if no run was made yet); the run, or None when
        nothing ran (refused settings, another action running, a click made during the last run).

        A click made during a run reaches the kernel either while it is going (newer kernels handle
        widget messages on another thread) or right after it (older ones queue them); ``sent`` is
        the browser's send time of the click, compared with the last run's, and both are dropped.
        """
        if self._sent_during_last_run(sent):
            self.ignored += 1
        else:
            with self._exclusive() as running:
                if running:
                    return self._apply(settings, sent)
        self.status = self._final_status + _ignored_note(self.ignored)
        return None

    def accept_all(self) -> VerifiedSuggestions | None:
        """Measure every suggestion (and what a search finds) before it is offered; None when the
        verification failed (the error says why) or another action was running."""
        with self._exclusive() as running:
            if not running:
                return None
            nan_metric = nan_equalization_metric(self.source.frame())
            try:
                with self._busy():
                    report = self._reporter("verifying suggestions", "measuring")
                    verified = self.session.verified_suggestions(
                        self.source.suggestions(), nan_metric=nan_metric, progress=report
                    )
            except Exception as error:  # the rows stay as they were
                self.status = "<i>Verifying the suggestions failed; the rows are unchanged.</i>"
                self.error = error_html(repr(error))
                return None
            self.status = verified_status(verified)
            self._show_truth()
            return verified

    def rank(self) -> bool:
        """The sensitivity ranking (``table``) and, per module, the trade-off curve (``curve``; None
        by block); False when cancelled, failed (``ranking_status`` says why) or another action was running."""
        by_block = self.by_block

        def work() -> tuple[pd.DataFrame, pd.DataFrame | None]:
            if by_block:
                return self.session.block_sensitivity(progress=self._reporter()), None
            return self.session.sensitivity(progress=self._reporter()), self.session.tradeoff(progress=self._reporter())

        unit = "block" if by_block else "module"
        found = self._simulated("ranking_status", "Sensitivity", f"calibrating once, then one forward pass per {unit}", work)
        if found is None:
            return False
        self.table, self.curve = table, curve = found
        if curve is not None:
            base = float(curve["simulated_output_sqnr_db"].iloc[0])
        else:  # any block's simulated SQNR less what keeping it float gains
            base = float(table["simulated_output_sqnr_db"].iloc[0] - table["output_sqnr_gain_db"].iloc[0]) if len(table) else 0.0
        if self.target == 0.0:
            self.target = round(base + 3.0, 1)
        most = ""
        if len(table):
            worst, gain = html.escape(str(table.index[0])), float(table["output_sqnr_gain_db"].iloc[0])
            most = f"Most harmful one at a time: <b>{worst}</b> (+{gain:.2f} dB when it alone stays float). "
        estimates = "Estimates; Apply measures." if self._simulation_reliable() else UNVERIFIED
        self.ranking_status = f"Simulated baseline {base:.2f} dB. {most}{estimates}"
        return True

    def propose(self) -> ReachPlan | None:
        """The fewest most-harmful modules to keep float for ``target`` (simulated); ranks the
        modules first when that was not done yet. None when cancelled, failed or refused."""
        with self._exclusive() as running:
            if not running:
                return None
            self.ranking_status = f"<i>planning for {self.target:g} dB…</i>"
            try:
                with self._busy(cancellable=True):
                    by_block = self.by_block
                    plan = self.session.plan_reach(self.target, by_block=by_block, progress=self._reporter())
                    if self.table is None and by_block:  # the plan ranked the blocks: keep the ranking
                        self.table = self.session.block_sensitivity(progress=self._reporter())
                    elif self.table is None:  # the plan ranked the modules: keep the ranking and the curve too
                        table = self.session.sensitivity(progress=self._reporter())
                        self.curve = self.session.tradeoff(progress=self._reporter())
                        self.table = table
            except Cancelled:
                self.ranking_status = "<i>Cancelled; the Tune rows are unchanged.</i>"
                return None
            except Exception as error:
                self.ranking_status = error_html(f"{type(error).__name__}: {error}")
                return None
            self._show_truth()
            picked = list(plan.path.chosen) if by_block and plan.path is not None else plan.float_modules
            names = html.escape(", ".join(picked) or "none")
            count = f"{len(picked)} block(s)" if by_block else f"{len(picked)} module(s)"
            if by_block:
                count += f" ({len(plan.float_modules)} modules)"
            if plan.met:
                reached = (
                    f"the float model's output in simulation ({plan.simulated_sqnr_db:.2f} dB: float round-off)"
                    if is_float_output(plan.simulated_sqnr_db)
                    else f"{plan.simulated_sqnr_db:.2f} dB in simulation"
                )
                self.ranking_status = (
                    f"{count} float reach {reached} ({names}); the Tune rows are set: Apply to confirm with a real run."
                )
            else:
                self.ranking_status = (
                    f"<span style='color:{RED}'>{self.target:g} dB is out of reach</span>: the best simulated point is "
                    f"{plan.simulated_sqnr_db:.2f} dB with {count} float ({names}); the Tune rows are set to that."
                )
            if plan.path is not None and plan.path.steps:
                self.ranking_status += path_html(plan.path)
            return plan

    def front(self) -> bool:
        """The size front and the uniform choices (``points``, ``uniform``), simulated; False when
        cancelled, failed (``front_status`` says why) or another action was running."""

        by_block = self.by_block

        def work() -> tuple[pd.DataFrame, pd.DataFrame]:
            front = self.session.pareto(progress=self._reporter(), by_block=by_block)
            return front, self.session.uniform_points(progress=self._reporter(), by_block=by_block)

        doing = f"each {'block' if by_block else 'module'} in each choice alone, then points along the front"
        found = self._simulated("front_status", "Size front", doing, work)
        if found is None:
            return False
        self.points, self.uniform = points, _ = found
        smallest, largest = points.iloc[0], points.iloc[-1]
        estimates = "" if self._simulation_reliable() else f" {UNVERIFIED}"
        self.front_status = (
            f"{len(points)} points from {smallest['size_bytes'] / 1024:,.1f} KB "
            f"({smallest['simulated_output_sqnr_db']:.2f} dB) to {largest['size_bytes'] / 1024:,.1f} KB "
            f"({largest['simulated_output_sqnr_db']:.2f} dB), simulated. Click a point, or type a budget, to put "
            f"its settings in the Tune rows; Apply measures it.{estimates}"
        )
        return True

    def _on_unit_change(self, _change: dict) -> None:
        """Modules or blocks: what was ranked or found for the other is not shown any more."""
        self.table = self.curve = self.points = self.uniform = None
        unit = "blocks" if self.by_block else "modules"
        self.ranking_status = self.front_status = f"<i>Sensitivity and the size front now work with {unit}.</i>"

    def cancel(self) -> None:
        """Stop the running cancellable action at its next step (a click handled on the kernel's
        other thread while the computation runs)."""
        self._cancel = True

    # ---- what the rows need ---------------------------------------------------------------------
    def restore(self, label: str) -> dict[str, ModuleSettings] | None:
        """Every module's settings as the run ``label`` had them (None when it has none)."""
        run = next((r for r in self.session.history if r.label == label), None)
        if run is None or run.settings is None:
            return None
        self.status = f"<i>The rows hold the settings of {html.escape(run.label)}; Apply to run them again.</i>"
        return {**self.session.current_settings(), **run.settings}

    def code(self, settings: Mapping[str, ModuleSettings]) -> str:
        """``settings`` as Python to paste into a pipeline, or a comment saying why they cannot be applied."""
        try:
            code = self.session.settings_as_code(settings)
        except InvalidSettingsError as error:
            return f"# these settings cannot be applied: {error}\n"
        if not self.rotate:
            return code
        rotated = "# rotations R1 + R2 folded into the float model first, as Apply does\nmodel = qreport_widgets.rotate(model)\n"
        return rotated + code

    def pin(self, label: str) -> None:
        """Pin the run ``label`` (its quantized model is kept past later runs), or unpin it."""
        index = next((i for i, r in enumerate(self.session.history) if r.label == label), None)
        if index is None:
            return
        keep = not self.session.kept(index)
        try:
            self.session.keep(index, keep)
        except ModelReleasedError as error:
            self.error = error_html(str(error), block=False)
            return
        self.error = ""
        where = f"session.history[{index}].quantized_model"
        self.status = (
            f"<i>{html.escape(label)}: its quantized model is kept ({where}) until you unpin it.</i>"
            if keep
            else f"<i>{html.escape(label)}: unpinned; its quantized model is released when a later run is recorded.</i>"
        )

    def pin_state(self, label: str | None) -> tuple[bool, bool]:
        """Whether the run ``label`` can be pinned (its model is still there) and whether it is."""
        index = next((i for i, r in enumerate(self.session.history) if r.label == label), None)
        if index is None:
            return False, False
        pinned = self.session.kept(index)
        return pinned or not isinstance(self.session.history[index].quantized_model, ReleasedModel), pinned

    def restorable(self) -> list[str]:
        """The labels of the runs whose settings can be put back in the rows."""
        return [r.label for r in self.session.history if r.settings is not None]

    # ---- helpers -------------------------------------------------------------------------------
    def _show_truth(self) -> None:
        """The truth check's verdict, once the baseline ran (it never starts a run by itself)."""
        if self.session.history:
            self.truth = truth_html(self.session.truth_check())

    def _simulated(self, status: str, name: str, doing: str, work: Callable[[], T]) -> T | None:
        """``work()``, simulation only, as one cancellable action told on the trait ``status``: what
        it does, then why it stopped. None when cancelled, failed or another action was running."""
        with self._exclusive() as running:
            if not running:
                return None
            setattr(self, status, f"<i>simulating: {doing}…</i>")
            try:
                with self._busy(cancellable=True):
                    found = work()
            except Cancelled:
                setattr(self, status, f"<i>{name} cancelled; nothing was changed.</i>")
                return None
            except Exception as error:  # user models and data: show, keep the tab usable
                setattr(self, status, error_html(f"{type(error).__name__}: {error}"))
                return None
            self._show_truth()
            return found

    def _simulation_reliable(self) -> bool:
        return not self.session.history or self.session.truth_check().reliable

    def _apply(self, settings: Mapping[str, ModuleSettings], sent: datetime.datetime | None) -> RunResult | None:
        try:
            validate_all(self.session.modules, settings)
        except InvalidSettingsError as error:
            self.error = error_html(str(error), block=False)
            return None
        self.ignored, self._final_status = 0, ""
        started = self._clock()
        result = None
        try:
            with self._busy():
                if not self.session.history:
                    self.session.baseline(progress=self._reporter("baseline", "calibrating"))
                self._show_truth()
                # the first number no run of the session holds: another widget of the same session
                # (the cell run again) applies too, and a run is restored by its label
                taken = {run.label for run in self.session.history}
                label = next(f"apply {n}" for n in itertools.count(1) if f"apply {n}" not in taken)
                reporter = self._reporter(label, "calibrating")
                result = self.session.apply(settings, label=label, progress=reporter, rotation=self.rotate or None)
            if result.ok:
                notes = "".join(f"<br><i>{html.escape(note)}</i>" for note in result.notes)
                kernels = result.kernel_sqnr_db
                off = set(kernels.index[kernels < KERNEL_AGREEMENT_DB])
                undone = len(set(result.module_notes) - off)
                if undone:
                    notes += f"<br><i>{undone} module(s) did not carry out their settings: their rows say what the run did.</i>"
                if off:
                    notes += f"<br><i>{len(off)} module(s) ran a quantized kernel that differs from its reference.</i>"
                self._final_status = run_status(result, self.session.history, self.table) + notes
            else:
                self._final_status = FAILED_RUN
                self.error = error_html(result.error or "")
        except Exception as error:  # never leave the buttons disabled or the error unsaid
            self._final_status, self.error, result = FAILED_RUN, error_html(repr(error)), None
        finally:
            self._last_run = (sent, self._clock() - started)
            self.status = self._final_status + _ignored_note(self.ignored)
        return result

    @contextmanager
    def _exclusive(self) -> Iterator[bool]:
        """Whether this action may run (no other is running); a refused click is counted."""
        if not self._lock.acquire(blocking=False):
            self.ignored += 1
            yield False
            return
        try:
            yield True
        finally:
            self._lock.release()

    @contextmanager
    def _busy(self, cancellable: bool = False) -> Iterator[None]:
        """One long action: the buttons disabled, the progress shown, the error cleared; all of it
        undone when the action ends, however it ends."""
        self._cancel = False
        with self.hold_trait_notifications():
            self.busy, self.cancellable, self.progress, self.error = True, cancellable, (0, 1), ""
        try:
            yield
        finally:
            with self.hold_trait_notifications():
                self.busy, self.cancellable = False, False

    def _reporter(self, label: str = "", doing: str = "") -> Progress:
        """A progress callback for the session: advances ``progress`` (and, with a label, the status
        line); raises Cancelled once ``cancel()`` was called."""
        if label:
            self.status = f"{html.escape(label)}: {doing}"
        self.remaining = ""
        phase = {"total": None, "start": 0.0, "from": 0}  # a new total is a new step (calibrating, then simulating)

        def report(done: int, total: int | None) -> None:
            if self._cancel:
                raise Cancelled
            now = self._pace_clock()
            if total != phase["total"] or done < phase["from"]:
                phase.update(total=total, start=now, **{"from": done})
            self.remaining = time_left(now - phase["start"], done - phase["from"], (total or done) - done)
            if label:
                left = f" · {self.remaining}" if self.remaining else ""
                self.status = f"{html.escape(label)}: {doing} {done}/{total or '?'}{left}"
            self.progress = (done, total or max(done, 1))

        return report

    def _sent_during_last_run(self, sent: datetime.datetime | None) -> bool:
        """Whether a click was made while the previous run was still going. Both click times come
        from the browser's clock and the run's length from the kernel's, so a clock offset between
        the two machines does not matter."""
        previous, seconds = self._last_run
        if sent is None or previous is None:
            return False
        return (sent - previous).total_seconds() < seconds


def error_html(text: str, *, block: bool = True) -> str:
    """An error in red: a preformatted block (tracebacks, reprs) or one line."""
    if block:
        return f"<pre style='color:{RED};white-space:pre-wrap'>{html.escape(text)}</pre>"
    return f"<span style='color:{RED}'>{html.escape(text)}</span>"


PATH_ROWS = 8  # steps of the search's path the Tune tab shows


def path_html(path: SearchPath) -> str:
    """The in-context search's path as a small table: each step's modules, its gain given the steps
    before, the simulated output SQNR after it and why it was taken."""
    table = path.frame()
    shown = table.iloc[: PATH_ROWS + 1]
    cells = "".join(
        "<tr>"
        f"<td>{html.escape(str(row.action))}</td><td><b>{html.escape(str(row.modules))}</b></td>"
        f"<td style='text-align:right'>{'' if math.isnan(row.gain_db) else f'{row.gain_db:+.2f}'}</td>"
        f"<td style='text-align:right'>{row.simulated_output_sqnr_db:.2f}</td>"
        f"<td style='color:#666'>{html.escape(str(row.why))}</td>"
        "</tr>"
        for row in shown.itertuples()
    )
    more = (
        f"<div style='color:#666'>… {len(table) - len(shown)} more step(s): session.plan_reach(...).path</div>"
        if len(table) > len(shown)
        else ""
    )
    head = "<tr><th>step</th><th>modules</th><th>gain given the steps before (dB)</th><th>simulated (dB)</th><th>why</th></tr>"
    return (
        "<div style='margin-top:4px'><i>The search's path (each module picked by what it gains given the picks before, "
        f"{path.simulated} sets simulated in {path.seconds:.1f} s):</i>"
        f"<table style='border-collapse:collapse;font-size:12px'>{head}{cells}</table>{more}</div>"
    )


def truth_html(truth: TruthCheck) -> str:
    """The truth check for the Tune tab: nothing when the simulation agrees with the real model;
    otherwise the gap and the kernels to blame, in red, with the notes on hover."""
    if not truth.status:
        return ""
    detail = html.escape("\n".join(truth.notes), quote=True)
    headline = truth.headline[0].upper() + truth.headline[1:]
    if not truth.disagreeing or truth.error:
        said = html.escape(truth.status[0].upper() + truth.status[1:]) + "."
    else:
        said = (
            f"{html.escape(headline)}: the quantized kernels of <b>{html.escape(', '.join(truth.disagreeing))}</b> compute "
            "something else than their reference. "
        )
        said += (
            "The simulation now runs them, so sensitivity and suggestions account for them; keeping them float is the fix to try."
            if truth.reliable
            else "Simulated numbers are unverified here; suggestions are measured by real runs."
        )
    return f"<div style='color:{RED};margin:4px 0' title='{detail}'>&#9888; {said}</div>"


def run_status(result: RunResult, history: list[RunResult], sensitivity: pd.DataFrame | None) -> str:
    """The run's output SQNR against the baseline (red when worse) and the best run so far, and
    which module hurts most where the sensitivity ranking has been computed."""
    line = f"{html.escape(result.label)}: output SQNR {result.output_sqnr_db:.2f} dB"
    baseline = next((r for r in history if r.baseline), None)
    if baseline is not None and baseline is not result:
        delta = result.output_sqnr_db - baseline.output_sqnr_db
        color = RED if delta < -0.05 else GREEN if delta > 0.05 else GREY
        verdict = " (worse than the baseline)" if delta < -0.05 else ""
        line += f", <b style='color:{color}'>{delta:+.2f} dB</b> vs the baseline ({baseline.output_sqnr_db:.2f} dB){verdict}"
    best = max(history, key=lambda r: r.output_sqnr_db, default=None)
    if best is not None and best is not result:
        line += f"; best so far: {html.escape(best.label)} ({best.output_sqnr_db:.2f} dB)"
    if sensitivity is not None and len(sensitivity):
        worst, gain = sensitivity.index[0], float(sensitivity["output_sqnr_gain_db"].iloc[0])
        line += f"<br>Most harmful module (sensitivity): <b>{html.escape(str(worst))}</b>, {gain:+.2f} dB if kept float"
    else:
        line += "<br><i>Sensitivity (above) ranks the modules by what keeping each float would gain.</i>"
    return line


def time_left(elapsed_s: float, done: int, left: int) -> str:
    """The time ``left`` more steps take at the pace of the ``done`` steps timed so far, in words
    ('' until two steps were timed, or when nothing is left)."""
    if done < 2 or left <= 0:
        return ""
    seconds = elapsed_s / done * left
    if seconds < 60:
        return f"about {max(1, round(seconds))} s left"
    minutes, seconds = divmod(round(seconds), 60)
    return f"about {minutes} min {seconds:02d} s left" if minutes < 60 else f"about {minutes // 60} h {minutes % 60:02d} min left"


def verified_status(verified: VerifiedSuggestions) -> str:
    """One line on what Accept all put in the rows, and what it measured."""
    rejected = len(verified.rejected)
    considered = f"{rejected} more considered and not suggested (each row says why)" if rejected else ""
    notes = "".join(f"<br><i>{html.escape(note)}</i>" for note in verified.notes)
    if verified.accept_all is None:
        return (
            f"<i>No suggestion helps: {len(verified.verdicts)} candidate(s) measured, none gains enough together; "
            f"{considered}.</i>{notes}"
        )
    run = verified.accept_all
    if not run.ok:
        return f"<span style='color:{RED}'>Accept all: the trial run failed; {considered}.</span>"
    gain = run.output_sqnr_db - verified.baseline_db
    color = RED if gain < 0 else GREEN
    return (
        f"Accept all (measured): <b style='color:{color}'>{gain:+.2f} dB</b> output SQNR in a trial run "
        f"({verified.baseline_db:.2f} -> {run.output_sqnr_db:.2f} dB) with {len(verified.offered)} setting(s) offered; "
        f"{considered}. Apply to keep it.{notes}"
    )


def _ignored_note(count: int) -> str:
    if not count:
        return ""
    clicks = "1 click" if count == 1 else f"{count} clicks"
    return f"<br><i>{clicks} made while the run was in progress ignored.</i>"
