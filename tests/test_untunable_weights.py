"""Weights no tunable module holds stay float whatever the settings: a mixture of experts' 3-d expert
weights (transformers' Qwen3-MoE, from a config at its defaults) are most of such a model's bytes, and
analyze says so, naming them and their share; a model whose weights all sit in tunable modules is
silent."""

from __future__ import annotations

import warnings

import pytest
from hf_models import tiny_gpt2, tiny_moe

import qreport_widgets as qw
from qreport_widgets.errors import QReportWarning


def test_a_mixture_of_experts_weights_left_float_are_named_with_their_share():
    model, batches = tiny_moe()
    with pytest.warns(QReportWarning, match=r"of the model's weight bytes sit in \d+ weights no tunable module holds") as caught:
        report = qw.analyze(model, batches[0], batches, engine="eager", format="int4-weight-only", progress=False)
    said = str(caught[0].message)
    assert "model.layers.0.mlp.experts.gate_up_proj (8, 128, 64)" in said and "session.untunable_weights()" in said
    found = report.session.untunable_weights()
    experts = found[found["weight"].str.contains("experts")]
    assert len(experts) == 4 and experts["bytes"].sum() == sum(
        p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name
    )
    assert 0.5 < found["share"].sum() < 1 and list(found["bytes"]) == sorted(found["bytes"], reverse=True)
    tunable = {m.fqn for m in report.session.modules}
    assert "model.layers.0.self_attn.q_proj" in tunable and not any("experts" in fqn for fqn in tunable)


def test_a_model_whose_weights_all_sit_in_tunable_modules_is_silent():
    model, batches = tiny_gpt2()  # its Conv1D projections are Linears in the session's copy
    with warnings.catch_warnings():
        warnings.simplefilter("error", QReportWarning)
        report = qw.analyze(model, batches[0], batches, engine="eager", format="int4-weight-only", progress=False)
    assert report.session.untunable_weights().empty


def test_a_mixture_of_experts_phone_program_serialises_and_runs_leaving_the_models_config_as_it_was():
    pytest.importorskip("executorch")
    from qreport_widgets.engines.executorch import DeployedProgram

    model, batches = tiny_moe()
    asked = model.config._experts_implementation  # transformers' grouped_mm: a custom op without an out variant
    session = qw.analyze(
        model, batches[0], batches, engine="eager", format="int8-dynamic-int4-weight", target="xnnpack", progress=False
    ).session
    baseline = session.baseline()
    assert baseline.ok, baseline.error  # exported with a batched matmul over the chosen experts: plain ops
    assert isinstance(baseline.quantized_model, DeployedProgram) and baseline.size_bytes == len(baseline.quantized_model.pte)
    assert baseline.output_sqnr_db > 10  # the runtime's output, against the float model's
    assert model.config._experts_implementation == asked
