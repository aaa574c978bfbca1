"""The Tune tab: per-module settings rows, Apply, Accept all, the runs; its logic is a TuneController."""

from __future__ import annotations

import datetime
import html
from collections.abc import Mapping
from dataclasses import replace

import ipywidgets as w
import pandas as pd

from ..engines.settings import ModuleSettings, Setting, kept_float
from ..tune.run import RunResult
from ..tune.truth import KERNEL_AGREEMENT_DB
from ..tune.verify import VerifiedSuggestions
from .front import SizeFrontPane
from .plots import scrolling_table
from .protocols import ReportSource, TuningSession
from .rows import SettingsRow, row_parts
from .runs import LayersChart, RunsTable, run_changes
from .sensitivity import SensitivityPane
from .tune_controller import TuneController, error_html

FIXED = {"flex": "0 0 auto"}  # a control beside a status line must not be squeezed
BULK = ("keep float", "per-channel", "reset")


class TuningPanel(w.VBox):
    """Edit settings, Apply them through a tuning session, compare runs.

    The widgets here only show state and forward clicks: ``controller`` (a ``TuneController``)
    decides what runs and what the status says. Without a session the panel shows
    ``unavailable`` (and ``error``) instead of rows.
    """

    def __init__(self, source: ReportSource, session: TuningSession | None, *, unavailable: str = "", error: str = "") -> None:
        self.source, self.session = source, session
        self.status, self.error, self.truth = w.HTML(), w.HTML(), w.HTML()
        measured = "Measure every suggestion first (simulated or a trial run); only those that help are set"
        self.accept = w.Button(
            description="Accept all suggestions", icon="check", tooltip=measured, layout={"width": "190px", **FIXED}
        )
        self.reset = w.Button(description="Reset to default", icon="undo", layout={"width": "150px", **FIXED})
        self.apply = w.Button(description="Apply", icon="play", button_style="primary", layout={"width": "110px", **FIXED})
        self.rotate = w.Checkbox(description="rotated (R1 + R2)", indent=False, layout={"width": "150px", **FIXED})
        if session is None:
            self.controller, self.rows = None, {}
            for button in (self.accept, self.reset, self.apply):
                button.disabled = True
            self.status.value = f"<i>{html.escape(unavailable or 'Live tuning needs a session.')}</i>"
            self.error.value = error_html(error) if error else ""
            super().__init__([self.status, self.error])
            return
        self.controller = controller = TuneController(session, source)
        problems = session.rotation_problems()
        self.rotate.tooltip = (
            "Apply quantizes the float model with orthogonal rotations folded into its weights: the same logits, fewer "
            "outlier channels (residual stream R1, each head's values R2)"
        )
        if problems:  # not a decoder the rotations are written for: no box to tick
            self.rotate.layout.display = "none"
        reasons: dict[str, list[str]] = {}
        for suggestion in source.suggestions():
            reasons.setdefault(suggestion.module_fqn, []).append(f"{suggestion.kind.value}: {suggestion.reason}")
        migrations = {fqn: m.summary for fqn, m in session.migrations().items()}
        # kept with the panel: a shared Layout no row holds any more (an eager row trades the FX controls'
        # layouts for the hidden one) would be garbage-collected, closing a model the page may still resolve
        self._row_parts = parts = row_parts()
        self.rows = {m.fqn: SettingsRow(m, reasons.get(m.fqn, []), migrations.get(m.fqn, ""), parts) for m in session.modules}
        self._order: list[str] = []  # forward order
        self.progress = w.IntProgress(value=0, min=0, max=1, layout={"width": "220px", "visibility": "hidden", **FIXED})
        self.restore_from = w.Dropdown(
            options=[], description="run", layout={"width": "200px", **FIXED}, style={"description_width": "30px"}
        )
        self.restore = w.Button(
            description="Restore its settings", icon="history", disabled=True, layout={"width": "170px", **FIXED}
        )
        self.pin = w.Button(
            description="Pin its model",
            icon="thumb-tack",
            disabled=True,
            layout={"width": "140px", **FIXED},
            tooltip="keep this run's quantized model (session.history[i].quantized_model): the session "
            "keeps only the latest run's and the pinned runs' models",
        )
        self.history = RunsTable()
        self.layers = LayersChart()
        self.summary = w.HTML()
        self.code = w.Textarea(layout={"width": "100%", "height": "160px"})
        self.rows_box = w.VBox(list(self.rows.values()), layout={"max_height": "400px", "overflow": "hidden auto"})
        self.filter = w.Text(placeholder="filter: name or type", layout={"width": "200px", **FIXED})
        self.only_suggested = w.Checkbox(description="with a suggestion", indent=False, layout={"width": "150px", **FIXED})
        ops = sum(not m.weighted for m in session.modules)
        self.all_ops = w.Checkbox(  # PReLU, activations, pooling, norms: rows of their own only when asked for
            description=f"+ {ops} other ops",
            indent=False,
            value=False,
            tooltip="also the quantized ops that are not Linear or Conv (PReLU, activations, pooling, norms): "
            "they can be kept float; a row that is changed or flagged by a run is always shown",
            layout={"width": "150px", **FIXED} if ops else {"display": "none"},
        )
        self.shown = w.HTML(layout=FIXED)
        blocks = {name: members for name, members in session.blocks().items() if len(members) > 1}
        self._blocks = {name: set(members) for name, members in blocks.items()}
        self.block = w.Dropdown(  # a transformer's blocks (model.layers.3), a ResNet's (layer1.0)
            options=[("all blocks", ""), *((f"{name} ({len(members)})", name) for name, members in blocks.items())],
            value="",
            tooltip="only the rows of one block: the buttons on the right then set the block",
            layout={"width": "210px", **FIXED} if blocks else {"display": "none"},
        )
        self.unit = w.ToggleButtons(
            options=[("modules", False), ("blocks", True)],
            value=False,
            tooltips=[
                "rank, propose and find the size front module by module",
                "rank and propose whole blocks kept float; on the size front every module of a block takes the same choice",
            ],
            style={"button_width": "80px"},
            layout=FIXED,
        )
        said = w.HTML("<span style='color:#666'>Sensitivity, Propose and the size front work with</span>", layout=FIXED)
        unit_line = w.HBox(
            [said, self.unit],
            layout={"align_items": "center", "flex_flow": "row wrap", **({} if blocks else {"display": "none"})},
        )
        self.bulk = {
            name: w.Button(description=name, tooltip=f"{name} on every row shown", layout={"width": "110px", **FIXED})
            for name in BULK
        }
        if not any(row.module.allows(Setting.PER_CHANNEL) for row in self.rows.values()):
            self.bulk["per-channel"].layout.display = "none"  # an engine with formats: the format says it
        self.sensitivity = SensitivityPane(controller, self._keep_float, self._order_rows)
        self.front = SizeFrontPane(controller, self._take_point, getattr(session, "eval_fn", None) is not None)
        bulk_label = w.HTML("<span style='color:#666'>on the rows shown:</span>", layout={**FIXED, "margin": "0 4px 0 12px"})
        toolbar = w.HBox(
            [self.filter, self.block, self.only_suggested, self.all_ops, self.shown, bulk_label, *self.bulk.values()],
            layout={"align_items": "center", "flex_flow": "row wrap"},
        )
        # the status line gets the full width under the buttons: measured results take a few lines
        buttons = w.HBox(
            [self.accept, self.reset, self.apply, self.rotate, self.progress, self.restore_from, self.restore, self.pin],
            layout={"align_items": "center", "flex_flow": "row wrap"},
        )
        self.results = w.Accordion(
            children=[self.summary, self.code],
            titles=("Quantization summary of the last run", "These settings as Python, to paste into a pipeline"),
        )
        # the per-layer chart joins after the first run: a bqplot figure laid out in a hidden tab has no size
        super().__init__(
            [
                unit_line,
                self.sensitivity,
                self.front,
                toolbar,
                self.rows_box,
                buttons,
                self.truth,
                self.status,
                self.error,
                self.history,
                self.results,
            ]
        )
        self._wire(controller)
        self._refresh_rows()
        self._show_code()
        if self.session.history:  # runs made in code before the widget was shown: their table (the chart on the next run)
            self.history.show(self.session.compare()[0], run_changes(self.session))
            self._show_restorable(None)

    def _wire(self, controller: TuneController) -> None:
        w.dlink((controller, "status"), (self.status, "value"))
        w.dlink((controller, "error"), (self.error, "value"))
        w.dlink((controller, "truth"), (self.truth, "value"))
        w.link((controller, "by_block"), (self.unit, "value"))
        w.link((controller, "rotate"), (self.rotate, "value"))
        self.rotate.observe(lambda _change: self._show_code(), "value")
        for button in (self.accept, self.reset, self.apply, self.rotate, *self.bulk.values()):
            w.dlink((controller, "busy"), (button, "disabled"))
        w.dlink((controller, "busy"), (self.progress.layout, "visibility"), lambda busy: "visible" if busy else "hidden")
        controller.observe(self._on_progress_change, "progress")
        self.accept.on_click(self._on_accept_click)
        self.reset.on_click(self._on_reset_click)
        self.apply.on_click(self._on_apply_click)
        self.restore.on_click(self._on_restore_click)
        self.pin.on_click(self._on_pin_click)
        self.restore_from.observe(lambda _change: self._show_pin(), "value")
        for name, button in self.bulk.items():
            button.on_click(lambda _b, name=name: self._bulk(name))
        self.filter.observe(self._on_filter_change, "value")
        self.only_suggested.observe(self._on_filter_change, "value")
        self.all_ops.observe(self._on_filter_change, "value")
        self.block.observe(self._on_filter_change, "value")

    def settings(self) -> dict[str, ModuleSettings]:
        """Every row's settings."""
        return {fqn: row.settings for fqn, row in self.rows.items()}

    # ---- handlers ------------------------------------------------------------------------------
    def _on_apply_click(self, _button: w.Button) -> None:
        result = self.controller.apply(self.settings(), _click_sent_at())
        if result is None:
            return
        if result.ok:  # a setting the engine accepted but did not carry out, or a kernel that misbehaved, on its row
            for fqn, row in self.rows.items():
                row.run_note = result.module_notes.get(fqn, "")
            if self._flagged_hidden():
                self._refresh_rows()
        self._show_runs(result if result.ok else None)

    def _on_accept_click(self, _button: w.Button) -> None:
        verified = self.controller.accept_all()
        if verified is not None:
            self._show_verified(verified)

    def _on_reset_click(self, _button: w.Button) -> None:
        self._set_all(self.session.current_settings())

    def _on_restore_click(self, _button: w.Button) -> None:
        """Put an earlier run's settings back in the rows (Apply runs them again)."""
        settings = self.controller.restore(self.restore_from.value)
        if settings is not None:
            self._set_all(settings)

    def _on_pin_click(self, _button: w.Button) -> None:
        self.controller.pin(self.restore_from.value)
        self._show_runs(None)

    def _show_pin(self) -> None:
        can, pinned = self.controller.pin_state(self.restore_from.value)
        self.pin.description = "Unpin its model" if pinned else "Pin its model"
        self.pin.disabled = not can

    def _on_filter_change(self, _change: dict) -> None:
        self._refresh_rows()

    def _on_progress_change(self, change: dict) -> None:
        done, total = change["new"]
        with self.progress.hold_sync():  # the maximum first: a value above the old one would be clipped
            self.progress.max = total
            self.progress.value = done

    # ---- rows ----------------------------------------------------------------------------------
    def _keep_float(self, names: list[str]) -> None:
        """Keep exactly ``names`` float (the other rows keep their other choices)."""
        chosen, start = set(names), self.session.current_settings()
        with self.hold_sync():
            for fqn, row in self.rows.items():
                row.settings = kept_float(row.settings, fqn in chosen, start[fqn])
        self._show_code()

    def _take_point(self, settings: Mapping[str, ModuleSettings]) -> None:
        """A size front point's settings in the rows (the modules it does not name as they start)."""
        self._set_all({**self.session.current_settings(), **settings})

    def _order_rows(self, order: list[str]) -> None:
        """Rows in ``order`` (names not in it follow in forward order); an empty order is forward order."""
        self._order = list(order)
        self._refresh_rows()

    def focus(self, fqn: str) -> bool:
        """Put ``fqn``'s row first among the rows shown, highlighted, widening the filters that hide
        it; False when the module has no row (the session does not tune it)."""
        row = self.rows.get(fqn)
        if row is None:
            return False
        with self.hold_sync():
            if self.filter.value.strip() and not row.matches(self.filter.value.strip()):
                self.filter.value = ""
            if self.only_suggested.value and not row.suggested:
                self.only_suggested.value = False
            if self.block.value and fqn not in self._blocks[self.block.value]:
                self.block.value = ""
            if not row.module.weighted:
                self.all_ops.value = True
            for other in self.rows.values():  # one picked row: only the ones that change are redrawn
                other.picked = other is row
            self._order_rows([fqn, *[name for name in self._order if name != fqn]])
        return True

    def _visible_rows(self) -> list[SettingsRow]:
        ranked = [self.rows[name] for name in self._order if name in self.rows]
        ordered = ranked + [row for name, row in self.rows.items() if name not in set(self._order)]
        text, only = self.filter.value.strip(), self.only_suggested.value
        start = self.session.current_settings()
        block = self._blocks.get(self.block.value)
        return [
            row
            for row in ordered
            if (not text or row.matches(text))
            and (block is None or row.fqn in block)
            and (not only or row.suggested)
            and (row.module.weighted or self.all_ops.value or _flagged(row, start))
        ]

    def _flagged_hidden(self) -> bool:
        """Whether a row now flagged is not among the rows shown."""
        shown = set(self.rows_box.children)
        return any(row not in shown and row.run_note for row in self.rows.values())

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
                    row.settings = replace(row.settings, keep_float=True)
                elif action == "per-channel" and row.module.allows(Setting.PER_CHANNEL):
                    row.settings = replace(row.settings, per_channel=True)
                elif action == "reset":
                    row.settings = start[row.fqn]
        self._show_code()

    def _set_all(self, settings: dict[str, ModuleSettings]) -> None:
        with self.hold_sync():
            for fqn, row in self.rows.items():
                row.settings = settings.get(fqn, ModuleSettings())
        self._show_code()

    def _show_verified(self, verified: VerifiedSuggestions) -> None:
        self._set_all(verified.settings)
        offered = {v.candidate.module_fqn for v in verified.offered}
        for fqn, texts in verified.reasons().items():
            if fqn in self.rows:
                self.rows[fqn].set_reasons(texts, fqn in offered)
        self._refresh_rows()

    # ---- results -------------------------------------------------------------------------------
    def _show_code(self) -> None:
        self.code.value = self.controller.code(self.settings())

    def _show_restorable(self, latest: RunResult | None) -> None:
        """The runs whose settings can be restored; a new run is chosen, otherwise (a pin) the run chosen stays."""
        restorable, chosen = self.controller.restorable(), self.restore_from.value
        self.restore_from.options = restorable
        self.restore_from.value = chosen if latest is None and chosen in restorable else (restorable[-1] if restorable else None)
        self.restore.disabled = not restorable
        self._show_pin()

    def _show_runs(self, latest: RunResult | None) -> None:
        runs, layers = self.session.compare()
        with self.hold_sync():
            self.history.show(runs, run_changes(self.session))
            self.layers.draw(layers, _kernels_apart(self.session.history))
            self.front.show_runs()
            self._show_restorable(latest)
            if self.layers not in self.children:
                self.children = (*self.children[:-1], self.layers, self.children[-1])  # above the summary
            if latest is not None:
                tables = latest.summary.to_html(index=False, border=0) + latest.conversions.to_html(index=False, border=0)
                self.summary.value = scrolling_table(tables)
                self._show_code()


def _flagged(row: SettingsRow, start: dict[str, ModuleSettings]) -> bool:
    """An op's row shown without "other ops": changed from the start, or noted by the last run."""
    return row.settings != start.get(row.fqn) or bool(row.run_note)


def _kernels_apart(history: list[RunResult]) -> pd.Series | None:
    """The kernel check of the latest run whose quantized kernels differ from their reference:
    only the disagreeing modules (None when no run found one)."""
    for run in reversed(history):
        apart = run.kernel_sqnr_db[run.kernel_sqnr_db < KERNEL_AGREEMENT_DB]
        if len(apart):
            return apart.rename(f"kernel check ({run.label})")
    return None


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
