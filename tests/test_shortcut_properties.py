"""Random runs of reuse, each answer against the one computed afresh (hypothesis).

- **Programs**: a one-block tiny Llama quantized as the eager engine's XNNPACK target quantizes it
  (8da4w, the embedding int4 or float), lowered 3-6 times in a row, each time after a random change:
  other int4 values (a second algorithm), a norm's scale (AWQ folded into it, a rotation's norms), the
  embedding (a rotation), two projections made alike (one blob for two constants), another group size
  or a module kept float (another graph). Every program a lowering reused (its weights written in, or
  its edge program serialised again) is, byte for byte, the program a fresh lowering gives.
- **Found weights and shared inputs**: random sequences of 3-6 applies on a tiny decoder's session
  (x86 int4: RTN, HQQ, GPTQ, AWQ at group sizes 32 / 64, modules kept float, rotated or not), in
  the check mode: every GPTQ weight taken as found before is computed afresh and compared, every
  input shared by the Linears that read it quantized again, every known variant simulated again.

``QREPORT_PROPERTY_EXAMPLES`` sets the number of examples of each (``make test``: 2 runs of programs,
each several lowerings of seconds, and 24 in ``make test-slow``; 15 runs of applies, a new draw each run).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hf_models import tiny_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("executorch", reason="the [executorch] extra is not installed")

from torchao.quantization import (  # noqa: E402
    FqnToConfig,
    Int8DynamicActivationIntxWeightConfig,
    IntxWeightOnlyConfig,
    quantize_,  # noqa: E402
)
from torchao.quantization.granularity import PerGroup  # noqa: E402

import qreport_widgets as qw  # noqa: E402
from qreport_widgets.core import shortcuts  # noqa: E402
from qreport_widgets.engines import program_reuse  # noqa: E402
from qreport_widgets.engines.contract import Variant  # noqa: E402
from qreport_widgets.engines.executorch import DYNAMIC, lower  # noqa: E402
from qreport_widgets.engines.settings import ModuleSettings  # noqa: E402

EXAMPLES = int(os.environ.get("QREPORT_PROPERTY_EXAMPLES", "0")) or None
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
NORMS = ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm")

CHANGES = st.one_of(
    st.tuples(st.just("values"), st.sets(st.sampled_from(LINEARS), min_size=1, max_size=3), st.floats(0.8, 1.25)),
    st.tuples(st.just("norm"), st.sampled_from(NORMS), st.floats(0.5, 1.5)),
    st.tuples(st.just("embedding"), st.just(""), st.floats(0.8, 1.25)),
    st.tuples(st.just("alike"), st.sampled_from((("k_proj", "v_proj"), ("gate_proj", "up_proj"))), st.just(1.0)),
    st.tuples(st.just("group"), st.sampled_from((32, 64)), st.just(1.0)),
    st.tuples(st.just("float"), st.sampled_from((*LINEARS, "")), st.just(1.0)),
    st.tuples(st.just("embedding format"), st.sampled_from(("int4", "float")), st.just(1.0)),
)


def _changed(state: dict, change: tuple) -> dict:
    kind, what, factor = change
    state = {**state, "model": copy.deepcopy(state["model"])}
    model = state["model"]
    with torch.no_grad():
        if kind == "values":
            for name in what:
                model.get_submodule(f"model.layers.0.{name}").weight.mul_(factor)
        elif kind == "norm":
            model.get_submodule(what).weight.mul_(factor)
        elif kind == "embedding":
            model.model.embed_tokens.weight.mul_(factor)
        elif kind == "alike":
            first, second = (
                model.get_submodule(f"model.layers.0.self_attn.{n}" if n[0] in "kv" else f"model.layers.0.mlp.{n}") for n in what
            )
            second.weight.copy_(first.weight)
        elif kind == "group":
            state["group"] = what
        elif kind == "float":
            state["float"] = what
        else:
            state["embedding"] = what
    return state


def _program_of(state: dict, example):
    model = copy.deepcopy(state["model"])
    configs = {}
    for name in LINEARS:
        if name != state["float"]:
            weight = PerGroup(state["group"])
            configs[f"model.layers.0.{name}"] = Int8DynamicActivationIntxWeightConfig(
                weight_dtype=torch.int4, weight_granularity=weight
            )
    configs["lm_head"] = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    if state["embedding"] == "int4":
        configs["model.embed_tokens"] = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    quantize_(model, FqnToConfig(configs), filter_fn=None)
    return model, lower(model, example, partitioner=DYNAMIC, fuse_quantized_ops=True)


def _fresh(model, example) -> bytes:
    held = dict(program_reuse.LOWERED)
    program_reuse.LOWERED.clear()
    try:
        return lower(model, example, partitioner=DYNAMIC, fuse_quantized_ops=True).pte
    finally:
        program_reuse.LOWERED.update(held)


@pytest.fixture(scope="module")
def one_block():
    model, batches = tiny_llama(layers=1)
    return model, batches[0]


def _programs_are_fresh(model, example, changes) -> None:
    program_reuse.LOWERED.clear()
    state = {"model": model, "group": 32, "float": "", "embedding": "int4"}
    quantized, program = _program_of(state, example)
    for change in changes:
        state = _changed(state, change)
        quantized, program = _program_of(state, example)
        if program.reused:  # written into a program lowered before: what a fresh lowering gives
            assert program.pte == _fresh(quantized, example), (changes, program.reused)
    program_reuse.LOWERED.clear()


UNHEALTHY = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


# each example lowers 3-6 programs and each reused one again, seconds each: 1 of 3-4 in make test (a
# fixed run of four is tests/test_program_reuse.py's), 24 of 3-6 in make test-slow
# (QREPORT_PROPERTY_EXAMPLES sets both counts)
@settings(max_examples=EXAMPLES or 1, deadline=None, suppress_health_check=UNHEALTHY)
@given(changes=st.lists(CHANGES, min_size=2, max_size=3))
def test_every_program_a_lowering_reuses_is_a_fresh_lowerings_bytes(one_block, changes):
    _programs_are_fresh(*one_block, changes)


@pytest.mark.slow  # about half a minute an example
@settings(max_examples=EXAMPLES or 24, deadline=None, suppress_health_check=UNHEALTHY)
@given(changes=st.lists(CHANGES, min_size=2, max_size=5))
def test_every_program_a_lowering_reuses_is_a_fresh_lowerings_bytes_at_length(one_block, changes):
    _programs_are_fresh(*one_block, changes)


def _applies() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {
            "algorithm": st.sampled_from(("rtn", "hqq", "gptq", "awq")),
            "group": st.sampled_from((32, 64)),
            "modules": st.sets(st.sampled_from(LINEARS), min_size=1),
            "float": st.sampled_from(("", *LINEARS)),
            "rotated": st.booleans(),
        }
    )


@pytest.fixture(scope="module")
def decoder_session():
    model, batches = tiny_llama()
    report = qw.analyze(
        model, batches[0], batches[:4], eval_data=batches[4:], engine="eager", format="int4-weight-only", progress=False
    )
    return report.session


@settings(max_examples=EXAMPLES or 15, deadline=None, suppress_health_check=UNHEALTHY)
@given(applies=st.lists(_applies(), min_size=3, max_size=6))
def test_random_applies_take_only_what_a_fresh_computation_gives(decoder_session, applies, monkeypatch):
    monkeypatch.setenv(shortcuts.ENVIRONMENT, "1")
    session = decoder_session
    for apply in applies:
        settings_ = {}
        for block in ("model.layers.0", "model.layers.1"):
            for name in apply["modules"]:
                algorithm = apply["algorithm"]
                if algorithm == "awq" and name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                    algorithm = "gptq"  # AWQ's scale folds into the norm its readers share: asked of all of them, or none
                settings_[f"{block}.{name}"] = ModuleSettings(
                    format="int4-weight-only", group_size=apply["group"], algorithm=algorithm
                )
            if apply["float"]:
                settings_[f"{block}.{apply['float']}"] = ModuleSettings(keep_float=True)
        run = session.apply(settings_, rotation=qw.Rotation() if apply["rotated"] else None)
        assert run.ok, run.error
        session.simulate(Variant(settings=tuple(settings_.items())))  # a variant known, once simulated before
