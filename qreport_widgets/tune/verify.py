"""Suggestions as claims, measured: every candidate setting is tried before it is offered.

A candidate is one module's setting changed from the starting configuration: what a detector
proposed (per-channel weights, dynamic activations, input-weight equalization) or what a search
tries where no detector proposed it (per-channel weights, dynamic activations on a Linear, keeping
a module float). The simulation tries
what it can (per-channel weights, keep float: forward passes only); a real run measures the rest
(dynamic activations, equalization, which change calibration). Equalization is tried only where
torch's equalization leaves the float model's output as it was (checked with the scales applied
and nothing quantized): on the trained digits CNN it changes it by 100-700% on three of five
layers. A detector's candidate is offered when it gains at least ``MIN_GAIN_DB`` of output SQNR,
one of the search's from ``FOUND_GAIN_DB``; every other candidate stays in the table as considered
and rejected, with what it measured or why it was not tried. Keeping a module float is measured
and shown but not offered: it buys SQNR with size and latency, a trade that reach, fit and the
size front make against a target or a budget; Accept all only quantizes better. The one exception
is a module whose quantized kernel computes something else than its reference (the kernel check
of ``truth.py``): float is then the fix of a broken kernel, not a trade. "Accept all"
combines the offered settings (the simulated ones added most helpful first while the simulated
whole still gains) and is measured by one real run; when that falls short of the best single
setting, the best single setting alone is what Accept all applies, and when both measure below
the baseline, nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..core.features import EQUALIZATION_COMP_METRICS, SuggestionKind
from ..core.progress import Progress, quiet, steps
from ..engines.contract import Variant
from ..engines.settings import ModuleSettings, Setting, TunableModule
from ..observe.frame import ReportFrame
from ..observe.records import Suggestion
from .migration import input_producers
from .run import ReleasedModel
from .search import FloatSearch
from .truth import KERNEL_AGREEMENT_DB

if TYPE_CHECKING:
    from .diagnosis import Diagnosis
    from .migration import Migrations
    from .real import RealRuns
    from .run import RunResult
    from .runner import Runner

ACCEPT_ALL = "accept all (verified)"  # the label of Accept all's trial runs
MIN_GAIN_DB = 0.1  # a detector's candidate must gain this much to be offered
FOUND_GAIN_DB = 0.5  # a setting the simulation found without a detector must gain this much
EXACT_FLOAT = 1e-4  # relative output error an equalized float model may show (float rounding)

TRADE = (
    "keeping it float trades size and latency for it, so Accept all leaves it out: tick keep float here, "
    "or let a target or a size budget decide (reach, fit, the size front)"
)


class Measured(str, Enum):
    """How a verdict's gain was measured."""

    SIMULATED = "simulated"
    REAL_RUN = "real run"
    NOT_TRIED = "not tried"

    def __str__(self) -> str:
        return self.value


class Origin(str, Enum):
    """Where a candidate came from."""

    DETECTOR = "detector"  # a detector's suggestion (``Candidate.detector`` names it)
    SEARCH = "search"  # tried on every module where it applies
    KERNEL_CHECK = "kernel check"  # keep float where the quantized kernel differs from its reference (truth.py)
    OUTLIER_CHANNELS = "outlier channels"  # a migration of outlier input channels the float model allows

    def __str__(self) -> str:
        return self.value


SIMULATED, REAL_RUN, NOT_TRIED = Measured.SIMULATED, Measured.REAL_RUN, Measured.NOT_TRIED
SEARCH, KERNEL_CHECK = Origin.SEARCH, Origin.KERNEL_CHECK

