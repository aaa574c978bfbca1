"""The Tune tab: per-module settings, Apply (prepare -> calibrate -> convert), run history."""

from __future__ import annotations

import datetime
import html
import threading
import time
from typing import TYPE_CHECKING

import ipywidgets as w
import numpy as np
import pandas as pd
from ipywidgets.widgets.widget_bool import CheckboxStyle
from ipywidgets.widgets.widget_description import DescriptionStyle
from ipywidgets.widgets.widget_string import HTMLStyle

from ..errors import InvalidSettingsError
from ..protocols import ReportSource, TuningSession
from ..settings import ModuleSettings, TunableModule, validate, validate_all
from ..verify import VerifiedSuggestions, nan_equalization_metric
from .plots import bar_range, scrolling_table
from .sensitivity import SensitivityPane

if TYPE_CHECKING:
    from ..session import RunResult

STATIC, DYNAMIC = "static", "dynamic"
PER_TENSOR, PER_CHANNEL = "per-tensor", "per-channel"
TOP_LAYERS = 20  # bars per run in the per-layer chart; the full table is session.compare()
SQNR_VIEW, DELTA_VIEW = "SQNR per run", "change vs baseline"
RUNS_DRAWN = 4  # the baseline and the last three runs in the per-layer chart
RowParts = dict[str, w.Layout | w.Style]  # what the rows of one panel share
_SERIES_COLORS = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]


