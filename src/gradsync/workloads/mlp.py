"""A multilayer perceptron for 1x28x28 images: the pixels flattened, two hidden layers of 512 units with
ReLU, a linear head; no convolution, no attention, no recurrence, no normalisation. 669,706 parameters, almost
all in two weight matrices (784x512 and 512x512): 2.7 MB of fp32 gradients for a forward and backward pass of
a few milliseconds, so its communication-to-computation ratio is high on any network below 1 Gbit/s.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class MLP(nn.Module):
    """``[B, C, H, W]`` float32 images -> logits ``[B, classes]`` through ``hidden`` ReLU layers.

    Args:
        image: (channels, height, width) of the input.
        hidden: widths of the hidden layers.
        classes: output classes.

    Raises:
        ValueError: for an empty ``hidden`` or a width < 1.
    """

    def __init__(self, image: tuple[int, int, int] = (1, 28, 28), hidden: tuple[int, ...] = (512, 512),
                 classes: int = 10) -> None:
        super().__init__()
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden must hold at least one width >= 1; got {hidden}")
        widths = [math.prod(image), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, H, W]`` -> logits ``[B, classes]``."""
        return self.layers(x)
