"""The digits models: trained with fixed seeds in seconds, cached, accurate enough to judge quantization on."""

from __future__ import annotations

import pytest
import torch

from qreport_widgets.demo.digits import MODELS, build_digits_model, trained_digits_model


# the MobileNet trains for 50 s (20 epochs of 54 layers): run by `make test-slow`
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "mobilenet" else n for n in MODELS])
def test_trained_models_are_accurate_and_cached(name, tmp_path):
    model, data = trained_digits_model(name, tmp_path)
    # the BERT reads pixels as tokens and learns their positions: 75% after its 20 epochs
    assert not model.training and data.accuracy(model) > (0.7 if name == "bert" else 0.85)
    assert sum(len(b[0]) for b in data.calibration) == 256 and data.evaluation_labels.numel() == 261
    again, _ = trained_digits_model(name, tmp_path)  # loaded from the cache
    for (key, value), other in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(value, other), key
    assert list(tmp_path.iterdir())[0].name.startswith(f"digits_{name}")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="pick one of cnn, mixer"):
        build_digits_model("resnet")