class SettingsRow(w.VBox):
    """One module's editable settings; the reason for each suggestion is on hover and in the row."""

    def __init__(self, module: TunableModule, reasons: list[str], migration: str = "", parts: RowParts | None = None) -> None:
        self.fqn = fqn = module.fqn
        self.module = module
        self.suggested = bool(reasons)
        self._search = f"{fqn} {module.type_name}".lower()
        type_name = html.escape(module.type_name)
        shared = parts if parts is not None else row_parts()  # one set for all rows: a 250-row model stays light
        self.activation = w.Dropdown(options=[STATIC, DYNAMIC], disabled=not module.allows("dynamic"),
                                     tooltip="activations: static (calibrated) or dynamic (Linear only)",
                                     layout=shared["activation"], style=shared["dropdown"])  # fmt: skip
        self.weight = w.Dropdown(options=[PER_TENSOR, PER_CHANNEL], disabled=not module.allows("per_channel"),
                                 tooltip="weights: one scale per tensor or per output channel",
                                 layout=shared["weight"], style=shared["dropdown"])  # fmt: skip
        self.equalize = w.Checkbox(description="equalize", indent=False, layout=shared["equalize"], style=shared["checkbox"],
                                   disabled=not module.allows("equalize"),
                                   tooltip=module.unavailable.get("equalize",
                                                                  "input-weight equalization with the next layer"))  # fmt: skip
        self.keep_float = w.Checkbox(description="keep float", indent=False, layout=shared["keep_float"],
                                     style=shared["checkbox"])  # fmt: skip
        self.observer = w.Dropdown(options=[("as started", ""), ("MinMax", "minmax"), ("Histogram", "histogram"),
                                            ("Percentile", "percentile")],
                                   disabled=not module.allows("observer"),
                                   tooltip=module.unavailable.get("observer",
                                       "the activation observer of this module's output (static activations); "
                                       "Percentile: the range of each batch's 0.01th to 99.99th percentile"),
                                   layout=shared["observer"], style=shared["dropdown"])  # fmt: skip
        # only where the session found outlier channels to move into the weights; last, so its
        # absence shifts no other control
        self.migrate = w.Checkbox(description="migrate", indent=False, disabled=not migration, tooltip=migration,
                                  layout=shared["migrate" if migration else "hidden"], style=shared["checkbox"])  # fmt: skip
        self._name = f"<b>{html.escape(fqn)}</b> <span style='color:#666'>{type_name}</span>"
        self.why = w.HTML(layout=shared["why"], style=shared["html"])  # the module's name, then why
        self._reasons = reasons
        self._run_note = ""  # what the last run did not carry out for this module
        self._setting = False
        self._render_why()
        # two lines at any width: the module and why, then its settings; rows keep their height
        # inside the scrolling box (a flex column would squeeze them together)
        controls = w.HBox([self.activation, self.weight, self.equalize, self.keep_float, self.observer, self.migrate],
                          layout=shared["controls"])  # fmt: skip
        super().__init__([self.why, controls], layout=shared["row"])

        for control in (self.activation, self.weight, self.equalize, self.keep_float, self.migrate, self.observer):
            control.observe(self._on_change, "value")

    def set_reasons(self, reasons: list[str], suggested: bool) -> None:
        """Show measured verdicts in place of the detectors' reasons (``suggested``: one is offered)."""
        self._reasons, self.suggested = reasons, suggested
        self._render_why()

    def set_run_note(self, note: str) -> None:
        """Say on the row what the last run did not carry out of its settings ("" clears it)."""
        if note != self._run_note:
            self._run_note = note
            self._render_why()

    def matches(self, text: str) -> bool:
        """Whether ``text`` is part of the module's name or type (case ignored)."""
        return text.lower() in self._search

    def _on_change(self, _change: dict) -> None:
        if not self._setting:  # a user's edit; a whole-row change renders once at its end
            self._render_why()

    def _render_why(self) -> None:
        """The reasons, and in red why these settings cannot be applied to this module, if so."""
        tip = html.escape("; ".join(self._reasons) or "no suggestion")
        problem = ""
        try:
            validate(self.module, self.settings)
        except InvalidSettingsError as error:
            problem = f"<div style='color:#b00'>{html.escape(str(error).removeprefix(self.fqn + ': '))}</div>"
        if self._run_note:
            problem += f"<div style='color:#a60'>last run: {html.escape(self._run_note)}</div>"
        why = f"<span style='font-size:11px;line-height:1.3;color:#444' title='{tip}'>{problem}{tip}</span>"
        self.why.value = (
            "<div style='display:flex;flex-wrap:wrap;align-items:baseline;column-gap:12px'>"
            f"<span style='white-space:nowrap' title='{tip}'>{self._name}</span>{why}</div>"
        )

    @property
    def settings(self) -> ModuleSettings:
        return ModuleSettings(
            dynamic=self.activation.value == DYNAMIC,
            per_channel=self.weight.value == PER_CHANNEL,
            equalize=self.equalize.value,
            keep_float=self.keep_float.value,
            migrate=self.migrate.value,
            observer=self.observer.value,
        )

    @settings.setter
    def settings(self, value: ModuleSettings) -> None:
        self._setting = True
        try:
            with self.hold_sync():
                self.activation.value = DYNAMIC if value.dynamic else STATIC
                self.weight.value = PER_CHANNEL if value.per_channel else PER_TENSOR
                self.equalize.value = value.equalize
                self.keep_float.value = value.keep_float
                self.migrate.value = value.migrate
                self.observer.value = value.observer
        finally:
            self._setting = False
        self._render_why()


