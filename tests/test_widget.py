"""The widget driven without a browser: set .value, read the marks and the tables."""

from __future__ import annotations

import collections

import bqplot as bq
import numpy as np
import pandas as pd
import pytest
import torch
import traitlets
from conftest import prepared, run
from models import ConvNet, conv_batches

import qreport_widgets as qw
from qreport_widgets import demo
from qreport_widgets.core import features as F
from qreport_widgets.observe.frame import ReportFrame
from qreport_widgets.widgets.controls import ExploreControls, Selection, feature_options, opening_feature
from qreport_widgets.widgets.plots import AxisScale, HistogramView, LineView, axis_scale
from qreport_widgets.widgets.views import ACTIVATION_VALUES, ALL_MODULES, ExploreViews, View


@pytest.fixture(scope="module")
def report():
    batches = demo.demo_batches(4)
    return qw.analyze(demo.build_demo_model(), batches[0], batches, qconfig_mapping=demo.demo_qconfig_mapping(), progress=False)


def test_header_and_model_overview(report):
    widget = report.widget()
    assert "DemoNet" in widget.header.value and "4 detectors" in widget.header.value
    assert "4 calibration batches" in widget.header.value and "dynamic" in widget.header.value
    model_tab = widget.tabs.children[3].value
    assert "call_module" in model_tab and "ConvReLU2d" in model_tab and "Linear" in model_tab
    assert len(widget.tabs.children[4].children) == 4


def test_module_dropdown_lists_modules_in_forward_order(report):
    controls = report.widget().controls
    values = [v for _, v in controls.module.options]
    assert values[0] == ALL_MODULES and values[1:] == report.frame().module_names
    assert controls.module.options[1][0] == "stem.conv (ConvReLU2d, 3 ch)"


def test_feature_dropdown_offers_only_what_the_module_reports(report):
    widget = report.widget()
    controls = widget.controls
    controls.module.value = "mlp.act"  # GELU: outlier detector only
    features = [v for _, v in controls.feature.options]
    assert F.OUTLIER_RATIOS in features and ACTIVATION_VALUES in features
    assert F.EQUALIZATION_COMP_METRICS not in features and F.INPUT_COMP_STAT not in features
    controls.module.value = "mlp.fc1"
    features = [v for _, v in controls.feature.options]
    assert F.EQUALIZATION_COMP_METRICS in features and F.INPUT_COMP_STAT in features
    labels = dict((v, label) for label, v in controls.feature.options)
    assert labels[F.EQUALIZATION_COMP_METRICS].endswith("per channel") and labels[F.INPUT_COMP_STAT].endswith("per module")
    assert "_" not in labels[F.INPUT_COMP_STAT]  # readable words; the raw key stays in the tables
    # a detector's settings (the same number for every module) are not offered for plotting
    assert F.TOLERANCE not in features and F.EQUALIZATION_CHANNEL_AXIS not in features


def test_line_view_shows_channels_and_the_threshold(report):
    widget = report.widget()
    widget.controls.module.value = "mlp.fc1"
    widget.controls.feature.value = F.OUTLIER_RATIOS
    line = widget.views.line
    expected = report.frame().channel_values("mlp.fc1", F.OUTLIER_RATIOS)
    x, y = line.drawn()
    np.testing.assert_allclose(y, expected.astype(np.float32))
    assert y.dtype == np.float32 and x.size == 32
    # the channels above the threshold are the red points, and the key under the figure counts them
    np.testing.assert_allclose(line.flagged.y, expected[expected > 3.5].astype(np.float32))
    assert f"{(expected > 3.5).sum()} of 32 channels above the outlier threshold" in widget.views.legend.value
    assert "outlier threshold = 3.5" in widget.views.legend.value
    assert np.atleast_2d(line.thresholds.y).tolist() == [[3.5, 3.5]] and line.thresholds.labels == ["outlier threshold"]
    widget.controls.feature.value = F.EQUALIZATION_COMP_METRICS
    assert line.thresholds.y[:, 0].tolist() == pytest.approx([0.5, 2.0])
    widget.controls.feature.value = F.INPUT_PER_CHANNEL_MAX  # no rule flags these: no red points, no count
    assert line.flagged.y.size == 0 and "of 32" not in widget.views.legend.value
    # over all modules a module is red when the outlier detector flagged one of its channels
    widget.controls.module.value = ALL_MODULES
    widget.controls.feature.value = F.OUTLIER_RATIOS
    channels = report.frame().channels
    flagged = channels.groupby("module", sort=False)[F.OUTLIERS_DETECTED].max()
    assert sorted(line.flagged.names) == sorted(flagged.index[flagged == 1]) and len(line.flagged.names) > 0


