"""Each engine's own options: built from its options type, ``build_engine`` refusing another engine's
argument by name, and the eager engine's starting int4 group size."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.ao.quantization import QConfigMapping, default_qconfig

from qreport_widgets.engines import ENGINES, build_engine, engine_named
from qreport_widgets.engines.eager import EagerEngine, EagerOptions
from qreport_widgets.engines.fx import FxEngine, FxOptions
from qreport_widgets.engines.pt2e import Pt2eEngine, Pt2eOptions
from qreport_widgets.engines.settings import GROUP_SIZES

FX_HINT = "FX starts from qconfig_mapping="
PT2E_HINT = "with PT2E pass quantizer="
EAGER_HINT = "with engine='eager' pass format= (the starting format of Linear layers)"


def test_each_engine_declares_and_builds_from_its_own_options():
    assert {name: load().options_type for name, load in ENGINES.items()} == {
        "fx": FxOptions,
        "pt2e": Pt2eOptions,
        "eager": EagerOptions,
    }
    mapping = QConfigMapping().set_global(default_qconfig)
    fx = engine_named("fx", FxOptions(backend="qnnpack", qconfig_mapping=mapping, prepare_custom_config={}))
    assert isinstance(fx, FxEngine) and fx.backend == "qnnpack" and fx.qconfig_mapping is mapping
    assert fx.prepare_custom_config == {}
    quantizer = object()
    pt2e = engine_named("pt2e", Pt2eOptions(quantizer=quantizer))
    assert isinstance(pt2e, Pt2eEngine) and pt2e.quantizer is quantizer
    eager = engine_named("eager", EagerOptions(format="int8-weight-only"))
    assert isinstance(eager, EagerEngine) and eager.start_format == "int8-weight-only"
    assert engine_named("eager").start_format == "int8-dynamic" and engine_named("fx").backend == "x86"
    with pytest.raises(dataclasses.FrozenInstanceError):
        FxOptions().backend = "qnnpack"


def test_build_engine_gives_each_engine_its_own_arguments():
    mapping = QConfigMapping().set_global(default_qconfig)
    fx = build_engine("fx", backend="fbgemm", qconfig_mapping=mapping)
    assert isinstance(fx, FxEngine) and fx.backend == "fbgemm" and fx.qconfig_mapping is mapping
    assert isinstance(build_engine("pt2e", backend="x86"), Pt2eEngine)  # a backend is no other engine's argument
    eager = build_engine("eager", backend="x86", format="int4-weight-only", group_size=128)
    assert (eager.start_format, eager.start_group_size) == ("int4-weight-only", 128)


@pytest.mark.parametrize(
    "engine, argument, hint",
    [
        ("fx", {"quantizer": object()}, FX_HINT),
        ("fx", {"format": "int8-weight-only"}, FX_HINT),
        ("fx", {"group_size": 64}, FX_HINT),
        ("pt2e", {"qconfig_mapping": QConfigMapping()}, PT2E_HINT),
        ("pt2e", {"prepare_custom_config": {}}, PT2E_HINT),
        ("pt2e", {"format": "int8-weight-only"}, PT2E_HINT),
        ("eager", {"quantizer": object()}, EAGER_HINT),
        ("eager", {"qconfig_mapping": QConfigMapping()}, EAGER_HINT),
    ],
)
def test_another_engines_argument_is_refused_by_name(engine, argument, hint):
    (name,) = argument
    with pytest.raises(ValueError) as raised:
        build_engine(engine, **argument)
    assert str(raised.value) == f"{name}= is not for engine={engine!r}; {hint}"


def test_several_foreign_arguments_and_an_unknown_engine():
    with pytest.raises(ValueError, match=f"^format= and quantizer= are not for engine='fx'; {FX_HINT}$"):
        build_engine("fx", quantizer=object(), format="int8-weight-only")
    with pytest.raises(ValueError, match="^engine must be 'fx' or 'pt2e' or 'eager', got 'tensorrt'$"):
        build_engine("tensorrt")
    with pytest.raises(ValueError, match="^engine must be 'fx' or 'pt2e' or 'eager', got 'tensorrt'$"):
        engine_named("tensorrt", FxOptions())


def test_another_engines_options_object_is_refused_naming_both():
    with pytest.raises(TypeError, match=r"^engine='pt2e' takes Pt2eOptions, not FxOptions \(the options of engine='fx'\)$"):
        engine_named("pt2e", FxOptions())
    with pytest.raises(TypeError, match=r"^engine='fx' takes FxOptions, not EagerOptions \(the options of engine='eager'\)$"):
        engine_named("fx", EagerOptions())
    with pytest.raises(TypeError, match="^engine='eager' takes EagerOptions, not dict$"):
        engine_named("eager", {"format": "int8-weight-only"})


def test_an_eager_group_size_is_the_starting_one_of_int4_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    example = (torch.randn(4, 128),)
    engine = build_engine("eager", format="int4-weight-only", group_size=64)
    prepared = engine.prepare(model, engine.base_config(), example)
    modules = engine.tunable_modules(prepared)
    assert modules == engine.observe(model, example).modules
    # a Linear whose rows of 32 the group size does not divide starts float
    assert {m.fqn: (m.current.format, m.current.group_size) for m in modules} == {
        "0": ("int4-weight-only", 64),
        "2": ("int4-weight-only", 64),
        "4": ("float", 0),
    }
    quantized = engine.convert(prepared)
    assert quantized[0].weight.block_size == (1, 64) and quantized[2].weight.block_size == (1, 64)
    assert type(quantized[4].weight) is nn.Parameter
    assert engine.config_as_code(engine.config_for({}, modules)).count("PerGroup(64)") == 2
    default = build_engine("eager", format="int8-dynamic-int4-weight")
    starts = {m.current.group_size for m in default.observe(model, example).modules if not m.current.keep_float}
    assert starts == {32}


@pytest.mark.parametrize("size", [48, 0, 256, True, 64.0, "64"])
def test_a_group_size_that_is_not_one_is_refused(size):
    sizes = ", ".join(map(str, GROUP_SIZES))
    with pytest.raises(ValueError, match=f"^group_size={size!r} with format='int4-weight-only': a group size is one of {sizes}$"):
        build_engine("eager", format="int4-weight-only", group_size=size)


def test_a_group_size_without_an_int4_format_is_refused():
    groups = r"a group size is for the int4 formats \(int4-weight-only, int8-dynamic-int4-weight\)"
    with pytest.raises(ValueError, match=f"^group_size=64 with format='int8-dynamic' \\(the default\\): {groups}$"):
        build_engine("eager", group_size=64)
    with pytest.raises(ValueError, match=f"^group_size=64 with format='int8-weight-only': {groups}$"):
        EagerOptions(format="int8-weight-only", group_size=64)
    with pytest.raises(ValueError, match="^format must be one of int8-dynamic, .*, got 'int3'$"):
        EagerOptions(format="int3")
