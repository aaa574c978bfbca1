"""ReportWidget: the report as one ipywidget (header, Explore / Model / Reports tabs)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as w
import pandas as pd

from ..storage import SavedReport
from .controls import ExploreControls
from .tuning import TuningPanel
from .views import ExploreViews, ModuleCard, View

if TYPE_CHECKING:
    from ..report import ModelReport


class ReportWidget(w.VBox):
    """Built once from a generated report; every selection updates the views in place."""

    def __init__(self, report: ModelReport | SavedReport) -> None:
        self.report = report
        self.frame = report.frame()
        self.header = w.HTML(self._header_html())
        self.controls = ExploreControls(self.frame)
        self.views = ExploreViews(self.frame)
        self.card = ModuleCard(self.frame)
        self.views.layout = w.Layout(flex="1 1 0%", min_width="480px")
        explore = w.VBox([self.controls, w.HBox([self.views, self.card], layout={"width": "100%"})])
        self.tuning = TuningPanel(report) if not isinstance(report, SavedReport) else _saved_report_note(report)
        self.tabs = w.Tab(children=[explore, self.tuning, w.HTML(self._model_html()), self._reports_accordion()])
        for i, title in enumerate(("Explore", "Tune", "Model", "Reports")):
            self.tabs.set_title(i, title)
        super().__init__([self.header, self.tabs])
        self.controls.module.observe(self._on_module_change, names="value")
        self.controls.feature.observe(self._on_selection_change, names="value")
        self.controls.view.observe(self._on_selection_change, names="value")
        self.controls.prefix.observe(self._on_selection_change, names="value")
        self._refresh()

    # ---- handlers ------------------------------------------------------------------------------
    def _on_module_change(self, change: dict) -> None:
        with self.hold_sync():
            self.controls.refresh_features()
            self._refresh()

    def _on_selection_change(self, change: dict) -> None:
        if not self.controls.changing:
            self._refresh()

    def _refresh(self) -> None:
        module, feature = self.controls.module.value, self.controls.feature.value
        self.card.show(module)
        if feature is None:
            self.views.message.value = "<i>This module reports no plottable feature.</i>"
            return
        self.views.show(module, feature, View(self.controls.view.value), self.controls.prefix.value)

    # ---- static panes --------------------------------------------------------------------------
    def _header_html(self) -> str:
        report, frame = self.report, self.frame
        model = report.model_name
        saved = isinstance(report, SavedReport)
        batches = report.calibration_batches()
        kinds = frame.suggestions["kind"].value_counts()
        detail = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        parts = [
            f"<b>qreport</b> · {html.escape(model)}" + (f" (saved {html.escape(report.saved_at)})" if saved else ""),
            _count(len(report.detectors), "detector"),
            _count(batches, "calibration batch", "calibration batches"),
            _count(len(frame.suggestions), "suggestion") + (f" ({detail})" if detail else ""),
        ]
        return "<div style='font-size:14px;padding:4px 0'>" + " · ".join(parts) + "</div>"

    def _model_html(self) -> str:
        graph = self.report.graph
        ops = pd.DataFrame(list(graph.op_counts().items()), columns=["FX op", "nodes"])
        layers = pd.DataFrame(list(graph.layer_type_counts().items()), columns=["layer type", "modules"])
        skipped = pd.DataFrame(list(graph.skipped.items()), columns=["not observed", "why"])
        tables = [("Graph (as prepare_fx built it)", ops), ("Layer types", layers)]
        if len(skipped):
            tables.append(("Modules without their own graph node", skipped))
        return "".join(f"<h4>{t}</h4>{df.to_html(index=False, border=0)}" for t, df in tables)

    def _reports_accordion(self) -> w.Accordion:
        texts = self.report.text_reports()
        children = [w.HTML(f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre>") for text in texts.values()]
        accordion = w.Accordion(children=children)
        for i, name in enumerate(texts):
            accordion.set_title(i, name)
        return accordion


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _saved_report_note(report: SavedReport) -> w.HTML:
    return w.HTML(
        f"<p><i>This report was opened from {html.escape(str(report.source or 'a file'))}. Trying other "
        "quantization settings needs the float model and calibration data, which a report file does not hold: "
        "run qreport_widgets.analyze(model, example_inputs, calibration_data) to tune live.</i></p>"
    )
