"""The Tune tab's size pane: the front of per-module choices by deployed size and simulated quality,
the uniform choices beside it, every real run on the same axes, a budget, and a click to the rows."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping

import bqplot as bq
import ipywidgets as w
import numpy as np
import pandas as pd

from ..engines.settings import ModuleSettings
from ..tune.run import RunResult
from .tune_controller import TuneController

SQNR, METRIC = "output SQNR", "your metric"
FRONT, UNIFORM, RUNS, CHOSEN = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"


class SizeFrontPane(w.VBox):
    """A button that computes the size front (simulated, no real run per point), the chart, and a
    budget box: the best point under the budget is selected, and a selected point's settings go to
    the Tune rows (``propose``) for Apply.

    Args:
        controller: computes the front (its ``busy`` disables the button here too).
        propose: called with a point's settings (module -> ModuleSettings).
        has_metric: whether the session has ``eval_fn`` (then the y axis can show it).
    """

    def __init__(
        self, controller: TuneController, propose: Callable[[Mapping[str, ModuleSettings]], None], has_metric: bool
    ) -> None:
        self.controller, self._propose = controller, propose
        about = "Per-module choices by deployed size and simulated output SQNR (no real run per point)"
        self.compute = w.Button(
            description="Size front", icon="line-chart", tooltip=about, layout={"width": "130px", "flex": "0 0 auto"}
        )
        self.budget = w.BoundedFloatText(
            value=0.0,
            min=0.0,
            max=1e12,
            description="budget KB",
            disabled=True,
            tooltip="The deployed size to fit in: the best point under it is selected (0: none)",
            layout={"width": "190px", "flex": "0 0 auto"},
        )
        measures = controller.session.metric if controller.session is not None else None
        named = measures.name if measures is not None and measures.label != measures.name else ""  # "perplexity"
        self.axis = w.ToggleButtons(
            options=[(SQNR, SQNR), (named or METRIC, METRIC)],
            value=SQNR,
            style={"button_width": "110px"},
            layout={"flex": "0 0 auto", "display": "" if has_metric else "none"},
        )
        self.cancel = w.Button(description="Cancel", icon="stop", layout={"width": "100px", "flex": "0 0 auto"})
        self.progress = w.IntProgress(
            value=0, min=0, max=1, layout={"width": "160px", "visibility": "hidden", "flex": "0 0 auto"}
        )
        self.status, self.chosen, self.uniform_text = w.HTML(), w.HTML(), w.HTML()
        self.figure, self.line, self.points, self.uniform_marks, self.runs, self.budget_line = _figure()
        controls = w.HBox([self.compute, self.budget, self.axis, self.progress, self.cancel], layout={"flex_flow": "row wrap"})
        super().__init__([controls, self.status])
        w.dlink((controller, "front_status"), (self.status, "value"))
        w.dlink((controller, "busy"), (self.compute, "disabled"))
        w.dlink((controller, "cancellable"), (self.cancel.layout, "display"), lambda shown: "" if shown else "none")
        w.dlink((controller, "cancellable"), (self.progress.layout, "visibility"), lambda shown: "visible" if shown else "hidden")
        controller.observe(self._on_progress_change, "progress")
        self.compute.on_click(self._on_compute_click)
        self.cancel.on_click(lambda _b: controller.cancel())
        self.budget.observe(self._on_budget_change, "value")
        self.axis.observe(lambda _change: self._draw(), "value")
        self.points.observe(self._on_select, "selected")
        controller.observe(self._on_unit_change, "by_block")

    @property
    def front(self) -> pd.DataFrame | None:
        """The front, once computed."""
        return self.controller.points

    def show_runs(self) -> None:
        """Draw the session's real runs made so far on the chart's axes (once the front is drawn)."""
        if self.front is not None:
            self._draw()

    # ---- handlers ------------------------------------------------------------------------------
    def _on_compute_click(self, _button: w.Button) -> None:
        if self.controller.front():
            self.budget.disabled = False
            self._draw()

    def _on_unit_change(self, change: dict) -> None:
        """Modules or blocks: the front drawn was for the other."""
        with self.hold_sync():
            self.children = tuple(c for c in self.children if c not in (self.figure, self.chosen, self.uniform_text))
            self.budget.disabled = True
            self.chosen.value = ""
        unit = "Per-block choices (every module of a block alike)" if change["new"] else "Per-module choices"
        self.compute.tooltip = f"{unit} by deployed size and simulated output SQNR (no real run per point)"

    def _on_budget_change(self, change: dict) -> None:
        front, budget = self.front, change["new"]
        if front is None:
            return
        fitting = np.flatnonzero(front["size_bytes"].to_numpy() <= budget * 1024) if budget > 0 else []
        with self.budget_line.hold_sync():
            if budget > 0:
                self.budget_line.x = np.array([budget, budget], dtype=np.float64)
                self.budget_line.y = np.array(self._y_range(), dtype=np.float64)
            else:
                self.budget_line.x, self.budget_line.y = np.zeros(0), np.zeros(0)
        if budget > 0 and not len(fitting):
            smallest = front.iloc[0]["size_bytes"] / 1024
            self.chosen.value = f"<i>No point fits in {budget:,.1f} KB: the smallest takes {smallest:,.1f} KB.</i>"
            self.points.selected = None
        elif len(fitting):
            self.points.selected = [int(fitting[-1])]  # the largest that fits is the best: every point beats smaller ones

    def _on_select(self, change: dict) -> None:
        selected, front = change["new"], self.front
        if front is None or selected is None or not len(selected):
            return
        index = int(selected[-1])
        point = front.iloc[index]
        self._propose(point["settings"])
        metric = f", metric {point['simulated_metric']:.4g}" if "simulated_metric" in point else ""
        self.chosen.value = (
            f"Point {index + 1} of {len(front)}: <b>{point['size_bytes'] / 1024:,.1f} KB</b>, "
            f"<b>{point['simulated_output_sqnr_db']:.2f} dB</b>{metric} (simulated); {html.escape(point['formats'])}. "
            "The Tune rows hold it: Apply to measure it."
        )

    def _on_progress_change(self, change: dict) -> None:
        done, total = change["new"]
        with self.progress.hold_sync():
            self.progress.max = total
            self.progress.value = done

    # ---- drawing -------------------------------------------------------------------------------
    def _values(self, frame: pd.DataFrame) -> np.ndarray:
        column = "simulated_metric" if self.axis.value == METRIC and "simulated_metric" in frame else "simulated_output_sqnr_db"
        return frame[column].to_numpy(dtype=np.float64)

    def _draw(self) -> None:
        front, uniform = self.controller.points, self.controller.uniform
        metric = self.axis.value == METRIC
        sizes, values = front["size_bytes"].to_numpy(dtype=np.float64) / 1024, self._values(front)
        shown = np.isfinite(values)
        kept = uniform[np.isfinite(self._values(uniform))]
        history = self.controller.session.history
        runs = [r for r in history if r.ok and r.deployed_bytes and math.isfinite(_run_value(r, metric))]
        with self.hold_sync():
            with self.points.hold_sync():
                self.points.x, self.points.y = sizes[shown], values[shown]
                self.line.x, self.line.y = sizes[shown], values[shown]
            with self.uniform_marks.hold_sync():
                self.uniform_marks.x = kept["size_bytes"].to_numpy(dtype=np.float64) / 1024
                self.uniform_marks.y = self._values(kept)
            with self.runs.hold_sync():
                self.runs.x = np.array([r.deployed_bytes / 1024 for r in runs], dtype=np.float64)
                self.runs.y = np.array([_run_value(r, metric) for r in runs], dtype=np.float64)
            _pad(self.points.scales["x"], np.concatenate([self.points.x, self.uniform_marks.x, self.runs.x]))
            _pad(self.points.scales["y"], np.concatenate([self.points.y, self.uniform_marks.y, self.runs.y]))
            measures = self.controller.session.metric
            label = (measures.label if measures is not None else "metric") if metric else "output SQNR (dB)"
            self.figure.axes[1].label = label
            for mark in (self.points, self.uniform_marks, self.runs):
                mark.tooltip.labels = ["size (KB)", label]
            # short enough to stay clear of the figure's toolbar at 1,024 px (the text above counts the points)
            self.figure.title = f"Size front, {len(runs)} real run{'' if len(runs) == 1 else 's'}"
            self.uniform_text.value = _uniform_html(uniform, metric)
            if self.figure not in self.children:
                self.children = (*self.children, self.figure, self.chosen, self.uniform_text)
        if self.budget.value > 0:
            self._on_budget_change({"new": self.budget.value})

    def _y_range(self) -> tuple[float, float]:
        values = np.concatenate([self.points.y, self.uniform_marks.y, self.runs.y]).astype(np.float64)
        values = values[np.isfinite(values)]
        return (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)


def _pad(scale: bq.LinearScale, values: np.ndarray) -> None:
    """The scale's range: the values' with a margin, so that no mark sits on the frame."""
    values = values[np.isfinite(values)].astype(np.float64)
    if not values.size:
        return
    low, high = float(values.min()), float(values.max())
    margin = 0.04 * (high - low) or 0.5
    scale.min, scale.max = low - margin, high + margin


def _run_value(run: RunResult, metric: bool) -> float:
    if metric:
        return math.nan if run.eval_metric is None else float(run.eval_metric)
    return float(run.output_sqnr_db)


def _uniform_html(uniform: pd.DataFrame, metric: bool) -> str:
    """The uniform choices in words (the orange marks), one line."""
    column = "simulated_metric" if metric and "simulated_metric" in uniform else "simulated_output_sqnr_db"
    parts = []
    for label, row in uniform.iterrows():
        value = row[column]
        shown = "float" if math.isinf(value) else (f"{value:.4g}" if metric else f"{value:.2f} dB")
        parts.append(f"{html.escape(str(label))}: {row['size_bytes'] / 1024:,.1f} KB, {shown}")
    mark = f"<span style='color:{UNIFORM}'>&#9670;</span>"
    return f"<span style='color:#666'>{mark} uniform choices (simulated): {'; '.join(parts)}</span>"


def _figure() -> tuple[bq.Figure, bq.Lines, bq.Scatter, bq.Scatter, bq.Scatter, bq.Lines]:
    x_scale, y_scale = bq.LinearScale(), bq.LinearScale()
    scales = {"x": x_scale, "y": y_scale}
    empty = np.zeros(0, np.float64)
    line = bq.Lines(x=empty, y=empty, scales=scales, colors=[FRONT], opacities=[0.4], interpolation="step-after")
    points = bq.Scatter(
        x=empty,
        y=empty,
        scales=scales,
        colors=[FRONT],
        default_size=48,
        tooltip=_tooltip(),
        interactions={"click": "select", "hover": "tooltip"},
        selected_style={"fill": CHOSEN, "stroke": CHOSEN},
        labels=["front (simulated)"],
        display_legend=True,
    )
    uniform = bq.Scatter(
        x=empty,
        y=empty,
        scales=scales,
        colors=[UNIFORM],
        marker="diamond",
        default_size=90,
        labels=["uniform (simulated)"],
        display_legend=True,
        tooltip=_tooltip(),
    )
    runs = bq.Scatter(
        x=empty,
        y=empty,
        scales=scales,
        colors=[RUNS],
        marker="square",
        default_size=60,
        labels=["real runs"],
        display_legend=True,
        tooltip=_tooltip(),
    )
    budget = bq.Lines(x=empty, y=empty, scales=scales, colors=[CHOSEN], line_style="dashed")
    axes = [
        bq.Axis(scale=x_scale, label="deployed size (KB)", tick_format=",.0f"),
        bq.Axis(scale=y_scale, side="left", label="output SQNR (dB)", tick_format=".1f", label_offset="45px"),
    ]
    figure = bq.Figure(
        marks=[line, points, uniform, runs, budget],
        axes=axes,
        title="",
        legend_location="bottom-right",
        fig_margin={"top": 40, "bottom": 50, "left": 65, "right": 20},
        layout={"width": "100%", "height": "360px"},
    )
    return figure, line, points, uniform, runs, budget


def _tooltip() -> bq.Tooltip:
    return bq.Tooltip(fields=["x", "y"], labels=["size (KB)", "output SQNR (dB)"], formats=[",.1f", ".2f"])
