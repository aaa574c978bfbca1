"""The report as one HTML file that opens in a browser with no network and no kernel.

Text (the header, the detectors' reports and suggestions, the runs, sensitivity, settings as code)
is plain HTML. Figures are the widget's own bqplot figures, embedded as widget state and drawn in
the page by the Jupyter widgets HTML manager; they keep their tooltips, but nothing in them calls
back into Python (bqplot's pan and zoom are left out: their layer takes the pointer, and the
tooltips would be lost; the browser's own zoom works). The page carries every script it runs: RequireJS and
the HTML manager (vendored in ``static/``, see ``static/LICENSES.md``), and bqplot's and
bqscales' own JavaScript from their installed wheels, each gzipped and base64-encoded and unpacked
in the browser by a few lines of this page's script (``DecompressionStream``).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import gzip
import html
import json
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import comm
import ipywidgets as w
import pandas as pd
from comm.base_comm import BaseComm
from ipywidgets.embed import dependency_state, embed_data
from jupyter_core.paths import jupyter_path

from .._version import __version__
from ..core import features as F
from ..errors import QReportError
from ..observe.frame import MODULE
from .controls import feature_options, preferred_feature
from .graph_view import GraphPane
from .protocols import ReportSource, TuningSession
from .runs import LayersChart, RunsTable, number, run_changes
from .views import ExploreViews, View

MAX_MODULE_FIGURES = 60  # flagged modules drawn; the rest are named
WIDGET_MODULES = ("bqplot", "bqscales")  # the widget packages whose JavaScript the page carries

_UNPACK = """(async function () {
  // the widget manager's style sheets name Font Awesome's font files, which this page does not
  // carry: the browser would ask for them (and fail). Their @font-face rules are dropped as the
  // sheets arrive; icons (only in the figures' hidden toolbars) are not drawn.
  new MutationObserver(records => {
    for (const record of records)
      for (const node of record.addedNodes)
        if (node.tagName === 'STYLE' && node.textContent.includes('@font-face'))
          node.textContent = node.textContent.replace(/@font-face\\s*{[^}]*}/g, '');
  }).observe(document.head, {childList: true});
  const note = document.getElementById('qreport-figures-note');
  try {
    if (!('DecompressionStream' in window))
      throw new Error('this browser cannot unpack them (no DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 can)');
    for (const packed of document.querySelectorAll('script[type="application/x-qreport-script"]')) {
      const bytes = Uint8Array.from(atob(packed.textContent.trim()), c => c.charCodeAt(0));
      let text = await new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'))).text();
      const name = packed.dataset.module;
      if (name)  // an AMD bundle that defines itself without a name: give it its package's
        text = '(function (define) {\\n' + text + '\\n})(Object.assign(function (deps, factory) { return window.define('
          + JSON.stringify(name) + ', deps, factory); }, {amd: window.define.amd}));';
      const script = document.createElement('script');
      script.textContent = text;
      document.head.appendChild(script);
    }
    note.remove();
  } catch (error) {
    note.textContent = 'The figures could not be drawn: ' + error.message;
  }
})();"""

_STYLE = """
body { font-family: -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif; font-size: 14px; color: #222;
       margin: 0 auto; padding: 12px 20px 40px; max-width: 1280px; }
