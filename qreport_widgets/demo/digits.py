"""Small models trained on scikit-learn's bundled digits data set (8 x 8 images, no download).

Trained weights behave differently under quantization from random ones (real ranges, real
outliers, layers that matter more than others), so tests, benchmarks and tutorials judge the tool
on these. Training takes a few seconds on a CPU with fixed seeds; pass ``cache_dir`` to keep the
weights between calls.

    model, data = trained_digits_model("cnn")
    report = analyze(model, data.calibration[0], data.calibration, eval_data=data.evaluation)
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .architectures import MobileNetV3Small, PReLUNet
from .cache import USER_CACHE, cached_file, recipe_tag, trained_once

MODELS = ("cnn", "mixer", "mobilenet", "prelu", "prelu_chain", "bert")
_TRAIN = 1280  # the first images train, the rest calibrate (half) and evaluate (half)


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU stem, a strided conv, a plain conv, two Linear layers: (B, 1, 8, 8) -> (B, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU()
        self.conv3, self.relu3 = nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()
        self.fc1, self.relu4 = nn.Linear(32 * 4 * 4, 64), nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.relu2(self.bn2(self.conv2(x)))
        x = self.relu3(self.conv3(x))
        return self.fc2(self.relu4(self.fc1(x.flatten(1))))


class MixerBlock(nn.Module):
    """Pre-norm token mixing (a Linear across the 8 rows) and a GELU MLP across channels, both residual."""

    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.token_mix = nn.LayerNorm(dim), nn.Linear(tokens, tokens)
        self.norm2, self.fc1, self.act, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class DigitsMixer(nn.Module):
    """Rows as tokens (B, 8 tokens, 8 pixels) -> embedding -> two mixer blocks -> mean over tokens -> (B, 10)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.block1, self.block2 = MixerBlock(8, dim), MixerBlock(8, dim)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.block1(self.embed(x.reshape(x.shape[0], 8, 8))))
        return self.head(self.norm(x).mean(dim=1))