_SETTING_OF = {
    SuggestionKind.PER_CHANNEL: Setting.PER_CHANNEL,
    SuggestionKind.DYNAMIC: Setting.DYNAMIC,
    SuggestionKind.EQUALIZATION: Setting.EQUALIZE,
}
# per-channel weights and keep float switch what the start calibrated; an activation observer's qparams come from
# one extra calibration of every candidate observer at once; dynamic activations quantize each batch's own range.
# Equalization and migration change the float model's weights and the calibration after them: real runs
SIMULATED_SETTINGS = frozenset({Setting.PER_CHANNEL, Setting.KEEP_FLOAT, Setting.OBSERVER, Setting.DYNAMIC})
CALIBRATING_SETTINGS = frozenset({Setting.OBSERVER, Setting.DYNAMIC})  # simulated where the engine's simulation can


@dataclass(frozen=True)
class Candidate:
    """One module's setting switched on, and where the idea came from."""

    module_fqn: str
    setting: Setting
    origin: Origin | str  # an Origin; a detector's name is taken as Origin.DETECTOR with ``detector`` set
    reason: str = ""
    value: Any = True  # what the setting is set to (an observer's name for ``observer``)
    detector: str = ""  # the detector whose suggestion this is

    def __post_init__(self) -> None:
        object.__setattr__(self, "setting", Setting(self.setting))  # a field's name is taken too
        if not isinstance(self.origin, Origin):
            if self.origin in {o.value for o in Origin}:
                object.__setattr__(self, "origin", Origin(self.origin))
            else:
                object.__setattr__(self, "detector", self.detector or str(self.origin))
                object.__setattr__(self, "origin", Origin.DETECTOR)

    @property
    def searched(self) -> bool:
        return self.origin is Origin.SEARCH

    @property
    def source(self) -> str:
        """Where it came from, in the candidates table's words: the detector's name, else the origin."""
        return self.detector if self.origin is Origin.DETECTOR else self.origin.value

    def applied_to(self, current: ModuleSettings) -> ModuleSettings:
        changed = replace(current, **{self.setting.value: self.value})
        return replace(changed, dynamic=False) if self.setting in (Setting.EQUALIZE, Setting.OBSERVER) else changed


@dataclass(frozen=True)
class Verdict:
    """A candidate with what it measured: the change of output SQNR against the starting configuration."""

    candidate: Candidate
    gain_db: float  # NaN when it was not tried or its run failed
    measured: Measured
    offered: bool
    note: str = ""  # why it was not tried or not offered
    together: tuple[str, ...] = ()  # kernel fixes measured (and offered) as one: they only help together

    def __post_init__(self) -> None:
        object.__setattr__(self, "measured", Measured(self.measured))  # its words are taken too

    @property
    def text(self) -> str:
        """In words, for a Tune row: "per-channel weights: +1.30 dB (simulated)"."""
        words = self.candidate.setting.words
        if self.candidate.setting is Setting.OBSERVER:
            words = f"{words} {self.candidate.value}"
        if self.measured is Measured.NOT_TRIED or math.isnan(self.gain_db):
            return f"{words}: not suggested, {self.note}"
        effect = f"{words}: {self.gain_db:+.2f} dB ({self.measured})"
        others = [name for name in self.together if name != self.candidate.module_fqn]
        if others:
            effect = f"{words}: {self.gain_db:+.2f} dB ({self.measured}, with {', '.join(others)} float too)"
        return effect if self.offered else f"{effect}, not suggested: {self.note}"


@dataclass
class VerifiedSuggestions:
    """Every candidate with its verdict, and Accept all as measured by a real run."""

    baseline_db: float
    verdicts: list[Verdict]
    settings: dict[str, ModuleSettings]  # what Accept all applies (every module's settings)
    accept_all: RunResult | None  # the real run of ``settings`` (None when nothing is offered)
    notes: list[str] = field(default_factory=list)

    @property
    def offered(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.offered]

    @property
    def rejected(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.offered]

    @property
    def accept_all_gain_db(self) -> float:
        """Output SQNR gained by Accept all in a real run (0 when nothing is offered)."""
        if self.accept_all is None:
            return 0.0
        return self.accept_all.output_sqnr_db - self.baseline_db if self.accept_all.ok else math.nan

    def reasons(self) -> dict[str, list[str]]:
        """Module -> its verdicts in words, offered first (what a Tune row shows)."""
        found: dict[str, list[str]] = {}
        for verdict in sorted(self.verdicts, key=lambda v: not v.offered):
            found.setdefault(verdict.candidate.module_fqn, []).append(verdict.text)
        return found

    def frame(self) -> pd.DataFrame:
        """One row per candidate: module, setting, origin, gain_db, measured, offered, note."""
        rows = [
            {
                "module": v.candidate.module_fqn,
                "setting": v.candidate.setting,
                "origin": v.candidate.source,
                "gain_db": v.gain_db,
                "measured": v.measured,
                "offered": v.offered,
                "note": v.note,
            }
            for v in self.verdicts
        ]
        columns = ["module", "setting", "origin", "gain_db", "measured", "offered", "note"]
        return pd.DataFrame(rows, columns=columns).sort_values(["offered", "gain_db"], ascending=[False, False])


