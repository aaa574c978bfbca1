"""The Explore tab's controls: module, feature and view, with options derived from the ReportFrame."""

from __future__ import annotations

import ipywidgets as w

from .. import features as F
from ..frame import ReportFrame
from .views import ACTIVATION_VALUES, ALL_MODULES, View, readable


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
    F.TOLERANCE, F.EQUALIZATION_THRESHOLD, F.EQUALIZATION_CHANNEL_AXIS, F.OUTLIER_RATIO_THRESHOLD,
    F.OUTLIER_REFERENCE_PERCENTILE, F.OUTLIER_CHANNEL_AXIS, F.BACKEND,
}  # fmt: skip


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


class ExploreControls(w.HBox):
    """Module dropdown, feature dropdown, view toggle and a module-prefix filter for tables."""

    def __init__(self, frame: ReportFrame) -> None:
        self.frame = frame
        self.module = w.Dropdown(options=module_options(frame), value=ALL_MODULES, description="Module",
                                 layout={"width": "340px"})  # fmt: skip
        self.feature = w.Dropdown(description="Feature", layout={"width": "480px"})
        self.view = w.ToggleButtons(options=[v.value for v in View], value=View.LINE.value,
                                    style={"button_width": "90px"})  # fmt: skip
        self.prefix = w.Text(placeholder="name or type", description="Find", layout={"width": "220px"},
                             tooltip="narrows the module list and the tables")  # fmt: skip
        self.changing = False
        self.refresh_features()
        self.prefix.observe(self._on_search, "value")
        super().__init__([self.module, self.feature, self.view, self.prefix], layout={"flex_flow": "row wrap"})

    def _on_search(self, _change: dict) -> None:
        """Narrow the module list to the modules whose name or type holds the text (the choice stays if it matches)."""
        options = module_options(self.frame, self.prefix.value)
        current = self.module.value
        self.module.options = options
        self.module.value = current if current in [v for _, v in options] else ALL_MODULES

    def refresh_features(self) -> None:
        """Offer the chosen module's features, keeping the current one when it still applies."""
        options = feature_options(self.frame, self.module.value)
        current = self.feature.value
        values = [value for _, value in options]
        self.changing = True  # listeners skip the intermediate values
        try:
            self.feature.options = options
            self.feature.value = current if current in values else (_preferred(values) if values else None)
        finally:
            self.changing = False


def _preferred(values: list[str]) -> str:
    for candidate in (F.OUTLIER_RATIOS, F.INPUT_PER_CHANNEL_MAX):
        if candidate in values:
            return candidate
    return values[0]
