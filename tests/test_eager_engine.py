"""The eager engine end to end on Hugging Face transformers built offline (BERT, a Llama-style
decoder, ViT), a BERT trained on the digits and the digits mixer: the report without a graph,
formats per module against hand ``quantize_`` calls, the set-up as code, the simulation against real
runs, verified suggestions, sensitivity and reach; PT2E on the same transformers; the caller's
float model never changed."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_unchanged, fingerprint
from hf_models import MODELS, mean_pooled_bert, tiny_bert, tiny_llama
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import qreport_widgets as qw
from qreport_widgets.core import features as F
from qreport_widgets.core.calibration import call_with
from qreport_widgets.core.metrics import output_tensor, sqnr_db
from qreport_widgets.demo.digits import trained_digits_model
from qreport_widgets.engines.contract import Variant
from qreport_widgets.engines.eager import EagerConfig, EagerEngine, FormatError
from qreport_widgets.engines.eager import engine as eager_engine
from qreport_widgets.engines.eager.formats import ao_config, deployed_bytes, torchao_eager
from qreport_widgets.engines.settings import FORMATS, ModuleSettings
from qreport_widgets.errors import InvalidSettingsError, UntraceableModelError
from qreport_widgets.observe.graph import OBSERVER_CONTAINER

QUANTIZED = FORMATS[1:]


@pytest.fixture(scope="module")
def cache(digits_cache):
    return digits_cache


@pytest.fixture(scope="module")
def digits_bert(cache):
    model, data = trained_digits_model("bert", cache_dir=cache)
    report = qw.analyze(
        model,
        data.calibration[0],
        data.calibration,
        eval_data=data.evaluation,
        eval_fn=data.accuracy,
        engine="eager",
        progress=False,
    )
    return model, data, report


def eager(model: nn.Module, batches, **kwargs) -> qw.ModelReport:
    return qw.analyze(model, batches[0], batches, engine="eager", progress=False, **kwargs)


def linears(session, name: str, **fields) -> dict[str, ModuleSettings]:
    return {m.fqn: ModuleSettings(format=name, **fields) for m in session.modules if m.type_name == "Linear"}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hugging_face_models_end_to_end(name):
    model, batches = MODELS[name]()
    before = fingerprint(model)
    report = eager(model, batches)
    reports = report.generate_model_report()
    assert set(reports) == {
        F.DetectorName.PER_CHANNEL.value,
        F.DetectorName.DYNAMIC_STATIC.value,
        F.DetectorName.EQUALIZATION.value,
        F.DetectorName.OUTLIER.value,
    }
    linear_units = [fqn for fqn, kind in report.analysis().graph.units.items() if kind == "Linear"]
    assert len(linear_units) >= 12 and set(linear_units) <= set(reports[F.DetectorName.OUTLIER.value][1])
    assert report.analysis().graph.kind == "modules"

    session = report.session
    baseline = session.baseline()
    assert baseline.ok and 20 < baseline.output_sqnr_db < 80, baseline.error
    assert baseline.deployed_bytes < baseline.size_bytes
    truth = session.truth_check()
    assert truth.agrees, truth.notes
    table = session.sensitivity(metric=False)
    assert set(table.index) == {m.fqn for m in session.modules if not m.current.keep_float}
    verified = session.verified_suggestions(report.suggestions())
    if verified.accept_all is not None:
        assert verified.accept_all.output_sqnr_db >= baseline.output_sqnr_db - 1e-9
    target = baseline.output_sqnr_db + 2.0
    reached = session.reach(target)
    assert reached.ok and reached.output_sqnr_db >= target, reached.notes
    widget = report.widget()
    rows = widget.tuning.rows
    query = next(fqn for fqn in rows if fqn.endswith(("query", "q_proj")))
    assert rows[query].format.value == "int8-dynamic" and rows[query].keep_float.layout.display == "none"
    assert rows[query].algorithm.disabled  # int8: nothing to choose
    rows[query].format.value = "int4-weight-only"
    assert rows[query].settings == ModuleSettings(format="int4-weight-only", group_size=32)
    assert not rows[query].group.disabled and not rows[query].algorithm.disabled
    assert [value for _, value in rows[query].algorithm.options] == ["", "hqq", "gptq", "awq", "learned"]
    rows[query].algorithm.value = "gptq"
    assert rows[query].settings == ModuleSettings(format="int4-weight-only", group_size=32, algorithm="gptq")
    rows[query].settings = ModuleSettings(format="int8-weight-only")
    assert rows[query].algorithm.disabled and rows[query].settings.algorithm == ""
    # an embedding offers fewer algorithms, and says why (ViT's patch convolution, of 3 input channels, takes no int4)
    offered = {"Embedding": (["", "hqq"], "an embedding looks rows up"), "Conv2d": ([""], "torchao's HQQ takes 2-d weights")}
    others = [row for row in rows.values() if row.module.type_name in offered and row.module.algorithms]
    assert bool(others) == (name != "vit")
    for row in others:
        values, why = offered[row.module.type_name]
        assert [value for _, value in row.algorithm.options] == values and why in row.algorithm.tooltip
    assert_unchanged(model, before)


def test_the_trained_digits_bert_every_format_agrees_with_its_simulation(digits_bert):
    model, data, report = digits_bert
    session = report.session
    baseline = session.baseline()
    assert baseline.eval_metric > 0.6  # a trained transformer: its accuracy survives int8
    for name in QUANTIZED:
        settings = linears(session, name)
        run = session.apply(settings, label=name)
        simulated, metric = session.simulate(Variant(settings=frozenset(settings.items())))
        assert run.ok, run.error
        assert abs(run.output_sqnr_db - simulated) < 0.5, (name, run.output_sqnr_db, simulated)
        assert metric == pytest.approx(run.eval_metric, abs=0.02)
    runs, _ = session.compare()
    by_name = runs.set_index("run")
    # int8 weights beat int4 weights; int4 stores fewer bytes deployed, but not in this process
    assert by_name.loc["int8-weight-only", "output SQNR (dB)"] > by_name.loc["int4-weight-only", "output SQNR (dB)"] + 10
    assert by_name.loc["int4-weight-only", "deployed size (KB)"] < by_name.loc["int8-weight-only", "deployed size (KB)"]
    assert by_name.loc["int4-weight-only", "size (KB)"] >= by_name.loc["int8-weight-only", "size (KB)"]
    int4 = next(r for r in session.history if r.label == "int4-weight-only")
    assert any("reference kernel" in note for note in int4.notes)


@pytest.mark.parametrize("name", QUANTIZED)
def test_each_format_on_a_linear_is_torchaos_own(name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).eval()
    batches = [(torch.randn(8, 64),) for _ in range(4)]
    session = eager(model, batches).session
    run = session.apply(linears(session, name))
    hand = copy.deepcopy(model)
    torchao_eager().quantize_(hand, ao_config(name))  # torchao's own default: every Linear
    assert run.ok, run.error
    for batch in batches:
        assert torch.equal(call_with(run.quantized_model, batch), call_with(hand, batch))


def test_the_set_up_as_code_builds_the_same_quantized_model():
    model, batches = tiny_llama()
    session = eager(model, batches).session
    settings = {
        **linears(session, "int8-weight-only"),
        "model.layers.0.mlp.down_proj": ModuleSettings(format="int4-weight-only", group_size=64),
        "model.layers.1.self_attn.q_proj": ModuleSettings(format="float"),
        "model.embed_tokens": ModuleSettings(format="int4-weight-only"),
    }
    run = session.apply(settings)
    assert run.ok, run.error
    code = session.settings_as_code(settings)
    assert "FqnToConfig" in code and "PerGroup(64)" in code and "q_proj" not in code.split("layers.1.self_attn")[1][:12]
    namespace = {"model": copy.deepcopy(model)}
    exec(code, namespace)  # noqa: S102  (the code the Tune tab shows, run as a user would)
    ours, theirs = run.quantized_model, namespace["model"]
    for batch in batches:
        assert torch.equal(output_tensor(call_with(ours, batch)), output_tensor(call_with(theirs, batch)))
    kinds = {fqn: type(m.weight).__name__ for fqn, m in theirs.named_modules() if hasattr(m, "weight")}
    assert kinds["model.embed_tokens"] == "IntxUnpackedToInt8Tensor"
    assert kinds["model.layers.1.self_attn.q_proj"] == "Parameter"


def test_formats_torchao_cannot_apply_are_refused_with_the_reason():
    model = nn.Sequential(nn.Conv2d(32, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 40), nn.Linear(40, 10)).eval()
    batches = [(torch.randn(2, 32, 8, 8),) for _ in range(3)]
    session = eager(model, batches).session
    modules = {m.fqn: m for m in session.modules}
    assert modules["0"].current.keep_float and not modules["0"].format_allowed("int8-dynamic")
    with pytest.raises(InvalidSettingsError, match="no convolution"):
        session.apply({"0": ModuleSettings(format="int8-weight-only")})
    with pytest.raises(InvalidSettingsError, match="rows of 40, which no group size"):
        session.apply({"3": ModuleSettings(format="int4-weight-only")})
    with pytest.raises(InvalidSettingsError, match="group size 128 does not divide"):
        session.apply({"2": ModuleSettings(format="int4-weight-only", group_size=128)})
    with pytest.raises(InvalidSettingsError, match="per row"):
        session.apply({"2": ModuleSettings(per_channel=True)})
    run = session.apply({"0": ModuleSettings(format="int4-weight-only"), "2": ModuleSettings(format="int4-weight-only")})
    assert run.ok and run.conversions.set_index("module").loc["0", "quantized"], run.error
    widget = eager(model, batches).widget()
    assert "int8-dynamic" not in widget.tuning.rows["0"].format.options
    assert "no convolution" in widget.tuning.rows["0"].format.tooltip


def test_embeddings_are_tunable_weight_only():
    model, batches = tiny_bert()
    session = eager(model, batches).session
    embedding = next(m for m in session.modules if m.fqn == "embeddings.word_embeddings")
    assert embedding.format_allowed("int4-weight-only") and embedding.format_allowed("int8-weight-only")
    assert "no activations" in embedding.formats["int8-dynamic"]
    run = session.apply({"embeddings.word_embeddings": ModuleSettings(format="int8-weight-only")})
    assert run.ok and run.per_layer_sqnr_db["embeddings.word_embeddings"] < 60


class _ScaledEmbedding(nn.Embedding):
    """An Embedding subclass with a scale its state dict leaves out, as Gemma's embedding has."""

    def __init__(self, rows: int, columns: int) -> None:
        super().__init__(rows, columns)
        self.scale = nn.Buffer(torch.tensor(columns**0.5), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale


class _ManyRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 64)
        self.scaled = _ScaledEmbedding(500, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 136, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(ids) + self.scaled(ids))))


