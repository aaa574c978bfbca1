"""Model Explorer files: the exported program and node data keyed by the nodes Model Explorer draws.

The written JSON is read back with Model Explorer's own node-data classes and its keys are checked
against the graph Model Explorer's own PyTorch adapter makes of the written ``.pt2``. Needs the
``[explorer]`` extra.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest
import torch

pytest.importorskip("model_explorer", reason="the [explorer] extra is not installed")

from model_explorer.consts import DEFAULT_SETTINGS  # noqa: E402
from model_explorer.node_data_builder import GraphNodeData, NodeDataResult, ThresholdItem  # noqa: E402
from model_explorer.pytorch_exported_program_adapter_impl import PytorchExportedProgramAdapterImpl  # noqa: E402

from qreport_widgets import DynamicStaticDetector, ModelReport, analyze  # noqa: E402
from qreport_widgets.demo.digits import trained_digits_model  # noqa: E402
from qreport_widgets.errors import MissingExtraError  # noqa: E402


@pytest.fixture(scope="module")
def digits_report(digits_cache):
    model, data = trained_digits_model("cnn", digits_cache)
    return analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)


def graph_node_ids(path) -> set[str]:
    """The node ids of the graph Model Explorer's PyTorch adapter makes of the program at ``path``."""
    graphs = PytorchExportedProgramAdapterImpl(torch.export.load(str(path)), DEFAULT_SETTINGS).convert()["graphs"]
    assert [graph.id for graph in graphs] == ["graph"]
    return {node.id for node in graphs[0].nodes}


def read_node_data(path) -> GraphNodeData:
    """A written node-data file as Model Explorer's own classes."""
    data = json.loads(path.read_text())
    graph = data["graph"]
    return GraphNodeData(
        results={key: NodeDataResult(**value) for key, value in graph["results"].items()},
        thresholds=[ThresholdItem(**item) for item in graph["thresholds"]],
    )


def test_every_metric_is_keyed_by_nodes_of_the_graph_it_describes(digits_report, tmp_path):
    session = digits_report.session
    files = digits_report.to_model_explorer(tmp_path)
    assert files.model == tmp_path / "model.pt2"
    ids = graph_node_ids(files.model)
    baseline, gains = session.baseline(), session.sensitivity()["output_sqnr_gain_db"]
    expected = {
        "per-layer SQNR dB (baseline)": baseline.per_layer_sqnr_db,
        "kernel SQNR dB (baseline)": baseline.kernel_sqnr_db,  # the FX baseline checks its kernels
        "sensitivity gain dB": gains,
    }
    assert set(files.node_data) == set(expected)
    for name, path in files.node_data.items():
        data = read_node_data(path)
        assert data.results and set(data.results) <= ids
        assert [t.value for t in data.thresholds] == sorted(t.value for t in data.thresholds)
        for module, value in expected[name].items():  # each module's value on the op reading its weight
            (node,) = files.nodes[module]
            assert data.results[node].value == pytest.approx(value)
    assert files.command().startswith(f"model-explorer {files.model} --node_data_paths=")


def test_a_run_by_label_and_its_kernel_check_and_a_server_that_answers(digits_report, tmp_path):
    session = digits_report.session
    fc2_float = {"fc2": session.current_settings()["fc2"].__class__(keep_float=True)}
    run = session.apply(fc2_float, label="fc2 float")
    files = digits_report.to_model_explorer(tmp_path, run="fc2 float", sensitivity=False)
    kernels = {"kernel SQNR dB (fc2 float)"} if len(run.kernel_sqnr_db) else set()
    assert set(files.node_data) == {"per-layer SQNR dB (fc2 float)", *kernels}
    per_layer = read_node_data(files.node_data["per-layer SQNR dB (fc2 float)"])
    assert len(per_layer.results) == len(run.per_layer_sqnr_db.dropna())
    with pytest.raises(KeyError, match="no run labelled 'nothing'"):
        digits_report.to_model_explorer(tmp_path, run="nothing")

    server = digits_report.show_in_model_explorer(tmp_path / "shown", run="fc2 float")
    try:
        assert "model.pt2" in server.url and "<iframe" in server._repr_html_()
        with urllib.request.urlopen(server.url, timeout=30) as page:
            assert page.status == 200
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_without_the_extra_or_a_session_it_says_what_to_do(digits_report, tmp_path, monkeypatch):
    bare = ModelReport(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [DynamicStaticDetector()])
    monkeypatch.setitem(sys.modules, "model_explorer", None)
    with pytest.raises(MissingExtraError, match=r"qreport-widgets\[explorer\]"):
        digits_report.to_model_explorer(tmp_path)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="build the report with qreport_widgets.analyze"):
        bare.to_model_explorer(tmp_path)
