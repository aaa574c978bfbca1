"""The quickstart in JupyterLab in headless Chromium: pick a module, double-click Apply, see one new run.

Needs Debian's chromium (``apt-get install -y chromium``); ``.ci/run`` installs it, and under CI
a missing Chromium fails the test. Elsewhere the test reports itself as not run, with the command.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from layout import layout_problems

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "01_quickstart.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
]
SCREENSHOTS = Path(os.environ.get("QREPORT_SCREENSHOTS", ROOT / ".browser-screenshots"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        message = "NOT RUN: Chromium is missing; install it with `apt-get install -y chromium` (not `playwright install`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    tmp = tmp_path_factory.mktemp("lab")
    for name, values in {
        "docmanager-extension/plugin": {"autosave": False},
        "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    }.items():
        path = tmp / "settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = _free_port()
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"))
    command = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--port-retries=0",
        "--allow-root",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={ROOT / 'notebooks'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={tmp / 'settings'}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(base + "/api/status", timeout=2):
                    break
            except OSError:
                time.sleep(0.25)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=30)


def _shut_down_kernels(lab: str) -> None:
    """End every kernel an earlier test left: a notebook opened again would reconnect to its kernel,
    whose hundreds of widgets the new page's manager restores while the cells make new ones (the
    54-layer notebook then failed now and then with "widget model not found" or a tab that never drew)."""
    cookies = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(cookies))
    opener.open(f"{lab}/lab", timeout=60).close()  # sets the _xsrf cookie the server asks of a DELETE
    xsrf = next((cookie.value for cookie in cookies if cookie.name == "_xsrf"), "")
    with opener.open(f"{lab}/api/sessions", timeout=10) as answer:
        sessions = json.load(answer)
    for session in sessions:
        request = urllib.request.Request(f"{lab}/api/sessions/{session['id']}", method="DELETE", headers={"X-XSRFToken": xsrf})
        opener.open(request, timeout=30).close()


def _open(page, lab: str, notebook: str) -> None:
    """Open one notebook on a fresh kernel in a fresh workspace (an earlier test's notebook is not
    restored beside it) and wait until it is the current panel and its kernel is connected and idle:
    widgets a kernel creates before the page's widget manager listens are lost ("model not found")."""
    _shut_down_kernels(lab)
    page.goto(f"{lab}/lab/tree/{notebook}?reset", timeout=120_000)
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    page.wait_for_function(
        """(notebook) => {
            const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const path = panel && panel.context && panel.context.path;
            const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
            const ready = kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
            return path && path.endsWith(notebook) && ready;
        }""",
        arg=notebook,
        timeout=120_000,
    )
    page.wait_for_timeout(1000)


def _wait_for_widget(page, name: str, console_errors: list[str], timeout_ms: int = 180_000):
    widget = page.locator(".jp-OutputArea-output .widget-tab").first
    try:
        widget.wait_for(timeout=timeout_ms)
    except Exception:
        page.screenshot(path=str(SCREENSHOTS / f"{name}_no_widget.png"), full_page=False)
        raise AssertionError(f"no widget; console errors: {console_errors}") from None
    return widget


def _assert_bars_drawn(widget, title: str = "Per-layer SQNR") -> None:
    """The chart's bars have heights (grouped bqplot bars without a y range draw flat)."""
    chart = widget.locator(".bqplot", has_text=title).first
    chart.wait_for(timeout=60_000)
    heights = chart.locator("rect.bar").evaluate_all("els => els.map(e => e.getBBox().height)")
    assert heights and sum(h > 1 for h in heights) >= len(heights) // 2, heights


def _error_widgets(page) -> list[str]:
    """What each of JupyterLab's error widgets on the page says once clicked open (the failed model,
    its module and the JavaScript error), so a failure names the widget it is about."""
    errors = page.locator(".jupyter-widgets-error-widget")
    if errors.count() == 0:
        return []
    errors.evaluate_all("els => els.forEach(e => e.click())")
    page.wait_for_timeout(300)
    where = "e => (e.parentElement.closest('.widget-box, .widget-tab') || e).className"
    return errors.evaluate_all(f"els => els.map(e => `in ${{({where})(e)}}: ${{e.innerText.slice(0, 800)}}`)")