def test_a_modules_size_read_off_two_few_row_copies_is_its_whole_quantized_size(monkeypatch):
    """Of a Linear's or an Embedding's (or a subclass's, Gemma's scaled embedding) first rows only:
    a decoder's head or embedding is never quantized whole for its size."""
    torch.manual_seed(0)
    batches = [torch.randint(0, 500, (2, 16)) for _ in range(2)]
    model = _ManyRows().eval()
    session = eager(model, batches).session
    engine, checked = session.engine, 0
    counted_rows, counted = [], eager_engine._quantized_bytes

    def counting(module, *args):
        counted_rows.append(module.weight.shape[0])
        return counted(module, *args)

    monkeypatch.setattr(eager_engine, "_quantized_bytes", counting)
    for module in session.modules:
        float_module = model.get_submodule(module.fqn)
        for choice in engine.size_choices(module):
            if choice.algorithm in ("gptq", "awq"):  # round to nearest's layout (their own test)
                continue
            holder = nn.Sequential(copy.deepcopy(float_module))
            if not choice.keep_float:
                torchao_eager().quantize_(holder, EagerConfig.of({"0": choice}).fqn_to_config(), filter_fn=None)
            assert engine.module_bytes(float_module, choice) == deployed_bytes(holder, True), (module.fqn, choice)
            checked += 1
    assert checked >= 30 and "scaled" in {m.fqn for m in session.modules}
    assert counted_rows and max(counted_rows) <= 2 * eager_engine.SIZE_ROWS