class Verification:
    """A session's suggestions verified once: the verdicts do not change, the simulation and the
    starting configuration being fixed."""

    def __init__(self, runner: Runner, real: RealRuns, diagnosis: Diagnosis, migrations: Migrations) -> None:
        self.runner, self.real, self.diagnosis, self.migrations = runner, real, diagnosis, migrations
        self._found: VerifiedSuggestions | None = None

    def verified(
        self, suggestions: Iterable[Suggestion], nan_metric: Iterable[str] = (), progress: Progress | None = None
    ) -> VerifiedSuggestions:
        """``suggestions`` and what the simulation finds by itself, each measured before it is
        offered; ``nan_metric`` names the modules whose equalization metric is NaN."""
        if self._found is None:
            suggestions, nan_metric = list(suggestions), list(nan_metric)
            refused = refusals(dict(self.runner.float_model.named_modules()), nan_metric)
            verifier = Verifier(self.runner, self.real, self.diagnosis, self.migrations, refused)
            found = verifier.verify(verifier.candidates(suggestions), progress)
            adopted = self.real.adopt_kernels(found.accept_all) if found.accept_all is not None else []
            if adopted:  # a broken kernel the baseline's inputs hid: everything measured again with it
                verifier = Verifier(self.runner, self.real, self.diagnosis, self.migrations, refused)
                found = verifier.verify(verifier.candidates(suggestions), progress)
                said = self.real.adopted_words("Accept all's first real run", adopted)
                found.notes.append(f"{said}; every candidate was measured again with them")
            self._found = found
        return self._found


