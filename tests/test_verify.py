"""Verified suggestions: every candidate measured before it is offered, Accept all never worse.

Real prepare_fx -> calibrate -> convert_fx runs on the trained digits models (weights cached in
pytest's tmp dir) and the architectures of tests/zoo.py, from the x86 default and a per-tensor start.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import zoo
from torch import nn
from torch.ao.quantization import QConfig, get_default_qconfig_mapping
from torch.ao.quantization.observer import default_weight_observer

import qreport_widgets as qw
from qreport_widgets import ModuleSettings
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.tune.truth import SIMULATION_ERROR_DB
from qreport_widgets.tune.verify import MIN_GAIN_DB, NOT_TRIED, Candidate, Verifier, refusals


def start(name: str):
    mapping = get_default_qconfig_mapping("x86")
    if name == "per-tensor":
        mapping.set_global(QConfig(activation=mapping.global_qconfig.activation, weight=default_weight_observer))
    return mapping


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


def digits_report(name: str, start_name: str, cache) -> qw.ModelReport:
    model, data = trained_digits_model(name, cache)
    return qw.analyze(
        model, data.calibration[0], data.calibration, eval_data=data.evaluation, qconfig_mapping=start(start_name), progress=False
    )


@pytest.mark.parametrize("start_name", ["x86", "per-tensor"])
@pytest.mark.parametrize("name", ["cnn", "mixer"])
def test_accept_all_is_measured_and_never_worse_than_the_baseline(name, start_name, cache):
    report = digits_report(name, start_name, cache)
    session = report.session
    verified = report.verified_suggestions(progress=lambda done, total: None)
    baseline = session.baseline()
    current = session.current_settings()
    changed = {fqn: s for fqn, s in verified.settings.items() if s != current[fqn]}
    run = session.apply(changed) if changed else baseline
    assert run.ok, run.error
    assert run.output_sqnr_db >= baseline.output_sqnr_db - MIN_GAIN_DB
    for verdict in verified.offered:  # each offered setting was measured to help
        assert verdict.gain_db >= MIN_GAIN_DB and verdict.measured in ("simulated", "real run")
        assert f"{verdict.gain_db:+.2f} dB" in verdict.text
    for verdict in verified.rejected:  # and every other one says why
        assert verdict.note and "not suggested" in verdict.text
    assert len(verified.frame()) == len(verified.verdicts)
    if verified.accept_all is not None:  # the trial run is what Apply then gives
        assert run.output_sqnr_db == pytest.approx(verified.accept_all.output_sqnr_db, abs=1e-6)
        assert verified.accept_all not in session.history[:-1]  # trials stay out of the history


def test_a_candidate_that_loses_is_not_offered(cache):
    report = digits_report("cnn", "per-tensor", cache)
    verified = report.verified_suggestions(progress=lambda done, total: None)
    losing = [v for v in verified.verdicts if not math.isnan(v.gain_db) and v.gain_db < -MIN_GAIN_DB]
    assert losing, verified.frame()
    assert all(not v.offered and "loses" in v.text for v in losing)
    # the search measured what no detector proposed: fc2 kept float gains more than 7 dB, a trade of
    # size for SQNR that reach / fit make, not Accept all
    found = {(v.candidate.module_fqn, v.candidate.setting): v for v in verified.verdicts}
    kept = found["fc2", "keep_float"]
    assert kept.candidate.origin == "search" and kept.gain_db > 7 and not kept.offered and "Accept all leaves it out" in kept.text


def test_equalization_that_changes_the_float_model_is_not_tried(cache):
    """torch's FX equalization of the digits CNN's last Linear scales the logits (a real run loses
    2.4 dB); its float output is checked before anything is run."""
    report = digits_report("cnn", "x86", cache)
    session = report.session
    assert session.equalization_float_error("fc1") < 1e-4
    assert session.equalization_float_error("fc2") > 0.5
    parts = session.parts
    verifier = Verifier(parts.runner, parts.real, parts.diagnosis, parts.migrations)
    verified = verifier.verify([Candidate("fc2", "equalize", "test")], progress=lambda done, total: None)
    (verdict,) = verified.verdicts
    assert verdict.measured == NOT_TRIED and not verdict.offered and "float model's output" in verdict.note


def test_keep_float_measured_by_a_real_run_is_judged_on_its_gain_not_blamed_for_itself(cache):
    """Where real runs measure a keep-float candidate (the simulation unreliable), the module it
    keeps float is the setting itself, not a layer the run lost."""
    report = digits_report("cnn", "per-tensor", cache)
    session = report.session
    parts = session.parts
    verifier = Verifier(parts.runner, parts.real, parts.diagnosis, parts.migrations)
    verdict = verifier._trial(Candidate("fc2", "keep_float", "search"), session.current_settings(), session.baseline())
    assert verdict.measured == "real run" and verdict.gain_db > 7
    assert "leaves fc2 float" not in verdict.note and "Accept all leaves it out" in verdict.text


def test_equalization_is_refused_on_grouped_convs_and_nan_metrics():
    torch.manual_seed(0)
    model = zoo.MobileNetV2().eval()
    refused = refusals(dict(model.named_modules()), nan_metric=["classifier"])
    depthwise = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert depthwise and all("grouped conv" in refused[fqn, "equalize"] for fqn in depthwise)
    assert "NaN" in refused["classifier", "equalize"]
    plain = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.groups == 1]
    assert not any((fqn, "equalize") in refused for fqn in plain)


def test_zoo_mobilenet_v3_accept_all_is_not_worse_and_nan_metric_is_refused():
    """MobileNetV3 from the x86 start: the unmeasured Accept all loses 0.7 dB; the verified one does not."""
    torch.manual_seed(0)
    model = zoo.MobileNetV3().eval()
    batches = zoo.image_batches(6)
    report = qw.analyze(model, batches[0], batches[:4], eval_data=batches[4:], progress=False)
    verified = report.verified_suggestions(progress=lambda done, total: None)
    gain = verified.accept_all_gain_db
    assert gain >= -MIN_GAIN_DB
    nan = [v for v in verified.verdicts if "NaN" in v.note]
    assert nan and all(v.measured == NOT_TRIED for v in nan)


def test_the_tune_tab_accept_all_shows_what_each_suggestion_measured(cache):
    report = digits_report("cnn", "per-tensor", cache)
    tuning = report.widget().tuning
    tuning.accept.click()
    assert "Accept all (measured)" in tuning.status.value and not tuning.error.value
    assert not any(row.settings.keep_float for row in tuning.rows.values())  # Accept all quantizes better, not less
    assert "dB (simulated)" in tuning.rows["fc2"].why.value and "reach, fit" in tuning.rows["fc2"].why.value
    assert "not suggested" in tuning.rows["conv2"].why.value  # per-channel measured to lose there
    assert not tuning.accept.disabled and not tuning.apply.disabled


def planted_outlier_report() -> qw.ModelReport:
    from qreport_widgets.demo.architectures import OutlierMlpBlock

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, 64, generator=generator),) for _ in range(8)]
    return qw.analyze(OutlierMlpBlock().eval(), batches[0], batches[:6], eval_data=batches[6:], progress=False)


def test_outlier_channels_are_found_and_migrated_exactly_in_float():
    from qreport_widgets.tune.migration import float_error, migrated

    report = planted_outlier_report()
    session = report.session
    (migration,) = session.migrations().values()
    assert (migration.producer, migration.consumer, migration.channels) == ("norm", "fc1", (0, 1, 2, 3))
    batch = session.eval_data[0]
    assert float_error(session.float_model, [migration], batch) < 1e-5
    moved = migrated(session.float_model, [migration])
    assert float(moved.norm.weight[:4].abs().max()) < 2 * float(moved.norm.weight[4:].abs().max())
    namespace = {"torch": torch, "model": __import__("copy").deepcopy(session.float_model)}  # the code to paste does the same
    exec(migration.as_code(), namespace)
    assert torch.equal(namespace["model"].fc1.weight, moved.fc1.weight)
    assert torch.equal(namespace["model"].norm.bias, moved.norm.bias)
    code = session.settings_as_code({"fc1": qw.ModuleSettings(migrate=True)})
    assert "model.get_submodule('norm')" in code and "prepare" in code
    with pytest.raises(qw.InvalidSettingsError, match="no outlier input channels"):
        session.apply({"fc2": qw.ModuleSettings(migrate=True)})


def test_migrations_from_the_observed_input_ranges_are_those_a_pass_over_the_data_finds():
    """The session reads each Linear's input ranges from the analysis instead of running the data
    through the model again (seconds on a ViT-B); what it finds is what the pass finds."""
    from qreport_widgets.tune.migration import find_migrations

    session = planted_outlier_report().session
    assert {"fc1", "fc2"} <= set(session.parts.migrations.known_ranges)
    consumers = [m.fqn for m in session.modules]
    assert session.migrations() == find_migrations(session.float_model, list(session.calibration_data), consumers)


def test_accept_all_gains_on_a_block_with_planted_outlier_channels():
    report = planted_outlier_report()
    verified = report.verified_suggestions(progress=lambda done, total: None)
    assert verified.settings["fc1"].migrate
    assert verified.accept_all_gain_db >= 2.0
    run = report.session.apply({k: v for k, v in verified.settings.items() if v != report.session.current_settings()[k]})
    assert run.output_sqnr_db - report.session.baseline().output_sqnr_db >= 2.0


@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_an_activation_observer_choice_reaches_the_converted_model(observer, cache):
    from qreport_widgets.engines.fx.observers import PercentileObserver
    from qreport_widgets.engines.fx.qconfig import ACTIVATION_OBSERVERS

    report = digits_report("cnn", "x86", cache)
    session = report.session
    settings = {"fc1": qw.ModuleSettings(observer=observer)}
    prepared = session.engine.prepare(session.float_model, session.parts.runner.config_for(settings), session.example_inputs)
    (fc1,) = [n for n in prepared.graph.nodes if n.op == "call_module" and n.target == "fc1"]
    (after,) = fc1.users
    assert type(prepared.get_submodule(str(after.target))) is ACTIVATION_OBSERVERS[observer]
    baseline = session.keep(session.baseline())  # pinned: its quantized model outlives the next run
    run = session.apply(settings)
    assert run.ok and run.quantized_model.fc1.scale != baseline.quantized_model.fc1.scale
    namespace: dict = {}
    exec(session.settings_as_code(settings), namespace)  # the code to paste builds the same mapping
    activation = namespace["qconfig_mapping"].module_name_qconfigs["fc1"].activation()
    assert type(activation) is ACTIVATION_OBSERVERS[observer] and activation.reduce_range
    if observer == "percentile":
        assert isinstance(activation, PercentileObserver) and activation.percentile == 99.99
    with pytest.raises(qw.InvalidSettingsError, match="static"):
        session.apply({"fc1": qw.ModuleSettings(dynamic=True, observer=observer)})


def test_per_layer_sqnr_of_a_migrated_run_reads_the_rescaled_layers_right():
    from qreport_widgets import demo

    model, batches = demo.build_demo_model(), demo.demo_batches(6)
    report = qw.analyze(model, batches[0], batches, progress=False)  # as the quickstart
    session = report.session
    assert session.migrations()["mlp.fc1"].producer == "mlp.norm"
    baseline = session.baseline()
    moved = session.apply({"mlp.fc1": qw.ModuleSettings(migrate=True)})
    # mlp.norm's output is rescaled on purpose: compared with the migrated float model, not the original
    assert moved.per_layer_sqnr_db["mlp.norm"] >= baseline.per_layer_sqnr_db["mlp.norm"] - 1.0
    assert moved.per_layer_sqnr_db["mlp.norm"] > 10


ACCEPT_ALL_CASES = [  # trained and real layouts, both starts; EfficientNet's Accept all measured -0.12 dB before
    ("digits cnn", "x86"),
    ("digits cnn", "per-tensor"),
    ("digits mixer", "x86"),
    ("digits mixer", "per-tensor"),
    ("resnet", "per-tensor"),
    ("efficientnet", "x86"),
    ("prelu_net", "x86"),
    ("text_encoder", "x86"),
]


@pytest.mark.parametrize(("name", "start_name"), ACCEPT_ALL_CASES)
def test_accept_all_never_quantizes_fewer_layers_nor_measures_below_the_baseline(name, start_name, cache):
    """Accept all quantizes better, not less: no layer leaves int8 (keeping one float is a trade of
    size for SQNR, made by reach / fit / the size front), except a layer whose quantized kernel the
    kernel check found computing something else; its real run is never below the baseline; and it
    costs at most three real runs beyond the equalization and migration trials, whatever the number
    of candidates."""
    if name.startswith("digits"):
        report = digits_report(name.split()[1], start_name, cache)
    else:
        torch.manual_seed(0)
        model, batches = zoo.ARCHITECTURES[name][0]().eval(), zoo.ARCHITECTURES[name][1](6)
        report = qw.analyze(
            model, batches[0], batches[:4], eval_data=batches[4:], qconfig_mapping=start(start_name), progress=False
        )
    session = report.session
    baseline = session.baseline(progress=lambda done, total: None)
    runs = []
    apply = session.apply
    session.apply = lambda *args, **kwargs: runs.append(kwargs.get("label")) or apply(*args, **kwargs)
    verified = report.verified_suggestions(progress=lambda done, total: None)
    # equalization and migration change the float model: a real run each (one for all equalization
    # candidates where it changes nothing); everything else is simulated
    model_changes = sum(v.candidate.setting in ("equalize", "migrate") for v in verified.verdicts if v.measured == "real run")
    assert len(runs) <= 3 + model_changes + (model_changes > 1), runs
    broken = set(session.truth_check().disagreeing)
    floated = {fqn for fqn, s in verified.settings.items() if s.keep_float and not session.current_settings()[fqn].keep_float}
    assert floated <= broken, verified.frame()
    if verified.accept_all is not None:
        assert verified.accept_all.ok and verified.accept_all.output_sqnr_db >= baseline.output_sqnr_db
        assert verified.accept_all.quantized_layers >= baseline.quantized_layers - len(floated)


@pytest.mark.parametrize(("name", "agreement"), [("cnn", 0.05), ("mixer", SIMULATION_ERROR_DB)])
def test_observer_and_dynamic_candidates_are_simulated_as_real_runs_measure_them(name, agreement, cache):
    """Another activation observer's qparams come from one extra calibration of every candidate
    observer at once; dynamic activations quantize each batch's range as torch's dynamic Linear
    does (7 bits on x86) and leave the ops that only they read float, as FX does."""
    from qreport_widgets.engines.contract import Variant

    model, data = trained_digits_model(name, cache)
    session = qw.QuantizationSession(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
    baseline = session.baseline(progress=lambda done, total: None).output_sqnr_db
    current = session.current_settings()
    producers = session.input_producers([m.fqn for m in session.modules])
    read_by_quantized = {p for c, p in producers.items() if not current[c].keep_float}  # dynamic refused there
    cases = [
        (m.fqn, ModuleSettings(observer=o), Variant(observers=frozenset({(m.fqn, o)})))
        for m in session.modules
        if m.weighted
        for o in ("percentile", "minmax")
    ]
    cases += [
        (m.fqn, ModuleSettings(dynamic=True), Variant(dynamic=frozenset({m.fqn})))
        for m in session.modules
        if m.allows("dynamic") and m.fqn not in read_by_quantized
    ]
    simulated = session.simulate_each([variant for _, _, variant in cases], metric=False)
    for (fqn, change, _), (sqnr, _) in zip(cases, simulated, strict=True):
        setting = replace(current[fqn], observer=change.observer, dynamic=change.dynamic)
        real = session.apply({fqn: setting}, record=False, progress=lambda done, total: None)
        assert abs((sqnr - baseline) - (real.output_sqnr_db - baseline)) <= agreement, (fqn, change)
