"""The Graph tab, driven from Python: the dataflow found in each engine's graph, colouring by each
number, a click to Explore and Tune, folding past the node limit."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from qreport_widgets import analyze, load_report
from qreport_widgets.demo.architectures import linear_chains, resnet18
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.observe.graph_layout import NODE_LIMIT, lay_out
from qreport_widgets.widgets.graph_view import BAD, GOOD, JOIN, NO_COLOUR, NO_VALUE


@pytest.fixture(scope="module")
def mixer_widget(digits_cache):
    """The trained digits mixer after a baseline, one more run and sensitivity."""
    model, data = trained_digits_model("mixer", digits_cache)
    report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    session = report.session
    session.baseline()
    session.apply({**session.current_settings()}, label="again")
    session.sensitivity()
    widget = report.widget()
    widget.tabs.selected_index = 2  # the Graph tab: the figure joins, the numbers are read
    return report, widget


def _small_resnet(engine: str):
    model = resnet18(width=8, classes=10).eval()
    data = [(torch.randn(2, 3, 32, 32),) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return analyze(model, data[0], data, engine=engine, eval_data=data[:1])


@pytest.mark.parametrize("engine", ["fx", "pt2e"])
def test_the_dataflow_has_the_residual_joins_of_a_resnet(engine):
    graph = _small_resnet(engine).analysis().graph
    adds = [name for name, (op, _) in graph.joins.items() if op == "add"]
    assert len(adds) == 8  # one per basic block
    first = adds[0]
    assert graph.joins[first][1] == "layer1.0"  # run in the block's forward
    into = {a for a, b in graph.edges if b == first}
    assert "maxpool" in into and any(a.startswith("layer1.0.conv2") for a in into)  # the skip and the branch meet
    assert {b for a, b in graph.edges if a == first} == {"layer1.0.relu2"}


def test_a_model_run_eagerly_is_drawn_in_call_order_where_no_module_feeds_another():
    report = _small_resnet("eager")
    graph = report.analysis().graph
    assert graph.kind == "modules" and not graph.joins
    laid = lay_out(graph)
    assert "call order" in laid.note and len(laid.shown) == len(graph.units)


def test_the_dataflow_survives_a_report_file(tmp_path):
    report = _small_resnet("fx")
    path = report.save(tmp_path / "r.qreport")
    loaded = load_report(path)
    assert dict(loaded.graph.joins) == dict(report.analysis().graph.joins)
    assert loaded.graph.edges == report.analysis().graph.edges
    assert lay_out(loaded.graph) == lay_out(report.analysis().graph)


def test_a_file_without_the_dataflow_is_drawn_in_forward_order(tmp_path):
    import dataclasses

    analysis = _small_resnet("fx").analysis()
    old = dataclasses.replace(analysis, graph=dataclasses.replace(analysis.graph, joins={}, edges=()))
    laid = lay_out(old.graph)
    assert "no dataflow" in laid.note
    assert [n.id for n in laid.shown] == list(analysis.graph.units)
    assert all(b == a + 1 for a, b in laid.edges)


def test_each_node_is_placed_below_what_feeds_it():
    graph = _small_resnet("fx").analysis().graph
    laid = lay_out(graph)
    for a, b in laid.edges:
        assert laid.nodes[b].y == laid.nodes[a].y + 1
    for layer in {n.y for n in laid.nodes}:  # one unit apart at least within a layer
        xs = sorted(n.x for n in laid.nodes if n.y == layer)
        assert all(later - earlier >= 1 - 1e-9 for earlier, later in zip(xs, xs[1:], strict=False))


def test_colour_by_each_number(mixer_widget):
    report, widget = mixer_widget
    pane, session = widget.graph, report.session
    labels = list(pane.colour_by.options)
    assert labels[0] == "per-layer SQNR · run 1 again"  # the latest run first
    assert "per-layer SQNR · run 0 baseline" in labels
    assert "sensitivity · output dB gained kept float" in labels and "local SQNR (its own error)" in labels
    assert "outlier ratio · largest channel" in labels and labels[-1] == NO_COLOUR
    sensitivity = session.sensitivity()
    expected = {
        "per-layer SQNR · run 1 again": (session.history[1].per_layer_sqnr_db, True),
        "sensitivity · output dB gained kept float": (sensitivity["output_sqnr_gain_db"], False),
        "local SQNR (its own error)": (sensitivity["local_sqnr_db"], True),
    }
    laid = pane.layout_
    for label, (values, lower_is_worse) in expected.items():
        pane.colour_by.value = label
        colours = dict(zip([n.id for n in laid.nodes], pane.mark.colors, strict=True))
        finite = values[values.map(math.isfinite)]
        finite = finite[finite.index.isin(colours)]
        worst = finite.idxmin() if lower_is_worse else finite.idxmax()
        best = finite.idxmax() if lower_is_worse else finite.idxmin()
        assert colours[worst] == BAD and colours[best] == GOOD, label
        shown = {d["name"]: d["shown"] for d in pane.mark.node_data}
        assert shown[worst] == f"{values[worst]:.3g} dB"
        assert pane.scale.min == pytest.approx(finite.min()) and pane.scale.max == pytest.approx(finite.max())
        assert label in pane.key.value
    pane.colour_by.value = "outlier ratio · largest channel"
    assert any(c not in (NO_VALUE, JOIN) for c in pane.mark.colors)
    pane.colour_by.value = NO_COLOUR
    assert set(pane.mark.colors) <= {NO_VALUE, JOIN, "#666"} and not pane.colour_axis.visible


def test_a_new_run_is_offered_when_the_tab_is_shown_again(mixer_widget):
    report, widget = mixer_widget
    widget.tabs.selected_index = 0
    report.session.apply(report.session.current_settings(), label="third")
    widget.tabs.selected_index = 2
    assert widget.graph.colour_by.options[0] == "per-layer SQNR · run 2 third"


def test_a_click_selects_the_module_in_explore_and_puts_its_tune_row_first(mixer_widget):
    _, widget = mixer_widget
    pane, tuning = widget.graph, widget.tuning
    target = list(tuning.rows)[-1]
    tuning.filter.value = "no such module"  # a filter that hides the row is cleared
    index = pane.layout_.index(target)
    pane.mark.selected = [index]  # what the browser sends on a click
    assert widget.controls.module.value == target
    assert widget.controls.selection.module == target
    assert tuning.filter.value == ""
    assert tuning.rows_box.children[0].fqn == target
    assert "▶" in tuning.rows[target].why.value
    assert "Selected in Explore" in pane.picked.value and "First in the Tune rows" in pane.picked.value
    other = list(tuning.rows)[0]
    pane.pick(other)
    assert tuning.rows_box.children[0].fqn == other and "▶" not in tuning.rows[target].why.value


def test_a_join_or_an_unknown_node_says_what_it_is(mixer_widget):
    _, widget = mixer_widget
    pane = widget.graph
    joins = [n for n in pane.layout_.shown if n.kind == "join"]
    if joins:
        before = widget.controls.module.value
        pane.pick(joins[0].id)
        assert "meet" in pane.picked.value and widget.controls.module.value == before
    with pytest.raises(KeyError, match="not a node"):
        pane.pick("no.such.module")
    for waypoint in [n.id for n in pane.layout_.nodes if n.kind == "waypoint"][:1]:  # a bend of an edge: nothing to pick
        with pytest.raises(KeyError, match="not a node"):
            pane.pick(waypoint)


def test_past_the_node_limit_modules_are_folded_and_a_click_opens_one():
    model = linear_chains()
    data = [(torch.randn(4, 8),) for _ in range(2)]
    report = analyze(model, data[0], data, eval_data=data[:1])
    assert len(report.analysis().graph.units) == 250
    widget = report.widget()
    widget.tabs.selected_index = 2
    pane = widget.graph
    laid = pane.layout_
    folded = [n for n in laid.shown if n.kind == "folded"]
    assert len(laid.shown) <= NODE_LIMIT and folded
    graph = report.analysis().graph
    assert len(graph.joins) == 24  # the first block adds the model's input, which is no node
    assert sorted(m for n in laid.shown for m in n.members) == sorted([*graph.units, *graph.joins])  # each once
    assert "folded" in pane.folding.value
    pane.pick(folded[0].id)
    opened = pane.layout_
    assert folded[0].id in pane.expanded and opened.index(folded[0].id) is None
    assert all(opened.index(m) is not None for m in folded[0].members)
    assert pane.fold_all.layout.display == ""
    pane.fold()
    assert pane.layout_ == laid and pane.fold_all.layout.display == "none"


def test_export_html_writes_the_file_or_says_why_not(mixer_widget, tmp_path):
    _, widget = mixer_widget
    widget.export_path.value = str(tmp_path / "mixer.html")
    widget.export.click()
    written = tmp_path / "mixer.html"
    assert written.is_file() and "Wrote" in widget.exported.value
    assert "widget-state+json" in written.read_text()
    selected = widget.controls.module.value
    widget.export_path.value = str(tmp_path / "mixer.txt")
    widget.export.click()
    assert "Export failed" in widget.exported.value and ".html" in widget.exported.value
    assert not (tmp_path / "mixer.txt").exists() and widget.controls.module.value == selected
    assert not widget.export.disabled


def test_exporting_sends_no_widget_to_the_notebook(mixer_widget, tmp_path, monkeypatch):
    """The page's hundreds of widgets exist only for their state: none is opened in the browser."""
    import comm
    from comm.base_comm import BaseComm

    published: list[str] = []

    class Recording(BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            published.append(msg_type)

    monkeypatch.setattr(comm, "create_comm", Recording)
    _, widget = mixer_widget
    widget.export_path.value = str(tmp_path / "unsent.html")
    widget.export.click()
    assert "Wrote" in widget.exported.value
    assert "comm_open" not in published  # only the button's and the status line's updates went out
    assert comm.create_comm is Recording  # put back
