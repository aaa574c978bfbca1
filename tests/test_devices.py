"""Everything the tool makes follows the model's device, checked on the CPU (CI has no GPU; the
same steps on a real one are ``test_gpu.py``, ``make test-gpu``):

- every tensor the package creates names its device, through whole FX and eager sessions (a tensor
  made on the default device is the CPU's, and meets a GPU model's tensors in the first op);
- the observers' hot path reads no value back from a device (on ``meta`` tensors, which hold no
  values: any read raises), and their state follows the tensor they observe;
- a copy for another device leaves the user's model where it is; batches move when asked.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from hf_models import tiny_llama
from torch import nn
from torch.overrides import TorchFunctionMode

import qreport_widgets as qw
from qreport_widgets.core.devices import CPU, MovedBatches, copy_on, float64_on, model_device, moved
from qreport_widgets.core.features import Stat
from qreport_widgets.demo.architectures import TinyConvNet
from qreport_widgets.engines import build_engine
from qreport_widgets.engines.eager.algorithms import InputStatistics
from qreport_widgets.engines.eager.found import FoundWeights
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.observe.observer import ModelReportObserver

PACKAGE = str(Path(qw.__file__).parent) + "/"
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.eye,
    torch.linspace,
    torch.randn,
    torch.rand,
    torch.randint,
}
META = torch.device("meta")


class DeviceUnnamed(TorchFunctionMode):
    """Counts the tensors the package's own code creates without naming a device, by file and line
    (``torch.as_tensor`` of a tensor keeps that tensor's device, and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and not (args and isinstance(args[0], torch.Tensor)):
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename.endswith(("torch/overrides.py", "torch/utils/_device.py")):
                caller = caller.f_back
            if caller is not None and caller.f_code.co_filename.startswith(PACKAGE):
                self.found[f"{caller.f_code.co_filename.removeprefix(PACKAGE)}:{caller.f_lineno} {func.__name__}"] += 1
        return func(*args, **kwargs)


def test_an_fx_session_makes_every_tensor_on_a_named_device():
    torch.manual_seed(0)
    model = TinyConvNet().eval()
    batches = [(torch.randn(4, 3, 32, 32),) for _ in range(4)]
    with DeviceUnnamed() as unnamed:
        report = qw.analyze(model, batches[0], batches, progress=False)
        session = report.session
        assert session.baseline().error is None
        session.sensitivity()
        report.verified_suggestions()
        session.reach(target_sqnr_db=30)
    assert not unnamed.found, f"tensors made on the default device: {dict(unnamed.found)}"


def test_an_eager_session_with_every_weight_algorithm_makes_every_tensor_on_a_named_device():
    model, batches = tiny_llama()
    with DeviceUnnamed() as unnamed:
        report = qw.analyze(
            model, batches[0], batches, progress=False, engine="eager", format="int4-weight-only", metric="perplexity"
        )
        session = report.session
        assert session.baseline().error is None
        session.block_sensitivity()
        for algorithm in ("gptq", "awq", "hqq"):
            settings = ModuleSettings(format="int4-weight-only", group_size=32, algorithm=algorithm)
            assert session.apply({"model.layers.0.mlp.down_proj": settings}).error is None
    assert not unnamed.found, f"tensors made on the default device: {dict(unnamed.found)}"


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((8, 64, 56, 56), 1), ((4, 128, 768), -1), ((512, 3072), -1), ((2, 16, 8, 8), 1), ((4, 7), 1), ((3,), 0)],
    ids=["conv-sampled", "tokens-sampled", "rows-tournament", "conv-small", "few-values", "one-axis"],
)
@pytest.mark.parametrize("sample", [4096, None], ids=["estimated", "exact"])
def test_an_observer_on_a_device_reads_no_value_back_and_keeps_its_state_there(shape, axis, sample):
    # meta tensors hold no values: .item(), bool(), .numpy() or a copy to the CPU raises on them, as a
    # host synchronisation would cost a GPU a stall per batch
    observer = ModelReportObserver(axis, 0.975, stats=list(Stat), percentiles=(0.5,), percentile_sample=sample)
    for _ in range(3):
        observer(torch.empty(shape, device=META))
    assert observer.num_batches_tracked == 3
    assert {buffer.device for buffer in observer.buffers()} == {META}
    assert observer.average_percentile_ratio.device == META


def test_an_observer_made_on_the_cpu_follows_the_tensor_it_observes():
    observer = ModelReportObserver(1)
    observer(torch.empty(2, 8, 4, device=META))
    assert {buffer.device for buffer in observer.buffers()} == {META}
    observer.reset_batch_and_epoch_values()
    assert observer.epoch_activation_min.device == META  # a fresh state stays where the old one was


