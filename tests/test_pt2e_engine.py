"""The PT2E engine end to end: ``analyze(engine="pt2e")`` on trained digits models and on every
tests/zoo.py architecture, against the FX engine on the same model; the simulation against real
PT2E runs; settings torchao accepted and never carried out shown on the run and the Tune row; the
quantizer set-up as code runs and does what the Tune settings asked."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_unchanged, fingerprint
from torch import nn
from zoo import ARCHITECTURES, ViT, image_batches

import qreport_widgets as qw
from qreport_widgets.core import features as F
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.pt2e import Pt2eEngine, converted_layers, torchao_pt2e
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.tune.verify import FOUND_GAIN_DB, MIN_GAIN_DB


def quiet(done, total):
    return None


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


def both_engines(model: nn.Module, calibration, evaluation, eval_fn=None) -> dict[str, qw.ModelReport]:
    return {
        engine: qw.analyze(
            model, calibration[0], calibration, eval_data=evaluation, eval_fn=eval_fn, engine=engine, progress=False
        )
        for engine in ("fx", "pt2e")
    }


@pytest.mark.parametrize("name", ["cnn", "mixer"])
def test_trained_digits_models_end_to_end(name, cache):
    model, data = trained_digits_model(name, cache)
    before = fingerprint(model)
    reports = both_engines(model, data.calibration, data.evaluation, data.accuracy)
    fx, pt2e = reports["fx"].session.baseline(), reports["pt2e"].session.baseline()
    assert pt2e.ok and pt2e.quantized_layers == len(reports["pt2e"].session.modules) > 0
    # close to FX or better: PT2E quantizes Linear / Conv inputs and weights, FX more of the graph
    assert pt2e.output_sqnr_db > fx.output_sqnr_db - 1.0, (pt2e.output_sqnr_db, fx.output_sqnr_db)
    assert pt2e.eval_metric > data.accuracy(model) - 0.02
    assert len(pt2e.per_layer_sqnr_db) == pt2e.quantized_layers and pt2e.size_bytes < fx.size_bytes * 1.5
    verified = reports["pt2e"].verified_suggestions(progress=quiet)
    # keeping a layer float helps under PT2E too: measured and shown, left to reach / fit (a trade of size)
    floats = [v for v in verified.verdicts if v.candidate.setting == "keep_float" and v.gain_db >= FOUND_GAIN_DB]
    assert floats and not any(v.offered for v in floats), verified.frame()
    # FX-only settings are one note, not a row per module
    assert not [v for v in verified.verdicts if v.candidate.setting in ("equalize", "observer")]
    assert all("FX only" in note for note in verified.notes if "candidate(s) not tried" in note)
    session = reports["pt2e"].session
    current = session.current_settings()
    changed = {fqn: s for fqn, s in verified.settings.items() if s != current[fqn]}
    if verified.accept_all is None:  # nothing that keeps every layer quantized helps here
        assert not changed
    else:
        assert verified.accept_all.ok and verified.accept_all_gain_db >= 0  # never below the baseline
        run = session.apply(changed, label="accept all")
        assert run.output_sqnr_db == pytest.approx(verified.accept_all.output_sqnr_db, abs=1e-6)
        assert not run.module_notes, run.module_notes  # every setting reached the graph
        assert [n for n in run.notes if not n.startswith("latency: ")] == [], run.notes
    reached = session.reach(target_sqnr_db=pt2e.output_sqnr_db + FOUND_GAIN_DB, progress=quiet)  # the trade, asked for
    assert reached.ok and reached.output_sqnr_db >= pt2e.output_sqnr_db + FOUND_GAIN_DB
    assert_unchanged(model, before)


def test_report_keys_and_channel_axes_match_the_fx_engine(cache):
    model, data = trained_digits_model("mixer", cache)
    reports = both_engines(model, data.calibration[:2], data.evaluation[:1])
    fx, pt2e = (reports[e].generate_model_report() for e in ("fx", "pt2e"))
    assert set(fx) == set(pt2e)
    for detector in fx:
        shared = set(fx[detector][1]) & set(pt2e[detector][1])
        assert shared, detector
        for fqn in shared:  # the same torch report keys per module
            assert set(fx[detector][1][fqn]) == set(pt2e[detector][1][fqn]), (detector, fqn)
    frame = reports["pt2e"].frame()
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    outliers = pt2e[F.DetectorName.OUTLIER.value][1]
    for fqn, linear in linears.items():  # batch x tokens x hidden: the channels of a Linear's input are its features
        assert len(outliers[fqn][F.OUTLIER_RATIOS]) == linear.in_features, fqn
        assert frame.modules.at[fqn, "channels"] == linear.in_features
    assert reports["pt2e"].graph.units["block1.norm1"].type_name == "LayerNorm"


# Verified suggestions on PT2E, on the layouts whose exported graphs differ in kind: conv -> add ->
# relu annotated whole (resnet), hardswish and squeeze-excite (mobilenet_v3), attention's reshapes
# (vit, text_encoder). Accept all's logic is the engines' own (tests/test_architectures.py accepts
# every zoo layout's suggestions on FX, tests/test_verify.py checks what Accept all measures), and the
# PT2E simulation it trusts is checked against real runs below. The other layouts' PT2E runs stay.
VERIFIED_ON_PT2E = ("resnet", "mobilenet_v3", "vit", "text_encoder")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_zoo_architecture_end_to_end(name):
    torch.manual_seed(0)
    build, data = ARCHITECTURES[name]
    model, batches = build().eval(), data(8)
    before = fingerprint(model)
    reports = both_engines(model, batches[:6], batches[6:])
    pt2e_report = reports["pt2e"]
    assert len(pt2e_report.frame().modules) > 0 and not pt2e_report.analysis().graph.units.keys() - {
        fqn for fqn, _ in model.named_modules()
    }
    fx, pt2e = reports["fx"].session.baseline(), pt2e_report.session.baseline()
    assert pt2e.ok and pt2e.quantized_layers > 0, pt2e.error
    assert pt2e.output_sqnr_db > fx.output_sqnr_db - 1.0, (pt2e.output_sqnr_db, fx.output_sqnr_db)
    if name in VERIFIED_ON_PT2E:
        verified = pt2e_report.verified_suggestions(progress=quiet)
        if verified.accept_all is not None:  # Accept all is no worse than the baseline
            assert verified.accept_all.output_sqnr_db >= pt2e.output_sqnr_db + MIN_GAIN_DB - 1e-9
    assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["digits cnn", "resnet"])
def test_the_simulation_gives_what_real_runs_give(name, cache):
    if name == "digits cnn":
        model, data = trained_digits_model("cnn", cache)
        calibration, evaluation = data.calibration, data.evaluation
    else:  # conv -> add -> relu: x86 annotates it whole, so some variants observe new tensors and calibrate again
        torch.manual_seed(0)
        build, batches = ARCHITECTURES[name][0], image_batches(8)
        model, calibration, evaluation = build().eval(), batches[:6], batches[6:]
    session = qw.QuantizationSession(model, calibration[0], calibration, eval_data=evaluation, engine=Pt2eEngine())
    table = session.sensitivity(progress=quiet)
    first, second = table.index[:2]
    variants = {
        Variant(frozenset({first})): {first: ModuleSettings(keep_float=True)},
        Variant(frozenset({first, second})): {first: ModuleSettings(keep_float=True), second: ModuleSettings(keep_float=True)},
        Variant(other_weights=frozenset({second})): {second: ModuleSettings(per_channel=False)},
    }
    for variant, settings in variants.items():
        simulated, _ = session.simulate(variant)
        real = session.apply(settings, record=False)
        assert simulated == pytest.approx(real.output_sqnr_db, abs=1e-6), (variant, simulated, real.output_sqnr_db)
    if name == "resnet":
        assert session.simulation().recalibrated > 0
    # the first layer reads the model's input: its own error is all its error
    baseline = session.baseline()
    head = session.modules[0].fqn
    assert table.at[head, "local_sqnr_db"] == pytest.approx(baseline.per_layer_sqnr_db[head], abs=1e-4)


def test_a_setting_torchao_never_carried_out_is_shown_on_the_run_and_its_tune_row():
    torch.manual_seed(0)
    model, batches = ViT().eval(), image_batches(6)
    report = qw.analyze(model, batches[0], batches[:4], eval_data=batches[4:], engine="pt2e", progress=False)
    attention = next(m for m in report.session.modules if m.type_name == "MultiheadAttention")
    assert attention.current.keep_float  # x86's quantizer leaves the attention's own linears float
    tuning = report.widget().tuning
    tuning.rows[attention.fqn].settings = ModuleSettings(per_channel=True)  # asked quantized
    tuning.apply.click()
    assert not tuning.error.value, tuning.error.value
    run = report.session.history[-1]
    assert run.module_notes[attention.fqn] == "asked static activations, per-channel weights, the converted graph has float"
    assert "last run: asked static activations" in tuning.rows[attention.fqn].why.value
    assert "last run" not in tuning.rows[report.session.modules[-1].fqn].why.value
    assert "not of int8 kernels" in tuning.status.value  # what the latency column measures


def test_fx_only_settings_are_disabled_on_tune_rows_and_refused():
    torch.manual_seed(0)
    batches = image_batches(4)
    report = qw.analyze(ARCHITECTURES["resnet"][0]().eval(), batches[0], batches, engine="pt2e", progress=False)
    row = next(iter(report.widget().tuning.rows.values()))
    assert row.equalize.disabled and row.observer.disabled and row.activation.disabled  # a Conv: no dynamic
    assert "FX only" in row.equalize.tooltip
    with pytest.raises(qw.InvalidSettingsError, match="FX only"):
        report.session.apply({row.fqn: ModuleSettings(per_channel=True, equalize=True)})


def test_the_quantizer_as_code_runs_and_does_what_the_settings_asked(cache):
    model, data = trained_digits_model("mixer", cache)
    session = qw.QuantizationSession(
        model, data.calibration[0], data.calibration[:2], eval_data=data.evaluation[:1], engine=Pt2eEngine()
    )
    names = [m.fqn for m in session.modules]
    settings = {
        names[0]: ModuleSettings(keep_float=True),
        names[1]: ModuleSettings(per_channel=False),
        names[2]: ModuleSettings(dynamic=True, per_channel=True),
        names[3]: ModuleSettings(dynamic=True, per_channel=False),
    }
    code = session.settings_as_code(settings)
    namespace = {"model": model, "example_inputs": data.calibration[0], "calibration_batches": data.calibration[:2]}
    exec(compile(code, "<settings as code>", "exec"), namespace)  # what a user pastes, run as it is
    layers = converted_layers(namespace["quantized"])
    for fqn, choice in settings.items():
        assert layers[fqn].matches(choice), (fqn, layers[fqn], choice)
    assert layers[names[4]].matches(ModuleSettings(per_channel=True))  # the others keep the default
    run = session.apply(settings)
    assert {fqn: layers[fqn] for fqn in settings} == {fqn: converted_layers(run.quantized_model)[fqn] for fqn in settings}


def test_a_quantizer_of_your_own_is_the_start_and_settings_override_it(cache):
    ao = torchao_pt2e()
    model, data = trained_digits_model("cnn", cache)
    from qreport_widgets.engines.pt2e.quantizer import quantization_config

    start = ao.X86InductorQuantizer().set_global(quantization_config(False, dynamic=False))  # per-tensor weights
    report = qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="pt2e", quantizer=start, progress=False
    )
    session = report.session
    assert all(not m.current.per_channel for m in session.modules)
    per_channel = [s for s in report.suggestions() if s.kind == F.SuggestionKind.PER_CHANNEL]
    assert {s.module_fqn for s in per_channel} == {m.fqn for m in session.modules}  # read from your quantizer
    first = session.modules[0].fqn
    run = session.apply({first: ModuleSettings(per_channel=True)})
    layers = converted_layers(run.quantized_model)
    assert layers[first].weight == "per-channel" and all(
        layer.weight == "per-tensor" for fqn, layer in layers.items() if fqn != first
    )
    assert "base_quantizer" in session.settings_as_code({first: ModuleSettings(per_channel=True)})


def test_engine_arguments_are_checked():
    batches = image_batches(2)
    model = ARCHITECTURES["resnet"][0]().eval()
    with pytest.raises(ValueError, match="engine must be 'fx' or 'pt2e'"):
        qw.analyze(model, batches[0], batches, engine="tensorrt", progress=False)
    with pytest.raises(ValueError, match="quantizer= is not for engine='fx'"):
        qw.analyze(model, batches[0], batches, quantizer=object(), progress=False)
    with pytest.raises(ValueError, match="with PT2E pass quantizer="):
        qw.analyze(model, batches[0], batches, engine="pt2e", qconfig_mapping=object(), progress=False)


def test_batch_norms_are_folded_into_their_convs_as_every_pt2e_run_folds_them():
    torch.manual_seed(0)
    model, batches = ARCHITECTURES["resnet"][0]().eval(), image_batches(3)
    report = qw.analyze(model, batches[0], batches, engine="pt2e", progress=False)
    graph = report.graph
    assert "bn1" not in graph.units and "folded into the conv before it" in graph.skipped["bn1"]
    conv = graph.units["conv1"]
    scale = model.bn1.weight / torch.sqrt(model.bn1.running_var + model.bn1.eps)
    torch.testing.assert_close(conv.weight, model.conv1.weight * scale.reshape(-1, 1, 1, 1))
    assert conv.base is not model.conv1 and conv.type_name == "Conv2d"
    assert report.session.float_model.conv1.weight.data_ptr() != conv.weight.data_ptr()