class TuningPanel(w.VBox):
    """Edit settings, Apply them through a tuning session, compare runs.

    Without a session the panel shows ``unavailable`` (and ``error``) instead of rows.
    """

    def __init__(self, source: ReportSource, session: TuningSession | None, *, unavailable: str = "", error: str = "") -> None:
        self.source = source
        self.session = session
        reasons: dict[str, list[str]] = {}
        for suggestion in source.suggestions():
            reasons.setdefault(suggestion.module_fqn, []).append(f"{suggestion.kind.value}: {suggestion.reason}")
        modules = session.modules if session is not None else []
        migrations = _migrations(session)
        parts = row_parts()
        self.rows = {m.fqn: SettingsRow(m, reasons.get(m.fqn, []), migrations.get(m.fqn, ""), parts) for m in modules}
        fixed = {"flex": "0 0 auto"}  # the status line beside them must not squeeze the buttons
        measured = "Measure every suggestion first (simulated or a trial run); only those that help are set"
        self.accept = w.Button(description="Accept all suggestions", icon="check", tooltip=measured,
                               layout={"width": "190px", **fixed})  # fmt: skip
        self.reset = w.Button(description="Reset to default", icon="undo", layout={"width": "150px", **fixed})
        self.apply = w.Button(description="Apply", icon="play", button_style="primary", layout={"width": "110px", **fixed})
        self.progress = w.IntProgress(value=0, min=0, max=1, layout={"width": "220px", "visibility": "hidden", **fixed})
        self.restore_from = w.Dropdown(options=[], description="run", layout={"width": "200px", **fixed},
                                       style={"description_width": "30px"})  # fmt: skip
        self.restore = w.Button(description="Restore its settings", icon="history", disabled=True,
                                layout={"width": "170px", **fixed})  # fmt: skip
        self.restore.on_click(self._on_restore_click)
        self.status = w.HTML()
        self.error = w.HTML()
        self.history = w.HTML()
        self.summary = w.HTML()
        self.code = w.Textarea(layout={"width": "100%", "height": "160px"}, description="", placeholder="")
        self.figure, self.bars, self.x_scale = _sqnr_figure()
        self.layer_view = w.ToggleButtons(
            options=[SQNR_VIEW, DELTA_VIEW], value=SQNR_VIEW, style={"button_width": "170px"},
            tooltips=["each run's SQNR per layer", "each run minus the baseline, per layer: where a change helped or hurt"],
        )  # fmt: skip
        self.layer_view.observe(self._on_layer_view_change, "value")
        self.layers_pane = w.VBox([self.layer_view, self.figure])
        self._layers = pd.DataFrame()
        self._running = threading.Lock()
        self._ignored = 0  # clicks dropped during the current or last run
        self._final_status = ""
        self._last_run: tuple[datetime.datetime | None, float] = (None, 0.0)
        self._applied = 0
        self.accept.on_click(self._on_accept_click)
        self.reset.on_click(self._on_reset_click)
        self.apply.on_click(self._on_apply_click)
        # the status line gets the full width under the buttons: measured results take a few lines
        buttons = w.HBox([self.accept, self.reset, self.apply, self.progress, self.restore_from, self.restore],
                         layout={"align_items": "center", "flex_flow": "row wrap"})  # fmt: skip
        self.rows_box = rows = w.VBox(list(self.rows.values()), layout={"max_height": "400px", "overflow": "hidden auto"})
        self._order: list[str] = []  # forward order
        self.filter = w.Text(placeholder="filter: name or type", layout={"width": "200px", "flex": "0 0 auto"})
        self.only_suggested = w.Checkbox(description="with a suggestion", indent=False, layout={"width": "150px", **fixed})
        self.shown = w.HTML(layout={"flex": "0 0 auto"})
        self.bulk = {
            name: w.Button(description=name, tooltip=f"{name} on every row shown", layout={"width": "110px", **fixed})
            for name in ("keep float", "per-channel", "reset")
        }
        for name, button in self.bulk.items():
            button.on_click(lambda _b, name=name: self._bulk(name))
        self.filter.observe(lambda _c: self._refresh_rows(), "value")
        self.only_suggested.observe(lambda _c: self._refresh_rows(), "value")
        bulk_label = w.HTML(
            "<span style='color:#666'>on the rows shown:</span>", layout={"flex": "0 0 auto", "margin": "0 4px 0 12px"}
        )
        toolbar = w.HBox([self.filter, self.only_suggested, self.shown, bulk_label, *self.bulk.values()],
                         layout={"align_items": "center", "flex_flow": "row wrap"})  # fmt: skip
        results = w.Accordion(
            children=[self.summary, self.code],
            titles=("Quantization summary of the last run", "These settings as Python, to paste into a pipeline"),
        )
        # the SQNR figure joins after the first run: a bqplot figure laid out in a hidden tab has no size
        if session is None:
            self._enable(False)
            self.status.value = f"<i>{html.escape(unavailable or 'Live tuning needs a session.')}</i>"
            if error:
                self.error.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(error)}</pre>"
            super().__init__([self.status, self.error])
            return
        self.sensitivity = SensitivityPane(session, self._keep_float, self._order_rows)
        super().__init__([self.sensitivity, toolbar, rows, buttons, self.status, self.error, self.history, results])
        self._refresh_rows()
        self._set_all(session.current_settings())
        self._show_code()

    # ---- handlers ------------------------------------------------------------------------------
    def _on_accept_click(self, _button: w.Button) -> None:
        if not self._running.acquire(blocking=False):  # a run or a verification is going
            self._ignored += 1
            return
        try:
            self._accept()
        finally:
            self._running.release()

    def _accept(self) -> None:
        """Measure every suggestion (and what a search finds) before putting it in the rows."""
        self._enable(False)
        self.error.value = ""
        try:
            nan_metric = nan_equalization_metric(self.source.frame())
            verified = self._run_with_progress(
                "verifying suggestions",
                lambda cb: self.session.verified_suggestions(self.source.suggestions(), nan_metric=nan_metric, progress=cb),
                doing="measuring",
            )
        except Exception as error:  # the rows stay as they were
            self.status.value = "<i>Verifying the suggestions failed; the rows are unchanged.</i>"
            self.error.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(repr(error))}</pre>"
            return
        finally:
            self._enable(True)
            self.progress.layout.visibility = "hidden"
        self._set_all(verified.settings)
        offered = {v.candidate.module_fqn for v in verified.offered}
        for fqn, texts in verified.reasons().items():
            if fqn in self.rows:
                self.rows[fqn].set_reasons(texts, fqn in offered)
        self._refresh_rows()
        self.status.value = verified_status(verified)
        self._show_code()

    def _on_restore_click(self, _button: w.Button) -> None:
        """Put an earlier run's settings back in the rows (Apply runs them again)."""
        run = next((r for r in self.session.history if r.label == self.restore_from.value), None)
        if run is None or run.settings is None:
            return
        self._set_all({**self.session.current_settings(), **run.settings})
        self.status.value = f"<i>The rows hold the settings of {html.escape(run.label)}; Apply to run them again.</i>"
        self._show_code()

    def _on_reset_click(self, _button: w.Button) -> None:
        self._set_all(self.session.current_settings())
        self._show_code()

    def _on_apply_click(self, _button: w.Button) -> None:
        # One run at a time. A click made during a run reaches us either while it is going (newer
        # kernels handle widget messages on another thread) or right after it (older kernels
        # queue them); both are dropped, and the status line says so.
        sent = _click_sent_at()
        if self._sent_during_last_run(sent) or not self._running.acquire(blocking=False):
            self._ignored += 1
            self.status.value = self._final_status + _ignored_note(self._ignored)
            return
        try:
            self._apply(sent)
        finally:
            self._running.release()

    def _apply(self, sent: datetime.datetime | None) -> None:
        settings = self.settings()
        try:
            validate_all(self.session.modules, settings)
        except InvalidSettingsError as error:
            self.error.value = f"<span style='color:#b00'>{html.escape(str(error))}</span>"
            return
        self._enable(False)
        self.error.value = ""
        self._ignored, self._final_status = 0, ""
        started = time.monotonic()
        try:
            if not self.session.history:
                self._run_with_progress("baseline", lambda cb: self.session.baseline(progress=cb))
            self._applied += 1
            label = f"apply {self._applied}"
            result = self._run_with_progress(label, lambda cb: self.session.apply(settings, label=label, progress=cb))
            if result.ok:
                for row in self.rows.values():  # a setting the engine accepted but did not carry out, on its row
                    row.set_run_note(next((n.removeprefix(f"{row.fqn}: ") for n in result.notes
                                           if n.startswith(f"{row.fqn}: ")), ""))  # fmt: skip
                notes = "".join(f"<br><i>{html.escape(note)}</i>" for note in result.notes)
                self._final_status = run_status(result, self.session.history, self.sensitivity.table) + notes
            else:
                self._final_status = "<i>Run failed; the previous results are kept.</i>"
                self.error.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(result.error)}</pre>"
            self._show_results(result if result.ok else None)
        except Exception as error:  # never leave the buttons disabled
            self._final_status = "<i>Run failed; the previous results are kept.</i>"
            self.error.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(repr(error))}</pre>"
        finally:
            self._last_run = (sent, time.monotonic() - started)
            self.status.value = self._final_status + _ignored_note(self._ignored)
            self._enable(True)
            self.progress.layout.visibility = "hidden"

    # ---- helpers -------------------------------------------------------------------------------
    def _sent_during_last_run(self, sent: datetime.datetime | None) -> bool:
        """Whether a click was made while the previous run was still going.

        Both click times come from the browser's clock and the run's length from the kernel's, so
        a clock offset between the two machines does not matter.
        """
        previous, seconds = self._last_run
        if sent is None or previous is None:
            return False
        return (sent - previous).total_seconds() < seconds

    def _keep_float(self, names: list[str]) -> None:
        """Keep exactly ``names`` float (the other rows keep their other choices)."""
        chosen = set(names)
        with self.hold_sync():
            for fqn, row in self.rows.items():
                row.keep_float.value = fqn in chosen
        self._show_code()

    def _order_rows(self, order: list[str]) -> None:
        """Rows in ``order`` (names not in it follow in forward order); an empty order is forward order."""
        self._order = list(order)
        self._refresh_rows()

    def _visible_rows(self) -> list[SettingsRow]:
        ranked = [self.rows[name] for name in self._order if name in self.rows]
        ordered = ranked + [row for name, row in self.rows.items() if name not in set(self._order)]
        text, only = self.filter.value.strip(), self.only_suggested.value
        return [row for row in ordered if (not text or row.matches(text)) and (not only or row.suggested)]

    def _refresh_rows(self) -> None:
        """The rows that pass the filter, in the chosen order (one message to the browser)."""
        visible = self._visible_rows()
        self.rows_box.children = tuple(visible)
        self.shown.value = f"<span style='color:#666'>{len(visible)} of {len(self.rows)} shown</span>"

    def _bulk(self, action: str) -> None:
        start = self.session.current_settings()
        with self.hold_sync():
            for row in self._visible_rows():
                if action == "keep float":
                    row.keep_float.value = True
                elif action == "per-channel" and not row.weight.disabled:
                    row.weight.value = PER_CHANNEL
                elif action == "reset":
                    row.settings = start[row.fqn]
        self._show_code()

    def settings(self) -> dict[str, ModuleSettings]:
        return {fqn: row.settings for fqn, row in self.rows.items()}

    def _set_all(self, settings: dict[str, ModuleSettings]) -> None:
        with self.hold_sync():
            for fqn, row in self.rows.items():
                row.settings = settings.get(fqn, ModuleSettings())

    def _enable(self, enabled: bool) -> None:
        for control in (self.accept, self.reset, self.apply):
            control.disabled = not enabled

    def _run_with_progress(self, label: str, run, doing: str = "calibrating"):
        self.progress.value, self.progress.max = 0, 1
        self.progress.layout.visibility = "visible"
        self.status.value = f"{html.escape(label)}: {doing}"

        def on_batch(done: int, total: int | None) -> None:
            self.progress.max = total or max(done, 1)
            self.progress.value = done
            self.status.value = f"{html.escape(label)}: {doing} {done}/{total or '?'}"

        return run(on_batch)

    def _show_code(self) -> None:
        try:
            self.code.value = self.session.settings_as_code(self.settings())
        except InvalidSettingsError as error:
            self.code.value = f"# these settings cannot be applied: {error}\n"

    def _show_results(self, latest: RunResult | None) -> None:
        runs, layers = self.session.compare()
        with self.hold_sync():
            shown = runs.assign(
                **{c: runs[c].map(lambda v: html.escape(str(v))) for c in runs.select_dtypes(include=["object", "string"])}
            )
            if "changes" in runs:
                shown["changes"] = runs["changes"].map(_short_changes)
            if "run" in runs:  # a label is a name: one line
                shown["run"] = shown["run"].map(lambda v: f"<span style='white-space:nowrap'>{v}</span>")
            runs_html = scrolling_table(shown.to_html(index=False, float_format=_number, border=0, escape=False))
            self.history.value = "<h4 style='margin:6px 0'>Runs</h4>" + runs_html
            self._draw_layers(layers)
            restorable = [r.label for r in self.session.history if r.settings is not None]
            self.restore_from.options = restorable
            self.restore_from.value = restorable[-1] if restorable else None
            self.restore.disabled = not restorable
            if self.layers_pane not in self.children:
                self.children = (*self.children[:-1], self.layers_pane, self.children[-1])  # above the summary
            if latest is not None:
                tables = latest.summary.to_html(index=False, border=0) + latest.conversions.to_html(index=False, border=0)
                self.summary.value = scrolling_table(tables)
                self._show_code()

    def _on_layer_view_change(self, _change: dict) -> None:
        if len(self._layers):
            self._draw_layers(self._layers)

    def _draw_layers(self, layers: pd.DataFrame) -> None:
        """Per-layer SQNR of every run, or each run's change from the baseline (DELTA_VIEW); past
        TOP_LAYERS layers, those lowest (or most changed) in the last run, in forward order."""
        self._layers = layers = layers.replace([np.inf, -np.inf], np.nan)
        if layers.shape[1] == 0:  # no run measured per layer yet
            return
        if layers.shape[1] > RUNS_DRAWN:  # the baseline and the latest runs: more groups are too thin to read
            layers = layers.iloc[:, [0, *range(layers.shape[1] - RUNS_DRAWN + 1, layers.shape[1])]]
        delta = self.layer_view.value == DELTA_VIEW and layers.shape[1] > 1
        if delta:
            layers = layers.iloc[:, 1:].sub(layers.iloc[:, 0], axis=0)
        total = len(layers)
        last = layers.iloc[:, -1]
        what = "SQNR change vs baseline" if delta else "Per-layer SQNR"
        if total > TOP_LAYERS:
            chosen = last.abs().nlargest(TOP_LAYERS).index if delta else last.nsmallest(TOP_LAYERS).index
            layers = layers[layers.index.isin(set(chosen))]
            which = "most changed" if delta else "lowest"
            self.figure.title = f"{what}: {TOP_LAYERS} {which} of {total} layers"
        else:
            self.figure.title = what
        low, high, span = bar_range(layers.to_numpy(dtype=np.float64).ravel())
        colors = _SERIES_COLORS[1 : layers.shape[1] + 1] if delta else _SERIES_COLORS[: layers.shape[1]]
        with self.figure.hold_sync():
            self.x_scale.domain = list(layers.index)
            # room above the bars for the legend, a line per run
            legend_share = min(0.6, (20 * layers.shape[1] + 25) / 220)  # px of legend / px of plot
            self.bars.scales["y"].min, self.bars.scales["y"].max = low, high + span * legend_share / (1 - legend_share)
            self.figure.axes[1].label = "change (dB)" if delta else "SQNR (dB)"
            self.bars.tooltip.labels = ["layer", "change (dB)" if delta else "SQNR (dB)"]
            with self.bars.hold_sync():
                self.bars.x = list(layers.index)
                self.bars.y = layers.T.to_numpy(dtype=np.float32, na_value=0.0)
                self.bars.labels = [f"{c} - baseline" if delta else c for c in layers.columns]
                self.bars.colors = colors


