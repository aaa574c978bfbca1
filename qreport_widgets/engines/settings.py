"""Per-module quantization settings, in words no engine owns: what a user edits in the Tune tab.

An engine (``fx`` today) says which modules can be tuned, what each does now, and which settings
it cannot apply to a module and why; it translates settings into its own configuration.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any

from ..core.features import SuggestionKind
from ..errors import InvalidSettingsError
from ..observe.records import Suggestion


@dataclass(frozen=True)
class ModuleSettings:
    """The per-module choices a user can accept or override."""

    dynamic: bool = False
    per_channel: bool = False
    equalize: bool = False
    keep_float: bool = False
    migrate: bool = False  # move the scale of outlier input channels into the weights (migration.py)
    observer: str = ""  # the output's activation observer: "" keeps the starting one, else "minmax", "histogram", "percentile"
    format: str = ""  # engines with formats (eager): one of FORMATS; "float" is keep_float
    group_size: int = 0  # int4 formats: weights per scale (0: DEFAULT_GROUP_SIZE)
    algorithm: str = ""  # int4 formats: how the int4 values are chosen, one of ALGORITHMS ("": "rtn")

    def __post_init__(self) -> None:
        # one way to say float on an engine with formats: keep_float and format "float" together
        if self.format == "float" or (self.keep_float and self.format):
            object.__setattr__(self, "keep_float", True)
            object.__setattr__(self, "format", "float")
            object.__setattr__(self, "group_size", 0)
            object.__setattr__(self, "algorithm", "")
        elif self.format in GROUPED_FORMATS and not self.group_size:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE)
        if self.algorithm == DEFAULT_ALGORITHM:  # one way to say round-to-nearest
            object.__setattr__(self, "algorithm", "")

    @property
    def quantized_format(self) -> str:
        """The format in words as a run applies it: "float", or the format with its group size."""
        if self.keep_float:
            return "float"
        if self.format in GROUPED_FORMATS:
            algorithm = f", {self.algorithm}" if self.algorithm else ""
            return f"{self.format} (group {self.group_size or DEFAULT_GROUP_SIZE}{algorithm})"
        return self.format


class Setting(str, Enum):
    """The name of one ModuleSettings field: what a candidate changes, what an engine cannot apply."""

    DYNAMIC = "dynamic"
    PER_CHANNEL = "per_channel"
    EQUALIZE = "equalize"
    KEEP_FLOAT = "keep_float"
    MIGRATE = "migrate"
    OBSERVER = "observer"
    FORMAT = "format"
    GROUP_SIZE = "group_size"
    ALGORITHM = "algorithm"

    def __str__(self) -> str:
        return self.value

    @property
    def words(self) -> str:
        """The setting in words: "per-channel weights"."""
        return _WORDS[self]

    def of(self, settings: ModuleSettings) -> Any:
        """This setting's value in ``settings``."""
        return getattr(settings, self.value)


_WORDS = {
    Setting.DYNAMIC: "dynamic activations",
    Setting.PER_CHANNEL: "per-channel weights",
    Setting.EQUALIZE: "input-weight equalization",
    Setting.KEEP_FLOAT: "keep float",
    Setting.MIGRATE: "outlier-channel migration",
    Setting.OBSERVER: "activation observer",
    Setting.FORMAT: "format",
    Setting.GROUP_SIZE: "group size",
    Setting.ALGORITHM: "weight algorithm",
}
assert [s.value for s in Setting] == [f.name for f in fields(ModuleSettings)], "Setting must name every field"
OBSERVER_NAMES = ("", "minmax", "histogram", "percentile")
# the weight / activation formats of engines that choose them per module (eager, on torchao's quantize_)
FORMATS = ("float", "int8-dynamic", "int8-weight-only", "int4-weight-only", "int8-dynamic-int4-weight")
GROUPED_FORMATS = ("int4-weight-only", "int8-dynamic-int4-weight")  # weights in groups of group_size
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
# how an int4 weight's values are chosen (engines/eager/algorithms.py): round to nearest, torchao's
# HQQ, GPTQ and AWQ (these two from the calibration batches' inputs to the module), and the rounding
# learned on each decoder block's output (engines/eager/learned.py)
ALGORITHMS = RTN, HQQ, GPTQ, AWQ, LEARNED = ("rtn", "hqq", "gptq", "awq", "learned")
DEFAULT_ALGORITHM = RTN
DATA_ALGORITHMS = (GPTQ, AWQ, LEARNED)  # chosen from what the calibration batches give the module or its block
GRAM_ALGORITHMS = (GPTQ, AWQ)  # chosen from the module's own inputs (their Gram matrix)
# what the size front and fit weigh unless told: the learned rounding costs minutes a decoder, so it
# is asked by name (``algorithms=``) or applied to a chosen point
SEARCHED_ALGORITHMS = (RTN, HQQ, GPTQ, AWQ)
ALGORITHM_FORMATS = GROUPED_FORMATS  # a weight algorithm chooses the int4 values of either
NO_FORMATS = "formats (int8 / int4 weight-only, dynamic int8) are chosen per module on engine='eager'"


