"""A small Vision Transformer for 1x28x28 images (Dosovitskiy et al., ICLR 2021, arXiv 2010.11929, §3.1):
non-overlapping patches linearly embedded, a learned class token and position embeddings, pre-norm
transformer encoder blocks, a linear head on the class token. Sized for a 2-core CPU: patches of 4x4
(49 tokens), width 64, 4 blocks of 4 heads, MLP 128: 139k parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def patch_embedding(image: tuple[int, int, int], patch: int, dim: int) -> tuple[nn.Conv2d, int]:
    """``(embedding, tokens)``: a convolution that embeds each non-overlapping ``patch`` x ``patch`` patch of an
    ``image`` (channels, height, width) as ``dim`` channels, and the number of patches.

    Raises:
        ValueError: if the image sides are not multiples of ``patch``.
    """
    c, h, w = image
    if h % patch or w % patch:
        raise ValueError(f"image sides {h}x{w} must be multiples of patch {patch}")
    return nn.Conv2d(c, dim, kernel_size=patch, stride=patch), (h // patch) * (w // patch)


class TinyViT(nn.Module):
    """ViT on ``[B, C, H, W]`` float32 images (H and W multiples of ``patch``) -> logits ``[B, classes]``.

    Args:
        image: (channels, height, width) of the input.
        patch: patch side (pixels).
        dim: token width.
        depth: encoder blocks.
        heads: attention heads per block.
        mlp: hidden width of each block's MLP.
        classes: output classes.

    Raises:
        ValueError: if the image sides are not multiples of ``patch`` or ``dim`` of ``heads``.
    """

    def __init__(self, image: tuple[int, int, int] = (1, 28, 28), patch: int = 4, dim: int = 64, depth: int = 4,
                 heads: int = 4, mlp: int = 128, classes: int = 10) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.embed, tokens = patch_embedding(image, patch, dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        block = nn.TransformerEncoderLayer(dim, heads, mlp, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, C, H, W]`` -> logits ``[B, classes]``."""
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos
        return self.head(self.norm(self.encoder(t)[:, 0]))
