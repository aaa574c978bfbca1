"""The Explore tab's controls: module, feature and view, with options derived from the ReportFrame.

What they select is one declared trait, ``ExploreControls.selection``, set once per user action.
"""

from __future__ import annotations

from dataclasses import dataclass

import ipywidgets as w
import numpy as np
import pandas as pd
import traitlets

from ..core import features as F
from ..engines.settings import module_blocks
from ..observe.frame import ReportFrame
from .views import ACTIVATION_VALUES, ALL_MODULES, View, flagged_modules, readable


def measured_modules(frame: ReportFrame) -> list[str]:
    """The modules some detector reports a value for (an Identity or a Dropout has none)."""
    return [name for name in frame.module_names if frame.present.get(name)]


def module_options(frame: ReportFrame, search: str = "") -> list[tuple[str, str]]:
    """All modules, then each measured module whose name or type contains ``search`` (case ignored)."""
    options = [("All modules", ALL_MODULES)]
    text = search.strip().lower()
    for name in measured_modules(frame):
        row = frame.modules.loc[name]
        label = f"{name} ({row['module_type']}, {row['channels']} ch)"
        if not text or text in label.lower():
            options.append((label, name))
    return options


# the built-in detectors' settings, reported per module by torch's report keys
SETTINGS = {
    F.TOLERANCE,
    F.EQUALIZATION_THRESHOLD,
    F.EQUALIZATION_CHANNEL_AXIS,
    F.OUTLIER_RATIO_THRESHOLD,
    F.OUTLIER_REFERENCE_PERCENTILE,
    F.OUTLIER_CHANNEL_AXIS,
    F.BACKEND,
}


def settings_features(frame: ReportFrame) -> set[str]:
    """A detector's settings (a threshold, a channel axis), not measurements: not offered for
    plotting. The built-in ones, and any per-module number that is the same for every module."""
    found = set(SETTINGS)
    for feature in frame.tensor_features:
        if frame.is_numeric(feature):
            values = frame.modules[feature].dropna()
            if len(values) > 1 and values.nunique() == 1:
                found.add(feature)
    return found


def feature_options(frame: ReportFrame, module: str) -> list[tuple[str, str]]:
    """Only the features that exist for ``module``: numeric per-channel ones first, then per-tensor."""
    if module == ALL_MODULES:
        per_channel, per_tensor = frame.channel_features, frame.tensor_features
        has_histogram = False
    else:
        per_channel, per_tensor = frame.features_of(module)
        has_histogram = module in frame.histograms
    constant = settings_features(frame)
    numeric = [f for f in per_tensor if frame.is_numeric(f) and f not in constant]
    options = [(f"{readable(f)} · per channel", f) for f in per_channel]
    if has_histogram:
        options.append(("activation values · recorded histogram", ACTIVATION_VALUES))
    options += [(f"{readable(f)} · per module", f) for f in numeric]
    return options


MOSTLY_FLAGGED = 0.5  # a feature whose detector flags more than this share of the modules says little at first sight
MOSTLY_POSITIVE = 0.9  # the share of modules a feature must be positive on to be compared in decades


def module_values(frame: ReportFrame, feature: str) -> pd.Series:
    """What Explore draws for ``feature`` over all modules: the mean over each module's channels
    for a per-channel feature, the value itself for a per-module one (NaN where not reported)."""
    if feature in frame.channel_features:
        return frame.per_module(feature)["mean"]
    return pd.to_numeric(frame.modules[feature], errors="coerce")


def opening_feature(frame: ReportFrame) -> str | None:
    """The feature Explore opens on: the measurement that best tells the modules apart.

    Of the features offered over all modules, those left out are flags (a per-channel feature
    that is only ever 0 or 1: a verdict, not a measurement), a feature whose detector flags more
    than ``MOSTLY_FLAGGED`` of the modules (red nearly everywhere), and a feature that is not
    positive on at least ``MOSTLY_POSITIVE`` of the modules reporting it. Each remaining feature's
    per-module values (``module_values``) are scored by the interquartile range of their log10:
    how many decades the middle half of the modules spans, so that one module far above the rest
    (an outlier ratio of 70,000 among ratios near 2) does not win on its own. The highest score
    wins, ties going to the feature listed first; with no candidate, ``preferred_feature``.
    """
    offered = [value for _, value in feature_options(frame, ALL_MODULES)]
    best, best_spread = None, -1.0
    for feature in offered:
        if feature in frame.channel_features and frame.channels[feature].dropna().isin((0.0, 1.0)).all():
            continue
        flagged = flagged_modules(frame, feature)
        values = module_values(frame, feature).to_numpy(dtype=np.float64)
        reported = np.isfinite(values)
        positive = values[reported & (values > 0)]
        if positive.size < 2 or positive.size < MOSTLY_POSITIVE * reported.sum():
            continue
        if flagged is not None and flagged.to_numpy()[reported].mean() > MOSTLY_FLAGGED:
            continue
        low, high = np.percentile(np.log10(positive), [25, 75])
        if high - low > best_spread:
            best, best_spread = feature, float(high - low)
    return best if best is not None else preferred_feature(offered)


