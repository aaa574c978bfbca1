"""One Tune row: a module's settings as controls, kept in step with its ``settings`` trait."""

from __future__ import annotations

import html
from contextlib import ExitStack

import ipywidgets as w
from ipywidgets.widgets.widget_bool import CheckboxStyle
from ipywidgets.widgets.widget_description import DescriptionStyle
from ipywidgets.widgets.widget_string import HTMLStyle
from traitlets import Bool, Instance, Unicode, observe

from ..engines.settings import (
    ALGORITHM_FORMATS,
    AWQ,
    DEFAULT_ALGORITHM,
    DEFAULT_GROUP_SIZE,
    GPTQ,
    GROUPED_FORMATS,
    HQQ,
    LEARNED,
    ModuleSettings,
    Setting,
    TunableModule,
    validate,
)
from ..errors import InvalidSettingsError

STATIC, DYNAMIC = "static", "dynamic"
PER_TENSOR, PER_CHANNEL = "per-tensor", "per-channel"
ALGORITHM_LABELS = {DEFAULT_ALGORITHM: "round", HQQ: "HQQ", GPTQ: "GPTQ", AWQ: "AWQ", LEARNED: "learned"}
OBSERVER_OPTIONS = [("as started", ""), ("MinMax", "minmax"), ("Histogram", "histogram"), ("Percentile", "percentile")]
RowParts = dict[str, w.Layout | w.Style]  # what the rows of one panel share


