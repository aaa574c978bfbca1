"""The built-in demo: a small conv + transformer-style model with a problem for every detector.

- ``meta_fc`` reads side features whose scale drifts from batch to batch (dynamic vs static);
- ``head`` reads a LayerNorm whose per-channel gains span three orders of magnitude
  (input-weight equalization); ``mlp.fc1`` has the same imbalance on a 3-D input, which torch's
  equalization cannot handle, so the report says so instead of suggesting it;
- image channel 0 carries rare large spikes (outliers at ``stem.conv``);
- the starting mapping quantizes every weight per tensor (per-channel).

``python -m qreport_widgets.demo`` prints the report and the suggested QConfigMapping.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.ao.quantization import QConfigMapping, default_qconfig

IMAGE_SHAPE = (3, 16, 16)
META_FEATURES = 16
HIDDEN = 32
CLASSES = 10


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class Mlp(nn.Module):
    def __init__(self, dim: int, ratio: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, dim * ratio)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(dim * ratio, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class DemoNet(nn.Module):
    """Image (B, 3, 16, 16) and side features (B, 16) -> logits (B, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBlock(3, 16)
        self.down = ConvBlock(16, HIDDEN, stride=2)
        self.mlp = Mlp(HIDDEN)
        self.meta_fc = nn.Linear(META_FEATURES, HIDDEN)
        self.neck = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        x = self.down(self.stem(image))  # (B, C, 8, 8)
        tokens = x.flatten(2).transpose(1, 2)  # (B, 64 tokens, C)
        tokens = self.mlp(tokens)
        pooled = tokens.mean(dim=1) + self.meta_fc(meta)
        return self.head(self.neck(pooled))


def build_demo_model(seed: int = 0) -> DemoNet:
    """The demo model in eval mode, with weights set so each detector has something to find."""
    generator = torch.Generator().manual_seed(seed)
    model = DemoNet()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        for block in (model.stem, model.down):
            block.bn.weight.uniform_(0.5, 1.5, generator=generator)
            block.bn.running_mean.zero_()
            block.bn.running_var.fill_(1.0)
        # LayerNorm gains spanning 1e-2 .. 1e1: fc1's input channels differ by orders of magnitude
        for norm in (model.mlp.norm, model.neck):
            norm.weight.copy_(torch.logspace(-2, 1, HIDDEN)[torch.randperm(HIDDEN, generator=generator)])
            norm.bias.zero_()
    return model.eval()


def demo_batches(count: int = 8, batch_size: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Calibration batches ``(image, meta)``; the meta scale drifts by 30x across batches."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(count):
        image = torch.randn(batch_size, *IMAGE_SHAPE, generator=generator)
        spikes = torch.rand(batch_size, *IMAGE_SHAPE[1:], generator=generator) < 0.004
        image[:, 0][spikes] = 25.0
        scale = 0.1 * 30.0 ** (i / max(count - 1, 1))
        meta = torch.randn(batch_size, META_FEATURES, generator=generator) * scale
        batches.append((image, meta))
    return batches


def demo_qconfig_mapping() -> QConfigMapping:
    """A common first attempt: per-tensor weights and min/max activations everywhere."""
    return QConfigMapping().set_global(default_qconfig)


def main() -> None:
    from ..core.calibration import torch_warnings_hidden

    with torch_warnings_hidden():
        _print_demo()


def _print_demo() -> None:
    from ..analyze import analyze

    batches = demo_batches()
    report = analyze(build_demo_model(), batches[0], batches, qconfig_mapping=demo_qconfig_mapping())
    for text, _ in report.generate_model_report().values():
        print(text)
    print("Suggested QConfigMapping (module name -> activation / weight observers):")
    for fqn, qconfig in report.generate_qconfig_mapping().module_name_qconfigs.items():
        activation = qconfig.activation.p.func.__name__ if qconfig else "float"
        weight = qconfig.weight.p.func.__name__ if qconfig else "float"
        print(f"  {fqn:12s} {activation:28s} {weight}")
    equalized = list(report.generate_equalization_mapping().module_name_qconfigs)
    print(f"Equalization suggested for: {', '.join(equalized) or 'none'}")
