"""Small layouts of real architectures (random weights) with the parts that break quantization tools.

Each one brings something toy models do not:

- ResNet: fused conv-bn-relu, residual adds, zero-initialised last BatchNorm of each block;
- MobileNetV2: depthwise convs, ReLU6, inverted residuals, an auxiliary head that is never called;
- MobileNetV3: Hardswish, squeeze-excitation (pool -> conv -> ReLU -> conv -> Hardsigmoid -> mul);
- EfficientNet: SiLU, squeeze-excitation with sigmoid, a functional dropout FX traces through;
- DenseNet: BatchNorm before conv, concatenations that grow the channel count, grouped convs;
- ConvNeXt: 7x7 depthwise convs, LayerNorm and Linear on channels-last 4-D tensors, GELU, layer scale;
- ViT: patch embedding, class token, nn.MultiheadAttention (out_proj is called inside it), GELU MLPs;
- TextEncoder: integer token ids, a bool padding mask, an embedding, attention;
- PReLUNet: an MTCNN-style face-detector stage, Conv + PReLU, whose quantized PReLU kernel in
  torch differs from its reference (the real int8 model is far worse than its simulation).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as fn

from qreport_widgets.demo.architectures import PReLUNet, conv_bn, resnet18


def zero_init_resnet(width: int = 8, classes: int = 10) -> nn.Module:
    model = resnet18(width, classes)
    for block in (b for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for b in stage):
        nn.init.zeros_(block.bn2.weight)  # as torchvision's zero_init_residual: the block starts as identity
    return model


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int, act: type = nn.ReLU6, se: bool = False) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(*conv_bn(cin, hidden, 1), act()) if expand != 1 else nn.Identity()
        self.depthwise = nn.Sequential(*conv_bn(hidden, hidden, 3, stride, groups=hidden), act())
        self.se = SqueezeExcite(hidden, max(hidden // 4, 4), nn.ReLU, nn.Hardsigmoid) if se else nn.Identity()
        self.project = nn.Sequential(*conv_bn(hidden, cout, 1))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int, act: type, gate: type) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.act = act()
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class MobileNetV2(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(3, 16, 3, 2), nn.ReLU6())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 8, 1, 1),
            InvertedResidual(8, 12, 2, 6),
            InvertedResidual(12, 12, 1, 6),
            InvertedResidual(12, 16, 2, 6),
        )
        self.head = nn.Sequential(*conv_bn(16, 64, 1), nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, classes)
        self.aux_classifier = nn.Linear(16, classes)  # kept for training, never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.head(self.blocks(self.stem(x))))
        return self.classifier(torch.flatten(x, 1))


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(3, 16, 3, 2), nn.Hardswish())
        self.blocks = nn.Sequential(
            InvertedResidual(16, 16, 2, 1, nn.ReLU, se=True),
            InvertedResidual(16, 24, 2, 4, nn.Hardswish),
            InvertedResidual(24, 24, 1, 3, nn.Hardswish, se=True),
        )
        self.head = nn.Sequential(*conv_bn(24, 96, 1), nn.Hardswish())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(96, 128), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.head(self.blocks(self.stem(x)))), 1))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(*conv_bn(cin, hidden, 1), nn.SiLU())
        self.depthwise = nn.Sequential(*conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.SiLU())
        self.se = SqueezeExcite(hidden, max(cin // 4, 2), nn.SiLU, nn.Sigmoid)
        self.project = nn.Sequential(*conv_bn(hidden, cout, 1))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.se(self.depthwise(self.expand(x))))
        # stochastic depth as a functional call: FX traces through it, no module of its own
        return x + fn.dropout(y, 0.1, self.training) if self.residual else y


class EfficientNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(3, 16, 3, 2), nn.SiLU())
        self.blocks = nn.Sequential(MBConv(16, 16, 1, 1), MBConv(16, 24, 2, 4), MBConv(24, 24, 1, 4))
        self.head = nn.Sequential(*conv_bn(24, 64, 1), nn.SiLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.head(self.blocks(self.stem(x)))), 1))


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU()
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.norm2, self.relu2 = nn.BatchNorm2d(4 * growth), nn.ReLU()
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, groups=2, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        y = self.conv1(self.relu1(self.norm1(features)))
        return torch.cat([features, self.conv2(self.relu2(self.norm2(y)))], 1)


class DenseNet(nn.Module):
    def __init__(self, classes: int = 10, growth: int = 6) -> None:
        super().__init__()
        self.stem = nn.Sequential(*conv_bn(3, 12, 3, 2), nn.ReLU())
        self.block1 = nn.Sequential(DenseLayer(12, growth), DenseLayer(12 + growth, growth))
        channels = 12 + 2 * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, 16, 1), nn.AvgPool2d(2))
        self.block2 = nn.Sequential(DenseLayer(16, growth), DenseLayer(16 + growth, growth))
        self.norm = nn.BatchNorm2d(16 + 2 * growth)
        self.classifier = nn.Linear(16 + 2 * growth, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.transition(self.block1(self.stem(x))))
        return self.classifier(torch.flatten(fn.adaptive_avg_pool2d(fn.relu(self.norm(x)), 1), 1))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)  # on (batch, height, width, channels)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))  # layer scale: a tiny branch before training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, classes: int = 10, dims: tuple[int, int] = (16, 32)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0]))
        self.stage1 = nn.Sequential(ConvNeXtBlock(dims[0]), ConvNeXtBlock(dims[0]))
        self.downsample = nn.Sequential(LayerNorm2d(dims[0]), nn.Conv2d(dims[0], dims[1], 2, 2))
        self.stage2 = nn.Sequential(ConvNeXtBlock(dims[1]))
        self.norm = nn.LayerNorm(dims[1])
        self.head = nn.Linear(dims[1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.downsample(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, key_padding_mask=padding, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 32, patch: int = 8, image: int = 32) -> None:
        super().__init__()
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.Sequential(EncoderBlock(dim, 4), EncoderBlock(dim, 4))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class TextEncoder(nn.Module):
    """Integer token ids and a bool padding mask in, class logits out."""

    def __init__(self, vocab: int = 50, dim: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = EncoderBlock(dim, 2)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.block(self.embed(ids), padding)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))


def image_batches(n: int = 4, batch: int = 4, size: int = 32, seed: int = 0) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=g),) for _ in range(n)]


def text_batches(n: int = 4, batch: int = 4, tokens: int = 7, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 50, (batch, tokens), generator=g)
        lengths = torch.randint(2, tokens + 1, (batch, 1), generator=g)
        out.append((ids, torch.arange(tokens) >= lengths))  # True marks padding
    return out


ARCHITECTURES = {
    "resnet": (lambda: zero_init_resnet(), image_batches),
    "mobilenet_v2": (MobileNetV2, image_batches),
    "mobilenet_v3": (MobileNetV3, image_batches),
    "efficientnet": (EfficientNet, image_batches),
    "densenet": (DenseNet, image_batches),
    "convnext": (ConvNeXt, image_batches),
    "vit": (ViT, image_batches),
    "text_encoder": (TextEncoder, text_batches),
    "prelu_net": (PReLUNet, image_batches),
}