def _assert_looks_right(widget) -> None:
    """Nothing clipped, no axis title over its ticks, no table cut, no widgets drawn over each other."""
    assert layout_problems(widget) == {}


def _assert_nothing_spills(widget) -> None:
    """No widget in the tab is wider than the tab (what scrolls must scroll, nothing is cut at the edge)."""
    controls = ".widget-button, .widget-toggle-buttons, .widget-dropdown, .widget-checkbox, .bqplot"
    spilled = widget.evaluate(
        """(root, controls) => {
            const edge = root.getBoundingClientRect().right + 1;
            return [...root.querySelectorAll(controls)]
                .filter(e => e.offsetParent !== null && e.getBoundingClientRect().right > edge)
                .map(e => (e.innerText || e.className).slice(0, 40));
        }""",
        controls,
    )
    assert not spilled, spilled


@contextlib.contextmanager
def _notebook_ran(lab: str, notebook: str, name: str, width: int = 1400, widget_timeout_ms: int = 180_000):
    """``notebook`` open in JupyterLab in Chromium with every cell run: (page, its widget, the
    console errors so far). The browser closes at the end, and no console error may be left."""
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    console_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": width, "height": 1100})
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        _open(page, lab, notebook)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        yield page, _wait_for_widget(page, name, console_errors, widget_timeout_ms), console_errors
        raised = _cells_that_raised(page)
        browser.close()
    assert not [e for e in console_errors if "favicon" not in e], console_errors
    assert raised == [], raised


# Every code cell of the open notebook has run (or a cell raised, which stops Run All); then what
# each cell that raised, or never ran, says. The notebooks run here are not run again by nbval.
_CELLS_DONE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [...Array(panel.content.model.cells.length).keys()].map(i => panel.content.model.cells.get(i));
  const code = cells.filter(c => c.type === 'code');
  const raised = code.some(c => c.outputs.toJSON().some(o => o.output_type === 'error'));
  return kernel && kernel.status === 'idle' && (raised || code.every(c => c.executionCount !== null));
}"""
_CELLS_RAISED = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  const found = [];
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    if (cell.executionCount === null) found.push(`cell ${i}: did not run`);
    for (const o of cell.outputs.toJSON())
      if (o.output_type === 'error') found.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
  }
  return found;
}"""


def _cells_that_raised(page) -> list[str]:
    page.wait_for_function(_CELLS_DONE, timeout=300_000)
    return page.evaluate(_CELLS_RAISED)


# the 54-layer notebook's widget (1,645 widget models) draws in about 15 s: its checks wait half as
# long as the others for it
WIDGET_54_MS = 90_000
# Accept all on the 54-layer model measures its candidates (sensitivity, the truth check, eight real
# runs: 30 s alone on two cores, from 25 to 65 s from run to run on the same machine); in `make test`
# the kernel has one thread and shares two cores with the other workers, which made it 2-4x that and
# passed 180 s once. The check is what the widget shows, not how fast: it waits up to 7 minutes.
ACCEPT_ALL_54_MS = 420_000