def test_all_modules_line_is_mean_with_min_max_band(report):
    widget = report.widget()
    widget.controls.module.value = ALL_MODULES
    widget.controls.feature.value = F.INPUT_PER_CHANNEL_MAX
    frame = report.frame()
    means = [np.nanmean(frame.channel_values(m, F.INPUT_PER_CHANNEL_MAX)) for m in frame.module_names]
    np.testing.assert_allclose(widget.views.line.drawn()[1], np.array(means, dtype=np.float32), rtol=1e-6)
    assert widget.views.line.band.y.shape == (2, len(frame.module_names))
    # hovering a point names its module
    assert widget.views.line.tooltip.fields == ["name", "y"]
    drawn_names = list(widget.views.line.points.names) + list(widget.views.line.flagged.names)
    assert sorted(drawn_names) == sorted(frame.module_names)


def test_histogram_views(report):
    widget = report.widget()
    controls = widget.controls
    controls.module.value = "stem.conv"
    controls.view.value = "Histogram"
    controls.feature.value = ACTIVATION_VALUES
    values = widget.views.values  # recorded input values: counts on a log axis, the tail stays visible
    counts, _ = report.frame().histograms["stem.conv"]
    assert values.bars.y.sum() == counts.sum() and values.bars.x.max() >= 16  # the spikes at 25 are in the picture
    assert isinstance(values.y_scale, bq.LogScale) and widget.views.children[1] is values.figure
    # the outlier rule over the whole tensor puts a dashed line where the tail begins, named in the key
    marker = np.atleast_2d(values.markers.x)
    assert marker.shape == (1, 2) and 0 < marker[0, 0] < 25
    assert "outlier rule: 3.5 x the 97.5th percentile" in widget.views.legend.value
    controls.view.value = "Line"  # a histogram of values has no points or line view of its own
    assert widget.views.children[1] is values.figure and "as a histogram" in widget.views.message.value
    controls.view.value = "Histogram"
    controls.feature.value = F.INPUT_PER_CHANNEL_MAX
    bars = widget.views.histogram.bars
    assert bars.y.sum() == 3 and isinstance(widget.views.histogram.y_scale, bq.LinearScale)
    assert widget.views.children[1] is widget.views.histogram.figure


def test_table_view_and_prefix_filter(report):
    widget = report.widget()
    controls = widget.controls
    controls.view.value = "Table"
    table = widget.views.table.value
    assert "Suggestions" in table and "meta_fc" in table and "stem.conv" in table
    controls.prefix.value = "mlp"  # the Find box narrows the tables and the module list alike
    table = widget.views.table.value
    assert "mlp.fc1" in table and "meta_fc" not in table
    assert all("mlp" in label for label, value in controls.module.options[1:])
    controls.prefix.value = "gelu"  # a type matches too
    assert [value for _, value in controls.module.options[1:]] == ["mlp.act"]
    controls.prefix.value = ""
    controls.module.value = "head"
    assert "Per-channel features" in widget.views.table.value