def _short_changes(text: str, shown: int = 2) -> str:
    """A run's changes in the runs table: the first few, the rest counted, all of them on hover."""
    parts = str(text).split("; ")
    short = "; ".join(parts[:shown]) + (f"; +{len(parts) - shown} more" if len(parts) > shown else "")
    return f"<span title='{html.escape(str(text))}' style='display:inline-block;min-width:14em'>{html.escape(short)}</span>"


def row_parts() -> RowParts:
    """The layouts and styles the Tune rows of one panel share (one browser model each, not one per
    row). Widths hold each label in full (a dropdown needs its text + 30 px, a checkbox + 22 px);
    the controls fit one line of a 520 px tab."""
    fixed = {"flex": "0 0 auto", "margin": "2px 1px 2px 0"}
    widths = {"activation": 88, "weight": 108, "equalize": 78, "keep_float": 88, "observer": 100, "migrate": 74}
    parts: RowParts = {name: w.Layout(width=f"{px}px", **fixed) for name, px in widths.items()}
    parts["hidden"] = w.Layout(display="none")
    parts["why"] = w.Layout(width="100%")
    parts["controls"] = w.Layout(align_items="center", flex_flow="row wrap")
    parts["row"] = w.Layout(border_bottom="1px solid #eee", flex="0 0 auto", padding="2px 0")
    parts["dropdown"], parts["checkbox"], parts["html"] = DescriptionStyle(), CheckboxStyle(), HTMLStyle()
    return parts