def test_the_54_layer_model_tune_accept_apply_and_its_graph_at_1024_and_1400(lab):
    """A 54-layer model on a narrow screen: filter the rows, Accept all, Apply; bars drawn, nothing
    spills. Then the Graph tab coloured by the run, at 1024 px and, the page widened, at 1400 px."""
    ran = _notebook_ran(lab, "06_a_54_layer_model.ipynb", "large_model", width=1024, widget_timeout_ms=WIDGET_54_MS)
    with ran as (page, widget, console_errors):
        page.wait_for_timeout(1000)
        widget.screenshot(path=str(SCREENSHOTS / "large_model_explore.png"))
        _assert_looks_right(widget)  # all modules: a point per module, red where one crosses the threshold
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.get_by_text(re.compile(r"^54 of \d+ shown$")).first.wait_for(timeout=60_000)  # the other ops hidden
        widget.locator("input[placeholder='filter: name or type']").first.fill("fc2")
        widget.get_by_text(re.compile(r"^(?!54 )\d+ of \d+ shown$")).first.wait_for(timeout=60_000)
        _filter_cleared(widget, 54)
        widget.locator("button", has_text="Accept all suggestions").first.click()
        widget.get_by_text("Accept all (measured)").first.wait_for(timeout=ACCEPT_ALL_54_MS)
        widget.locator("button", has_text="Apply").first.click()
        try:
            widget.get_by_text("apply 1: output SQNR").first.wait_for(timeout=180_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "large_model_after_apply.png"), full_page=False)
        _assert_bars_drawn(widget)
        _assert_nothing_spills(widget)
        _assert_looks_right(widget)
        widget.locator("button", has_text="change vs baseline").first.click()
        _assert_bars_drawn(widget, "SQNR change vs baseline")
        widget.locator(".bqplot", has_text="SQNR change vs baseline").first.screenshot(
            path=str(SCREENSHOTS / "large_model_delta.png")
        )
        _assert_looks_right(widget)
        assert _error_widgets(page) == [], console_errors

        widget.locator(".lm-TabBar-tab", has_text="Graph").first.click()
        widget.locator(".widget-html b", has_text="per-layer SQNR · run 1 apply 1").first.wait_for(timeout=60_000)
        nodes = widget.locator(".bqplot .network .node")
        nodes.first.wait_for(timeout=60_000)
        assert nodes.count() >= 54
        colours = nodes.locator(".element").evaluate_all("els => new Set(els.map(e => getComputedStyle(e).fill)).size")
        assert colours > 3  # coloured by the run's per-layer SQNR, not one grey
        for width in (1024, 1400):
            page.set_viewport_size({"width": width, "height": 1100})
            page.wait_for_timeout(1500)  # the figures redraw at the new width
            widget.screenshot(path=str(SCREENSHOTS / f"graph_tab_{width}.png"))
            _assert_looks_right(widget)
            _assert_nothing_spills(widget)


def test_quickstart_graph_explore_and_apply_adds_one_run(lab):
    """The quickstart: a Graph node's tooltip names it and a click selects it in Explore; Explore's
    module and feature views; Accept all, a double-clicked Apply: one new run."""
    with _notebook_ran(lab, NOTEBOOK, "quickstart") as (page, widget, _console_errors):
        widget.locator(".lm-TabBar-tab", has_text="Graph").first.click()
        node = widget.locator(".bqplot .network .node", has_text="head").first
        node.wait_for(timeout=60_000)
        node.hover()
        page.locator(".bqplot_tooltip_div", has_text="Linear").first.wait_for(timeout=30_000)
        node.click()
        widget.get_by_text("Selected in Explore").first.wait_for(timeout=60_000)
        widget.screenshot(path=str(SCREENSHOTS / "quickstart_graph.png"))
        _assert_looks_right(widget)
        _assert_nothing_spills(widget)
        widget.locator(".lm-TabBar-tab", has_text="Explore").first.click()
        module = page.locator(".widget-dropdown", has=page.locator("label", has_text="Module")).first.locator("select")
        chosen = module.evaluate("s => s.options[s.selectedIndex].text").replace("\xa0", " ")
        assert chosen.startswith("head (Linear"), chosen
        module.select_option(label="head (Linear, 32 ch)")
        page.get_by_text("head · equalization balance per channel").first.wait_for(timeout=60_000)
        _assert_looks_right(widget)
        module.select_option(label="stem.conv (ConvReLU2d, 3 ch)")  # its input has spikes at 25
        feature = page.locator(".widget-dropdown", has=page.locator("label", has_text="Feature")).first.locator("select")
        feature.select_option(label="activation values · recorded histogram")
        _assert_bars_drawn(widget, "stem.conv · recorded input values")  # counts on a log axis: every bar stands
        widget.get_by_text("outlier rule: 3.5 x the 97.5th percentile at 8.75").first.wait_for(timeout=60_000)
        widget.screenshot(path=str(SCREENSHOTS / "quickstart_explore_values.png"))
        _assert_looks_right(widget)
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.locator("button", has_text="Accept all suggestions").first.click()
        # Apply once Accept all has finished (a click made while it runs is dropped and counted)
        widget.get_by_text("Accept all (measured)").first.wait_for(timeout=120_000)
        # a double click: the second click reaches the kernel while the first one's run is going
        widget.locator("button", has_text="Apply").first.dblclick()
        try:
            status = widget.get_by_text("apply 1: output SQNR").first
            status.wait_for(timeout=120_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "quickstart_after_apply.png"), full_page=False)
        assert "1 click made while the run was in progress ignored" in status.inner_text()
        assert "vs the baseline" in status.inner_text()
        _assert_bars_drawn(widget)
        _assert_nothing_spills(widget)
        _assert_looks_right(widget)
        history = widget.locator(".widget-html", has_text="Runs").first.inner_text()
        assert "baseline" in history and "apply 1" in history and "apply 2" not in history
        assert _error_widgets(page) == []


