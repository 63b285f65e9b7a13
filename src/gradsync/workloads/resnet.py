"""A small pre-activation-free ResNet (He et al. 2016, "Deep Residual Learning", §3-4) for 28x28 inputs.

``ResNetFMNIST`` follows the CIFAR-style ResNet of §4.2: a 3x3 stem, three stages of BasicBlocks
(widths w, 2w, 4w; stride 2 between stages), global average pooling and a linear classifier.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetFMNIST(nn.Module):
    """ResNet for 1x28x28 images.

    Args:
        width: channels of the first stage (the stages have width, 2*width, 4*width).
        blocks: BasicBlocks per stage.
        num_classes: output logits.

    Input float32 ``[B, 1, 28, 28]``; output float32 logits ``[B, num_classes]``.
    """

    def __init__(self, width: int = 16, blocks: tuple[int, int, int] = (1, 1, 1), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2**i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