@dataclass(frozen=True)
class TunableModule:
    """A module whose settings can be changed, as the engine sees it in the prepared model.

    ``unavailable`` maps a Setting (or its name) to why the engine cannot apply it here; ``native``
    is the engine's own description of the module's current configuration. ``weighted`` is False
    for an op whose only choice is quantized or float (PReLU, an activation, pooling, a norm):
    diagnosis ranks the weighted layers, and such an op only where its quantized kernel
    disagrees with the simulation.
    """

    fqn: str
    type_name: str
    current: ModuleSettings
    unavailable: Mapping[Setting, str] = field(default_factory=dict)
    native: Any = None
    weighted: bool = True
    formats: Mapping[str, str] = field(default_factory=dict)  # format -> why not ("" where it applies)
    group_sizes: tuple[int, ...] = ()  # the group sizes an int4 format can take here
    algorithms: Mapping[str, str] = field(default_factory=dict)  # weight algorithm -> why not ("" where it applies)

    def __post_init__(self) -> None:
        try:
            typed = {Setting(name): why for name, why in self.unavailable.items()}
        except ValueError as error:
            raise ValueError(f"{self.fqn}: {error}; unavailable names ModuleSettings fields") from None
        if not self.formats:  # an engine without formats
            typed.setdefault(Setting.FORMAT, NO_FORMATS)
            typed.setdefault(Setting.GROUP_SIZE, NO_FORMATS)
            typed.setdefault(Setting.ALGORITHM, NO_FORMATS)
        object.__setattr__(self, "unavailable", typed)
        object.__setattr__(self, "formats", dict(self.formats))
        object.__setattr__(self, "algorithms", dict(self.algorithms))

    def algorithm_allowed(self, name: str) -> bool:
        return self.algorithms.get(name or DEFAULT_ALGORITHM) == ""

    def format_allowed(self, name: str) -> bool:
        return self.formats.get(name) == ""

    def allows(self, setting: Setting | str) -> bool:
        return Setting(setting) not in self.unavailable

    def why_not(self, setting: Setting | str) -> str:
        """Why the engine cannot apply ``setting`` here ("" when it can)."""
        return self.unavailable.get(Setting(setting), "")


def validate(module: TunableModule, settings: ModuleSettings) -> None:
    """Raise InvalidSettingsError naming the module when ``settings`` cannot be applied to it."""
    for setting in Setting:
        if setting.of(settings) and not module.allows(setting):
            raise InvalidSettingsError(f"{module.fqn}: {module.why_not(setting)}")
    if settings.equalize and settings.dynamic:
        raise InvalidSettingsError(f"{module.fqn}: input-weight equalization needs static activation quantization")
    if settings.observer and settings.dynamic:
        raise InvalidSettingsError(f"{module.fqn}: an activation observer is for static activations; dynamic ones have none")
    if settings.format and settings.format != "float":
        _validate_format(module, settings)
    if settings.observer not in OBSERVER_NAMES:
        known = ", ".join(OBSERVER_NAMES[1:])
        raise InvalidSettingsError(f"{module.fqn}: unknown activation observer {settings.observer!r} (known: {known})")


def _validate_format(module: TunableModule, settings: ModuleSettings) -> None:
    name = settings.format
    if name not in FORMATS:
        raise InvalidSettingsError(f"{module.fqn}: unknown format {name!r} (known: {', '.join(FORMATS)})")
    if settings.keep_float:
        return
    if not module.format_allowed(name):
        raise InvalidSettingsError(f"{module.fqn}: {module.formats.get(name) or name + ' is not offered here'}")
    if settings.group_size and name not in GROUPED_FORMATS:
        raise InvalidSettingsError(f"{module.fqn}: {group_size_problem(name, settings.group_size)}")
    size = settings.group_size or DEFAULT_GROUP_SIZE
    if name in GROUPED_FORMATS and size not in module.group_sizes:
        offered = ", ".join(map(str, module.group_sizes)) or "none"
        raise InvalidSettingsError(f"{module.fqn}: group size {size} does not divide its rows (group sizes that do: {offered})")
    if settings.algorithm:
        _validate_algorithm(module, settings)