def test_an_int4_embedding_counts_its_values_a_byte_each_on_x86_as_it_is_held_and_saved():
    """On x86 torchao holds an int4 embedding's values one to an int8, and a checkpoint writes them so
    (transformers cannot load a packed Embedding): its size is no smaller than int8's there, and the
    size front never buys an int4 embedding for bytes it does not save."""
    torch.manual_seed(0)
    model = _ManyRows().eval()
    session = eager(model, [torch.randint(0, 500, (2, 16)) for _ in range(2)]).session
    embedding = model.embed
    int4 = session.engine.module_bytes(embedding, ModuleSettings(format="int4-weight-only", group_size=32))
    int8 = session.engine.module_bytes(embedding, ModuleSettings(format="int8-weight-only"))
    rows, width = embedding.weight.shape
    assert int4 == rows * width + rows * (width // 32) * 4  # a byte a value, an fp32 scale a group of 32
    assert int4 >= int8 == rows * width + rows * 4
    linear = session.engine.module_bytes(model.up, ModuleSettings(format="int4-weight-only", group_size=32))
    assert linear == 256 * 64 // 2 + 256 * 2 * 4 + 256 * 4  # a Linear's stay half a byte: packed in its checkpoint


def test_a_decoders_activations_are_observed_per_hidden_feature():
    """Every per-channel observer of a decoder counts its channels on the hidden features, the
    embedding's output included (an embedding writes (batch, tokens, features)), never on the tokens."""
    model, batches = tiny_llama()
    report = eager(model, batches)
    hidden, intermediate = model.config.hidden_size, model.config.intermediate_size
    observers = dict(report.model.get_submodule(OBSERVER_CONTAINER).named_children())
    assert "model_embed_tokens" in observers
    for name, observer in observers.items():
        if observer.min_val.numel():
            assert observer.ch_axis == -1 and observer.min_val.numel() in (hidden, intermediate), name


def _features(report: qw.ModelReport) -> dict:
    return {
        (detector, fqn, key): value.tolist() if isinstance(value, torch.Tensor) else value
        for detector, (_, per_module) in report.generate_model_report(False).items()
        for fqn, features in per_module.items()
        for key, value in features.items()
    }


class _InPlaceReLUNet(nn.Module):
    """A Linear whose output an in-place ReLU overwrites: what the Linear wrote is gone after the pass."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize(
    "build",
    [tiny_llama, lambda: (_InPlaceReLUNet().eval(), [(torch.randn(8, 16),) for _ in range(3)])],
    ids=["llama", "in-place relu"],
)
def test_the_example_batch_is_not_run_twice_and_the_report_is_the_same(build):
    """When the example inputs are the first calibration batch, the pass that maps the modules feeds
    the observers that batch; the report is exactly the one a separate pass gives. A tensor changed
    in place after it was seen (an in-place ReLU over a Linear's output) makes the batch run again."""
    model, batches = build()
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    calls = []
    handle = first.register_forward_pre_hook(lambda *_: calls.append(1))
    replayed = eager(model, batches)
    replayed_calls, calls[:] = len(calls), []
    separate = qw.analyze(model, copy.deepcopy(batches[0]), batches, engine="eager", progress=False)
    handle.remove()
    in_place = any(getattr(m, "inplace", False) for m in model.modules())
    assert replayed_calls == len(batches) + (1 if in_place else 0)
    assert len(calls) == len(batches) + 1
    assert _features(replayed) == _features(separate)


def test_structured_outputs_and_output_fn():
    model, batches = tiny_bert()
    session = eager(model, batches).session
    first = session.reference_outputs()[0]
    assert first.shape == (4, 16, 64)  # last_hidden_state, not the pooler output with it
    pooled = eager(model, batches, output_fn=lambda out: out.pooler_output).session
    assert pooled.reference_outputs()[0].shape == (4, 64)
    assert pooled.baseline().output_sqnr_db != session.baseline().output_sqnr_db


def test_positional_batches_and_tuple_outputs():
    model, batches = mean_pooled_bert()
    report = eager(model, batches)
    run = report.session.baseline()
    assert run.ok and run.per_layer_sqnr_db.index[0].startswith("encoder.embeddings")


def test_a_failing_format_names_the_module():
    engine = EagerEngine()
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 40), nn.Linear(40, 4)).eval()
    config = EagerConfig({"0": ("int8-weight-only", 0, ""), "2": ("int4-weight-only", 32, "")})  # validation refuses "2" first
    prepared = engine.prepare(model, config, ())
    with pytest.raises(FormatError, match=r"could not apply int4-weight-only \(group 32\) to 2 \(Linear\)"):
        engine.convert(prepared)


