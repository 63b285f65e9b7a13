"""A GRU that reads a 1x28x28 image row by row (Cho et al., EMNLP 2014, arXiv 1406.1078: the gated
recurrent unit; the row-by-row reading of "sequential MNIST" classifiers, Le, Jaitly & Hinton 2015,
arXiv 1504.00941, with rows instead of pixels): 28 steps of 28 features, a linear head on the last hidden
state. 2 layers of 128 units: 161k parameters, recurrent weight matrices whose gradients are not
convolution kernels.
"""

from __future__ import annotations

import torch
from torch import nn


class RowGRU(nn.Module):
    """``[B, 1, H, W]`` float32 images -> logits ``[B, classes]``; each of the H rows (W features) is one
    time step.

    Args:
        width: features per row (W).
        hidden: GRU units per layer.
        layers: stacked GRU layers.
        classes: output classes.
    """

    def __init__(self, width: int = 28, hidden: int = 128, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.gru = nn.GRU(width, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, 1, H, W]`` -> logits ``[B, classes]``."""
        out, _ = self.gru(x.flatten(1, 2))
        return self.head(out[:, -1])