def _validate_algorithm(module: TunableModule, settings: ModuleSettings) -> None:
    name = settings.algorithm
    if name not in ALGORITHMS:
        raise InvalidSettingsError(f"{module.fqn}: unknown weight algorithm {name!r} (known: {', '.join(ALGORITHMS)})")
    if settings.format not in ALGORITHM_FORMATS:
        raise InvalidSettingsError(
            f"{module.fqn}: a weight algorithm chooses int4 weight values: it is for {', '.join(ALGORITHM_FORMATS)}, "
            f"not {settings.format}"
        )
    if not module.algorithm_allowed(name):
        raise InvalidSettingsError(f"{module.fqn}: {module.algorithms.get(name) or name + ' is not offered here'}")


def group_size_problem(name: str, size: int) -> str:
    """Why format ``name`` cannot take group size ``size`` on any module ("" when it can); whether a
    module's rows divide into it is the module's own (``TunableModule.group_sizes``)."""
    if name not in GROUPED_FORMATS:
        return f"a group size is for the int4 formats ({', '.join(GROUPED_FORMATS)})"
    if not isinstance(size, int) or isinstance(size, bool) or size not in GROUP_SIZES:
        return f"a group size is one of {', '.join(map(str, GROUP_SIZES))}"
    return ""


def validate_all(modules: Iterable[TunableModule], settings: Mapping[str, ModuleSettings]) -> None:
    """Every entry of ``settings`` names a tunable module and fits it."""
    by_name = {m.fqn: m for m in modules}
    unknown = [fqn for fqn in settings if fqn not in by_name]
    if unknown:
        shown = ", ".join(sorted(by_name)[:6]) + (" ..." if len(by_name) > 6 else "")
        raise InvalidSettingsError(f"no tunable module named {', '.join(map(repr, unknown))}; the tunable modules are {shown}")
    for fqn, choice in settings.items():
        if not isinstance(choice, ModuleSettings):
            raise InvalidSettingsError(f"{fqn}: expected ModuleSettings, got {type(choice).__name__}")
        validate(by_name[fqn], choice)


def kept_float(choice: ModuleSettings, keep: bool, start: ModuleSettings) -> ModuleSettings:
    """``choice`` kept float, or no longer kept float. On an engine with formats float is a format,
    so a module no longer kept float takes its starting format back (and stays float if it started
    float)."""
    if keep:
        return replace(choice, keep_float=True)
    if not choice.keep_float:
        return choice
    if choice.format:
        return choice if start.keep_float else start
    return replace(choice, keep_float=False)


def with_suggestions(modules: Iterable[TunableModule], suggestions: Iterable[Suggestion]) -> dict[str, ModuleSettings]:
    """Each module's current settings with every suggestion for it accepted (module order kept)."""
    kinds: dict[str, set[SuggestionKind]] = {}
    for suggestion in suggestions:
        kinds.setdefault(suggestion.module_fqn, set()).add(suggestion.kind)
    settings = {}
    for module in modules:
        chosen, now = kinds.get(module.fqn, set()), module.current
        settings[module.fqn] = ModuleSettings(
            dynamic=now.dynamic or SuggestionKind.DYNAMIC in chosen,
            per_channel=now.per_channel or SuggestionKind.PER_CHANNEL in chosen,
            equalize=SuggestionKind.EQUALIZATION in chosen and SuggestionKind.DYNAMIC not in chosen,
            keep_float=now.keep_float,
            migrate=now.migrate,
            observer=now.observer,
            format=now.format,
            group_size=now.group_size,
            algorithm=now.algorithm,
        )
    return settings


_NUMBERED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def module_blocks(names: Iterable[str]) -> dict[str, list[str]]:
    """Module names grouped by the first numbered part of their names (``model.layers.3`` for
    ``model.layers.3.mlp.down_proj``, ``layer1.0`` for ``layer1.0.conv1``): a transformer's blocks,
    a ResNet's; a name with no numbered part (``lm_head``) is a block of its own. First-seen order."""
    blocks: dict[str, list[str]] = {}
    for name in names:
        found = _NUMBERED.match(name)
        blocks.setdefault(found.group(1) if found else name, []).append(name)
    return blocks
