"""Small models written for the tests (random weights)."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv layers that prepare_fx does not fuse (ReLU comes after pooling)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.pool2 = nn.AvgPool2d(2)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        x = self.relu1(self.pool(self.conv1(x)))
        x = self.relu2(self.pool2(self.conv2(x)))
        return self.conv3(x)


class Mlp(nn.Module):
    """Linear layers on 2-D inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 24)
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(24, 16)
        self.fc3 = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.tanh(self.drop(self.fc1(x)))
        x = torch.sigmoid(self.fc2(x))
        return self.fc3(x)


class Mixed(nn.Module):
    """A conv trunk and a linear head on flattened features."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(24, 5)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x)).flatten(1))


def conv_batches(n: int = 4, seed: int = 0, shape=(4, 3, 12, 12)) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g) + 0.1 * i,) for i in range(n)]


def mlp_batches(n: int = 4, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 12, generator=g) * (1 + i),) for i in range(n)]


class TokenMlp(nn.Module):
    """A transformer MLP block on (batch, tokens, hidden) inputs."""

    def __init__(self, hidden: int = 8, tokens: int = 5) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
