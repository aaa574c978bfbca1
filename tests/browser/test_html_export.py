"""The standalone HTML report opened in headless Chromium with every request but ``file:`` ones
aborted: figures drawn, no console errors, the suggestions and run labels in the text.

Needs Debian's chromium (``apt-get install -y chromium``); under CI a missing Chromium fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_quickstart_browser import CHROME_ARGS, CHROMIUM

from qreport_widgets import analyze, load_report
from qreport_widgets.demo.digits import trained_digits_model

DRAWN = "() => !document.getElementById('qreport-figures-note') && document.querySelectorAll('.bqplot').length > 0"


@pytest.fixture(scope="module")
def reports(digits_cache, tmp_path_factory):
    """The trained digits mixer with two runs, written live and from a saved-and-loaded report."""
    model, data = trained_digits_model("mixer", digits_cache)
    report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    session = report.session
    session.baseline()
    session.apply(session.suggested_settings(report.analysis().suggestions()), label="suggested settings")
    folder = tmp_path_factory.mktemp("html")
    live = report.save_html(folder / "live.html")
    loaded = load_report(report.save(folder / "mixer.qreport")).save_html(folder / "loaded.html")
    return report, live, loaded


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        message = "NOT RUN: Chromium is missing; install it with `apt-get install -y chromium` (not `playwright install`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS)
        yield browser
        browser.close()


def _open(browser, path: Path) -> tuple[object, list[str], list[str]]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    asked: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))

    def only_files(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            asked.append(route.request.url)
            route.abort()

    page.route("**/*", only_files)
    page.goto(path.as_uri())
    page.wait_for_function(DRAWN, timeout=60_000)
    page.wait_for_timeout(1000)  # late errors, late requests
    return page, errors, asked


@pytest.mark.parametrize("which", ["live", "loaded"])
def test_the_html_report_opens_offline_with_its_figures_drawn(reports, browser, which):
    report, live, loaded = reports
    path = live if which == "live" else loaded
    assert path.stat().st_size < 5_000_000
    page, errors, asked = _open(browser, path)
    assert errors == [] and asked == []
    graph = report.analysis().graph
    nodes = page.locator(".graph .bqplot .network .node").count()
    assert nodes >= len(graph.units)  # every module drawn (and the ops where outputs meet)
    assert page.locator(".figure .bqplot path.dot").count() > 0  # the flagged modules' channels
    text = page.inner_text("body")
    for suggestion in report.analysis().suggestions():
        assert suggestion.module_fqn in text and suggestion.reason in text
    if which == "live":
        assert "baseline" in text and "suggested settings" in text
        assert page.locator(".bqplot .bargroup, .bqplot rect.bar").count() > 0  # per-layer SQNR of the runs
        code = report.session.settings_as_code(report.session.history[-1].settings)
        assert code.strip().splitlines()[-1].strip() in text  # the settings as code
    else:
        assert "suggested settings" not in text
    page.close()


def test_hovering_a_graph_node_shows_its_name_offline(reports, browser):
    report, live, _ = reports
    page, errors, _asked = _open(browser, live)
    first = next(iter(report.analysis().graph.units))
    page.locator(".graph .bqplot .network .node").first.hover()
    page.wait_for_timeout(300)
    assert first in page.inner_text(".graph")
    assert errors == []
    page.close()