class Verifier:
    """Measures candidates: simulated where the simulation can, real runs otherwise.

    Args:
        runner: the modules, their starting settings and the float model.
        real: the baseline, the truth check and trial runs.
        diagnosis: the simulation (checked against the real model) and the sensitivity ranking.
        migrations: the outlier-channel migrations the float model allows.
        refused: (module, setting) -> why that candidate is not tried at all.
    """

    def __init__(
        self,
        runner: Runner,
        real: RealRuns,
        diagnosis: Diagnosis,
        migrations: Migrations,
        refused: Mapping[tuple[str, Setting], str] | None = None,
    ) -> None:
        self.runner, self.real, self.diagnosis, self.migrations = runner, real, diagnosis, migrations
        self.refused = dict(refused or {})
        self.modules: dict[str, TunableModule] = {m.fqn: m for m in runner.modules}
        self._trials: dict[frozenset, RunResult] = {}

    def _producers(self, names: Iterable[str]) -> dict[str, str]:
        return input_producers(self.runner.float_model, names)

    def candidates(self, suggestions: Iterable[Suggestion]) -> list[Candidate]:
        """The detectors' suggestions as candidates (one per module and setting), the
        outlier-channel migrations the session found, then a search of what no detector proposed:
        per-channel weights where a module is per tensor, dynamic activations on every static
        Linear, keep float for the modules the sensitivity ranking puts at or above ``FOUND_GAIN_DB``."""
        suggestions = list(suggestions)
        found: dict[tuple[str, Setting], Candidate] = {}
        for suggestion in suggestions:
            setting = _SETTING_OF.get(suggestion.kind)
            if setting is not None and (suggestion.module_fqn, setting) not in found:
                candidate = Candidate(suggestion.module_fqn, setting, Origin.DETECTOR, suggestion.reason)
                found[suggestion.module_fqn, setting] = replace(candidate, detector=suggestion.detector)
        producers = self._producers(list(self.modules))
        for consumer, producer in producers.items():  # a dynamic Linear's output is float: its reader would run float
            if producer in self.modules and consumer in self.modules and not self.modules[consumer].current.keep_float:
                why = f"its output is float when it is dynamic, and {consumer}, which reads it, would run float"
                self.refused.setdefault((producer, Setting.DYNAMIC), why)
        for module in self.modules.values():  # what no detector proposed, tried everywhere it applies
            if module.current.keep_float:
                continue
            for setting in (Setting.PER_CHANNEL, Setting.DYNAMIC):
                if not setting.of(module.current) and module.allows(setting):
                    found.setdefault((module.fqn, setting), Candidate(module.fqn, setting, SEARCH))
        outliers = {s.module_fqn: s.detector for s in suggestions if s.kind == SuggestionKind.OUTLIERS}
        for fqn, producer in self._producers(outliers).items():  # clip the producer's range
            if producer in self.modules:
                reason = f"outliers in the input of {fqn}"
                candidate = Candidate(producer, Setting.OBSERVER, outliers[fqn], reason, "percentile")
                found.setdefault((producer, Setting.OBSERVER), candidate)
        truth = self.real.truth(quiet)
        for fqn in truth.disagreeing:  # a kernel that computes something else: keeping it float is the fix
            if fqn in self.modules:
                reason = f"its quantized kernel differs from its reference ({truth.kernels[fqn]:.1f} dB on the same input)"
                found.setdefault((fqn, Setting.KEEP_FLOAT), Candidate(fqn, Setting.KEEP_FLOAT, KERNEL_CHECK, reason))
        for fqn, migration in self.migrations.found().items():  # outlier input channels found
            candidate = Candidate(fqn, Setting.MIGRATE, Origin.OUTLIER_CHANNELS, migration.summary)
            found.setdefault((fqn, Setting.MIGRATE), candidate)
        table = self.diagnosis.sensitivity(quiet, metric=False)
        for fqn in table.index[table["output_sqnr_gain_db"] >= FOUND_GAIN_DB]:
            found.setdefault((fqn, Setting.KEEP_FLOAT), Candidate(fqn, Setting.KEEP_FLOAT, SEARCH))
        return list(found.values())

    def verify(self, candidates: Sequence[Candidate], progress: Progress | None = None) -> VerifiedSuggestions:
        baseline = self.real.baseline(quiet)
        engine_wide = self._unavailable_everywhere()  # e.g. equalization under PT2E: one note, not a row each
        left_out = [c for c in candidates if c.setting in engine_wide]
        candidates = [c for c in candidates if c.setting not in engine_wide]
        skipped = [
            f"{count} {setting.words} candidate(s) not tried: {engine_wide[setting]}"
            for setting in engine_wide
            if (count := sum(c.setting == setting for c in left_out))
        ]
        truth = self.real.truth(quiet)
        if not truth.reliable:  # the simulation does not match the real model: real runs measure everything
            skipped.append(f"every candidate measured by a real run: {truth.status}")
        verdicts: dict[Candidate, Verdict] = {}
        simulated, real = [], []
        for candidate in candidates:
            why = self._not_tried(candidate)
            if why:
                verdicts[candidate] = Verdict(candidate, math.nan, NOT_TRIED, False, why)
            elif candidate.setting in SIMULATED_SETTINGS and truth.reliable:
                simulated.append(candidate)
            else:
                real.append(candidate)
        try:
            gains = self._simulated_gains(simulated)
        except (KeyError, RuntimeError):  # a simulation that cannot follow an observer or dynamic: real runs for those
            real += [c for c in simulated if c.setting in CALIBRATING_SETTINGS]
            simulated = [c for c in simulated if c.setting not in CALIBRATING_SETTINGS]
            gains = self._simulated_gains(simulated)
        with steps(len(real) + 2, "verifying suggestions", "run", progress) as step:
            for candidate, gain in zip(simulated, gains, strict=True):
                verdicts[candidate] = self._judge(candidate, gain, SIMULATED)
            verdicts.update(self._kernel_fixes_together([verdicts[c] for c in simulated]))
            step()
            current = self.runner.current_settings()
            for candidate, verdict in self._no_ops(real, current, baseline).items():
                verdicts[candidate] = verdict
            for candidate in real:
                if candidate not in verdicts:
                    verdicts[candidate] = self._trial(candidate, current, baseline)
                step()
            ordered = [verdicts[c] for c in candidates]
            settings, accept_all, notes = self._accept_all(ordered, baseline)
            step()
        return VerifiedSuggestions(baseline.output_sqnr_db, ordered, settings, accept_all, notes + skipped)

    def _unavailable_everywhere(self) -> dict[Setting, str]:
        """Settings the engine cannot apply to any module, for one reason: setting -> the reason."""
        found = {}
        for setting in Setting:
            reasons = {m.unavailable.get(setting) for m in self.modules.values()}
            if self.modules and len(reasons) == 1 and None not in reasons:
                found[setting] = reasons.pop()
        return found

    def _trial(self, candidate: Candidate, current: Mapping[str, ModuleSettings], baseline: RunResult) -> Verdict:
        """A candidate measured by a real run (kept out of the history)."""
        fqn = candidate.module_fqn
        if candidate.setting is Setting.EQUALIZE:
            error = self.runner.equalization_float_error({fqn: ModuleSettings(equalize=True)})
            if not error <= EXACT_FLOAT:  # torch's equalization must leave the float model's output as it was
                why = f"torch's equalization here changes the float model's output ({error:.1%} relative error)"
                return Verdict(candidate, math.nan, NOT_TRIED, False, why)
        changed = {fqn: candidate.applied_to(current[fqn])}
        run = self._trial_run(changed, f"try {fqn}")
        if not run.ok:
            return Verdict(candidate, math.nan, REAL_RUN, False, f"the run failed: {run.error}")
        gain = run.output_sqnr_db - baseline.output_sqnr_db
        lost = _left_float(run, baseline, changed)  # a keep-float candidate's own module is float on purpose
        if lost:  # e.g. a dynamic Linear's float output leaves the LayerNorm after it float
            return Verdict(candidate, gain, REAL_RUN, False, f"it leaves {', '.join(lost)} float, which the start quantizes")
        return self._judge(candidate, gain, REAL_RUN)

    def _no_ops(
        self, real: Sequence[Candidate], current: Mapping[str, ModuleSettings], baseline: RunResult
    ) -> dict[Candidate, Verdict]:
        """Equalization candidates tried together in one real run first: where torch's equalization
        changes nothing (no pair of layers to balance: the output is bit for bit the baseline's),
        that one run measures them all."""
        together = [c for c in real if c.setting is Setting.EQUALIZE]
        if len(together) < 2:
            return {}
        run = self._trial_run({c.module_fqn: c.applied_to(current[c.module_fqn]) for c in together}, "try equalization")
        if not run.ok or run.output_sqnr_db != baseline.output_sqnr_db:
            return {}
        why = f"torch's equalization changes nothing here (the {len(together)} candidates measured together in one run)"
        return {c: Verdict(c, 0.0, REAL_RUN, False, why) for c in together}

    def _not_tried(self, candidate: Candidate) -> str:
        module = self.modules.get(candidate.module_fqn)
        if module is None:
            return "not a module the engine can tune"
        if (candidate.module_fqn, candidate.setting) in self.refused:
            return self.refused[candidate.module_fqn, candidate.setting]
        if not module.allows(candidate.setting):
            return module.why_not(candidate.setting)
        if candidate.setting.of(module.current):
            return "already set"
        if module.current.keep_float:
            return "the module is kept float"
        return ""

    def _trial_run(self, changed: dict[str, ModuleSettings], label: str) -> RunResult:
        """A trial run of ``changed`` (kept out of the history), run once: Accept all often ends up
        with the settings of one candidate's own trial."""
        key = frozenset(changed.items())
        if key not in self._trials:
            accept_all = label == ACCEPT_ALL  # its kernels checked: a kernel fix may uncover a broken kernel after it
            run = self.real.apply(changed, label=label, progress=quiet, record=False, check_kernels=accept_all)
            # its measurements are what a verdict needs: the model goes (a dozen trial runs would hold a dozen),
            # unless it holds a broken kernel the simulation does not run yet (``RealRuns.adopt_kernels`` copies it)
            released = ReleasedModel(label, "after its trial run was measured (apply the settings to get a model)")
            hidden = run.ok and bool(
                set(run.kernel_sqnr_db.index[run.kernel_sqnr_db < KERNEL_AGREEMENT_DB]) - set(self.real.truth(quiet).real_kernels)
            )
            self._trials[key] = replace(run, quantized_model=released) if run.ok and not hidden else run
        return self._trials[key]

    def _simulated_gains(self, candidates: Sequence[Candidate | Sequence[Verdict]]) -> list[float]:
        """Simulated output SQNR gain of each candidate alone, or of each group of verdicts together."""
        variants = [Variant()] + [_variant([c] if isinstance(c, Candidate) else [v.candidate for v in c]) for c in candidates]
        base, *each = self.diagnosis.simulate_each(variants, quiet, "verifying suggestions", metric=False)
        return [sqnr - base[0] for sqnr, _ in each]

    def _kernel_fixes_together(self, verdicts: Sequence[Verdict]) -> dict[Candidate, Verdict]:
        """Broken kernels hide each other: three in series each leave the output garbage while the
        others stay broken, so each alone gains nothing. The in-context search (``search.py``) over
        the kernel fixes finds the set that gains together; its members are offered as one, each
        with the set's gain."""
        fixes = [v for v in verdicts if v.candidate.setting is Setting.KEEP_FLOAT and v.candidate.origin is Origin.KERNEL_CHECK]
        if len(fixes) < 2:
            return {}
        names = [v.candidate.module_fqn for v in sorted(fixes, key=lambda v: -v.gain_db)]

        def measure(sets: Sequence[frozenset[str]]) -> list[tuple[float, float | None]]:
            variants = [Variant(float_modules=s) for s in sets]
            return self.diagnosis.simulate_each(variants, quiet, "verifying suggestions", metric=False)

        path = FloatSearch(measure, names, names).run()
        gain = path.simulated_db - path.start_db
        if len(path.chosen) < 2 or not gain >= MIN_GAIN_DB or all(v.offered for v in fixes):
            return {}
        found = {}
        for verdict in fixes:
            if verdict.candidate.module_fqn in path.chosen:
                found[verdict.candidate] = replace(verdict, gain_db=gain, offered=True, note="", together=path.chosen)
        return found

    def _judge(self, candidate: Candidate, gain: float, measured: Measured) -> Verdict:
        needed = FOUND_GAIN_DB if candidate.searched else MIN_GAIN_DB
        if gain >= needed and candidate.setting is Setting.KEEP_FLOAT and candidate.origin is not Origin.KERNEL_CHECK:
            return Verdict(candidate, gain, measured, False, TRADE)
        if gain >= needed:
            return Verdict(candidate, gain, measured, True)
        note = f"it loses {-gain:.2f} dB" if gain < 0 else f"it gains less than {needed:g} dB"
        return Verdict(candidate, gain, measured, False, note)

    def _accept_all(
        self, verdicts: list[Verdict], baseline: RunResult
    ) -> tuple[dict[str, ModuleSettings], RunResult | None, list[str]]:
        """What Accept all applies, its real run and its notes; a verdict Accept all must leave out
        after its real run is replaced in ``verdicts`` (not offered, with why)."""
        current = self.runner.current_settings()
        offered = sorted((v for v in verdicts if v.offered), key=lambda v: -v.gain_db)
        if not offered:
            return current, None, []
        chosen, notes = self._combine_simulated([v for v in offered if v.measured is Measured.SIMULATED])
        chosen += [v for v in offered if v.measured is not Measured.SIMULATED]  # each measured alone by a real run
        combined = _combined(chosen, current)
        run = self._trial_run(_changed(combined, current), ACCEPT_ALL)
        left = _left_float(run, baseline, combined) if run.ok else []
        blamed = set(self._producers(left).values()) | set(left)
        dynamic = [v for v in chosen if v.candidate.setting is Setting.DYNAMIC]
        dropped = [v for v in dynamic if v.candidate.module_fqn in blamed] or (dynamic if left else [])
        if dropped:  # a dynamic Linear's float output can leave the layer it feeds float: those settings out
            why = f"with the others, its real run leaves {', '.join(left)} float, which the start quantizes"
            for verdict in dropped:
                verdicts[verdicts.index(verdict)] = replace(verdict, offered=False, note=why)
            chosen = [v for v in chosen if v not in dropped]
            offered = [v for v in offered if v not in dropped]
            if not offered:
                return (
                    current,
                    None,
                    [*notes, f"dynamic activations on {', '.join(v.candidate.module_fqn for v in dropped)}: {why}"],
                )
            combined = _combined(chosen, current)
            run = self._trial_run(_changed(combined, current), ACCEPT_ALL)
        best = offered[0]
        gained = run.output_sqnr_db - baseline.output_sqnr_db if run.ok and not _left_float(run, baseline, combined) else math.nan
        if gained >= 0 and (gained >= best.gain_db - MIN_GAIN_DB or len(offered) == 1):
            return combined, run, notes
        fqn = best.candidate.module_fqn  # together they do worse than the best one alone: that one
        single = {**current, fqn: best.candidate.applied_to(current[fqn])}
        alone = self._trial_run({fqn: single[fqn]}, ACCEPT_ALL)
        kept_all = alone.ok and not _left_float(alone, baseline, single)
        alone_gained = alone.output_sqnr_db - baseline.output_sqnr_db if kept_all else math.nan
        if alone_gained >= 0 and not alone_gained < gained:
            note = (
                f"all {len(offered)} offered settings together measured {gained:+.2f} dB, less than "
                f"{best.candidate.setting.words} on {fqn} alone ({alone_gained:+.2f} dB): Accept all applies that one"
            )
            return single, alone, [*notes, note]
        if gained >= 0:
            return combined, run, notes
        note = (  # a real run below the baseline is never what Accept all applies
            f"the offered settings together measured {gained:+.2f} dB and the best alone {alone_gained:+.2f} dB "
            "in real runs, below the baseline: Accept all changes nothing (each row still shows its own measure)"
        )
        return current, None, [*notes, note]

    def _combine_simulated(self, offered: list[Verdict]) -> tuple[list[Verdict], list[str]]:
        """Settings interact: add the simulated ones most helpful first, each kept only when the
        simulated combination gains at least ``MIN_GAIN_DB`` more with it."""
        if len(offered) < 2:
            return offered, []
        units: dict[tuple[str, ...] | Verdict, list[Verdict]] = {}  # kernel fixes offered together are one unit
        for verdict in offered:
            units.setdefault(verdict.together or verdict, []).append(verdict)
        chosen: list[Verdict] = []
        best = 0.0
        for unit in units.values():
            gain = self._simulated_gains([[*chosen, *unit]])[0]
            if not chosen or gain >= best + MIN_GAIN_DB:
                chosen, best = [*chosen, *unit], gain
        dropped = ", ".join(f"{v.candidate.setting} on {v.candidate.module_fqn}" for v in offered if v not in chosen)
        notes = []
        if dropped:
            notes.append(
                f"left out of Accept all, as they add less than {MIN_GAIN_DB:g} dB to the others in simulation: {dropped}"
            )
        return chosen, notes