def preferred_feature(values: list[str]) -> str | None:
    """The feature shown when the current one does not apply: the outlier ratio, the input max, or the first."""
    for candidate in (F.OUTLIER_RATIOS, F.INPUT_PER_CHANNEL_MAX):
        if candidate in values:
            return candidate
    return values[0] if values else None


@dataclass(frozen=True)
class Selection:
    """What Explore shows: a module (``ALL_MODULES`` for all), one of its features, a view and the Find text."""

    module: str = ALL_MODULES
    feature: str | None = None
    view: View = View.POINTS
    prefix: str = ""


class ExploreControls(w.HBox):
    """Module dropdown, feature dropdown, view toggle and a module-prefix filter for tables.

    Listeners observe ``selection``: it changes once per user action, never to a half-updated
    pair (a new module with the old module's feature), because the widgets' updates run with
    trait notifications held and only the end state is announced.
    """

    selection = traitlets.Instance(Selection, help="the module, feature, view and Find text shown; set by the widgets")

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame
        self.module = w.Dropdown(
            options=module_options(frame), value=ALL_MODULES, description="Module", layout={"width": "340px"}
        )
        self.feature = w.Dropdown(
            options=feature_options(frame, ALL_MODULES),
            value=opening_feature(frame),
            description="Feature",
            layout={"width": "480px"},
        )
        self.view = w.ToggleButtons(
            options=[v.value for v in View],
            value=View.POINTS.value,
            style={"button_width": "96px"},
            tooltips=[
                "a point per channel, or per module",
                "the points joined, in channel or forward order",
                "how the values are distributed",
                "the numbers, with the suggestions",
            ],
        )
        self.prefix = w.Text(
            placeholder="name or type",
            description="Find",
            layout={"width": "220px"},
            tooltip="narrows the module list and the tables",
        )
        blocks = [name for name, members in module_blocks(measured_modules(frame)).items() if len(members) > 1]
        self.block = w.Dropdown(  # a transformer's blocks (model.layers.3): the Find text that picks one
            options=[("all blocks", ""), *((name, f"{name}.") for name in blocks)],
            value="",
            description="Block",
            tooltip="narrows the module list and the tables to one block",
            layout={"width": "230px"} if blocks else {"display": "none"},
            style={"description_width": "40px"},
        )
        children = [self.module, self.feature, self.view, self.prefix, self.block]
        super().__init__(children, layout={"flex_flow": "row wrap"})
        self._features: dict[str, list[tuple[str, str]]] = {ALL_MODULES: self.feature.options}
        self.selection = self._selected()
        self.module.observe(self._on_module_change, "value")
        self.feature.observe(self._on_feature_change, "value")
        self.view.observe(self._on_view_change, "value")
        self.prefix.observe(self._on_prefix_change, "value")
        self.block.observe(self._on_block_change, "value")

    @traitlets.validate("selection")
    def _validate_selection(self, proposal: traitlets.Bunch) -> Selection:
        selection = proposal.value
        if selection.feature not in [None, *[v for _, v in self._features_of(selection.module)]]:
            raise traitlets.TraitError(f"{selection.module or 'all modules'} has no feature {selection.feature!r} to show")
        return selection

    def show_module(self, fqn: str) -> bool:
        """Select ``fqn`` (clearing a Find text that hides it); False when no detector measured it."""
        if fqn not in measured_modules(self.frame):
            return False
        if fqn not in [value for _, value in self.module.options]:
            self.prefix.value = ""
        self.module.value = fqn
        return True

    def _on_module_change(self, _change: dict) -> None:
        with self.hold_trait_notifications():  # the feature list follows; listeners see the end state only
            self._offer_features()
            self.selection = self._selected()

    def _on_feature_change(self, _change: dict) -> None:
        self.selection = self._selected()

    def _on_view_change(self, _change: dict) -> None:
        self.selection = self._selected()

    def _on_block_change(self, change: dict) -> None:
        if change["new"] or self.prefix.value == change["old"]:  # not when typing over the block's text cleared it
            self.prefix.value = change["new"]

    def _on_prefix_change(self, _change: dict) -> None:
        """Narrow the module list to the modules whose name or type holds the text (the choice stays if it matches)."""
        if self.block.value and self.prefix.value != self.block.value:  # typed over the block's text
            self.block.value = ""
        with self.hold_trait_notifications():
            options = module_options(self.frame, self.prefix.value)
            module, feature = self.module.value, self.feature.value
            self.module.options = options  # a Dropdown given new options selects the first one
            self.module.value = module if module in [v for _, v in options] else ALL_MODULES
            if feature in [v for _, v in self.feature.options]:
                self.feature.value = feature
            self.selection = self._selected()

    def _offer_features(self) -> None:
        """Offer the chosen module's features, keeping the current one when it still applies."""
        options = self._features_of(self.module.value)
        current = self.feature.value
        values = [value for _, value in options]
        self.feature.options = options
        self.feature.value = current if current in values else preferred_feature(values)

    def _features_of(self, module: str) -> list[tuple[str, str]]:
        if module not in self._features:
            self._features[module] = feature_options(self.frame, module)
        return self._features[module]

    def _selected(self) -> Selection:
        return Selection(self.module.value, self.feature.value, View(self.view.value), self.prefix.value)
