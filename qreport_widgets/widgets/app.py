"""ReportWidget: the report as one ipywidget (header, Explore / Tune / Graph / Model / Reports tabs)."""

from __future__ import annotations

import html

import ipywidgets as w
import pandas as pd

from .controls import ExploreControls
from .graph_view import GraphPane
from .protocols import ReportSource, TuningSession
from .tune_controller import error_html
from .tuning import TuningPanel
from .views import ExploreViews, ModuleCard

TABS = ("Explore", "Tune", "Graph", "Model", "Reports")


class ReportWidget(w.VBox):
    """Built once from a report source; every selection updates the views in place.

    Args:
        source: what to show (an ``Analysis``: ``report.analysis()`` or a loaded report).
        session: runs tuning (the Tune tab); without one the tab says why (``tuning_unavailable``,
            with ``tuning_error`` in red when building a session failed).
    """

    def __init__(
        self,
        source: ReportSource,
        session: TuningSession | None = None,
        *,
        tuning_unavailable: str = "",
        tuning_error: str = "",
    ) -> None:
        self.source = source
        self.frame = source.frame()
        self.header = w.HTML(self._header_html())
        self.controls = ExploreControls(self.frame)
        self.views = ExploreViews(self.frame)
        self.card = ModuleCard(self.frame)
        self.views.layout.flex, self.views.layout.min_width = "1 1 0%", "480px"  # its own Layout, not a new one
        # the card goes under the figure when the tab is too narrow for both side by side
        explore = w.VBox([self.controls, w.HBox([self.views, self.card], layout={"width": "100%", "flex_flow": "row wrap"})])
        self.tuning = TuningPanel(source, session, unavailable=tuning_unavailable, error=tuning_error)
        self.graph = GraphPane(source, session, on_pick=self._on_graph_pick, hidden=True)
        panes = [explore, self.tuning, self.graph, w.HTML(self._model_html()), self._reports_accordion()]
        self.tabs = w.Tab(children=panes, titles=TABS)
        self.session = session
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in source.model_name) or "model"
        self.export_path = w.Text(
            value=f"{name}-qreport.html",
            layout={"width": "260px", "flex": "0 0 auto"},
            tooltip="where the HTML report is written (relative to the notebook's folder)",
        )
        self.export = w.Button(
            description="Export HTML",
            icon="download",
            layout={"width": "130px", "flex": "0 0 auto"},
            tooltip="one HTML file that opens in any browser, offline, with no Python: the report, "
            "its figures, the graph, the runs and the settings as code",
        )
        self.exported = w.HTML()
        bar = w.HBox(
            [self.header, self.export_path, self.export, self.exported], layout={"align_items": "center", "flex_flow": "row wrap"}
        )
        super().__init__([bar, self.tabs])
        self.export.on_click(self._on_export_click)
        self.controls.observe(self._on_selection_change, names="selection")
        self.tabs.observe(self._on_tab_change, names="selected_index")
        self._refresh()

    # ---- handlers ------------------------------------------------------------------------------
    def _on_selection_change(self, change: dict) -> None:
        self._refresh()

    def _on_export_click(self, _button: w.Button) -> None:
        from .html_export import page_size, write_html

        self.export.disabled = True
        self.exported.value = "<i>writing…</i>"
        try:
            path = write_html(self.source, self.export_path.value.strip(), self.session)
        except Exception as error:  # shown where the user clicked; the widget stays as it was
            self.exported.value = error_html(f"Export failed: {type(error).__name__}: {error}", block=False)
        else:
            self.exported.value = f"Wrote <code>{html.escape(str(path))}</code> ({page_size(path)})"
        finally:
            self.export.disabled = False

    def _on_tab_change(self, change: dict) -> None:
        if change["new"] == TABS.index("Graph"):
            self.graph.show()  # runs made and sensitivity computed since it was last shown

    def _on_graph_pick(self, fqn: str) -> str:
        """A module clicked in the Graph tab: selected in Explore, first among the Tune rows."""
        said = ["Selected in Explore." if self.controls.show_module(fqn) else "No detector measured it (Explore)."]
        if self.tuning.rows:
            said.append("First in the Tune rows." if self.tuning.focus(fqn) else "Not among the modules tuned.")
        return " ".join(said)

    def _refresh(self) -> None:
        selection = self.controls.selection
        with self.hold_sync():
            self.card.show(selection.module)
            if selection.feature is None:
                self.views.message.value = "<i>This module reports no plottable feature.</i>"
                return
            self.views.show(selection.module, selection.feature, selection.view, selection.prefix)

    # ---- static panes --------------------------------------------------------------------------
    def _header_html(self) -> str:
        source, frame = self.source, self.frame
        kinds = frame.suggestions["kind"].value_counts()
        detail = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        parts = [
            f"<b>qreport</b> · {html.escape(source.model_name)}"
            + (f" (saved {html.escape(source.saved_at)})" if source.saved_at else ""),
            _count(len(source.detectors), "detector"),
            _count(source.batches, "calibration batch", "calibration batches"),
            _count(len(frame.suggestions), "suggestion") + (f" ({detail})" if detail else ""),
        ]
        return "<div style='font-size:14px;padding:4px 0'>" + " · ".join(parts) + "</div>"

    def _model_html(self) -> str:
        graph = self.source.graph
        ops = pd.DataFrame(list(graph.op_counts().items()), columns=["graph op", "nodes"])
        layers = pd.DataFrame(list(graph.layer_type_counts().items()), columns=["layer type", "modules"])
        skipped = pd.DataFrame(list(graph.skipped.items()), columns=["not observed", "why"])
        if graph.kind == "modules":  # a model run eagerly: its module tree, no graph
            ops.columns = ["observed by hooks", "count"]
            units = pd.DataFrame(list(graph.units.items()), columns=["module", "type"])
            tables = [
                ("Modules as the forward pass calls them (observed by hooks; no graph)", ops),
                ("Layer types", layers),
                ("Leaf modules in call order", units),
            ]
        else:
            tables = [("Graph nodes (prepare_fx or torch.export, as the report observed it)", ops), ("Layer types", layers)]
        if len(skipped):
            tables.append(("Modules not observed", skipped))
        return "".join(f"<h4>{t}</h4>{df.to_html(index=False, border=0)}" for t, df in tables)

    def _reports_accordion(self) -> w.Accordion:
        texts = self.source.text_reports()
        children = [w.HTML(f"<pre style='white-space:pre-wrap'>{html.escape(text)}</pre>") for text in texts.values()]
        accordion = w.Accordion(children=children, selected_index=None)  # collapsed: the titles are the summary
        counts: dict[str, int] = {}
        for suggestion in self.source.suggestions():
            counts[suggestion.detector] = counts.get(suggestion.detector, 0) + 1
        for i, (name, text) in enumerate(texts.items()):
            lines = len(text.splitlines())
            accordion.set_title(i, f"{name} · {_count(counts.get(name, 0), 'suggestion')} · {_count(lines, 'line')}")
        return accordion


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
