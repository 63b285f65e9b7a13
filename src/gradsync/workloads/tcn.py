"""A temporal convolutional network (TCN) over the rows of 1x28x28 images (Bai, Kolter & Koltun 2018, "An
Empirical Evaluation of Generic Convolutional and Recurrent Networks for Sequence Modeling", arXiv 1803.01271,
§3 and Figure 1): each of the 28 rows (28 features) is one time step, as the GRU reads them
(:class:`~gradsync.workloads.rnn.RowGRU`); residual blocks of two dilated causal 1-D convolutions (kernel 3,
dilations 1, 2, 4, so the last step sees all 28 rows), ReLU after each, a 1x1 convolution on the residual where
the channels change, and a linear head on the last time step. No weight normalisation and no dropout (the
paper's regularisers), so every parameter is a plain weight or bias.

Channels 64: a forward and backward pass plus the SGD step of batch 64 took a median of 35.8 ms on one thread
here (the other core busy; 96 channels: 59.3 ms, 128: 96.7 ms).

69,706 parameters (278,824 bytes of fp32 gradients): five 64 x 64 x 3 convolutions (12,288 weights each, a
64 x 192 matrix as PowerSGD views it), the first 28 -> 64 one (5,376), the 1x1 residual projection (1,792), 448
biases of the blocks and the 650 of the head.
"""

from __future__ import annotations

import torch
from torch import nn


class _CausalBlock(nn.Module):
    """Two dilated causal convolutions ``[B, C_in, T] -> [B, C_out, T]`` with a residual connection."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.trim = (kernel - 1) * dilation  # padded on both sides by Conv1d; the right side is cut (causal)
        self.conv1 = nn.Conv1d(c_in, c_out, kernel, padding=self.trim, dilation=dilation)
        self.conv2 = nn.Conv1d(c_out, c_out, kernel, padding=self.trim, dilation=dilation)
        self.down = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv1(x)[..., :-self.trim])
        y = torch.relu(self.conv2(y)[..., :-self.trim])
        return torch.relu(y + (x if self.down is None else self.down(x)))


class RowTCN(nn.Module):
    """``[B, 1, H, W]`` float32 images -> logits ``[B, classes]``; each of the H rows (W features) is one
    time step.

    Args:
        width: features per row (W).
        channels: channels of every block.
        dilations: one residual block per dilation.
        kernel: kernel size of every convolution.
        classes: output classes.

    Raises:
        ValueError: for ``width`` or ``channels`` < 1, ``kernel`` < 2, or no dilations or one < 1.
    """

    def __init__(self, width: int = 28, channels: int = 64, dilations: tuple[int, ...] = (1, 2, 4), kernel: int = 3,
                 classes: int = 10) -> None:
        super().__init__()
        if min(width, channels) < 1 or kernel < 2 or not dilations or min(dilations) < 1:
            raise ValueError(f"width and channels must be >= 1, kernel >= 2 and dilations >= 1; got width={width}, "
                             f"channels={channels}, kernel={kernel}, dilations={dilations}")
        self.blocks = nn.Sequential(*(_CausalBlock(width if i == 0 else channels, channels, kernel, d)
                                      for i, d in enumerate(dilations)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, 1, H, W]`` -> logits ``[B, classes]``."""
        return self.head(self.blocks(x.flatten(1, 2).transpose(1, 2))[..., -1])
