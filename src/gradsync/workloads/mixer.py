"""A small MLP-Mixer for 1x28x28 images (Tolstikhin et al., NeurIPS 2021, arXiv 2105.01601, §2): non-overlapping
patches linearly embedded, then blocks of a token-mixing MLP (across the patches, shared over channels) and a
channel-mixing MLP (across channels, shared over patches), each pre-norm with a skip connection, global average
pooling and a linear head. No attention and no convolution past the patch embedding. Sized for a 2-core CPU:
patches of 4x4 (49 tokens), width 64, 4 blocks, token MLP 64, channel MLP 128: 95k parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from .vit import patch_embedding


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_mlp: int, channel_mlp: int) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, token_mlp), nn.GELU(), nn.Linear(token_mlp, tokens))
        self.channel_norm = nn.LayerNorm(dim)
        self.channel_mlp = nn.Sequential(nn.Linear(dim, channel_mlp), nn.GELU(), nn.Linear(channel_mlp, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t + self.token_mlp(self.token_norm(t).transpose(1, 2)).transpose(1, 2)
        return t + self.channel_mlp(self.channel_norm(t))


class TinyMixer(nn.Module):
    """MLP-Mixer on ``[B, C, H, W]`` float32 images (H and W multiples of ``patch``) -> logits ``[B, classes]``.

    Args:
        image: (channels, height, width) of the input.
        patch: patch side (pixels).
        dim: channels per token.
        depth: mixer blocks.
        token_mlp: hidden width of the token-mixing MLP.
        channel_mlp: hidden width of the channel-mixing MLP.
        classes: output classes.

    Raises:
        ValueError: if the image sides are not multiples of ``patch``.
    """

    def __init__(self, image: tuple[int, int, int] = (1, 28, 28), patch: int = 4, dim: int = 64, depth: int = 4,
                 token_mlp: int = 64, channel_mlp: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.embed, tokens = patch_embedding(image, patch, dim)
        self.blocks = nn.Sequential(*(_MixerBlock(tokens, dim, token_mlp, channel_mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, H, W]`` -> logits ``[B, classes]``."""
        t = self.blocks(self.embed(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(t).mean(dim=1))
