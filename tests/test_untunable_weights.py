"""A mixture of experts' 3-d expert weights (transformers' Qwen3-MoE, from a config at its defaults)
are most of such a model's bytes: the session holds them as one ``nn.Linear`` an expert, over the
user's weights, and quantizes them in every format and algorithm, the phone program included.
Weights no tunable module holds (an experts module of another layout, a custom module's matrix) stay
float whatever the settings, and analyze says so, naming them and their share; a model whose
weights all sit in tunable modules is silent."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_unchanged, fingerprint
from hf_models import tiny_gpt2, tiny_moe

import qreport_widgets as qw
from qreport_widgets.core.experts import ExpertLinears, is_expert_weights
from qreport_widgets.engines.eager import learned
from qreport_widgets.engines.rotation import ONLINE_HADAMARD
from qreport_widgets.engines.settings import ModuleSettings
from qreport_widgets.errors import QReportWarning


def experts_of(model):
    return {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}


def every_int4(session, fmt: str, algorithm: str = "rtn") -> dict[str, ModuleSettings]:
    chosen = ModuleSettings(format=fmt, group_size=32, algorithm=algorithm)
    return {m.fqn: chosen for m in session.modules if m.type_name == "Linear"}


def test_a_mixture_of_experts_experts_are_one_linear_an_expert_over_the_users_weights_and_gptq_fits_each(monkeypatch):
    monkeypatch.setattr(learned, "LEARNED_STEPS", 10)
    monkeypatch.setattr(learned, "LEARNED_BATCHES", 1)
    model, batches = tiny_moe()
    before = fingerprint(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QReportWarning)  # the routers alone stay float: 0.4% of the bytes
        report = qw.analyze(
            model, batches[0], batches, eval_data=batches[:2], engine="eager", format="int4-weight-only", group_size=32,
            metric="perplexity", progress=False,
        )  # fmt: skip
    session = report.session
    tunable = {m.fqn for m in session.modules}
    experts = {f"model.layers.{b}.mlp.experts.{p}.{e}" for b in (0, 1) for p in ("gate_up_proj", "down_proj") for e in range(8)}
    assert experts <= tunable
    left = session.untunable_weights()
    routers = ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert list(left["weight"]) == routers and left["share"].sum() < 0.01

    # each expert's Linear is a view of the user's 3-d weight: no copy
    ours = session.float_model.get_submodule("model.layers.1.mlp.experts")
    theirs = model.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(ours, ExpertLinears)
    assert ours.down_proj[5].weight.data_ptr() == theirs.down_proj[5].data_ptr()
    assert torch.equal(ours.gate_up_proj[3].weight, theirs.gate_up_proj[3])

    baseline = session.baseline()
    assert baseline.ok, baseline.error
    assert any("one Linear an expert" in note for note in baseline.notes)
    expert = baseline.quantized_model.get_submodule("model.layers.0.mlp.experts.down_proj.2").weight
    assert int(expert.qdata.min()) >= -8 and int(expert.qdata.max()) <= 7  # int4 values

    # GPTQ fits each expert to the tokens routed to it; the model's output is closer to float
    run = session.apply(every_int4(session, "int4-weight-only", "gptq"), label="gptq")
    assert run.ok, run.error
    assert run.output_sqnr_db > baseline.output_sqnr_db and run.size_bytes == baseline.size_bytes
    fitted = [fqn for fqn in tunable if ".experts." in fqn and fqn not in run.module_notes]
    assert fitted  # experts GPTQ changed (the others say why they kept round to nearest)
    for fqn in fitted[:4]:
        assert not torch.equal(
            run.quantized_model.get_submodule(fqn).weight.qdata, baseline.quantized_model.get_submodule(fqn).weight.qdata
        ), fqn
    # the rounding learned on each block's output takes the experts with the block's other Linears
    blocks = {
        fqn: ModuleSettings(format="int4-weight-only", group_size=32, algorithm="learned") for fqn in tunable if ".layers." in fqn
    }
    taught = session.apply(blocks, label="learned")
    assert taught.ok, taught.error
    assert taught.output_sqnr_db > baseline.output_sqnr_db
    rtn, ours = (r.quantized_model.get_submodule("model.layers.1.mlp.experts.gate_up_proj.4").weight for r in (baseline, taught))
    assert not torch.equal(rtn.qdata, ours.qdata)

    # rotated first (the router and every expert read or write the stream; R4 on each expert's down_proj
    # input as the model runs, one matrix for all): the same experts, still int4 each
    rotated = session.apply(every_int4(session, "int4-weight-only", "gptq"), rotation=qw.Rotation(down=True), label="rotated")
    assert rotated.ok, rotated.error
    experts = rotated.quantized_model.get_submodule("model.layers.0.mlp.experts")
    assert isinstance(experts, ExpertLinears)
    assert len({id(getattr(down, ONLINE_HADAMARD)) for down in experts.down_proj}) == 1
    assert rotated.output_sqnr_db > baseline.output_sqnr_db - 3  # the same quality class as unrotated: nothing broke
    assert_unchanged(model, before)


class _SwappedHalves(torch.nn.Module):
    """The experts layout with up before gate in ``gate_up_proj``: the names and shapes of transformers'
    experts, other arithmetic."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == e)
            up, gate = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            found = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, found)
        return out


def test_experts_of_another_arithmetic_are_left_float_and_named_with_their_share():
    model, batches = tiny_moe()
    assert all(is_expert_weights(m) for m in experts_of(model).values())
    model = copy.deepcopy(model)
    for name, module in experts_of(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _SwappedHalves(module))
    assert not any(is_expert_weights(m) for m in experts_of(model).values())  # checked by its outputs, not its names
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

    model, batches = tiny_moe(layers=1)  # each block lowers 16 expert Linears
    asked = model.config._experts_implementation  # transformers' grouped_mm: a custom op without an out variant
    session = qw.analyze(
        model, batches[0], batches, engine="eager", format="int8-dynamic-int4-weight", target="xnnpack", progress=False
    ).session
    baseline = session.baseline()
    assert baseline.ok, baseline.error  # exported with every expert on every token, weighted by its routing: plain ops
    program = baseline.quantized_model
    assert isinstance(program, DeployedProgram) and baseline.size_bytes == len(program.pte)
    assert baseline.output_sqnr_db > 10  # the runtime's output, against the float model's
    assert model.config._experts_implementation == asked
    # every expert's Linear 8da4w in the program, run by XNNPACK: no matrix product left to the portable kernels
    left = program.delegation.left
    assert "aten.sigmoid" in left and not {"aten.linear", "aten.mm", "aten.addmm"} & set(left), left
    assert left.get("aten.bmm", 0) <= 2  # the attention's own two products
    expert_bytes = sum(p.numel() * 4 for name, p in model.named_parameters() if ".experts." in name)
    assert len(program.pte) < sum(p.numel() * 4 for p in model.parameters()) - expert_bytes / 2  # stored int4, not float