def _combined(chosen: Sequence[Verdict], current: Mapping[str, ModuleSettings]) -> dict[str, ModuleSettings]:
    """Every module's settings with the ``chosen`` verdicts applied, the larger gain first where two
    settings exclude each other."""
    combined = dict(current)
    for verdict in sorted(chosen, key=lambda v: -v.gain_db):
        fqn, setting = verdict.candidate.module_fqn, verdict.candidate.setting
        if _compatible(combined[fqn], current[fqn], setting):
            combined[fqn] = verdict.candidate.applied_to(combined[fqn])
    return combined


def _changed(settings: Mapping[str, ModuleSettings], current: Mapping[str, ModuleSettings]) -> dict[str, ModuleSettings]:
    return {fqn: s for fqn, s in settings.items() if s != current[fqn]}


def _left_float(run: RunResult, baseline: RunResult, settings: Mapping[str, ModuleSettings] | None = None) -> list[str]:
    """The layers ``baseline`` quantizes that ``run`` leaves float, other than those ``settings``
    keep float on purpose (a kernel the kernel check found broken)."""
    if not len(run.conversions) or not len(baseline.conversions):
        return []
    before = baseline.conversions.set_index("module")["quantized"]
    after = run.conversions.set_index("module")["quantized"]
    kept = {fqn for fqn, s in (settings or {}).items() if s.keep_float}
    return [fqn for fqn, was in before.items() if was and fqn in after and not after[fqn] and fqn not in kept]


