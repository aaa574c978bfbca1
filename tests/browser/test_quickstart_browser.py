"""The quickstart in JupyterLab in headless Chromium: pick a module, double-click Apply, see one new run.

Needs Debian's chromium (``apt-get install -y chromium``); ``.ci/run`` installs it, and under CI
a missing Chromium fails the test. Elsewhere the test reports itself as not run, with the command.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "01_quickstart.ipynb"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
]  # fmt: skip
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
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--port-retries=0",
        "--allow-root", "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={ROOT / 'notebooks'}",
        "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={tmp / 'settings'}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
    ]  # fmt: skip
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


def _assert_bars_drawn(widget) -> None:
    """The per-layer chart's bars have heights (grouped bqplot bars without a y range draw flat)."""
    chart = widget.locator(".bqplot", has_text="Per-layer SQNR").first
    chart.wait_for(timeout=60_000)
    heights = chart.locator("rect.bar").evaluate_all("els => els.map(e => e.getBBox().height)")
    assert heights and sum(h > 1 for h in heights) >= len(heights) // 2, heights


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


def test_large_model_tune_accept_apply_at_1024(lab):
    """A 54-layer model on a narrow screen: filter the rows, Accept all, Apply; bars drawn, nothing spills."""
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": 1024, "height": 1100})
        page.goto(f"{lab}/lab/tree/06_a_54_layer_model.ipynb", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=120_000)
        page.wait_for_timeout(2000)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        widget = page.locator(".jp-OutputArea-output .widget-tab").first
        widget.wait_for(timeout=180_000)
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.get_by_text("54 of 54 shown").first.wait_for(timeout=60_000)
        widget.locator("input[placeholder='filter: name or type']").first.fill("fc2")
        widget.get_by_text("of 54 shown").first.wait_for(timeout=60_000)
        widget.locator("input[placeholder='filter: name or type']").first.fill("")
        widget.locator("button", has_text="Accept all suggestions").first.click()
        widget.get_by_text("Accept all (measured)").first.wait_for(timeout=180_000)
        widget.locator("button", has_text="Apply").first.click()
        try:
            widget.get_by_text("apply 1: output SQNR").first.wait_for(timeout=180_000)
        finally:
            page.screenshot(path=str(SCREENSHOTS / "large_model_after_apply.png"), full_page=False)
        _assert_bars_drawn(widget)
        _assert_nothing_spills(widget)
        assert page.locator(".jupyter-widgets-error-widget").count() == 0
        browser.close()


def test_quickstart_apply_adds_one_run(lab):
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    console_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROME_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{lab}/lab/tree/{NOTEBOOK}", timeout=120_000)
        page.wait_for_selector(".jp-Notebook", timeout=120_000)
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget", timeout=120_000)
        page.wait_for_timeout(2000)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        widget = page.locator(".jp-OutputArea-output .widget-tab").first
        widget.wait_for(timeout=180_000)
        module = page.locator(".widget-dropdown", has=page.locator("label", has_text="Module")).first.locator("select")
        module.select_option(label="head (Linear, 32 ch)")
        page.get_by_text("head · outlier_detection_percentile_ratios").first.wait_for(timeout=60_000)
        widget.locator(".lm-TabBar-tab", has_text="Tune").first.click()
        widget.locator("button", has_text="Accept all suggestions").first.click()
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
        history = widget.locator(".widget-html", has_text="Runs").first.inner_text()
        assert "baseline" in history and "apply 1" in history and "apply 2" not in history
        assert page.locator(".jupyter-widgets-error-widget").count() == 0
        browser.close()
    assert not [e for e in console_errors if "favicon" not in e], console_errors
