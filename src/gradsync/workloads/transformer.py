"""A decoder-only (GPT-style) character-level transformer language model built from torch's modules.

The architecture is the decoder-only transformer of Radford et al. (2018), "Improving Language
Understanding by Generative Pre-Training", section 3.1: token plus learned position embeddings, a
stack of masked (causal) multi-head self-attention blocks (Vaswani et al. 2017, "Attention Is All You
Need", arXiv:1706.03762, section 3.2.3, masking "illegal connections" to later positions), and a
linear layer giving next-token logits at every position. The blocks use pre-layer normalisation
(Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture", arXiv:2002.04745,
section 3), which trains stably without a long learning-rate warm-up, and GELU activations
(Hendrycks & Gimpel 2016, arXiv:1606.08415) as in GPT.

Each block is one ``torch.nn.TransformerEncoderLayer(norm_first=True, batch_first=True)``; stacked in
``torch.nn.TransformerEncoder`` and given an additive causal mask (``-inf`` above the diagonal), an
encoder layer is exactly a decoder-only block (there is no cross-attention to drop). Scored in bits
per character like the char-LSTM (Graves 2013, arXiv:1308.0850, section 3).
"""

from __future__ import annotations

import torch
from torch import nn


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Additive attention mask float32 ``[length, length]``: 0 on and below the diagonal, ``-inf``
    above it, so position i attends to positions 0..i only (the layout ``nn.MultiheadAttention``'s
    ``attn_mask`` takes; equal to ``nn.Transformer.generate_square_subsequent_mask``).

    Raises:
        ValueError: if ``length < 1``.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1; got {length}")
    return torch.triu(torch.full((length, length), float("-inf"), device=device), diagonal=1)


class CharTransformer(nn.Module):
    """Token + position embedding -> ``layers`` causal pre-LN transformer blocks -> LayerNorm -> linear.

    Args:
        vocab_size: number of distinct characters V (>= 2).
        context: longest sequence T the position embedding covers (>= 1).
        d_model: embedding width D; must be divisible by ``heads``.
        heads: attention heads per block (>= 1).
        layers: transformer blocks (>= 1).
        ff_mult: width of each block's feed-forward layer as a multiple of D (>= 1).
        dropout: dropout on the embeddings, attention weights and residual branches, in [0, 1).
        channels_first: return logits ``[B, V, T]`` instead of ``[B, T, V]``: the layout
            ``F.cross_entropy(logits, y)`` and ``logits.argmax(1) == y`` take with targets ``[B, T]``
            (as ``CharLSTM(channels_first=True)``), so a classification training loop works unchanged.

    Input ``x``: int64 token ids ``[B, T]`` with ``1 <= T <= context``. Output: float32 logits
    ``[B, T, V]`` (``[B, V, T]`` with ``channels_first``); the logits at position t depend only on
    ``x[:, :t + 1]``.

    The causal mask is built in ``forward`` (and cached per length and device), not stored as a
    buffer: DDP would broadcast a buffer from rank 0 on every forward.

    Raises:
        ValueError: for an argument out of range (naming it), or from ``forward`` for a sequence
            longer than ``context``.
    """

    def __init__(self, vocab_size: int, context: int = 256, d_model: int = 128, heads: int = 4,
                 layers: int = 4, ff_mult: int = 4, dropout: float = 0.0, channels_first: bool = False) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2; got {vocab_size}")
        if context < 1:
            raise ValueError(f"context must be >= 1; got {context}")
        if heads < 1 or d_model < 1 or d_model % heads:
            raise ValueError(f"d_model must be a positive multiple of heads >= 1; got d_model={d_model}, heads={heads}")
        if layers < 1:
            raise ValueError(f"layers must be >= 1; got {layers}")
        if ff_mult < 1:
            raise ValueError(f"ff_mult must be >= 1; got {ff_mult}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1); got {dropout}")
        self.vocab_size, self.context, self.channels_first = vocab_size, context, channels_first
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(d_model, heads, ff_mult * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def _mask(self, length: int, device: torch.device) -> torch.Tensor:
        key = (length, str(device))
        if key not in self._masks:
            self._masks[key] = causal_mask(length, device)
        return self._masks[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` int64 ``[B, T]`` -> logits float32 ``[B, T, V]`` (``[B, V, T]`` if channels_first)."""
        t = x.shape[1]
        if not 1 <= t <= self.context:
            raise ValueError(f"sequence length must be in [1, {self.context}] (the context); got {t}")
        positions = torch.arange(t, device=x.device)
        h = self.drop(self.embed(x) + self.pos(positions))
        h = self.blocks(h, mask=self._mask(t, x.device), is_causal=True)
        logits = self.head(self.norm(h))
        return logits.transpose(1, 2) if self.channels_first else logits