class Blocks(torch.nn.Module):
    """Two numbered blocks of two Linears each (``layers.0.up``), and a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(collections.OrderedDict(up=torch.nn.Linear(8, 16), down=torch.nn.Linear(16, 8)))
            for _ in range(12)
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = x + block(x)
        return self.head(x)


def test_the_block_dropdown_narrows_explore_and_tune_to_one_block():
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(3)]
    widget = qw.analyze(Blocks().eval(), batches[0], batches, eval_data=batches[:1], progress=False).widget()
    controls = widget.controls
    assert [value for _, value in controls.block.options][:3] == ["", "layers.0.", "layers.1."]
    controls.block.value = "layers.1."  # not layers.10 or layers.11
    assert [value for _, value in controls.module.options[1:]] == ["layers.1.up", "layers.1.down"]
    controls.prefix.value = "head"  # typed over the block's text: the block goes, the text stays
    assert controls.block.value == "" and controls.prefix.value == "head"
    controls.block.value = "layers.11."
    controls.block.value = ""  # all blocks again: the Find text it set goes too
    assert controls.prefix.value == "" and len(controls.module.options) == 1 + 25
    tune = widget.tuning
    tune.block.value = "layers.10"
    assert [row.fqn for row in tune.rows_box.children] == ["layers.10.up", "layers.10.down"]
    assert tune.unit.layout.display != "none"


def test_module_card_lists_suggestions(report):
    widget = report.widget()
    widget.controls.module.value = "meta_fc"
    assert "dynamic" in widget.card.value and "non-stationary" in widget.card.value


def test_wide_module_is_drawn_bucketed():
    from qreport_widgets.widgets.plots import MAX_DRAWN_POINTS, LineView

    view = LineView()
    values = np.arange(4096, dtype=float)
    view.update(values)
    assert view.points.y.size <= MAX_DRAWN_POINTS and view.band.y.shape[1] == view.points.y.size
    assert view.band.y[1].max() == 4095


def test_widget_from_a_bare_prepared_model():
    report = qw.ModelReport(prepared(ConvNet(), conv_batches()[0]), [qw.OutlierDetector()])
    run(report.prepare_detailed_calibration(), conv_batches())
    widget = report.widget()
    assert "GraphModule" in widget.header.value
    widget.controls.module.value = "conv2"
    assert F.OUTLIER_RATIOS in [v for _, v in widget.controls.feature.options]
    assert widget.controls.feature.value == opening_feature(report.frame())  # conv2 reports it too: it stays


def test_reports_are_collapsed_per_detector_with_a_summary_in_each_title(report):
    accordion = report.widget()._reports_accordion()
    assert accordion.selected_index is None and len(accordion.titles) == len(report.text_reports())
    counts = {}
    for suggestion in report.suggestions():
        counts[suggestion.detector] = counts.get(suggestion.detector, 0) + 1
    for title, name in zip(accordion.titles, report.text_reports(), strict=True):
        assert title.startswith(f"{name} · {counts.get(name, 0)} suggestion") and "line" in title


def test_runs_table_shows_a_long_change_list_short_with_all_of_it_on_hover():
    from qreport_widgets.tune.run import Change
    from qreport_widgets.widgets.runs import short_changes

    cell = short_changes([Change("fc1", ("per_channel",)), Change("fc2", ("keep_float",)), Change("<head>", ("dynamic",))])
    assert ">fc1: per_channel; fc2: keep_float; +1 more module<" in cell
    assert "title='fc1: per_channel; fc2: keep_float; &lt;head&gt;: dynamic'" in cell
    assert ">the starting settings<" in short_changes(())
    assert ">a hand-written mapping<" in short_changes(None)


def test_runs_table_says_identical_changes_once():
    from qreport_widgets.tune.run import Change
    from qreport_widgets.widgets.runs import short_changes

    int4 = ("format=int4-weight-only", "group_size=32", "algorithm=gptq")
    changed = [Change(f"model.layers.{i}.mlp.{p}", int4) for i in range(4) for p in ("up_proj", "down_proj")]
    changed += [Change("lm_head", ("keep_float",)), Change("model.layers.0.self_attn.q_proj", ("per_channel",))]
    cell = short_changes(changed)
    assert ">8 modules: format=int4-weight-only, group_size=32, algorithm=gptq; lm_head: keep_float; +1 more module<" in cell
    assert "model.layers.3.mlp.down_proj: format=int4-weight-only" in cell  # every module on hover


def test_line_joins_the_points_and_keeps_the_flagged_ones_red(report):
    widget = report.widget()
    line, figure = widget.views.line, widget.views.line.figure
    widget.controls.module.value = "mlp.fc1"
    widget.controls.feature.value = F.OUTLIER_RATIOS
    assert widget.controls.view.value == "Points" and line.line.y.size == 0  # points alone at first
    widget.controls.view.value = "Line"
    expected = report.frame().channel_values("mlp.fc1", F.OUTLIER_RATIOS)
    np.testing.assert_array_equal(line.line.x, np.arange(32, dtype=np.float32))
    np.testing.assert_array_equal(line.line.y, expected.astype(np.float32))
    assert line.line.y.dtype == np.float32
    np.testing.assert_allclose(line.flagged.y, expected[expected > 3.5].astype(np.float32))  # red, on top of the line
    assert figure.marks.index(line.flagged) > figure.marks.index(line.line)
    widget.controls.module.value = "mlp.fc2"  # a new module is drawn joined too
    expected = report.frame().channel_values("mlp.fc2", F.OUTLIER_RATIOS)
    np.testing.assert_array_equal(line.line.y, expected.astype(np.float32))
    widget.controls.view.value = "Points"
    assert line.line.y.size == 0 and line.drawn()[1].size == expected.size
    assert widget.views.line.figure is figure and widget.views.children[1] is figure  # the same figure throughout


def test_axis_scale_rule():
    assert axis_scale(np.geomspace(0.01, 10, 50)) == AxisScale(log=True)  # three decades
    assert axis_scale(np.linspace(1, 50, 50)) == AxisScale()  # under two decades
    assert axis_scale([2.0, 2.1, 1.9, 70_000.0]) == AxisScale(log=True)  # one module far above the rest
    # a few values <= 0 are left out of a log axis and counted; many keep the axis linear
    assert axis_scale([0.0, *np.geomspace(1, 1e4, 19)]) == AxisScale(log=True, left_out=1)
    assert axis_scale([0.0] * 5 + list(np.geomspace(1, 1e4, 5))) == AxisScale()
    assert axis_scale([-3.0, 1.0, 2.0]) == AxisScale() and axis_scale([np.nan, np.inf, 1.0]) == AxisScale()
    assert axis_scale([1.0, 2.0, np.nan, np.inf, 1e5]).log  # NaN and infinities count for neither
    assert axis_scale([1.0, 2.0], reach=[[0.5, 0.9], [3.0, 5e3]]).log  # a band that spans decades
    assert AxisScale(log=True).label("ratio") == "ratio (log scale)" and AxisScale().label("ratio") == "ratio"


def test_values_spanning_decades_get_a_log_axis_without_a_new_figure():
    view = LineView(y_label="ratio")
    figure, marks = view.figure, list(view.figure.marks)
    view.update(np.array([2.0, 2.5, 0.0, 70_000.0, 1.9, 2.2, 2.1, 2.4, 2.3, 1.8, 2.0]))
    assert isinstance(view.y_scale, bq.LogScale) and view.y_axis.label == "ratio (log scale)"
    assert all(mark.scales["y"] is view.log_y for mark in figure.marks)
    assert view.drawn()[1].size == 10 and "log scale" in view.legend_html and "1 value(s) ≤ 0 not drawn" in view.legend_html
    view.update(np.linspace(1.0, 3.0, 11))
    assert isinstance(view.y_scale, bq.LinearScale) and view.y_axis.label == "ratio"
    assert all(mark.scales["y"] is view.linear_y for mark in figure.marks) and "log scale" not in view.legend_html
    assert view.figure is figure and list(figure.marks) == marks
    histogram = HistogramView()
    assert histogram.show_values(np.geomspace(1e-3, 1e3, 200), 12).log
    assert isinstance(histogram.x_scale, bq.LogScale) and histogram.bars.scales["x"] is histogram.log_x
    assert histogram.bars.y.sum() == 200 and histogram.x_axis.label == "value (log scale)"
    np.testing.assert_allclose(np.diff(np.log10(histogram.bars.x)), 0.5, rtol=1e-4)  # bins of equal ratio
    assert not histogram.show_values(np.linspace(1, 3, 100), 10).log
    assert isinstance(histogram.x_scale, bq.LinearScale) and histogram.bars.scales["x"] is histogram.linear_x


def dwarfed_frame(flagged_modules: int) -> ReportFrame:
    """Twelve modules whose outlier ratios sit near 2 but for one module's 70,000, and whose input
    maxima spread over four decades; the outlier detector flags ``flagged_modules`` of them."""
    rng = np.random.default_rng(0)
    features = {}
    for i in range(12):
        ratios = rng.uniform(1.5, 3.0, 8) * (35_000 if i == 3 else 1)
        detected = np.zeros(8)
        detected[0] = float(i < flagged_modules)
        features[f"m{i}"] = {
            F.OUTLIER_RATIOS: ratios,
            F.OUTLIERS_DETECTED: detected,
            F.OUTLIER_RATIO_THRESHOLD: 3.5,
            F.INPUT_PER_CHANNEL_MAX: rng.uniform(0.5, 1.5, 8) * 10.0 ** (i / 3 - 2),
        }
    return ReportFrame.from_features(features)


@pytest.mark.parametrize("flagged", [10, 2])
def test_explore_opens_on_a_feature_that_tells_modules_apart(flagged):
    frame = dwarfed_frame(flagged)
    assert opening_feature(frame) == F.INPUT_PER_CHANNEL_MAX
    controls, views = ExploreControls(frame), ExploreViews(frame)
    assert controls.selection == Selection(ALL_MODULES, F.INPUT_PER_CHANNEL_MAX, View.POINTS, "")
    views.show(ALL_MODULES, F.INPUT_PER_CHANNEL_MAX, View.POINTS)
    assert isinstance(views.line.y_scale, bq.LogScale) and "log scale" in views.legend.value
    views.show(ALL_MODULES, F.OUTLIER_RATIOS, View.POINTS)  # the ratio itself is no longer flat at 0 either
    assert isinstance(views.line.y_scale, bq.LogScale) and views.line.drawn()[1].size == 12


def test_a_selection_change_refreshes_the_view_once_with_a_consistent_pair(report):
    widget = report.widget()
    frame, controls = report.frame(), widget.controls
    shown = []
    widget.views.show = lambda module, feature, view, prefix="": shown.append((module, feature, view, prefix))
    changes = []
    controls.observe(changes.append, names="selection")
    # the GELU has no equalization metric: the feature follows the module in the same, single refresh
    controls.module.value = "mlp.fc1"
    controls.feature.value = F.EQUALIZATION_COMP_METRICS
    shown.clear(), changes.clear()
    controls.module.value = "mlp.act"  # its feature list starts with another feature than the one it gets
    assert feature_options(frame, "mlp.act")[0][1] != F.OUTLIER_RATIOS
    assert shown == [("mlp.act", F.OUTLIER_RATIOS, View.POINTS, "")] and len(changes) == 1
    assert changes[0]["old"].module == "mlp.fc1" and changes[0]["new"] == controls.selection
    for step in (
        lambda: setattr(controls.feature, "value", ACTIVATION_VALUES),
        lambda: setattr(controls.view, "value", "Line"),
        lambda: setattr(controls.prefix, "value", "head"),  # filters mlp.act out: back to all modules, once
    ):
        shown.clear()
        step()
        assert len(shown) == 1, shown
    assert shown[0][:2] == (ALL_MODULES, F.OUTLIER_RATIOS) and shown[0][2] is View.LINE
    controls.prefix.value = ""
    controls.module.value = "stem.conv"
    controls.feature.value = ACTIVATION_VALUES
    shown.clear()
    controls.prefix.value = "stem"  # the module still matches: module and feature stay
    assert shown == [("stem.conv", ACTIVATION_VALUES, View.LINE, "stem")]
    with pytest.raises(traitlets.TraitError, match="no feature"):
        controls.selection = Selection("mlp.act", F.EQUALIZATION_COMP_METRICS)


def test_a_module_that_started_float_and_runs_quantized_says_it_was_float():
    import pandas as pd

    from qreport_widgets import ModuleSettings
    from qreport_widgets.tune.run import RunResult

    settings = {"fc1": ModuleSettings(format="int8-weight-only"), "fc2": ModuleSettings(keep_float=True)}
    start = {"fc1": ModuleSettings(keep_float=True), "fc2": ModuleSettings(format="int8-weight-only")}
    run = RunResult(None, None, 30.0, pd.Series(dtype=float), 0, 1.0, 0.1, settings=settings)
    assert run.changes(start) == "fc1: format=int8-weight-only, was float; fc2: keep_float"


def test_the_per_layer_chart_leaves_room_for_a_decoders_long_first_names_and_names_its_runs_above():
    from qreport_widgets.widgets.runs import LayersChart

    names = ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    layers = pd.DataFrame(
        {"baseline": [20.0, 25.0, 30.0], "fit <= 621.2 KB and perplexity <= 5.34809": [22.0, 26.0, 31.0]}, names
    )
    chart = LayersChart()
    chart.draw(layers)
    # the first tick's name, rotated and ending at its tick, reaches about 4 px a character to the left
    assert chart.figure.fig_margin["left"] >= 4 * len(names[0]) - 10
    assert "fit &lt;= 621.2 KB and perplexity &lt;= 5.34809" in chart.legend.value and not chart.bars.display_legend
    chart.draw(pd.DataFrame({"baseline": [20.0, 25.0]}, ["conv1", "fc"]))
    assert chart.figure.fig_margin["left"] == 60  # short names: the y axis's room only