def _number(value: float) -> str:
    """Three significant digits, thousands written out: 2,806 rather than 2.81e+03."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _migrations(session: TuningSession | None) -> dict[str, str]:
    """Module -> what its outlier-channel migration does, where the session found one."""
    return {fqn: m.summary for fqn, m in session.migrations().items()} if session is not None else {}


def run_status(result: RunResult, history: list[RunResult], sensitivity: pd.DataFrame | None) -> str:
    """The run's output SQNR against the baseline (red when worse) and the best run so far, and
    which module hurts most where the sensitivity ranking has been computed."""
    line = f"{html.escape(result.label)}: output SQNR {result.output_sqnr_db:.2f} dB"
    baseline = next((r for r in history if r.label == "baseline"), None)
    if baseline is not None and baseline is not result:
        delta = result.output_sqnr_db - baseline.output_sqnr_db
        color = "#b00" if delta < -0.05 else "#070" if delta > 0.05 else "#444"
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


def verified_status(verified: VerifiedSuggestions) -> str:
    """One line on what Accept all put in the rows, and what it measured."""
    rejected = len(verified.rejected)
    considered = f"{rejected} more considered and not suggested (each row says why)" if rejected else ""
    if verified.accept_all is None:
        return f"<i>No suggestion helps: {len(verified.verdicts)} candidate(s) measured, none gains enough; {considered}.</i>"
    run = verified.accept_all
    if not run.ok:
        return f"<span style='color:#b00'>Accept all: the trial run failed; {considered}.</span>"
    gain = run.output_sqnr_db - verified.baseline_db
    color = "#b00" if gain < 0 else "#070"
    notes = "".join(f"<br><i>{html.escape(note)}</i>" for note in verified.notes)
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


def _click_sent_at() -> datetime.datetime | None:
    """When the browser sent the message being handled (inside a Jupyter kernel), else None."""
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        sent = kernel.get_parent()["header"]["date"] if kernel is not None else None
        if isinstance(sent, str):
            sent = datetime.datetime.fromisoformat(sent)
    except Exception:  # no kernel, or a kernel without message headers: no check
        return None
    return sent if isinstance(sent, datetime.datetime) else None


def _sqnr_figure():
    import bqplot as bq

    x_scale, y_scale = bq.OrdinalScale(), bq.LinearScale(min=0.0)
    bars = bq.Bars(x=[], y=np.zeros((0, 0), np.float32), scales={"x": x_scale, "y": y_scale}, type="grouped",
                   display_legend=True, labels=[], colors=_SERIES_COLORS[:1], padding=0.15,
                   tooltip=bq.Tooltip(fields=["x", "y"], labels=["layer", "SQNR (dB)"], formats=["", ".1f"]))  # fmt: skip
    # module names are long: rotated ticks with room under them, and no axis title to collide with
    axes = [bq.Axis(scale=x_scale, tick_rotate=-35, tick_style={"font-size": "9px", "text-anchor": "end"}),
            bq.Axis(scale=y_scale, side="left", label="SQNR (dB)", label_offset="40px")]  # fmt: skip
    figure = bq.Figure(
        marks=[bars], axes=axes, title="Per-layer SQNR", legend_location="top-right",
        fig_margin={"top": 50, "bottom": 110, "left": 60, "right": 20}, layout={"width": "100%", "height": "380px"},
    )  # fmt: skip
    return figure, bars, x_scale
