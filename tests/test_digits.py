"""The digits models: trained with fixed seeds in seconds, cached, accurate enough to judge quantization on."""

from __future__ import annotations

import runpy

import pytest
import torch
from conftest import COMMITTED_WEIGHTS

from qreport_widgets.demo.digits import MODELS, build_digits_model, default_epochs, digits_weights_name, trained_digits_model
from qreport_widgets.demo.text import decoder_weights_name

# the MobileNet trains for 50 s (20 epochs of 54 layers) and the BERT for 12 s: run by `make test-slow`
# (the BERT's kept weights are checked below; the others train in a few seconds)
SLOW_TRAINING = ("mobilenet", "bert")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TRAINING else n for n in MODELS])
def test_trained_models_are_accurate_and_cached(name, tmp_path):
    model, data = trained_digits_model(name, tmp_path)
    # the BERT reads pixels as tokens and learns their positions: 75% after its 20 epochs
    assert not model.training and data.accuracy(model) > (0.7 if name == "bert" else 0.85)
    assert sum(len(b[0]) for b in data.calibration) == 256 and data.evaluation_labels.numel() == 261
    again, _ = trained_digits_model(name, tmp_path)  # loaded from the cache
    for (key, value), other in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(value, other), key
    assert list(tmp_path.iterdir())[0].name.startswith(f"digits_{name}")


def test_the_kept_bert_is_accurate(digits_cache):
    model, data = trained_digits_model("bert", digits_cache)  # tests/weights' file, as the other tests load it
    assert not model.training and data.accuracy(model) > 0.7


def test_the_weights_kept_with_the_tests_are_the_current_recipes():
    """The tests load the trained models from tests/weights; a changed model, training loop or data
    names other files, which must be trained there (else every run trains them, a minute and a half)."""
    refresh = runpy.run_path(str(COMMITTED_WEIGHTS / "refresh.py"))  # its KEPT: the models trained there
    expected = {digits_weights_name(name, default_epochs(name)) for name in refresh["KEPT"]} | {decoder_weights_name()}
    kept = {path.name for path in COMMITTED_WEIGHTS.glob("*.pt")}
    assert kept == expected, (
        f"tests/weights: remove {sorted(kept - expected)}, then train {sorted(expected - kept)} "
        "with `python tests/weights/refresh.py`"
    )


def test_unknown_model_name():
    with pytest.raises(ValueError, match="pick one of cnn, mixer"):
        build_digits_model("resnet")
