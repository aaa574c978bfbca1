"""What the widget needs from the core, as protocols: a report source and, for tuning, a session.

``Analysis`` (from ``analyze()``, ``ModelReport.analysis()`` or ``load_report``) is a report source;
``QuantizationSession`` is a tuning session. The widget names neither class, so anything offering
these members can be shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import pandas as pd

    from ..core.metrics import Metric
    from ..engines.settings import ModuleSettings, TunableModule
    from ..observe.frame import ReportFrame
    from ..observe.records import Suggestion
    from ..tune.diagnosis import ReachPlan
    from ..tune.migration import Migration
    from ..tune.run import RunResult
    from ..tune.truth import TruthCheck
    from ..tune.verify import VerifiedSuggestions


@runtime_checkable
class GraphView(Protocol):
    """The model's structure as the analysis saw it."""

    @property
    def units(self) -> Mapping[str, str]: ...  # observed module -> type name, forward order

    @property
    def skipped(self) -> Mapping[str, str]: ...  # module -> why it was not observed

    @property
    def kind(self) -> str: ...  # "graph" (FX / torch.export) or "modules" (run eagerly, observed by hooks)

    def op_counts(self) -> dict[str, int]: ...

    def layer_type_counts(self) -> dict[str, int]: ...


@runtime_checkable
class ReportSource(Protocol):
    """A generated report: names, counts, the tables, texts and suggestions."""

    @property
    def model_name(self) -> str: ...

    @property
    def detectors(self) -> Sequence[str]: ...

    @property
    def batches(self) -> int: ...

    @property
    def saved_at(self) -> str | None: ...

    @property
    def graph(self) -> GraphView: ...

    def frame(self) -> ReportFrame: ...

    def text_reports(self) -> Mapping[str, str]: ...

    def suggestions(self) -> Sequence[Suggestion]: ...


@runtime_checkable
class TuningSession(Protocol):
    """Edit per-module settings, run them, keep and compare the runs."""

    history: list[RunResult]
    metric: Metric | None  # what the runs' eval_metric measures; None without one

    @property
    def modules(self) -> list[TunableModule]: ...

    def current_settings(self) -> dict[str, ModuleSettings]: ...

    def suggested_settings(self, suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]: ...

    def verified_suggestions(
        self,
        suggestions: Iterable[Suggestion],
        *,
        nan_metric: Iterable[str] = (),
        progress: Callable[[int, int | None], None] | None = None,
    ) -> VerifiedSuggestions: ...

    def migrations(self) -> dict[str, Migration]: ...

    def settings_as_code(self, settings: Mapping[str, ModuleSettings]) -> str: ...

    def baseline(self, progress: Callable[[int, int | None], None] | None = None) -> RunResult: ...

    def apply(
        self,
        settings: Mapping[str, ModuleSettings],
        *,
        label: str | None = None,
        progress: Callable[[int, int | None], None] | None = None,
        rotation: bool | None = None,
    ) -> RunResult: ...

    def rotation_problems(self) -> dict[str, str]: ...

    def compare(self) -> tuple[pd.DataFrame, pd.DataFrame]: ...

    def keep(self, run: int | RunResult, keep: bool = True) -> RunResult: ...

    def kept(self, run: int | RunResult) -> bool: ...

    def truth_check(self, progress: Callable[[int, int | None], None] | None = None) -> TruthCheck: ...

    def sensitivity(self, progress: Callable[[int, int | None], None] | None = None) -> pd.DataFrame: ...

    def blocks(self) -> dict[str, list[str]]: ...

    def block_sensitivity(self, progress: Callable[[int, int | None], None] | None = None) -> pd.DataFrame: ...

    def tradeoff(self, progress: Callable[[int, int | None], None] | None = None) -> pd.DataFrame: ...

    def pareto(self, progress: Callable[[int, int | None], None] | None = None, *, by_block: bool = False) -> pd.DataFrame: ...

    def uniform_points(
        self, progress: Callable[[int, int | None], None] | None = None, *, by_block: bool = False
    ) -> pd.DataFrame: ...

    def computed(self) -> dict[str, pd.DataFrame]: ...

    def plan_reach(
        self,
        target_sqnr_db: float | None = None,
        target_metric: float | None = None,
        *,
        by_block: bool = False,
        progress: Callable[[int, int | None], None] | None = None,
    ) -> ReachPlan: ...