def _compatible(now: ModuleSettings, start: ModuleSettings, setting: Setting) -> bool:
    """Whether ``setting`` can join what a module already has from a larger gain."""
    if now.keep_float:
        return False
    if setting is Setting.KEEP_FLOAT:  # it replaces every other choice: only on a module not changed yet
        return now == start
    if setting is Setting.EQUALIZE:
        return not now.dynamic
    if setting is Setting.DYNAMIC:
        return not now.equalize and not now.observer
    if setting is Setting.OBSERVER:
        return not now.dynamic and not now.observer
    return True


def _variant(candidates: Iterable[Candidate]) -> Variant:
    candidates = list(candidates)
    float_modules = frozenset(c.module_fqn for c in candidates if c.setting is Setting.KEEP_FLOAT)
    other = frozenset(c.module_fqn for c in candidates if c.setting is Setting.PER_CHANNEL) - float_modules
    observers = frozenset((c.module_fqn, str(c.value)) for c in candidates if c.setting is Setting.OBSERVER)
    dynamic = frozenset(c.module_fqn for c in candidates if c.setting is Setting.DYNAMIC) - float_modules
    return Variant(float_modules=float_modules, other_weights=other, observers=observers, dynamic=dynamic)


def refusals(graph_modules: Mapping[str, Any], nan_metric: Iterable[str]) -> dict[tuple[str, Setting], str]:
    """The rules no measurement is needed for: input-weight equalization is never tried on a
    grouped or depthwise conv (torch's equalization assumes one input channel per weight column and
    fails or corrupts there) nor where its metric is NaN (nothing was measured to balance)."""
    refused = {}
    for fqn, module in graph_modules.items():
        groups = getattr(module, "groups", 1)
        if isinstance(groups, int) and groups > 1:
            refused[fqn, Setting.EQUALIZE] = f"equalization does not apply to a grouped conv (groups={groups})"
    for fqn in nan_metric:
        refused.setdefault((fqn, Setting.EQUALIZE), "its equalization metric is NaN (nothing measured to balance)")
    return refused


def nan_equalization_metric(frame: ReportFrame) -> list[str]:
    """The modules whose input-weight equalization metric has a NaN channel (for ``refusals``)."""
    feature = EQUALIZATION_COMP_METRICS
    if feature not in frame.channel_features:
        return []
    reported = [m for m in frame.module_names if feature in frame.present.get(m, frozenset())]
    return [m for m in reported if np.isnan(frame.channel_values(m, feature)).any()]