def _filter_cleared(widget, rows: int) -> None:
    """The Tune tab's filter emptied, and its ``rows`` rows drawn: the buttons under the rows box move
    down as they are drawn, and a click whose press and release straddle that move reaches no button
    (its release lands on a row), so a click is made only once the rows are all there."""
    widget.locator("input[placeholder='filter: name or type']").first.fill("")
    widget.get_by_text(re.compile(rf"^{rows} of \d+ shown$")).first.wait_for(timeout=60_000)
    checkboxes = widget.locator(".widget-checkbox", has_text="keep float")
    for _ in range(600):  # the rows the kernel sends are drawn a little after their count
        if checkboxes.count() >= rows:
            return
        widget.page.wait_for_timeout(100)
    raise AssertionError(f"{checkboxes.count()} Tune rows drawn, {rows} expected")


def test_the_tune_tab_says_where_the_real_model_and_its_simulation_disagree(lab):
    """The PReLU notebook: the first Apply runs the baseline, the red line names the kernels, the PReLU
    rows join the rows shown, and the per-layer chart has the kernel check as a series of its own."""
    with _notebook_ran(lab, "08_when_the_simulation_disagrees.ipynb", "kernel_truth") as (page, widget, _console_errors):
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.get_by_text("worse than its simulation").first.wait_for(timeout=60_000)  # the notebook ran the baseline
        widget.locator("label", has_text="other ops").first.click()  # the PReLU rows, with keep float
        widget.locator("input[placeholder='filter: name or type']").first.fill("PReLU")
        widget.get_by_text(re.compile(r"^4 of \d+ shown$")).first.wait_for(timeout=60_000)
        widget.locator("button", has_text="keep float").first.click()  # on the four rows shown
        _filter_cleared(widget, 10)
        widget.locator("button", has_text="Apply").first.click()
        try:
            widget.get_by_text("apply 1: output SQNR").first.wait_for(timeout=120_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "kernel_truth_after_apply.png"), full_page=False)
        status = widget.get_by_text("apply 1: output SQNR").first.inner_text()
        assert "vs the baseline" in status and "+3" in status  # 0.5 dB -> 34 dB: more than +30 dB
        truth = widget.get_by_text("worse than its simulation").first
        assert "prelu1, prelu2, prelu3, prelu4" in truth.inner_text()
        assert "rgb(187, 0, 0)" in truth.evaluate("e => getComputedStyle(e.closest('div')).color")
        _assert_bars_drawn(widget, "red: kernels that differ")
        # the kernel check is a series of its own, named beside the runs above the chart
        widget.locator(".qr-legend", has_text="kernel check (baseline)").first.wait_for(timeout=30_000)
        chart = widget.locator(".bqplot", has_text="red: kernels that differ").first
        chart.screenshot(path=str(SCREENSHOTS / "kernel_truth_layers.png"))
        _assert_nothing_spills(widget)
        _assert_looks_right(widget)
        assert _error_widgets(page) == []


