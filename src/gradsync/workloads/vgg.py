"""A small VGG-style CNN for 1x28x28 images (Simonyan & Zisserman 2015, "Very Deep Convolutional Networks for
Large-Scale Image Recognition", arXiv 1409.1556, §2.1 and Table 1): stacks of 3x3 convolutions of stride 1,
max pooling between stacks, the width doubling after each pool; no skip connection, no branch. Batch norm
follows every convolution (torchvision's ``vgg11_bn`` variant; Ioffe & Szegedy 2015), and a global average pool
and one linear layer replace the paper's three fully connected layers (which at 28x28 would hold most of the
parameters).

Defaults: stacks of 1, 1, 2 and 2 convolutions of 16, 32, 64 and 96 channels (the paper's configuration A, "VGG-11",
at 1/8 to 1/5 of its widths, one stack fewer), 199,994 parameters (799,976 bytes of fp32 gradients). The greatest
weights are the last stack's, 96 x 864 as PowerSGD views a convolution (output channels x the rest).
"""

from __future__ import annotations

import torch
from torch import nn


class TinyVGG(nn.Module):
    """``[B, C, 28, 28]`` float32 images -> logits ``[B, classes]``.

    Args:
        channels: input channels.
        stacks: ``(convolutions, width)`` per stack; a 2x2 max pool follows every stack but the last.
        classes: output classes.

    Raises:
        ValueError: for no stack, a stack of fewer than 1 convolution or width, more than 4 pools (28 -> 1),
            or ``classes`` < 1.
    """

    def __init__(self, channels: int = 1, stacks: tuple[tuple[int, int], ...] = ((1, 16), (1, 32), (2, 64), (2, 96)),
                 classes: int = 10) -> None:
        super().__init__()
        if not stacks or len(stacks) > 5 or any(n < 1 or w < 1 for n, w in stacks) or classes < 1:
            raise ValueError(f"stacks must be 1 to 5 stacks of >= 1 convolutions of width >= 1, and classes >= 1; got "
                             f"stacks={stacks}, classes={classes}")
        parts: list[nn.Module] = []
        cin = channels
        for i, (n, width) in enumerate(stacks):
            if i > 0:
                parts.append(nn.MaxPool2d(2))
            for _ in range(n):
                parts += [nn.Conv2d(cin, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
                cin = width
        self.features = nn.Sequential(*parts)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, 28, 28]`` -> logits ``[B, classes]``."""
        return self.head(self.features(x))
