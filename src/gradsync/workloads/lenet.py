"""A LeNet-5-style convolutional network for 1x28x28 images (LeCun et al. 1998, "Gradient-Based Learning
Applied to Document Recognition", Proc. IEEE 86(11), §II.B): two 5x5 convolutions without padding, each
followed by a 2x2 max-pool (28 -> 24 -> 12 -> 8 -> 4), then two fully connected layers; ReLU in place of
the paper's scaled tanh, max-pooling in place of its trainable sub-sampling, no normalisation, no skip
connection. Widths 16 and 32 channels and a 512-unit hidden layer instead of 6, 16 and 120/84, so the
gradient is large enough for its all-reduce to matter; a forward and backward pass of batch 64 took 31 ms on
one thread here (widths 32 and 64: 70 ms).

281,034 parameters (1,124,136 bytes of fp32 gradients): 262,656 (93 %) in the 512 -> 512 layer, 12,832 in the
second convolution (a 32 x 400 matrix as PowerSGD views it), 416 in the first, 5,130 in the head.
"""

from __future__ import annotations

import torch
from torch import nn


class LeNet(nn.Module):
    """``[B, C, 28, 28]`` float32 images -> logits ``[B, classes]``.

    Args:
        channels: input channels.
        widths: output channels of the two convolutions.
        hidden: units of the fully connected hidden layer.
        classes: output classes.

    Raises:
        ValueError: for a width or ``hidden`` < 1.
    """

    def __init__(self, channels: int = 1, widths: tuple[int, int] = (16, 32), hidden: int = 512,
                 classes: int = 10) -> None:
        super().__init__()
        if min(widths) < 1 or hidden < 1:
            raise ValueError(f"widths and hidden must be >= 1; got widths={widths}, hidden={hidden}")
        self.features = nn.Sequential(
            nn.Conv2d(channels, widths[0], 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(widths[0], widths[1], 5), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(widths[1] * 4 * 4, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, 28, 28]`` -> logits ``[B, classes]``."""
        return self.head(self.features(x))
