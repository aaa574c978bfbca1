"""The standalone HTML report: its size and the time to write it, on the 54-layer notebook model
(notebooks/06_a_54_layer_model.ipynb) before and after two runs and sensitivity, on a trained
digits model, and on a 250-module model whose graph is folded; and how much of each file is the
scripts every page carries.

    python benchmarks/html_report.py
"""

from __future__ import annotations

import base64
import tempfile
import time
from pathlib import Path

import torch
from common import setup

from qreport_widgets import analyze
from qreport_widgets.demo.architectures import linear_chains, mobilenet_v3_small
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.widgets import html_export


def _notebook_model():
    model = mobilenet_v3_small(size=64)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 64, 64, generator=generator),) for _ in range(6)]
    return analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False)


def _digits(folder: Path):
    model, data = trained_digits_model("mobilenet", folder)
    return analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)


def _deep():
    model = linear_chains()
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    return analyze(model, batches[0], batches[:2], eval_data=batches[2:], progress=False)


def _runs(report) -> None:
    session = report.session
    session.baseline()
    session.apply(session.suggested_settings(report.analysis().suggestions()), label="suggested")
    session.sensitivity()


def main() -> None:
    setup()
    scripts = [html_export._vendored("require.js.gz"), html_export._vendored("embed-amd.js.gz")]
    scripts += [html_export._installed(name) for name in html_export.WIDGET_MODULES]
    carried = sum(len(base64.b64encode(s)) for s in scripts)
    print(f"scripts every page carries (gzipped, base64): {carried / 1e6:.2f} MB")
    print("| model | runs | observed modules | file | written in |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        cases = [
            ("54-layer notebook model", _notebook_model),
            ("digits MobileNet (trained)", lambda: _digits(folder)),
            ("250 Linear layers in 25 residual blocks", _deep),
        ]
        for name, build in cases:
            report = build()
            for with_runs in (False, True):
                if with_runs:
                    _runs(report)
                start = time.perf_counter()
                path = report.save_html(folder / "report.html", runs=with_runs)
                seconds = time.perf_counter() - start
                runs = "baseline, suggested; sensitivity" if with_runs else "none"
                modules = len(report.analysis().graph.units)
                print(f"| {name} | {runs} | {modules} | {path.stat().st_size / 1e6:.2f} MB | {seconds:.2f} s |")


if __name__ == "__main__":
    main()
