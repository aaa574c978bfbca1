"""Google's Model Explorer, where edge engineers look at graphs: the float model's exported program
as a ``.pt2`` file and one node-data JSON per metric, keyed by the ids Model Explorer gives the
program's nodes (its PyTorch adapter names a node by its FX name), and its server started beside a
notebook.

A module's value goes on the op nodes that read its weight (a Conv's ``conv2d``, a Linear's
``linear``), found through the program's signature (which placeholder holds which parameter).
Needs the ``[explorer]`` extra (``ai-edge-model-explorer``).
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import MissingExtraError, QReportError

INSTALL = "pip install 'qreport-widgets[explorer]'  (ai-edge-model-explorer)"
GRAPH_ID = "graph"  # the one graph Model Explorer's PyTorch adapter makes of a program
MODEL_FILE = "model.pt2"
START_TIMEOUT_S = 60.0


class ModelExplorerError(QReportError, RuntimeError):
    """The program could not be exported for Model Explorer, or its server did not start."""


@dataclass(frozen=True)
class NodeMetric:
    """One overlay: a value per module, the colours by value (``thresholds``: ascending (upper
    bound, colour); a value takes the first colour whose bound it does not exceed) and what it is."""

    values: Mapping[str, float]
    thresholds: Sequence[tuple[float, str]]
    description: str = ""


# colours from bad to good, as the widget's bars use them
RED, ORANGE, YELLOW, GREEN = "#d62728", "#ff7f0e", "#ffd54f", "#2ca02c"
# per-layer SQNR (dB): higher is better
SQNR_THRESHOLDS = ((10.0, RED), (20.0, ORANGE), (30.0, YELLOW), (1e9, GREEN))
# what keeping a module float gains at the output (dB): higher is worse for the quantized model
GAIN_THRESHOLDS = ((0.3, GREEN), (1.0, YELLOW), (3.0, ORANGE), (1e9, RED))
# a quantized kernel against its reference (dB): below 30 it computes something else
KERNEL_THRESHOLDS = ((30.0, RED), (1e9, GREEN))


@dataclass(frozen=True)
class ModelExplorerFiles:
    """What ``write_model_explorer`` wrote: the program and a node-data file per metric."""

    directory: Path
    model: Path
    node_data: dict[str, Path] = field(default_factory=dict)
    nodes: dict[str, list[str]] = field(default_factory=dict)  # module -> the node ids its values are on

    def command(self) -> str:
        """The shell command that opens these files in Model Explorer."""
        data = ",".join(str(p) for p in self.node_data.values())
        return f"model-explorer {self.model}" + (f" --node_data_paths={data}" if data else "")


def model_explorer_api() -> Any:
    """Model Explorer's package; a clear error naming the extra when missing."""
    try:
        import model_explorer
        from model_explorer import node_data_builder
    except ImportError as error:
        raise MissingExtraError(f"Model Explorer is not installed ({error}); install it with: {INSTALL}") from error
    return model_explorer, node_data_builder


def exported_program(model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` in eval mode (``model`` is not changed); a clear error when it cannot."""
    training = model.training
    try:
        return torch.export.export(model.eval(), example_inputs)
    except Exception as error:
        raise ModelExplorerError(
            f"torch.export could not export the model for Model Explorer ({type(error).__name__}: {str(error)[:300]}); "
            "Model Explorer reads exported programs (.pt2) only"
        ) from error
    finally:
        model.train(training)


def module_nodes(program: torch.export.ExportedProgram) -> dict[str, list[str]]:
    """Module name -> the ids of the op nodes that read its weight, in graph order."""
    weights = {name: target for name, target in program.graph_signature.inputs_to_parameters.items()}
    found: dict[str, list[str]] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            target = weights.get(arg.name)
            if target is not None and target.endswith(".weight"):
                found.setdefault(target.removesuffix(".weight"), []).append(node.name)
                break
    return found


def write_model_explorer(
    directory: str | Path,
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    metrics: Mapping[str, NodeMetric],
) -> ModelExplorerFiles:
    """``model``'s exported program as ``directory/model.pt2`` and ``metrics`` (name -> NodeMetric)
    as ``directory/<name>.json`` each, in Model Explorer's node-data format."""
    _, builder = model_explorer_api()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    program = exported_program(model, example_inputs)
    path = directory / MODEL_FILE
    torch.export.save(program, str(path))
    nodes = module_nodes(program)
    written = {}
    for name, metric in metrics.items():
        results = {
            node: builder.NodeDataResult(value=float(value))
            for module, value in metric.values.items()
            if value == value  # NaN: no value to show
            for node in nodes.get(module, ())
        }
        if not results:
            continue
        thresholds = [builder.ThresholdItem(value=bound, bgColor=colour) for bound, colour in metric.thresholds]
        data = builder.ModelNodeData(graphsData={GRAPH_ID: builder.GraphNodeData(results=results, thresholds=thresholds)})
        written[name] = directory / f"{_slug(name)}.json"
        data.save_to_file(str(written[name]))
    return ModelExplorerFiles(directory, path, written, nodes)


@dataclass
class ModelExplorerServer:
    """Model Explorer's server on ``url``, started by ``show``: shown in a notebook as the app in a
    frame with a link; ``stop()`` ends it."""

    url: str
    process: subprocess.Popen
    height: int = 600

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def _repr_html_(self) -> str:
        url = html.escape(self.url, quote=True)
        return (
            f'<iframe src="{url}" width="100%" height="{self.height}" style="border:1px solid #ddd"></iframe>'
            f'<div>Model Explorer: <a href="{url}" target="_blank">{html.escape(self.url[:80])}...</a></div>'
        )

    def __repr__(self) -> str:
        return f"Model Explorer at {self.url}"


def show(files: ModelExplorerFiles, port: int | None = None, host: str = "localhost") -> ModelExplorerServer:
    """Start Model Explorer's server on ``files`` in a process of its own (the notebook stays free)
    and return it once it answers."""
    model_explorer_api()
    command = [sys.executable, "-m", "model_explorer", str(files.model), "--no_open_in_browser", f"--host={host}"]
    if port is not None:
        command.append(f"--port={port}")
    if files.node_data:
        command.append("--node_data_paths=" + ",".join(str(p) for p in files.node_data.values()))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    found: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip())
            if not found and re.match(r"https?://", line.strip()):
                found.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not found and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not found:
        process.kill()
        said = "\n".join(lines[-8:])
        raise ModelExplorerError(f"Model Explorer's server did not start ({' '.join(command)}):\n{said}")
    return ModelExplorerServer(found[0], process)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower() or "metric"