def test_engine_arguments_are_checked():
    model, batches = tiny_bert()
    with pytest.raises(ValueError, match="format must be one of"):
        qw.analyze(model, batches[0], batches, engine="eager", format="int3")
    with pytest.raises(ValueError, match="quantizer= is not for engine='eager'"):
        qw.analyze(model, batches[0], batches, engine="eager", quantizer=object())
    start = eager(model, batches, format="int8-weight-only").session
    assert {m.current.format for m in start.modules if m.type_name == "Linear"} == {"int8-weight-only"}


def test_the_digits_mixer_under_the_eager_engine(cache):
    model, data = trained_digits_model("mixer", cache_dir=cache)
    report = qw.analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation, engine="eager", progress=False)
    session = report.session
    baseline = session.baseline()
    assert baseline.ok and session.truth_check().agrees
    verified = session.verified_suggestions(report.suggestions())
    assert verified.accept_all is None or verified.accept_all.output_sqnr_db >= baseline.output_sqnr_db - 1e-9
    assert session.plan_reach(baseline.output_sqnr_db + 3).met


def test_fx_says_which_engines_need_no_symbolic_trace():
    model, batches = tiny_bert()
    with pytest.raises(UntraceableModelError, match="engine='eager'.*engine='pt2e'"):
        qw.analyze(model, batches[0], batches, progress=False)


