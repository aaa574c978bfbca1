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
]


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, cells in {"01_quickstart.ipynb": QUICKSTART}.items():
        nbformat.write(notebook(cells), HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
