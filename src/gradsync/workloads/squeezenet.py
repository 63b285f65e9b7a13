"""A small SqueezeNet for 1x28x28 images (Iandola et al. 2016, "SqueezeNet: AlexNet-level accuracy with 50x
fewer parameters and <0.5MB model size", arXiv 1602.07360, §3.1-3.2): "Fire" modules, each a 1x1 "squeeze"
convolution to few channels feeding a 1x1 and a 3x3 "expand" convolution side by side, their maps
concatenated; max pooling between pairs of Fire modules; no fully connected layer: a 1x1 convolution to the
classes, then global average pooling. Batch norm follows every convolution (the paper has none; without it
the network trains slowly under the recipe's one-cycle SGD).

The stem is a 3x3 convolution of stride 2 (28 -> 14), then three pairs of Fire modules at 14x14, 7x7 and 3x3.

Defaults: widths 32, 64, 128 and 192 channels, squeeze ratio 1/8, 87,210 parameters (348,840 bytes of fp32
gradients). No weight is a large matrix: the greatest are the 3x3 expands, 96 x 216, as PowerSGD views a
convolution (output channels x the rest), and the classifier, 10 x 192.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn_relu(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class Fire(nn.Module):
    """``[B, cin, H, W]`` -> ``[B, 2 * expand, H, W]``: squeeze to ``squeeze`` channels (1x1), then 1x1 and
    3x3 expands of ``expand`` channels each, concatenated (Iandola et al. 2016, §3.2)."""

    def __init__(self, cin: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = _conv_bn_relu(cin, squeeze, 1)
        self.expand1 = _conv_bn_relu(squeeze, expand, 1)
        self.expand3 = _conv_bn_relu(squeeze, expand, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.squeeze(x)
        return torch.cat([self.expand1(s), self.expand3(s)], 1)


class TinySqueezeNet(nn.Module):
    """``[B, C, 28, 28]`` float32 images -> logits ``[B, classes]``.

    Args:
        channels: input channels.
        widths: the stem's output channels, then each pair of Fire modules' (even: two expands of half).
        classes: output classes.

    Raises:
        ValueError: for fewer than two widths, an odd or < 2 Fire width, or ``classes`` < 1.
    """

    def __init__(self, channels: int = 1, widths: tuple[int, ...] = (32, 64, 128, 192), classes: int = 10) -> None:
        super().__init__()
        if len(widths) < 2 or widths[0] < 1 or any(w < 2 or w % 2 for w in widths[1:]) or classes < 1:
            raise ValueError(f"widths must be a stem width >= 1 and Fire widths that are even and >= 2, and classes "
                             f">= 1; got widths={widths}, classes={classes}")
        parts: list[nn.Module] = [_conv_bn_relu(channels, widths[0], 3, stride=2)]
        cin = widths[0]
        for i, w in enumerate(widths[1:]):
            if i > 0:
                parts.append(nn.MaxPool2d(2))
            squeeze = max(1, w // 8)
            parts += [Fire(cin, squeeze, w // 2), Fire(w, squeeze, w // 2)]
            cin = w
        self.features = nn.Sequential(*parts)
        self.classifier = nn.Sequential(nn.Conv2d(cin, classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, 28, 28]`` -> logits ``[B, classes]``."""
        return self.classifier(self.features(x))
