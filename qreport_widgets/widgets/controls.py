"""The Explore tab's controls: module, feature and view, with options derived from the ReportFrame."""

from __future__ import annotations

import ipywidgets as w

from .. import features as F
from ..frame import ReportFrame
from .views import ACTIVATION_VALUES, ALL_MODULES, View


def module_options(frame: ReportFrame) -> list[tuple[str, str]]:
    options = [("All modules", ALL_MODULES)]
    for name, row in frame.modules.iterrows():
        options.append((f"{name} ({row['module_type']}, {row['channels']} ch)", name))
    return options


def feature_options(frame: ReportFrame, module: str) -> list[tuple[str, str]]:
    """Only the features that exist for ``module``: numeric per-channel ones first, then per-tensor."""
    if module == ALL_MODULES:
        per_channel, per_tensor = frame.channel_features, frame.tensor_features
        has_histogram = False
    else:
        per_channel, per_tensor = frame.features_of(module)
        has_histogram = module in frame.histograms
    numeric = [f for f in per_tensor if frame.is_numeric(f)]
    options = [(f"{f} · per-channel", f) for f in per_channel]
    if has_histogram:
        options.append((f"{ACTIVATION_VALUES} · recorded histogram", ACTIVATION_VALUES))
    options += [(f"{f} · per-tensor", f) for f in numeric]
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
        self.prefix = w.Text(placeholder="module prefix", description="Filter", layout={"width": "220px"})
        self.changing = False
        self.refresh_features()
        super().__init__([self.module, self.feature, self.view, self.prefix], layout={"flex_flow": "row wrap"})

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