def test_gptq_and_awq_statistics_are_summed_on_the_linears_device_in_float64_where_it_has_it():
    statistics = InputStatistics.empty(64, META)
    assert (statistics.fit_sum.device, statistics.fit_sum.dtype) == (META, torch.float64)
    assert float64_on(torch.device("cuda")) and not float64_on(torch.device("mps"))  # Apple's GPUs have no float64


def test_a_copy_on_another_device_leaves_the_model_where_it_is():
    model, _ = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as many decoders are
    before = {name: (p, p.device) for name, p in model.named_parameters(remove_duplicate=False)}
    copied = copy_on(model, META)
    assert model_device(copied) == META and model_device(model) == CPU
    assert all(p is before[name][0] and p.device == CPU for name, p in model.named_parameters(remove_duplicate=False))
    assert copied.lm_head.weight is copied.model.embed_tokens.weight  # still tied
    same = copy_on(model, CPU)
    assert same.model.norm.weight is model.model.norm.weight  # nothing to move: shared, not copied


def test_batches_move_as_they_are_read_and_keep_their_form():
    Pair = namedtuple("Pair", "ids mask")
    batches = [(torch.ones(2, 3), 5), {"input_ids": torch.ones(2, dtype=torch.long)}, Pair(torch.ones(1), None), torch.ones(4)]
    read = list(MovedBatches(batches, META))
    assert len(MovedBatches(batches, META)) == 4
    assert read[0][0].device == META and read[0][1] == 5
    assert read[1]["input_ids"].device == META
    assert isinstance(read[2], Pair) and read[2].ids.device == META and read[2].mask is None
    assert read[3].device == META and batches[3].device == CPU  # the caller's batch is not moved
    assert moved(batches[3], CPU) is batches[3]


@pytest.mark.parametrize(("engine", "options"), [("fx", {}), ("pt2e", {}), ("eager", {}), ("eager", {"target": "xnnpack"})])
def test_real_runs_whose_kernels_are_the_cpus_say_so(engine, options):
    if options.get("target") == "xnnpack":
        pytest.importorskip("executorch", reason="the [executorch] extra")
    built = build_engine(engine, **options)
    assert built.kernel_device == CPU
    assert "CPU" in built.kernel_words()


@pytest.mark.parametrize("engine", ["fx", "eager"])
def test_inputs_on_another_device_than_the_model_are_refused_naming_both(engine):
    model = nn.Sequential(nn.Linear(8, 4)).to(META)
    batches = [(torch.ones(2, 8),)]
    with pytest.raises(qw.DeviceMismatchError, match=r"on cpu but the model is on meta; move it there .*move_batches=True"):
        qw.analyze(model, batches[0], batches, progress=False, engine=engine)
    on_meta = (torch.ones(2, 8, device=META),)
    with pytest.raises(qw.CalibrationError, match="Batch 1 is on cpu but the model is on meta"):
        qw.analyze(model, on_meta, [on_meta, *batches], progress=False, engine=engine)


def test_an_eager_model_calibrated_where_it_lives_converts_as_a_copy_with_every_weight_it_found():
    # on a GPU, GPTQ / AWQ / the learned rounding compute where the model is and the calibrated model
    # then moves to the kernels' device (``relocated``); here both are the CPU, so the copy's weights
    # must be exactly the ones the model calibrated in place converts to
    model, batches = tiny_llama()
    report = qw.analyze(model, batches[0], batches[:4], progress=False, engine="eager", format="int4-weight-only")
    session, runner = report.session, report.session.parts.runner
    linears = [m.fqn for m in session.modules if m.current.format == "int4-weight-only" and m.algorithm_allowed("learned")]
    algorithms = {fqn: ("gptq", "awq", "learned")[i % 3] for i, fqn in enumerate(linears)}  # a module of each
    settings = {fqn: ModuleSettings(format="int4-weight-only", group_size=32, algorithm=a) for fqn, a in algorithms.items()}
    config = runner.config_for(settings)
    engine = session.engine
    assert engine.computes_where_the_model_is(config)
    converted = []
    for move in (False, True):
        engine.found_before = FoundWeights()  # each computes its GPTQ weights (none taken from the other)
        prepared = runner.prepare(session.float_model, config)
        with contextlib.closing(engine.calibration_passes(prepared)) as passes:
            for statistics in passes:
                runner.calibrate(prepared, "calibrating", statistics=statistics)
        if move:
            relocated = engine.relocated(prepared, CPU)
            assert relocated is not prepared
            prepared = relocated
        converted.append(engine.convert(prepared))
    in_place, moved_copy = ({fqn: m.get_submodule(fqn).weight.dequantize() for fqn in algorithms} for m in converted)
    for fqn in algorithms:
        assert torch.equal(in_place[fqn], moved_copy[fqn]), fqn
    assert engine.run_notes(config, converted[1]).notes == engine.run_notes(config, converted[0]).notes  # the learned notes too
    assert not engine.computes_where_the_model_is(runner.config_for({linears[0]: ModuleSettings(format="int4-weight-only")}))
