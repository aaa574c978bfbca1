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


class PReLUNet(nn.Module):
    """An MTCNN-style face-detector stage: Conv2d + PReLU blocks, a max pool, a Linear + PReLU, and a
    Linear head. torch's x86 FX mapping converts each PReLU to a quantized kernel that applies its
    slope to positive inputs too, so the real int8 model is far worse than its reference.

    ``(B, in_channels, size, size) -> (B, classes)``; ``size`` divisible by 2; ``slope``: the
    PReLUs' starting slope (torch's default 0.25; negative makes them abs-like).
    """

    def __init__(self, in_channels: int = 3, size: int = 32, classes: int = 10, width: int = 16, slope: float = 0.25) -> None:
        super().__init__()
        self.conv1, self.prelu1 = nn.Conv2d(in_channels, width, 3, padding=1), nn.PReLU(width, slope)
        self.pool = nn.MaxPool2d(2)
        self.conv2, self.prelu2 = nn.Conv2d(width, 2 * width, 3, padding=1), nn.PReLU(2 * width, slope)
        self.conv3, self.prelu3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.PReLU(2 * width, slope)
        self.fc1, self.prelu4 = nn.Linear(2 * width * (size // 2) ** 2, 64), nn.PReLU(64, slope)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.prelu1(self.conv1(x)))
        x = self.prelu3(self.conv3(self.prelu2(self.conv2(x))))
        return self.fc2(self.prelu4(self.fc1(x.flatten(1))))


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.relu, self.fc2, self.gate = (
            nn.Conv2d(channels, squeezed, 1),
            nn.ReLU(),
            nn.Conv2d(squeezed, channels, 1),
            nn.Hardsigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.relu(self.fc1(self.pool(x)))))


class InvertedResidual(nn.Module):
    """Expand 1x1 (when the width changes), depthwise k x k, optional squeeze-excitation, project 1x1."""

    def __init__(self, cin: int, kernel: int, expanded: int, cout: int, se: bool, hardswish: bool, stride: int) -> None:
        super().__init__()
        act = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = []
        if expanded != cin:
            layers += [*conv_bn(cin, expanded, 1), act()]
        layers += [*conv_bn(expanded, expanded, kernel, stride, groups=expanded), act()]
        if se:
            layers.append(SqueezeExcite(expanded, _divisible(expanded // 4)))
        layers += conv_bn(expanded, cout, 1)
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


# kernel, expanded width, output width, squeeze-excitation, hardswish, stride (MobileNetV3-Small)
_MOBILENET_V3_SMALL = [
    (3, 16, 16, True, False, 2), (3, 72, 24, False, False, 2), (3, 88, 24, False, False, 1),
    (5, 96, 40, True, True, 2), (5, 240, 40, True, True, 1), (5, 240, 40, True, True, 1),
    (5, 120, 48, True, True, 1), (5, 144, 48, True, True, 1), (5, 288, 96, True, True, 2),
    (5, 576, 96, True, True, 1), (5, 576, 96, True, True, 1),
]  # fmt: skip


class MobileNetV3Small(nn.Module):
    """MobileNetV3-Small's layout: 54 Conv / Linear layers, depthwise convs, Hardswish, squeeze-excitation."""

    def __init__(self, classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(in_channels, 16, 3, 2), nn.Hardswish())
        blocks, cin = [], 16
        for kernel, expanded, cout, se, hardswish, stride in _MOBILENET_V3_SMALL:
            blocks.append(InvertedResidual(cin, kernel, expanded, cout, se, hardswish, stride))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(*conv_bn(cin, 576, 1), nn.Hardswish())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.head(self.blocks(self.stem(x)))), 1))


def mobilenet_v3_small(classes: int = 1000, size: int = 96) -> MobileNetV3Small:
    """Random weights, with BatchNorm statistics measured on random images of ``size`` pixels, so
    activations keep their scale through all 54 layers (default statistics let them vanish)."""
    torch.manual_seed(0)
    model = MobileNetV3Small(classes)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None  # a plain average over the batches below
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(16, 3, size, size))
    return model.eval()


def _divisible(value: int, divisor: int = 8) -> int:
    return max(divisor, (value + divisor // 2) // divisor * divisor)


class LinearChainBlock(nn.Module):
    """``depth`` Linear layers in a row around a residual add: a deep graph of tiny layers."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


def linear_chains(blocks: int = 25, depth: int = 10, width: int = 8) -> nn.Sequential:
    """``blocks * depth`` Linear layers (250 by default) in residual blocks: a model past the Graph
    tab's node limit that costs nothing to run."""
    return nn.Sequential(*[LinearChainBlock(width, depth) for _ in range(blocks)]).eval()


class OutlierMlpBlock(nn.Module):
    """A pre-norm transformer MLP block on (batch, tokens, hidden) with planted outlier channels.

    The LayerNorm's gain is ``factor`` times larger on the first ``outliers`` hidden channels and
    the next Linear's weights are ``factor`` times smaller on them: the float function is that of
    an ordinary block, but the LayerNorm's output has a few channels ``factor`` times wider than
    the rest (as LLM activations do), which per-tensor activation quantization handles badly.
    """

    def __init__(self, hidden: int = 64, outliers: int = 4, factor: float = 20.0, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.act, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.2, 0.2)
            self.norm.weight[:outliers] *= factor
            self.norm.bias[:outliers] *= factor
            self.fc1.weight[:, :outliers] /= factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(self.act(self.fc1(self.norm(x))))
        return self.head(x)


class VitAttention(nn.Module):
    """Multi-head self-attention as timm writes it: one qkv Linear, a softmax, one projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attention = (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1)
        return self.proj((attention @ v).transpose(1, 2).reshape(batch, tokens, dim))


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), VitAttention(dim, heads)
        self.norm2, self.fc1, self.act, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class VitTiny(nn.Module):
    """ViT-Tiny/16's layout as timm builds it (192 wide, 12 blocks of 3 heads, 50 Linear / Conv
    layers), for 224 px images; random weights unless trained."""

    def __init__(self, classes: int = 1000, dim: int = 192, depth: int = 12, heads: int = 3, image: int = 224) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 16, 16)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // 16) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(VitBlock(dim, heads, dim * 4) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])
