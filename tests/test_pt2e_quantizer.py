"""Tune settings through torchao's PT2E quantizer: export -> prepare_pt2e -> calibrate -> convert_pt2e,
read back from the converted graph (what was asked is what the graph does)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qreport_widgets.engines.pt2e import build_quantizer, converted_layers, torchao_pt2e
from qreport_widgets.engines.settings import ModuleSettings


class ConvMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).relu().mean((2, 3))
        return self.fc3(self.fc2(self.fc1(x).relu()))


def _convert(model: nn.Module, settings: dict[str, ModuleSettings]) -> torch.fx.GraphModule:
    ao = torchao_pt2e()
    example = (torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)
    exported = torch.export.export(copy.deepcopy(model), example).module()
    prepared = ao.prepare_pt2e(exported, build_quantizer(settings))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            prepared(torch.randn(4, 3, 8, 8, generator=generator))
    return ao.convert_pt2e(prepared)


def test_every_setting_reaches_the_converted_graph():
    model = ConvMlp().eval()
    before = copy.deepcopy(model.state_dict())
    settings = {
        "conv": ModuleSettings(per_channel=True),
        "fc1": ModuleSettings(per_channel=False),  # per-tensor weights
        "fc2": ModuleSettings(keep_float=True),
        "fc3": ModuleSettings(dynamic=True, per_channel=True),  # static and dynamic in one model
    }
    layers = converted_layers(_convert(model, settings))
    assert layers["conv"].weight == "per-channel" and layers["conv"].activation == "static"
    assert layers["fc1"].weight == "per-tensor" and layers["fc1"].activation == "static"
    assert layers["fc2"].weight == "float" and layers["fc2"].activation == "float"
    assert layers["fc3"].activation == "dynamic" and layers["fc3"].weight == "per-channel"
    assert all(layers[name].matches(choice) for name, choice in settings.items())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the float model is untouched


def test_a_setting_the_graph_does_not_carry_out_is_seen():
    layers = converted_layers(_convert(ConvMlp().eval(), {"fc1": ModuleSettings(keep_float=True)}))
    assert not layers["fc1"].matches(ModuleSettings(per_channel=True))  # asked quantized, got float
    assert layers["fc2"].matches(ModuleSettings(per_channel=True))  # the x86 default elsewhere


def test_missing_torchao_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    from qreport_widgets.engines.pt2e import MissingExtraError

    torchao_pt2e.cache_clear()  # imported once per process: import it again, without torchao
    monkeypatch.setattr(builtins, "__import__", no_torchao)
    try:
        with pytest.raises(MissingExtraError, match=r"pip install 'qreport-widgets\[pt2e\]'"):
            torchao_pt2e()
    finally:
        torchao_pt2e.cache_clear()


def _batches(count: int, size: int, seed: int) -> list[tuple[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 8, 8, generator=generator),) for _ in range(count)]


def _fx_converted(model: nn.Module, example, calibration) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), example)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return convert_fx(prepared)


def _session(model: nn.Module, calibration, held_out=None):
    from qreport_widgets import QuantizationSession
    from qreport_widgets.engines.pt2e import Pt2eEngine

    return QuantizationSession(model, calibration[0], calibration, eval_data=held_out, engine=Pt2eEngine())


def test_pt2e_run_matches_fx_on_the_same_model_and_frees_the_batch_size():
    from qreport_widgets.core.metrics import sqnr_db

    torch.manual_seed(0)
    model = ConvMlp().eval()
    before = copy.deepcopy(model.state_dict())
    calibration, held_out = _batches(4, 4, seed=2), _batches(2, 7, seed=3)  # another batch size after export
    session = _session(model, calibration, held_out)
    run = session.apply({"fc2": ModuleSettings(per_channel=True)})
    assert run.ok, run.error
    fx = _fx_converted(model, calibration[0], calibration)
    with torch.no_grad():
        reference = torch.cat([model(*b) for b in held_out])
        fx_sqnr = sqnr_db(reference, torch.cat([fx(*b) for b in held_out]))
    assert run.output_sqnr_db > 15 and abs(run.output_sqnr_db - fx_sqnr) < 3, (run.output_sqnr_db, fx_sqnr)
    assert all(layer.weight == "per-channel" for layer in converted_layers(run.quantized_model).values())
    assert run.quantized_layers == 4 and run.notes[-1].startswith("latency: ")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_run_that_quantizes_nothing_is_an_error_and_fx_only_settings_are_refused():
    from qreport_widgets.errors import InvalidSettingsError

    session = _session(ConvMlp().eval(), _batches(2, 4, seed=4))
    run = session.apply({n: ModuleSettings(keep_float=True) for n in ("conv", "fc1", "fc2", "fc3")})
    assert not run.ok and "quantized no Linear or Conv layer" in run.error and not session.history
    with pytest.raises(InvalidSettingsError, match="input-weight equalization is FX only"):
        session.apply({"fc2": ModuleSettings(per_channel=True, equalize=True)})
    with pytest.raises(InvalidSettingsError, match="only Linear layers dynamically"):
        session.apply({"conv": ModuleSettings(dynamic=True)})
