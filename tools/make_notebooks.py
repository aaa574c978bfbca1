"""Write the tutorial notebooks from their cell sources (kept here so diffs stay readable).

python tools/make_notebooks.py
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent.parent / "notebooks"


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells]
    return nb


QUICKSTART = [
    (
        "md",
        "# Quickstart: why does quantization hurt this model?\n\n"
        "`analyze` prepares a copy of the model with `prepare_fx`, observes it while it calibrates and "
        "reports what each detector found. The float model is never changed.",
    ),
    (
        "code",
        "import warnings\nwarnings.simplefilter('ignore')\n\n"
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo import build_demo_model, demo_batches, demo_qconfig_mapping\n\n"
        "model, batches = build_demo_model(), demo_batches()\n"
        "report = analyze(model, batches[0], batches, qconfig_mapping=demo_qconfig_mapping(), progress=False)",
    ),
    (
        "md",
        "## Explore the report\n\nPick a module and a feature; switch between the line, histogram and table views. "
        "Dashed lines are the detectors' thresholds.",
    ),
    ("code", "report.widget()"),
    ("md", "## What the detectors suggest"),
    ("code", "report.frame().suggestions[['module', 'kind', 'reason']]"),
    (
        "md",
        "## Tune and re-quantize\n\n"
        "In the widget's **Tune** tab, *Accept all suggestions* fills in every module's settings and "
        "**Apply** re-runs `prepare_fx` -> calibration -> `convert_fx` on a pristine copy of the model, "
        "then adds the run to the history next to the baseline. The same from code:",
    ),
    (
        "code",
        "session = report.session\n"
        "baseline = session.baseline()\n"
        "tuned = session.run(report.suggested_qconfig_mapping(), report.suggested_equalization_mapping(), label='suggested')\n"
        "runs, per_layer = session.compare()\n"
        "runs  # NBVAL_IGNORE_OUTPUT",
    ),
    ("code", "per_layer.round(1)  # NBVAL_IGNORE_OUTPUT"),
    (
        "md",
        "The dynamic activation on `meta_fc` (whose input scale drifts between batches) and the equalized "
        "`head` raise the output SQNR; equalizing `head` keeps the LayerNorm before it in float, which the "
        "*quantized layers* column shows.",
    ),
]


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, cells in {"01_quickstart.ipynb": QUICKSTART}.items():
        nbformat.write(notebook(cells), HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