class DigitsMobileNet(nn.Module):
    """MobileNetV3-Small's 54 layers (``architectures.MobileNetV3Small``) on the digits scaled up to 32 x 32."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MobileNetV3Small(classes=10, in_channels=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(nn.functional.interpolate(x, scale_factor=4.0, mode="bilinear", align_corners=False))


class DigitsBert(nn.Module):
    """A Hugging Face BERT (``BertForSequenceClassification`` from a ``BertConfig``: 2 layers, hidden
    64, random initialisation, trained here) reading each image as 64 tokens, its pixels' 17
    intensities: (B, 1, 8, 8) -> (B, 10) logits. Needs ``transformers``."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from transformers import BertConfig, BertForSequenceClassification
        except ImportError as error:
            raise ImportError("the digits BERT is a Hugging Face model: pip install transformers") from error
        config = BertConfig(
            vocab_size=17,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = BertForSequenceClassification(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = ((x * 0.4 + 0.3) * 16).round().long().clamp(0, 16).flatten(1)  # undo digits_tensors' scaling
        return self.bert(input_ids=tokens).logits


@dataclass(frozen=True)
class DigitsData:
    """Batches of ``(images,)`` for calibration and evaluation, and the labels of the evaluation images."""

    calibration: list[tuple[torch.Tensor]]
    evaluation: list[tuple[torch.Tensor]]
    evaluation_labels: torch.Tensor

    def accuracy(self, model: nn.Module) -> float:
        """Top-1 accuracy of ``model`` on the evaluation images (an ``eval_fn`` for the session)."""
        with torch.no_grad():
            predicted = torch.cat([model(*batch).argmax(dim=1) for batch in self.evaluation])
        return float((predicted == self.evaluation_labels).float().mean())


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 images as (N, 1, 8, 8) float32, standardised, and their labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # pragma: no cover - scikit-learn is a dev dependency
        raise ImportError("the digits models need scikit-learn: pip install scikit-learn") from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return (images - 0.3) / 0.4, torch.tensor(digits.target, dtype=torch.int64)


def digits_data(batch_size: int = 64) -> DigitsData:
    """The images no model was trained on, split into calibration and evaluation batches."""
    images, labels = digits_tensors()
    rest, rest_labels = images[_TRAIN:], labels[_TRAIN:]
    half = (len(rest) // 2 // batch_size) * batch_size
    calibration = [(rest[i : i + batch_size],) for i in range(0, half, batch_size)]
    evaluation = [(rest[i : i + batch_size],) for i in range(half, len(rest), batch_size)]
    return DigitsData(calibration, evaluation, rest_labels[half:])


_CLASSES = {
    "cnn": DigitsCNN,
    "mixer": DigitsMixer,
    "mobilenet": DigitsMobileNet,
    "prelu": PReLUNet,
    "prelu_chain": PReLUNet,
    "bert": DigitsBert,
}


def _model_class(name: str) -> type[nn.Module]:
    if name not in _CLASSES:
        raise ValueError(f"unknown digits model {name!r}; pick one of {', '.join(MODELS)}")
    return _CLASSES[name]


def build_digits_model(name: str) -> nn.Module:
    model_class = _model_class(name)
    if name == "prelu":  # a face-detector stage's layout on the 8 x 8 digits
        return PReLUNet(in_channels=1, size=8)
    if name == "prelu_chain":  # the same, its slopes starting negative: broken kernels that only matter together
        return PReLUNet(in_channels=1, size=8, slope=-0.25)
    return model_class()


def trained_digits_model(
    name: str = "cnn", cache_dir: str | Path | None = USER_CACHE, epochs: int | None = None
) -> tuple[nn.Module, DigitsData]:
    """A model trained on the first 1,280 digits (fixed seed) in eval mode, and the held-out data;
    trained once and kept in ``cache_dir`` (default: ``cache.cache_folder()``; None: not kept).

    Epochs default to 30 (``cnn``, ``mixer``, ``prelu``: seconds), 20 (``mobilenet``: about a
    minute on two cores, 88% accuracy) and 20 (``bert``, a Hugging Face transformer: 20 s, 75% accuracy). ``prelu`` is
    ``architectures.PReLUNet``, whose x86 FX conversion runs torch's quantized PReLU kernel (see
    ``truth.py``); ``prelu_chain`` the same with slopes starting at -0.25, where that kernel leaves
    the output garbage: three such PReLUs in series each gain nothing kept float alone, together
    about 33 dB (and a fourth, after them, agrees with its reference until they are float)."""
    epochs = epochs if epochs is not None else default_epochs(name)
    cached = cached_file(cache_dir, digits_weights_name(name, epochs))
    return trained_once(lambda: build_digits_model(name), lambda model: _train(model, epochs), cached), digits_data()


def default_epochs(name: str) -> int:
    return {"mobilenet": 20, "bert": 20}.get(name, 30)


def digits_weights_name(name: str, epochs: int) -> str:
    """The file model ``name``'s trained weights are kept as: named by its epochs and a tag of its
    recipe (its class, the training loop, the images), so weights of another recipe are never loaded."""
    model_class = _model_class(name)
    parts = (inspect.getsource(build_digits_model), inspect.getsource(model_class), inspect.getsource(_train), name, epochs)
    return f"digits_{name}_{epochs}_{recipe_tag(*parts, _digits_digest())}.pt"


@functools.cache
def _digits_digest() -> str:
    images, labels = digits_tensors()
    return recipe_tag(images.numpy().tobytes(), labels.numpy().tobytes())


def _train(model: nn.Module, epochs: int) -> None:
    images, labels = digits_tensors()
    generator = torch.Generator().manual_seed(0)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        order = torch.randperm(_TRAIN, generator=generator)
        for start in range(0, _TRAIN, 64):
            index = order[start : start + 64]
            optimiser.zero_grad()
            nn.functional.cross_entropy(model(images[index]), labels[index]).backward()
            optimiser.step()