class SettingsRow(w.VBox):
    """One module's editable settings; the reason for each suggestion is on hover and in the row.

    ``settings`` and the controls are one value: setting the trait updates every control at once
    (listeners see no half-updated row), and a control's edit updates the trait.
    """

    settings = Instance(ModuleSettings, args=(), help="the module's settings, as its controls show them")
    run_note = Unicode("", help="what the last run did not carry out of these settings ('' when it did all)")
    picked = Bool(False, help="the module picked in the Graph tab: its name is highlighted")

    def __init__(self, module: TunableModule, reasons: list[str], migration: str = "", parts: RowParts | None = None) -> None:
        self.fqn = fqn = module.fqn
        self.module = module
        self.suggested = bool(reasons)
        self._search = f"{fqn} {module.type_name}".lower()
        self._reasons = reasons
        shared = parts if parts is not None else row_parts()  # one set for all rows: a 250-row model stays light
        dropdown, checkbox = shared["dropdown"], shared["checkbox"]
        self.activation = w.Dropdown(
            options=[STATIC, DYNAMIC],
            disabled=not module.allows(Setting.DYNAMIC),
            tooltip="activations: static (calibrated) or dynamic (Linear only)",
            layout=shared["activation"],
            style=dropdown,
        )
        self.weight = w.Dropdown(
            options=[PER_TENSOR, PER_CHANNEL],
            disabled=not module.allows(Setting.PER_CHANNEL),
            tooltip="weights: one scale per tensor or per output channel",
            layout=shared["weight"],
            style=dropdown,
        )
        equalize_tip = module.why_not(Setting.EQUALIZE) or "input-weight equalization with the next layer"
        self.equalize = w.Checkbox(
            description="equalize",
            indent=False,
            layout=shared["equalize"],
            style=checkbox,
            disabled=not module.allows(Setting.EQUALIZE),
            tooltip=equalize_tip,
        )
        self.keep_float = w.Checkbox(description="keep float", indent=False, layout=shared["keep_float"], style=checkbox)
        observer_tip = (
            "the activation observer of this module's output (static activations); "
            "Percentile: the range of each batch's 0.01th to 99.99th percentile"
        )
        self.observer = w.Dropdown(
            options=OBSERVER_OPTIONS,
            disabled=not module.allows(Setting.OBSERVER),
            tooltip=module.why_not(Setting.OBSERVER) or observer_tip,
            layout=shared["observer"],
            style=dropdown,
        )
        # only where the session found outlier channels to move into the weights; last, so its
        # absence shifts no other control
        self.migrate = w.Checkbox(
            description="migrate",
            indent=False,
            disabled=not migration,
            tooltip=migration,
            layout=shared["migrate" if migration else "hidden"],
            style=checkbox,
        )
        # an engine with formats (eager): one format dropdown (float among them) and the int4 group
        # size in place of the activation / weight / equalize / keep float / observer controls
        offered = [name for name, why in module.formats.items() if not why]
        refused = "; ".join(f"{name}: {why}" for name, why in module.formats.items() if why)
        format_tip = "the module's format (torchao)" + (f". Not offered here: {refused}" if refused else "")
        self.format = w.Dropdown(
            options=offered or ["float"],
            tooltip=format_tip,
            layout=shared["format" if module.formats else "hidden"],
            style=dropdown,
        )
        groups = list(module.group_sizes) or [DEFAULT_GROUP_SIZE]
        self.group = w.Dropdown(
            options=[(f"group {g}", g) for g in groups],
            value=groups[0],
            disabled=True,
            tooltip="int4 formats: weights per scale (smaller groups: more scales, less error)",
            layout=shared["group" if module.formats else "hidden"],
            style=dropdown,
        )
        algorithms = [
            (ALGORITHM_LABELS[name], "" if name == DEFAULT_ALGORITHM else name)
            for name, why in module.algorithms.items()
            if not why
        ]
        refused_algorithms = "; ".join(f"{name}: {why}" for name, why in module.algorithms.items() if why)
        algorithm_tip = (
            "int4 weight-only: how the int4 values are chosen (round to nearest; HQQ: torchao's scale search; "
            "GPTQ / AWQ: from the calibration inputs; learned: each block's rounding learned on its output, minutes a decoder)"
            + (f". Not offered here: {refused_algorithms}" if refused_algorithms else "")
        )
        self.algorithm = w.Dropdown(
            options=algorithms or [(ALGORITHM_LABELS[DEFAULT_ALGORITHM], "")],
            value="",
            disabled=True,
            tooltip=algorithm_tip,
            layout=shared["algorithm" if module.algorithms else "hidden"],
            style=dropdown,
        )
        if module.formats:
            for control in (self.activation, self.weight, self.equalize, self.keep_float, self.observer):
                control.layout = shared["hidden"]
        self._controls = (
            self.activation,
            self.weight,
            self.equalize,
            self.keep_float,
            self.observer,
            self.format,
            self.group,
            self.algorithm,
            self.migrate,
        )
        self._name = f"<b>{html.escape(fqn)}</b> <span style='color:#666'>{html.escape(module.type_name)}</span>"
        self.why = w.HTML(layout=shared["why"], style=shared["html"])  # the module's name, then why
        # two lines at any width: the module and why, then its settings; rows keep their height
        # inside the scrolling box (a flex column would squeeze them together)
        controls = w.HBox(list(self._controls), layout=shared["controls"])
        super().__init__([self.why, controls], layout=shared["row"])
        for control in self._controls:
            control.observe(self._on_control_change, "value")
        if module.current == self.settings:  # the controls' defaults already: no change to announce
            self._render_why()
        else:
            self.settings = module.current  # the observer sets the controls and renders

    def set_reasons(self, reasons: list[str], suggested: bool) -> None:
        """Show measured verdicts in place of the detectors' reasons (``suggested``: one is offered)."""
        self._reasons, self.suggested = reasons, suggested
        self._render_why()

    def matches(self, text: str) -> bool:
        """Whether ``text`` is part of the module's name or type (case ignored)."""
        return text.lower() in self._search

    # ---- handlers ------------------------------------------------------------------------------
    def _on_control_change(self, _change: dict) -> None:
        self.settings = self._from_controls()

    @observe("settings")
    def _on_settings_change(self, change: dict) -> None:
        value: ModuleSettings = change["new"]
        with ExitStack() as held:  # every control takes its value before any listener hears of one
            for control in self._controls:
                held.enter_context(control.hold_trait_notifications())
            self.activation.value = DYNAMIC if value.dynamic else STATIC
            self.weight.value = PER_CHANNEL if value.per_channel else PER_TENSOR
            self.equalize.value = value.equalize
            self.keep_float.value = value.keep_float
            self.migrate.value = value.migrate
            self.observer.value = value.observer
            if self.module.formats:
                shown = "float" if value.keep_float else value.format
                if shown in self.format.options:  # else the row says why it cannot be applied
                    self.format.value = shown
                size = value.group_size or DEFAULT_GROUP_SIZE
                if size in dict(self.group.options).values():
                    self.group.value = size
                self.group.disabled = self.format.value not in GROUPED_FORMATS
                if value.algorithm in dict(self.algorithm.options).values():
                    self.algorithm.value = value.algorithm
                self.algorithm.disabled = self.format.value not in ALGORITHM_FORMATS
        self._render_why()

    @observe("picked")
    def _on_picked_change(self, _change: dict) -> None:
        self._render_why()

    @observe("run_note")
    def _on_run_note_change(self, _change: dict) -> None:
        self._render_why()

    # ---- helpers -------------------------------------------------------------------------------
    def _from_controls(self) -> ModuleSettings:
        if self.module.formats:
            grouped = self.format.value in GROUPED_FORMATS
            self.group.disabled = not grouped
            chooses = self.format.value in ALGORITHM_FORMATS
            self.algorithm.disabled = not chooses
            return ModuleSettings(
                format=self.format.value,
                group_size=self.group.value if grouped else 0,
                algorithm=self.algorithm.value if chooses else "",
                migrate=self.migrate.value,
            )
        return ModuleSettings(
            dynamic=self.activation.value == DYNAMIC,
            per_channel=self.weight.value == PER_CHANNEL,
            equalize=self.equalize.value,
            keep_float=self.keep_float.value,
            migrate=self.migrate.value,
            observer=self.observer.value,
        )

    def _render_why(self) -> None:
        """The reasons, and in red why these settings cannot be applied to this module, if so."""
        tip = html.escape("; ".join(self._reasons) or "no suggestion")
        problem = ""
        try:
            validate(self.module, self.settings)
        except InvalidSettingsError as error:
            problem = f"<div style='color:#b00'>{html.escape(str(error).removeprefix(self.fqn + ': '))}</div>"
        if self.run_note:
            problem += f"<div style='color:#a60'>last run: {html.escape(self.run_note)}</div>"
        why = f"<span style='font-size:11px;line-height:1.3;color:#444' title='{tip}'>{problem}{tip}</span>"
        name = f"<span style='background:#fff3b0;padding:0 3px'>▶ {self._name}</span>" if self.picked else self._name
        self.why.value = (
            "<div style='display:flex;flex-wrap:wrap;align-items:baseline;column-gap:12px'>"
            f"<span style='white-space:nowrap' title='{tip}'>{name}</span>{why}</div>"
        )


def row_parts() -> RowParts:
    """The layouts and styles the Tune rows of one panel share (one browser model each, not one per
    row). Widths hold each label in full (a dropdown needs its text + 30 px, a checkbox + 22 px);
    the controls fit one line of a 520 px tab."""
    fixed = {"flex": "0 0 auto", "margin": "2px 1px 2px 0"}
    widths = {
        "activation": 88,
        "weight": 108,
        "equalize": 78,
        "keep_float": 88,
        "observer": 100,
        "migrate": 74,
        "format": 196,
        "group": 96,
        "algorithm": 84,
    }
    parts: RowParts = {name: w.Layout(width=f"{px}px", **fixed) for name, px in widths.items()}
    parts["hidden"] = w.Layout(display="none")
    parts["why"] = w.Layout(width="100%")
    parts["controls"] = w.Layout(align_items="center", flex_flow="row wrap")
    parts["row"] = w.Layout(border_bottom="1px solid #eee", flex="0 0 auto", padding="2px 0")
    parts["dropdown"], parts["checkbox"], parts["html"] = DescriptionStyle(), CheckboxStyle(), HTMLStyle()
    return parts
