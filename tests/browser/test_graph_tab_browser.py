"""The Graph tab of the 54-layer notebook in JupyterLab in headless Chromium, after one Apply,
through the layout audit of ``../shared/tools/notebook_in_browser.py`` at a wide and a narrow
screen: nothing clipped, overlapping or cut, no console error, the figure drawn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_quickstart_browser import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT.parent / "shared" / "tools" / "notebook_in_browser.py"


@pytest.mark.parametrize("width", [1400, 1024])
def test_the_graph_tab_passes_the_layout_audit(width, tmp_path):
    missing = [str(p) for p in (Path(CHROMIUM), TOOL) if not p.exists()]
    if missing:
        message = f"NOT RUN: {', '.join(missing)} missing (apt-get install -y chromium; ../shared beside the clone)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    command = [
        sys.executable, str(TOOL), str(ROOT / "notebooks" / "06_a_54_layer_model.ipynb"), "--click", "Tune",
        "--click", "Apply", "--click", "Graph", "--expect", "per-layer SQNR · run 1", "--layout",
        "--width", str(width), "--screenshot-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    summary = [line for line in done.stdout.splitlines() if line.startswith(("SUMMARY", "PROBLEM"))]
    assert done.returncode == 0 and summary and summary[-1].startswith("SUMMARY OK"), "\n".join(summary) or done.stderr[-2000:]
