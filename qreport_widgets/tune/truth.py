"""The simulation against the real model: does the int8 model compute what its simulation says?

Every estimate the session shows (sensitivity, the trade-off, reach's plan, the simulated gains of
suggestions) comes from the simulation, which follows the engine's reference quantized model. A
real run executes the backend's kernels instead; where one of them computes something else than
its reference (torch's quantized PReLU applies its slope to positive inputs too), every simulated
number is wrong by as much. The truth check compares the two on the starting configuration, names
the modules whose kernels disagree (``Engine.kernel_sqnr``: each kernel against its reference on
the same quantized input) and has the simulation run those real kernels, so that its numbers are
true again; what stays apart is said, and the simulated numbers are then marked unverified.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.calibration import call_with
from ..core.metrics import layer_sqnr_db, sqnr_apart

if TYPE_CHECKING:
    from ..engines.contract import Simulation
    from .run import RunResult

# A kernel against its reference on the same input scores 60 dB or more (rounding steps) on every
# zoo and digits model; one that computes something else scores far less (PReLU: about 5 dB).
# Float round-off (another thread count, SIMD width or CPU: FLOAT_ROUNDOFF_DB and above) is far
# above this line, so no CPU's summation order makes a kernel "differ".
KERNEL_AGREEMENT_DB = 30.0
# How far a simulated output SQNR may be from a real run's: measured within 0.32 dB on the
# 54-layer MobileNetV3-Small layout (benchmarks/README.md), up to 0.57 dB on its trained version.
SIMULATION_ERROR_DB = 0.6


@dataclass(frozen=True)
class TruthCheck:
    """The starting configuration's simulated output SQNR against its real run.

    ``kernels``: each quantized module's kernel SQNR against its reference (empty for an engine
    whose real model runs reference ops); ``real_kernels``: the modules whose real kernels the
    simulation now runs; ``corrected_db``: the simulated output SQNR with them; ``layers``: per
    layer, the real and the simulated SQNR where both are read.
    """

    real_db: float
    simulated_db: float
    kernels: pd.Series = field(default_factory=lambda: pd.Series(dtype=float))
    real_kernels: tuple[str, ...] = ()
    corrected_db: float = math.nan
    layers: pd.DataFrame = field(default_factory=pd.DataFrame)
    error: str = ""  # why the simulation could not be compared
    blocks_error: str = ""  # why the blocks' outputs inside the real run could not be read, where asked

    @property
    def gap_db(self) -> float:
        """Simulated minus real output SQNR, before any real kernel ran in the simulation."""
        return self.simulated_db - self.real_db

    @property
    def disagreeing(self) -> list[str]:
        """The modules whose quantized kernel computes something else than its reference."""
        return [str(name) for name, value in self.kernels.items() if value < KERNEL_AGREEMENT_DB]

    @property
    def agrees(self) -> bool:
        """Whether the simulation as built matched the real run within its stated error (float
        round-off counting as the float model's output, ``sqnr_apart``)."""
        return not self.error and abs(sqnr_apart(self.simulated_db, self.real_db)) <= SIMULATION_ERROR_DB

    @property
    def reliable(self) -> bool:
        """Whether the simulation in use (with any real kernels) matches the real run."""
        if self.agrees:
            return True
        return not self.error and abs(sqnr_apart(self.corrected_db, self.real_db)) <= SIMULATION_ERROR_DB

    @property
    def headline(self) -> str:
        """The gap in words: "the real int8 model is 32.7 dB worse than its simulation"."""
        return _gap_words(self.gap_db)

    @property
    def status(self) -> str:
        """One line for the widget ("" when the simulation agrees)."""
        if self.error:
            return f"the simulation could not be checked against the real model: {self.error}"
        if self.agrees:
            return ""
        head = _gap_words(self.gap_db)
        if self.reliable:
            return f"{head}; the simulation now runs the real kernels of {_names(self.real_kernels)}"
        return f"{head}: simulated numbers are unverified here, suggestions are measured by real runs"

    @property
    def notes(self) -> tuple[str, ...]:
        """What the baseline run's notes say (nothing when the simulation agrees)."""
        if self.error:
            return (self.status,)
        if self.agrees:
            return ()
        unreliable = "" if self.reliable else "; simulated rankings are unreliable here"
        said = [
            f"{_gap_words(self.gap_db)} (real {self.real_db:.2f} dB, simulated {self.simulated_db:.2f} dB): "
            f"a quantized kernel differs from its reference{unreliable}"
        ]
        if self.disagreeing:
            each = ", ".join(f"{name} ({self.kernels[name]:.1f} dB)" for name in self.disagreeing)
            said.append(
                f"quantized kernels that compute something else than their reference (on the same input; "
                f"agreeing kernels score above {KERNEL_AGREEMENT_DB:g} dB): {each}"
            )
        opens = self.gap_opens_at()
        if opens:
            said.append(opens)
        if self.blocks_error:
            said.append(self.blocks_error)
        if self.real_kernels and self.reliable:
            said.append(
                f"the simulation now runs the real kernels of {_names(self.real_kernels)} ({self.corrected_db:.2f} dB, "
                f"within {SIMULATION_ERROR_DB:g} dB of the real run): sensitivity, reach and suggestions account for them"
            )
        elif not self.reliable:
            corrected = (
                f" (with the real kernels of {_names(self.real_kernels)}: {self.corrected_db:.2f} dB)"
                if self.real_kernels
                else ""
            )
            said.append(
                f"the simulation still differs from the real run{corrected}: its numbers are unverified; "
                "suggestions are measured by real runs and reach confirms every step with one"
            )
        return tuple(said)

    def gap_opens_at(self) -> str:
        """Where along the layers the real SQNR first falls below the simulated one by more than the
        simulation's error ("" when no layer shows it)."""
        if self.layers.empty:
            return ""
        apart = self.layers[self.layers["simulated_sqnr_db"] - self.layers["real_sqnr_db"] > SIMULATION_ERROR_DB + 1.0]
        if apart.empty:
            return ""
        name, row = next(iter(apart.iterrows()))
        return f"the gap opens at {name}: real {row['real_sqnr_db']:.1f} dB, simulated {row['simulated_sqnr_db']:.1f} dB"


def _gap_words(gap_db: float) -> str:
    if gap_db > 0:
        return f"the real int8 model is {gap_db:.1f} dB worse than its simulation"
    return f"the real int8 model is {-gap_db:.1f} dB better than its simulation"


def _names(names: tuple[str, ...] | list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def check_truth(
    baseline: RunResult,
    simulation: Simulation,
    simulated_sqnr: Callable[[], float],
    adopt_kernels: Callable[[torch.nn.Module, list[str]], list[str]],
    float_model: torch.nn.Module,
    batch: Any,
    inner_sqnr: Callable[[], pd.Series] | None = None,
) -> TruthCheck:
    """The baseline run against ``simulation`` (``simulated_sqnr()``: its output SQNR as configured
    now); where they disagree, the blocks' outputs inside the real run (``inner_sqnr()``, an
    ExecuTorch program's taps) join the per-layer table, so ``gap_opens_at`` can name the first block
    where they part; where the baseline names kernels that differ, the simulation runs those real
    kernels from then on (``adopt_kernels(quantized, names)``, the names it now runs), and the check
    says what that gave."""
    simulated = simulated_sqnr()
    real_layers, blocks_error = baseline.per_layer_sqnr_db, ""
    if inner_sqnr is not None and abs(sqnr_apart(simulated, baseline.output_sqnr_db)) > SIMULATION_ERROR_DB:
        try:
            real_layers = pd.concat([real_layers, inner_sqnr()])
        except Exception as error:  # the blocks could not be read inside: the rest of the check stands
            blocks_error = f"the blocks' outputs inside the real run could not be read ({type(error).__name__}: {error})"
    layers = _side_by_side(real_layers, simulated_layers(simulation, float_model, batch, list(real_layers.index)))
    truth = TruthCheck(
        baseline.output_sqnr_db,
        simulated,
        baseline.kernel_sqnr_db,
        layers=layers,
        corrected_db=simulated,
        blocks_error=blocks_error,
    )
    if truth.agrees or not truth.disagreeing or baseline.quantized_model is None:
        return truth
    adopted = adopt_kernels(baseline.quantized_model, truth.disagreeing)
    if not adopted:
        return truth
    return replace(truth, real_kernels=tuple(adopted), corrected_db=simulated_sqnr())


def simulated_layers(
    simulation: Simulation, float_model: torch.nn.Module, batch: Any, blocks: list[str] | None = None
) -> pd.Series:
    """Each module's output SQNR in the simulation (starting configuration) against the float
    model, on ``batch``, where both models have a plain (not fused) module of that name, and of the
    modules named in ``blocks`` that hold others (a decoder's blocks: their first output)."""
    floats = dict(float_model.named_modules())
    wanted = set(blocks or ())
    names = [
        name
        for name, module in simulation.model.named_modules()
        if name in floats and type(module) is type(floats[name]) and (next(module.children(), None) is None or name in wanted)
    ]
    found: dict[str, dict[str, torch.Tensor]] = {"float": {}, "simulated": {}}

    def keep(side: str, name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, tuple) and output and name in wanted:
                output = output[0]
            if isinstance(output, torch.Tensor):
                found[side].setdefault(name, output.detach().clone())

        return hook

    hooks = [floats[n].register_forward_hook(keep("float", n)) for n in names]
    hooks += [simulation.model.get_submodule(n).register_forward_hook(keep("simulated", n)) for n in names]
    try:
        with torch.no_grad():
            simulation.configure(())
            call_with(float_model, batch)
            call_with(simulation.model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    both = [n for n in names if n in found["float"] and n in found["simulated"]]
    values = {n: layer_sqnr_db(found["float"][n], found["simulated"][n]) for n in both}
    return pd.Series({n: value for n, value in values.items() if value is not None}, dtype=float)


def _side_by_side(real: pd.Series, simulated: pd.Series) -> pd.DataFrame:
    """Real and simulated per-layer SQNR where both were read, in the real run's order."""
    both = [name for name in real.index if name in simulated.index]
    return pd.DataFrame(
        {"real_sqnr_db": real[both].astype(float), "simulated_sqnr_db": simulated[both].astype(float)}, index=pd.Index(both)
    )