h1 { font-size: 20px; margin: 8px 0 2px; } h2 { font-size: 17px; margin: 28px 0 6px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin: 16px 0 4px; } .muted { color: #666; } .note { color: #a60; }
table { border-collapse: collapse; font-size: 13px; } th, td { padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
.scroll { overflow-x: auto; max-width: 100%; } .tall { max-height: 480px; overflow: auto; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; white-space: pre-wrap; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 12px; }
.figure { border: 1px solid #e3e3e3; padding: 4px; min-width: 0; } summary { cursor: pointer; font-weight: 600; }
"""


def write_html(source: ReportSource, path: str | os.PathLike, session: TuningSession | None = None) -> Path:
    """Write ``source`` (and ``session``'s runs and computed diagnoses, when given) to ``path``."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"{path}: an HTML report's name ends in .html")
    with _unsent_widgets():
        text = _Page(source, session).render()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path


class _UnsentComm(BaseComm):
    """A widget's comm that sends nothing: the page's widgets exist only to give it their state."""

    made: list[_UnsentComm] | None = None
    owner: w.Widget | None = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if _UnsentComm.made is not None:
            _UnsentComm.made.append(self)

    def publish_msg(self, msg_type: str, data=None, metadata=None, buffers=None, **keys) -> None:
        return None

    def on_msg(self, callback) -> None:
        self.owner = getattr(callback, "__self__", None)  # the widget this comm carries
        super().on_msg(callback)


@contextlib.contextmanager
def _unsent_widgets() -> Iterator[None]:
    """The widgets made inside are never sent to a notebook's browser (writing a page from the
    Export button would otherwise open a model there for each of the page's hundreds of widgets)
    and are closed at the end."""
    made: list[_UnsentComm] = []
    create, _UnsentComm.made = comm.create_comm, made
    comm.create_comm = _UnsentComm
    try:
        yield
    finally:
        comm.create_comm, _UnsentComm.made = create, None
        for carried in made:
            if carried.owner is not None:
                carried.owner.close()


class _Page:
    def __init__(self, source: ReportSource, session: TuningSession | None) -> None:
        self.source, self.session, self.frame = source, session, source.frame()
        self.views: list[w.Widget] = []

    def embed(self, widget: w.Widget, css: str = "figure") -> str:
        """A place in the page where ``widget`` is drawn."""
        self.views.append(widget)
        spec = json.dumps(widget.get_view_spec())
        return f"<div class='{css}'><script type='application/vnd.jupyter.widget-view+json'>{spec}</script></div>"

    def render(self) -> str:
        body = [
            self._header(),
            self._graph(),
            self._detectors(),
            self._modules(),
            self._runs(),
            self._diagnoses(),
        ]
        state = embed_data(views=self.views, state=dependency_state(self.views, drop_defaults=True), drop_defaults=True)
        title = html.escape(f"qreport · {self.source.model_name}")
        return "\n".join(
            [
                "<!DOCTYPE html>",
                "<html lang='en'><head><meta charset='utf-8'>",
                f"<meta name='generator' content='qreport_widgets {__version__}'><title>{title}</title>",
                f"<style>{_STYLE}</style>",
                "<script type='application/vnd.jupyter.widget-state+json'>" + _script_json(state["manager_state"]) + "</script>",
                "</head><body>",
                "<p id='qreport-figures-note' class='muted'>Drawing the figures…</p>",
                *body,
                *_scripts(),
                f"<script>{_UNPACK}</script>",
                "</body></html>",
            ]
        )

    # ---- sections ------------------------------------------------------------------------------
    def _header(self) -> str:
        source, frame = self.source, self.frame
        saved = f" · saved {html.escape(source.saved_at)}" if source.saved_at else ""
        written = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        facts = [
            f"{len(source.detectors)} detectors ({html.escape(', '.join(source.detectors))})",
            f"{source.batches} calibration batches",
            f"{len(frame.module_names)} modules",
            f"{len(frame.suggestions)} suggestions",
        ]
        return (
            f"<h1>qreport · {html.escape(source.model_name)}</h1>"
            f"<div class='muted'>{' · '.join(facts)}{saved} · written {written} by qreport_widgets {__version__}</div>"
        )

    def _graph(self) -> str:
        pane = GraphPane(self.source, self.session, clickable=False)
        return (
            "<h2>Graph</h2>"
            f"<div class='muted'>{pane.folding.value}. {pane.key.value}. "
            "Hover a node for its name, type and value.</div>" + self.embed(pane.canvas, "graph")
        )

    def _detectors(self) -> str:
        parts = ["<h2>Detectors</h2>"]
        table = self.frame.suggestions
        for name, text in self.source.text_reports().items():
            mine = table[table["detector"] == name]
            rows = mine[[MODULE, "kind", "reason"]]
            parts.append(f"<h3>{html.escape(name)} · {len(mine)} suggestions</h3>")
            if len(mine):
                parts.append(_table(rows, tall=True))
            parts.append(f"<details><summary>Its report</summary><pre>{html.escape(text)}</pre></details>")
        return "".join(parts)

    def _modules(self) -> str:
        frame = self.frame
        flagged = list(dict.fromkeys(frame.suggestions[MODULE]))
        if not flagged:
            return "<h2>Flagged modules</h2><p class='muted'>No detector flagged a module.</p>"
        shown = [m for m in flagged if m in frame.modules.index][:MAX_MODULE_FIGURES]
        figures = []
        for module in shown:
            offered = [value for _, value in feature_options(frame, module)]
            detectors = set(frame.suggestions[frame.suggestions[MODULE] == module]["detector"])
            feature = (
                F.OUTLIER_RATIOS
                if F.OUTLIER_RATIOS in offered and F.DetectorName.OUTLIER.value in detectors
                else preferred_feature(offered)
            )
            if feature is None:
                continue
            views = ExploreViews(frame)
            views.show(module, feature, View.POINTS)
            views.line.figure.layout.width = "100%"
            views.line.figure.display_toolbar = False  # its icons need a font the page does not carry
            figures.append(self.embed(views))
        left = len(flagged) - len(shown)
        more = f"<p class='muted'>{left} more flagged modules are in the tables above.</p>" if left > 0 else ""
        return (
            f"<h2>Flagged modules ({len(flagged)})</h2><p class='muted'>Each module's per-channel view of what it was "
            "flagged for, as the Explore tab draws it (red: the channels flagged).</p>"
            f"<div class='figures'>{''.join(figures)}</div>{more}"
        )

    def _runs(self) -> str:
        session = self.session
        if session is None:
            return ""
        if not session.history:
            return "<h2>Runs</h2><p class='muted'>No run yet (the Tune tab's Apply, or session.apply()).</p>"
        runs, layers = session.compare()
        table = RunsTable()
        table.show(runs, run_changes(session))
        chart = LayersChart()
        chart.draw(layers)
        chart.figure.display_toolbar = False
        latest = next((run for run in reversed(session.history) if run.settings is not None), None)
        latest_code = session.settings_as_code(latest.settings) if latest is not None and latest.settings is not None else ""
        code = []
        for i, run in enumerate(session.history):
            if run.settings is not None:
                as_code = session.settings_as_code(run.settings)
                code.append(
                    f"<details><summary>run {i} · {html.escape(run.label)}: its settings as Python</summary>"
                    f"<pre>{html.escape(as_code)}</pre></details>"
                )
        per_layer = layers.copy()
        per_layer.index.name = "layer"
        return (
            f"<h2>Runs ({len(session.history)})</h2>"
            + table.value
            + chart.legend.value
            + self.embed(chart.figure, "figure wide")
            + "<details><summary>Per-layer SQNR of every run (dB)</summary>"
            + _table(per_layer.reset_index(), tall=True)
            + "</details>"
            + "".join(code)
            + (f"<h3>Settings of the latest run, as Python</h3><pre>{html.escape(latest_code)}</pre>" if latest_code else "")
        )

    def _diagnoses(self) -> str:
        if self.session is None:
            return ""
        computed = self.session.computed()
        parts = []
        titles = {
            "sensitivity": "Sensitivity: output SQNR gained when each module alone stays float (simulated)",
            "tradeoff": "Trade-off: the most harmful modules kept float one after the other (simulated)",
            "size_front": "Size front: deployed size against simulated output SQNR",
        }
        for name, title in titles.items():
            table = computed.get(name)
            if table is None:
                continue
            shown = table.drop(columns=[c for c in ("settings",) if c in table]).reset_index()
            parts.append(f"<h3>{html.escape(title)}</h3>" + _table(shown, tall=True))
        if not parts:
            return ""
        return "<h2>Diagnoses</h2>" + "".join(parts)


def _table(table: pd.DataFrame, tall: bool = False) -> str:
    body = table.to_html(index=False, border=0, float_format=number, na_rep="–")
    return f"<div class='scroll{' tall' if tall else ''}'>{body}</div>"


def _script_json(value: object) -> str:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


def _scripts() -> list[str]:
    """The packed scripts, in the order they run: RequireJS, the widget packages (named AMD
    modules), then the HTML manager, which draws the widgets as soon as it is defined."""
    return [
        _packed(_vendored("require.js.gz")),
        *(_packed(_installed(name), name) for name in WIDGET_MODULES),
        _packed(_vendored("embed-amd.js.gz")),
    ]


def _packed(gzipped: bytes, module: str = "") -> str:
    named = f" data-module='{module}'" if module else ""
    return f"<script type='application/x-qreport-script'{named}>{base64.b64encode(gzipped).decode()}</script>"


@functools.cache
def _vendored(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


@functools.cache
def _installed(package: str) -> bytes:
    """``package``'s notebook JavaScript as its wheel installed it, gzipped."""
    for folder in jupyter_path("nbextensions"):
        found = Path(folder) / package / "index.js"
        if found.is_file():
            text = found.read_text(encoding="utf-8")
            text = "\n".join(line for line in text.splitlines() if not line.startswith("//# sourceMappingURL="))
            return gzip.compress(text.encode(), compresslevel=9, mtime=0)
    raise QReportError(
        f"{package}'s JavaScript (nbextensions/{package}/index.js) is not installed where Jupyter looks "
        f"({', '.join(jupyter_path('nbextensions'))}); reinstall it: pip install --force-reinstall {package}"
    )


def page_size(path: str | os.PathLike) -> str:
    size = Path(path).stat().st_size
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} KB"
