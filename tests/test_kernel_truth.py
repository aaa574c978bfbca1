"""When the real int8 kernels disagree with the simulation: a trained PReLU model (digits, seconds)
whose x86 FX conversion runs torch's quantized PReLU kernel, which applies the slope to positive
inputs too. The truth check must notice, name the PReLUs, and every way to keep them float must
work and give back what the simulation promised."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.ao.quantization import get_default_qconfig_mapping
from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
from zoo import ARCHITECTURES

import qreport_widgets as qw
from qreport_widgets.core.metrics import sqnr_db
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.engines.contract import Variant
from qreport_widgets.tune.truth import KERNEL_AGREEMENT_DB, SIMULATION_ERROR_DB
from qreport_widgets.tune.verify import KERNEL_CHECK, MIN_GAIN_DB, SIMULATED

# real runs of x86's int8 kernels decide these outcomes: `make test` runs them again without AVX-512 and on one thread
pytestmark = pytest.mark.kernels

PRELUS = ["prelu1", "prelu2", "prelu3", "prelu4"]
QUIET = lambda done, total: None  # noqa: E731


@pytest.fixture(scope="module")
def trained(digits_cache):
    return trained_digits_model("prelu", digits_cache)


@pytest.fixture(scope="module")
def report(trained):
    model, data = trained
    return qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, progress=False)


def test_the_truth_check_notices_the_gap_and_names_every_prelu(report):
    session = report.session
    baseline = session.baseline(progress=QUIET)
    truth = session.truth_check()
    assert truth.gap_db > 20 and baseline.output_sqnr_db < 5  # the real model is garbage, its simulation is not
    assert truth.disagreeing == PRELUS
    assert (baseline.kernel_sqnr_db.drop(PRELUS) >= KERNEL_AGREEMENT_DB).all()  # conv and linear kernels agree
    said = " ".join(baseline.notes)
    assert "worse than its simulation" in said and "a quantized kernel differs from its reference" in said
    assert "prelu1 (" in said and "the gap opens at prelu1" in said
    assert all("quantized kernel differs" in baseline.module_notes[name] for name in PRELUS)
    # the simulation now runs the four real kernels and agrees with the real run
    assert truth.real_kernels == tuple(PRELUS) and truth.reliable
    assert abs(truth.corrected_db - baseline.output_sqnr_db) <= SIMULATION_ERROR_DB


def test_keeping_the_prelus_float_restores_what_the_simulation_promised(report):
    session = report.session
    truth = session.truth_check()
    ((simulated, _),) = session.simulate_each([Variant(float_modules=frozenset(PRELUS))], metric=False)
    run = session.apply({name: qw.ModuleSettings(keep_float=True) for name in PRELUS}, label="prelus float", progress=QUIET)
    assert run.ok and run.output_sqnr_db >= truth.simulated_db - SIMULATION_ERROR_DB
    # float PReLU outputs are quantized by their readers' 7-bit observers, not the PReLUs' 8-bit ones: simulated too
    assert abs(run.output_sqnr_db - simulated) <= SIMULATION_ERROR_DB
    assert all(type(run.quantized_model.get_submodule(name)) is nn.PReLU for name in PRELUS)
    assert len(run.kernel_sqnr_db) and (run.kernel_sqnr_db >= KERNEL_AGREEMENT_DB).all()


def test_sensitivity_and_reach_find_the_prelus_through_the_real_kernels(report):
    session = report.session
    truth = session.truth_check()
    ranking = session.sensitivity(progress=QUIET, metric=False)
    assert set(ranking.index[:4]) == set(PRELUS)  # the Linear and Conv layers are not what hurts
    target = truth.simulated_db - 3.0
    reached = session.reach(target_sqnr_db=target, progress=QUIET)
    assert reached.ok and reached.output_sqnr_db >= target and "met with 4 of" in reached.notes[-1]
    assert {name for name, s in reached.settings.items() if s.keep_float} == set(PRELUS)


def test_accept_all_offers_the_kernel_fix_and_its_simulated_gains_are_real(report):
    session = report.session
    verified = report.verified_suggestions(progress=QUIET)
    kept = {v.candidate.module_fqn for v in verified.offered if v.candidate.setting == "keep_float"}
    assert kept == set(PRELUS)
    assert {v.candidate.origin for v in verified.offered if v.candidate.module_fqn in PRELUS} == {KERNEL_CHECK}
    baseline = session.baseline()
    assert verified.accept_all.ok and verified.accept_all_gain_db > 20
    # every gain shown as simulated is one a real run has too
    for verdict in verified.offered:
        if verdict.measured != SIMULATED:
            continue
        fqn = verdict.candidate.module_fqn
        alone = session.apply({fqn: verdict.candidate.applied_to(session.current_settings()[fqn])}, record=False)
        assert abs((alone.output_sqnr_db - baseline.output_sqnr_db) - verdict.gain_db) <= SIMULATION_ERROR_DB, fqn
    assert verified.accept_all_gain_db >= max(v.gain_db for v in verified.offered) - MIN_GAIN_DB


def test_the_tune_rows_keep_the_prelus_float(report):
    panel = report.widget().tuning
    hidden = [name for name in PRELUS if panel.rows[name] not in panel.rows_box.children]
    assert hidden == PRELUS or all(panel.rows[name].run_note for name in PRELUS)  # ops join only when flagged
    panel.all_ops.value = True
    assert all(panel.rows[name] in panel.rows_box.children for name in PRELUS)
    assert panel.rows["prelu1"].weight.disabled and not panel.rows["prelu1"].keep_float.disabled
    for name in PRELUS:
        panel.rows[name].keep_float.value = True
    panel.apply.click()
    latest = report.session.history[-1]
    assert (
        latest.ok and latest.label.startswith("apply") and latest.output_sqnr_db > report.session.truth_check().simulated_db - 1
    )
    assert "red: kernels that differ" in panel.layers.figure.title  # the baseline's kernels, a series of their own
    assert "prelu1" in panel.truth.value and "worse than its simulation" in panel.truth.value
    assert "kernel check (baseline)" in panel.layers.bars.labels
    assert "convert_fx_keeping_float" in panel.code.value


def test_a_float_prelu_converts_where_torchs_convert_fx_fails(trained):
    model, data = trained
    mapping = get_default_qconfig_mapping("x86").set_module_name("prelu2", None)
    prepared = prepare_fx(copy.deepcopy(model), mapping, data.calibration[0])
    for batch in data.calibration:
        prepared(*batch)
    with pytest.raises(AttributeError, match="weight"):  # torch lowers the float PReLU anyway: qconfig None
        convert_fx(copy.deepcopy(prepared))
    session = qw.QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    settings = {"prelu2": qw.ModuleSettings(keep_float=True)}
    run = session.apply(settings, progress=QUIET)
    assert run.ok and type(run.quantized_model.prelu2) is nn.PReLU
    namespace: dict = {}
    exec(session.settings_as_code(settings), namespace)  # the code a pipeline pastes converts the same model
    pasted = prepare_fx(copy.deepcopy(model), namespace["qconfig_mapping"], data.calibration[0])
    for batch in data.calibration:
        pasted(*batch)
    pasted = namespace["convert_fx_keeping_float"](pasted)
    images = data.evaluation[0][0]
    assert torch.equal(pasted(images), run.quantized_model(images))


def test_settings_refuse_everything_but_keep_float_on_an_op(report):
    op = next(m for m in report.session.modules if m.fqn == "prelu1")
    assert not op.weighted and op.current == qw.ModuleSettings()
    with pytest.raises(qw.InvalidSettingsError, match="prelu1: PReLU is quantized as a whole: it can be kept float"):
        report.session.apply({"prelu1": qw.ModuleSettings(per_channel=True)})


def test_pt2e_does_not_quantize_prelu_and_its_simulation_agrees(trained):
    model, data = trained
    report = qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="pt2e", progress=False)
    truth = report.session.truth_check(progress=QUIET)
    assert truth.agrees and truth.status == "" and len(truth.kernels) == 0
    assert truth.real_db > 25


def test_random_weights_with_default_slopes_are_ruined_too():
    build, batches = ARCHITECTURES["prelu_net"]
    torch.manual_seed(0)
    data = batches(6)
    session = qw.QuantizationSession(build().eval(), data[0], data[:4], eval_data=data[4:])
    truth = session.truth_check(progress=QUIET)
    assert not truth.agrees and truth.gap_db > 10 and set(PRELUS) <= set(truth.disagreeing)
    assert math.isfinite(truth.corrected_db) and truth.reliable


def test_kernel_check_agrees_on_a_model_without_such_kernels(digits_cache):
    model, data = trained_digits_model("cnn", digits_cache)
    session = qw.QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    baseline = session.baseline(progress=QUIET)
    truth = session.truth_check()
    assert truth.agrees and truth.notes == () and truth.real_kernels == ()
    assert len(baseline.kernel_sqnr_db) == 5 and (baseline.kernel_sqnr_db >= KERNEL_AGREEMENT_DB).all()
    tuned = session.apply({"fc1": qw.ModuleSettings(per_channel=False)}, progress=QUIET)
    assert tuned.ok and tuned.kernel_sqnr_db.empty  # the baseline's kernels agree: no conversion spent on it
    floated = qw.QuantizationSession(
        model,
        data.calibration[0],
        data.calibration,
        eval_data=data.evaluation,
        qconfig_mapping=get_default_qconfig_mapping("x86").set_module_name("fc2", None),
    )
    floated.baseline(progress=QUIET)
    requantized = floated.apply({"fc2": qw.ModuleSettings(per_channel=True)}, progress=QUIET)
    assert "fc2" in requantized.kernel_sqnr_db  # a module the start kept float gets its kernel checked
    assert sqnr_db(torch.ones(3), torch.ones(3)) == math.inf


def test_a_functional_add_is_an_op_that_can_be_kept_float():
    build, batches = ARCHITECTURES["resnet"]
    torch.manual_seed(0)
    data = batches(6)
    model = build().eval()
    session = qw.QuantizationSession(model, data[0], data[:4], eval_data=data[4:])
    ops = {m.fqn: m for m in session.modules if not m.weighted}
    assert {"maxpool", "layer1.0.add", "layer1.0.relu2", "layer4.1.add"} <= set(ops)
    settings = {"layer1.0.add": qw.ModuleSettings(keep_float=True)}
    run = session.apply(settings, progress=QUIET)
    adds = [n for n in run.quantized_model.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert any(n.target is __import__("operator").add for n in adds)  # one add left float, the others quantized
    assert sum("quantized" in str(n.target) for n in adds) == len(adds) - 1
    code = session.settings_as_code(settings)
    assert "set_module_name_object_type_order('layer1.0', operator.add, 0, None)" in code
    namespace: dict = {}
    exec(code, namespace)
    assert namespace["qconfig_mapping"].module_name_object_type_order_qconfigs
    assert abs(session.simulate(["layer1.0.add"])[0] - run.output_sqnr_db) <= SIMULATION_ERROR_DB


def test_a_simulation_that_cannot_run_the_real_kernels_says_its_numbers_are_unverified(trained, monkeypatch):
    from qreport_widgets.engines.fx.simulate import Simulator
    from qreport_widgets.errors import QReportWarning

    monkeypatch.setattr(Simulator, "run_real_kernels", lambda self, quantized, names: [])
    model, data = trained
    session = qw.QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    truth = session.truth_check(progress=QUIET)
    assert not truth.reliable and "unverified" in truth.status and truth.real_kernels == ()
    assert any("its numbers are unverified" in note for note in session.baseline().notes)
    with pytest.warns(QReportWarning, match="unverified"):
        session.sensitivity(progress=QUIET, metric=False)
    reached = session.reach(target_sqnr_db=truth.simulated_db - 3.0, progress=QUIET)
    assert "each step is a real run" in reached.notes[-1]
