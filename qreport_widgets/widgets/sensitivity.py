"""The Tune tab's "which module hurts" pane: simulated sensitivity, the trade-off curve, a target to reach."""

from __future__ import annotations

from collections.abc import Callable

import bqplot as bq
import ipywidgets as w
import numpy as np
import pandas as pd

from .plots import bar_range
from .tune_controller import TuneController

TOP = 20  # bars shown, most harmful first


class SensitivityPane(w.VBox):
    """Buttons to rank modules (simulated, calibrated once) and to propose the float set for a target.

    Args:
        controller: runs the ranking and the plan (its ``busy`` disables the buttons here too).
        propose: called with the module names to keep float (the Tune rows take them).
        reorder: called with the module names in the order the rows should take.
    """

    def __init__(
        self, controller: TuneController, propose: Callable[[list[str]], None], reorder: Callable[[list[str]], None]
    ) -> None:
        self.controller, self._propose, self._reorder = controller, propose, reorder
        self.compute = _button("Sensitivity", "search", 130, "Rank modules by the output SQNR gained when each alone stays float")
        self.order = w.ToggleButtons(
            options=["forward order", "most harmful first"],
            value="forward order",
            disabled=True,
            style={"button_width": "150px"},
            layout={"flex": "0 0 auto"},
        )
        self.target = w.FloatText(value=0.0, description="target dB", layout={"width": "170px", "flex": "0 0 auto"})
        self.reach = _button(
            "Propose float set",
            "bullseye",
            170,
            "The fewest modules kept float for the target, each picked by what it gains given the picks before",
        )
        self.cancel = _button("Cancel", "stop", 100, "Stop the computation at the next module")
        self.progress = w.IntProgress(
            value=0, min=0, max=1, layout={"width": "160px", "visibility": "hidden", "flex": "0 0 auto"}
        )
        self.remaining = w.HTML(layout={"flex": "0 0 auto", "margin": "0 6px"})
        self.status = w.HTML()
        self.bars, self.bars_figure = _bars()
        self.curve, self.target_line, self.curve_figure = _curve()
        self.curve_axis = self.curve_figure.axes[0]
        self.figures = w.HBox([self.bars_figure, self.curve_figure], layout={"width": "100%", "flex_flow": "row wrap"})
        controls = w.HBox(
            [self.compute, self.order, self.target, self.reach, self.progress, self.remaining, self.cancel],
            layout={"flex_flow": "row wrap", "align_items": "center"},
        )
        super().__init__([controls, self.status])
        w.link((controller, "target"), (self.target, "value"))
        w.dlink((controller, "ranking_status"), (self.status, "value"))
        for button in (self.compute, self.reach):
            w.dlink((controller, "busy"), (button, "disabled"))
        w.dlink((controller, "cancellable"), (self.cancel.layout, "display"), lambda shown: "" if shown else "none")
        w.dlink((controller, "cancellable"), (self.progress.layout, "visibility"), lambda shown: "visible" if shown else "hidden")
        controller.observe(self._on_progress_change, "progress")
        w.dlink(
            (controller, "remaining"),
            (self.remaining, "value"),
            lambda text: f"<span style='color:#666'>{text}</span>" if text else "",
        )
        w.dlink((controller, "cancellable"), (self.remaining.layout, "display"), lambda shown: "" if shown else "none")
        self.compute.on_click(self._on_compute_click)
        self.reach.on_click(self._on_reach_click)
        self.cancel.on_click(self._on_cancel_click)
        self.order.observe(self._on_order_change, names="value")
        controller.observe(self._on_unit_change, "by_block")

    @property
    def table(self) -> pd.DataFrame | None:
        """The sensitivity ranking, once computed."""
        return self.controller.table

    # ---- handlers ------------------------------------------------------------------------------
    def _on_compute_click(self, _button: w.Button) -> None:
        if self.controller.rank():
            self._draw()

    def _on_reach_click(self, _button: w.Button) -> None:
        drawn = self.controller.table is not None
        plan = self.controller.propose()
        if plan is None:
            return
        self._propose(plan.float_modules)
        if not drawn and self.controller.table is not None:  # the plan ranked the modules: draw them too
            self._draw()

    def _on_order_change(self, change: dict) -> None:
        if self.table is None:
            return
        ranked = list(self.table.index)
        if self.controller.by_block:  # the blocks' modules, most harmful block first
            blocks = self.controller.session.blocks()
            ranked = [fqn for block in ranked for fqn in blocks.get(block, [])]
        self._reorder(ranked if change["new"] == "most harmful first" else [])

    def _on_unit_change(self, change: dict) -> None:
        """Modules or blocks: the ranking drawn was for the other; the rows go back to forward order."""
        with self.hold_sync():
            self.children = tuple(child for child in self.children if child is not self.figures)
            self.order.value = "forward order"
            self.order.disabled = True
        unit = "block" if change["new"] else "module"
        self.compute.tooltip = f"Rank {unit}s by the output SQNR gained when each alone stays float"
        self.reach.tooltip = f"The fewest {unit}s kept float for the target, each picked by what it gains given the picks before"

    def _on_cancel_click(self, _button: w.Button) -> None:
        # JupyterLab handles widget messages on another kernel thread while a computation runs, so
        # this arrives during it; the next progress report stops the computation
        self.controller.cancel()

    def _on_progress_change(self, change: dict) -> None:
        done, total = change["new"]
        with self.progress.hold_sync():
            self.progress.max = total
            self.progress.value = done

    # ---- drawing -------------------------------------------------------------------------------
    def _draw(self) -> None:
        table, curve = self.controller.table, self.controller.curve
        top = table.head(TOP)
        gains = top["output_sqnr_gain_db"].to_numpy(dtype=np.float64)
        low, high, span = bar_range(gains)
        unit = "block" if self.controller.by_block else "module"
        with self.hold_sync():
            with self.bars.hold_sync():
                # bars rise from the bottom of the axis, so a gain near zero still shows as a short bar
                floor = low - 0.05 * span
                self.bars.scales["y"].min, self.bars.scales["y"].max = floor, high + 0.1 * span
                self.bars.base = floor
                self.bars.x, self.bars.y = list(top.index), gains.astype(np.float32)
                self.bars.tooltip.labels = [unit, "gain (dB)"]
            if curve is not None:  # the trade-off is per module
                counts = curve.index.to_numpy(dtype=np.float64)
                sqnr = curve["simulated_output_sqnr_db"].to_numpy(dtype=np.float64)
                with self.curve.hold_sync():
                    self.curve.x, self.curve.y = counts.astype(np.float32), sqnr.astype(np.float32)
                self.target_line.x = np.array([counts.min(), counts.max()], dtype=np.float32)
                self.target_line.y = np.array([self.target.value] * 2, dtype=np.float32)
                self.curve_axis.tick_values = np.unique(np.linspace(0, counts.max(initial=0), min(len(counts), 11)).round())
            self.figures.children = (self.bars_figure, self.curve_figure) if curve is not None else (self.bars_figure,)
            kept = "each block kept float whole" if unit == "block" else "kept float"
            self.bars_figure.title = f"Gain if {kept}, top {len(top)} of {len(table)} (simulated)"
            if self.figures not in self.children:
                self.children = (*self.children, self.figures)
            self.order.disabled = False