@pytest.mark.parametrize("build", [mean_pooled_bert, tiny_llama], ids=["bert", "llama"])
def test_pt2e_on_transformers(build):
    model, batches = build()
    report = qw.analyze(model, batches[0], batches, engine="pt2e", progress=False)
    baseline = report.session.baseline()
    assert baseline.ok and baseline.output_sqnr_db > 20, baseline.error


class _Failing:
    """A PT2E quantizer whose annotation fails inside torchao-like code."""

    def transform_for_annotation(self, model):
        return model

    def annotate(self, model):
        return [][0]

    def validate(self, model):
        return None


def test_a_quantizer_that_fails_is_explained_with_the_way_out():
    model, batches = mean_pooled_bert()
    with pytest.raises(qw.errors.QReportError, match="prepare_pt2e.*IndexError.*engine='eager'"):
        qw.analyze(model, batches[0], batches, engine="pt2e", quantizer=_Failing(), progress=False)


def test_sqnr_of_structured_outputs_is_the_first_tensor():
    assert output_tensor({"logits": torch.ones(2), "aux": torch.zeros(3)}).shape == (2,)
    assert output_tensor((torch.ones(2), torch.zeros(3))).shape == (2,)
    assert sqnr_db(torch.ones(3), torch.ones(3)) == float("inf")


def test_format_sensitivity_ranks_what_each_format_costs_and_a_cell_matches_its_real_run(digits_bert):
    _, _, report = digits_bert
    session = report.session
    table = session.format_sensitivity()
    quantized = {m.fqn for m in session.modules if not m.current.keep_float}
    assert set(table.index) == quantized and list(table["cost_db"]) == sorted(table["cost_db"], reverse=True)
    top = table.index[0]
    assert table.loc[top, "int4-weight-only"] < table.loc[top, "int8-weight-only"]
    run = session.apply({top: ModuleSettings(format="int4-weight-only")}, record=False)
    assert abs(run.output_sqnr_db - table.loc[top, "int4-weight-only"]) < 0.5
    fx_like = eager(nn.Sequential(nn.Conv2d(3, 4, 3)).eval(), [(torch.randn(1, 3, 8, 8),)] * 2).session
    assert fx_like.format_sensitivity().empty  # nothing the start quantizes


@pytest.mark.kernels
def test_a_decoder_left_at_its_config_defaults_as_from_pretrained_gives_it():
    """``LlamaConfig`` left at its defaults, as ``from_pretrained`` gives a decoder: ``use_cache=True``,
    so the forward also returns a cache. The logits are measured, int4 runs and meets a target on
    the model as it is, and the user's config is left alone."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    assert config.use_cache
    model = LlamaForCausalLM(config).eval()
    before = fingerprint(model)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (2, 16), generator=generator),) for _ in range(4)]
    report = qw.analyze(model, batches[0], batches, eval_data=batches[2:], engine="eager", metric="perplexity", progress=False)
    session = report.session
    baseline = session.baseline()
    assert baseline.ok and 20 < baseline.output_sqnr_db < 80, baseline.error
    assert session.truth_check().agrees
    run = session.apply(linears(session, "int4-weight-only", group_size=32))
    assert run.ok and run.output_sqnr_db < baseline.output_sqnr_db and run.eval_metric > baseline.eval_metric * 0.99
    reached = session.reach(baseline.output_sqnr_db + 3.0)
    assert reached.ok and reached.output_sqnr_db >= baseline.output_sqnr_db + 3.0, reached.notes
    assert model.config.use_cache
    assert_unchanged(model, before)
