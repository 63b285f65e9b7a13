"""A small DenseNet-BC for 1x28x28 images (Huang et al. 2017, "Densely Connected Convolutional Networks",
CVPR, §3): every layer of a dense block takes the concatenation of all earlier feature maps of the block
and adds ``growth`` new ones (BN-ReLU-1x1 bottleneck to ``4 * growth`` channels, then BN-ReLU-3x3 to
``growth``, the "B" variant), and a transition (BN-ReLU-1x1 conv halving the channels, the "C"
compression 0.5, then 2x2 average pooling) joins two blocks. The stem is a 4x4 convolution of stride 4
(28 -> 7, patches as ConvNeXt's stem cuts them, in place of the paper's 3x3 convolution at full resolution:
at 14x14 a forward and backward pass of batch 64 took 120 ms on one thread here), so the two blocks run at
7x7 and 3x3; global average pooling and one linear layer classify.

Defaults: growth 10, two blocks of 6 layers, 76,770 parameters (307,080 bytes of fp32 gradients), 41-57 ms
for a forward and backward pass of batch 64 on one thread. No weight is a large matrix: the greatest are
the 1x1 bottlenecks and the transition, 40 x up to 90, and the 3x3 kernels, 10 x 360, as PowerSGD views a
convolution (output channels x the rest).
"""

from __future__ import annotations

import torch
from torch import nn


def _bn_relu_conv(cin: int, cout: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False))


class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_bn_relu_conv(cin, 4 * growth, 1), _bn_relu_conv(4 * growth, growth, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class TinyDenseNet(nn.Module):
    """``[B, C, 28, 28]`` float32 images -> logits ``[B, classes]``.

    Args:
        channels: input channels.
        growth: feature maps each dense layer adds (the paper's ``k``).
        layers: dense layers per block, one entry per block.
        classes: output classes.

    Raises:
        ValueError: for a ``growth``, a block's layers or ``classes`` < 1, or no block.
    """

    def __init__(self, channels: int = 1, growth: int = 10, layers: tuple[int, ...] = (6, 6),
                 classes: int = 10) -> None:
        super().__init__()
        if growth < 1 or not layers or min(layers) < 1 or classes < 1:
            raise ValueError(f"growth, every block's layers and classes must be >= 1; got growth={growth}, "
                             f"layers={layers}, classes={classes}")
        width = 2 * growth
        parts: list[nn.Module] = [nn.Conv2d(channels, width, 4, stride=4, bias=False)]
        for i, n in enumerate(layers):
            for _ in range(n):
                parts.append(_DenseLayer(width, growth))
                width += growth
            if i < len(layers) - 1:
                parts += [_bn_relu_conv(width, width // 2, 1), nn.AvgPool2d(2)]
                width //= 2
        parts += [nn.BatchNorm2d(width), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*parts)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, 28, 28]`` -> logits ``[B, classes]``."""
        return self.head(self.features(x))