def test_a_transformer_format_per_layer_apply_and_the_module_tree_at_1400_and_1024(lab):
    """The eager-engine notebook: a Hugging Face BERT's Tune row takes int4 weights from its format
    dropdown, Apply runs it; the layout holds at 1400 px and, resized, at 1024 px; the Model tab
    lists the leaf modules in call order."""
    with _notebook_ran(lab, "09_a_transformer.ipynb", "transformer") as (page, widget, _console_errors):
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.locator("input[placeholder='filter: name or type']").first.fill("layer.0.output.dense")
        widget.get_by_text(re.compile(r"^1 of \d+ shown$")).first.wait_for(timeout=60_000)
        widget.locator(".widget-dropdown select:visible").filter(has_text="int4-weight-only").first.select_option(
            label="int4-weight-only"
        )
        widget.locator("button", has_text="Apply").first.click()
        try:
            widget.get_by_text("apply 1: output SQNR").first.wait_for(timeout=120_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "transformer_after_apply.png"), full_page=False)
        assert "int4-weight-only" in widget.locator(".widget-html", has_text="format=int4-weight-only").first.inner_text()
        _assert_bars_drawn(widget)
        for width in (1400, 1024):
            page.set_viewport_size({"width": width, "height": 1100})
            page.wait_for_timeout(800)
            page.screenshot(path=str(SCREENSHOTS / f"transformer_tune_{width}.png"), full_page=False)
            _assert_nothing_spills(widget)
            _assert_looks_right(widget)
        widget.locator(".lm-TabBar-tab", has_text="Model").first.click()
        widget.get_by_text("Leaf modules in call order").first.wait_for(timeout=30_000)
        page.screenshot(path=str(SCREENSHOTS / "transformer_model_tab.png"), full_page=False)
        assert _error_widgets(page) == []


def test_the_size_front_a_budget_and_apply_at_1400_and_1024(lab):
    """The size budget notebook: Tune -> Size front draws the front, a budget typed in KB selects the
    best point under it and fills the rows, Apply runs it and the run joins the chart; the layout
    holds at 1400 px and, resized, at 1024 px."""
    with _notebook_ran(lab, "10_size_budget.ipynb", "size_budget") as (page, widget, _console_errors):
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.locator("button", has_text="Size front").first.click()
        widget.get_by_text(re.compile(r"\d+ points from")).first.wait_for(timeout=120_000)
        budget = widget.locator(".widget-text", has_text="budget KB").locator("input").first
        budget.fill("65")
        budget.press("Enter")
        widget.get_by_text(re.compile(r"^Point \d+ of \d+")).first.wait_for(timeout=30_000)
        chart = widget.locator(".bqplot", has_text="Size front").first
        assert chart.locator(".dot").count() > 10  # the front's points, the uniform marks, the runs
        widget.locator("button", has_text="Apply").first.click()
        try:
            widget.get_by_text("apply 1: output SQNR").first.wait_for(timeout=120_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "size_front_after_apply.png"), full_page=False)
        widget.get_by_text(re.compile(r"Size front, \d+ real runs?")).first.wait_for(timeout=30_000)
        for width in (1400, 1024):
            page.set_viewport_size({"width": width, "height": 1100})
            page.wait_for_timeout(800)
            chart.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / f"size_front_{width}.png"), full_page=False)
            _assert_nothing_spills(widget)
            _assert_looks_right(widget)
        assert _error_widgets(page) == []