def _button(description: str, icon: str, width: int, tooltip: str) -> w.Button:
    return w.Button(description=description, icon=icon, tooltip=tooltip, layout={"width": f"{width}px", "flex": "0 0 auto"})


def _bars() -> tuple[bq.Bars, bq.Figure]:
    x_scale, y_scale = bq.OrdinalScale(), bq.LinearScale(min=0.0, max=1.0)
    tooltip = bq.Tooltip(fields=["x", "y"], labels=["module", "gain (dB)"], formats=["", ".3f"])
    bars = bq.Bars(
        x=[], y=np.zeros(0, np.float32), scales={"x": x_scale, "y": y_scale}, colors=["#d62728"], padding=0.2, tooltip=tooltip
    )
    axes = [
        bq.Axis(scale=x_scale, label="", tick_rotate=-35, tick_style={"font-size": "9px"}),
        bq.Axis(scale=y_scale, side="left", label="gain (dB)", tick_format=".2f", label_offset="50px"),
    ]
    figure = bq.Figure(
        marks=[bars],
        axes=axes,
        title="",
        fig_margin={"top": 40, "bottom": 90, "left": 70, "right": 10},
        layout={"flex": "3 1 460px", "height": "340px"},
    )
    return bars, figure


def _curve() -> tuple[bq.Lines, bq.Lines, bq.Figure]:
    x_scale, y_scale = bq.LinearScale(), bq.LinearScale()
    scales = {"x": x_scale, "y": y_scale}
    curve = bq.Lines(
        x=np.zeros(0, np.float32),
        y=np.zeros(0, np.float32),
        scales=scales,
        marker="circle",
        marker_size=16,
        colors=["#1f77b4"],
        tooltip=bq.Tooltip(fields=["x", "y"], labels=["float modules", "SQNR (dB)"], formats=["", ".2f"]),
    )
    target = bq.Lines(
        x=np.zeros(0, np.float32), y=np.zeros(0, np.float32), scales=scales, colors=["#d62728"], line_style="dashed"
    )
    axes = [
        bq.Axis(scale=x_scale, label="modules kept float", tick_format="d"),
        bq.Axis(scale=y_scale, side="left", label="output SQNR (dB)", tick_format=".1f", label_offset="45px"),
    ]
    figure = bq.Figure(
        marks=[curve, target],
        axes=axes,
        title="Trade-off (simulated)",
        fig_margin={"top": 40, "bottom": 50, "left": 65, "right": 10},
        layout={"flex": "2 1 320px", "height": "340px"},
    )
    return curve, target, figure
