"""Repo-written layouts of common architectures (random weights, any size) for tests and benchmarks.

They reproduce what real models bring to a quantization tool: fused conv-bn-relu, residual adds,
channel counts that change at every stage, LayerNorm on token-major tensors.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = conv_bn(cin, width, 3, stride)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = conv_bn(width, cout, 3)
        self.downsample = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + shortcut)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = conv_bn(cin, width, 1)
        self.relu1 = nn.ReLU()
        self.conv2, self.bn2 = conv_bn(width, width, 3, stride)
        self.relu2 = nn.ReLU()
        self.conv3, self.bn3 = conv_bn(width, cout, 1)
        self.downsample = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        return self.relu3(self.bn3(self.conv3(y)) + shortcut)


class ResNet(nn.Module):
    """ResNet layout: stem, four stages, global pooling, linear head."""

    def __init__(self, block: type, layers: tuple[int, ...], width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn(3, width, 7, 2)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], width
        for i, count in enumerate(layers):
            blocks = []
            for j in range(count):
                blocks.append(block(cin, width * 2**i, 2 if j == 0 and i > 0 else 1))
                cin = width * 2**i * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(width: int = 64, classes: int = 1000) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), width, classes).eval()


def resnet50(width: int = 64, classes: int = 1000) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), width, classes).eval()


class TransformerMlp(nn.Module):
    """Pre-norm transformer MLP blocks on (batch, tokens, hidden)."""

    def __init__(self, hidden: int = 768, blocks: int = 4, ratio: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm": nn.LayerNorm(hidden),
                    "fc1": nn.Linear(hidden, hidden * ratio),
                    "act": nn.GELU(),
                    "fc2": nn.Linear(hidden * ratio, hidden),
                }
            )
            for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block["fc2"](block["act"](block["fc1"](block["norm"](x))))
        return x


class TinyConvNet(nn.Module):
    """Three conv-bn-relu layers and a head on 32x32 images, where per-call overhead dominates."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *conv_bn(3, 16),
            nn.ReLU(),
            *conv_bn(16, 32, stride=2),
            nn.ReLU(),
            *conv_bn(32, 64, stride=2),
            nn.ReLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))
