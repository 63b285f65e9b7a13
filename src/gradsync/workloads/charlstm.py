"""A character-level LSTM language model (the LSTM workload of GraVAC's evaluation).

Character-level LSTM language models follow Graves (2013), "Generating Sequences With Recurrent
Neural Networks" (arXiv:1308.0850), section 3: predict the next character from the previous ones with
stacked LSTM layers and a softmax over the character set, scored in bits per character. GraVAC
(Tyagi & Sharma 2023) reports its largest compression gain on an LSTM language model; this one is
sized for a 2-core CPU: embedding 64 -> 2 x LSTM(256) -> linear, about 0.88 M parameters for the
73-character KJV vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

LN2 = math.log(2.0)


class CharLSTM(nn.Module):
    """Embedding -> ``nn.LSTM`` (batch_first) -> linear over the vocabulary.

    Args:
        vocab_size: number of distinct characters V.
        embed: embedding width E.
        hidden: LSTM hidden width H.
        layers: number of stacked LSTM layers.
        dropout: dropout between LSTM layers (and on the last layer's output); 0 disables it.
        channels_first: return logits ``[B, V, T]`` instead of ``[B, T, V]``. That is the layout
            ``F.cross_entropy(logits, y)`` and ``logits.argmax(1) == y`` take directly with targets
            ``[B, T]``, so a classification training loop works unchanged (mean loss over all B*T
            positions in nats; accuracy = next-character accuracy).

    Input ``x``: int64 token ids ``[B, T]``. Output: float32 logits ``[B, T, V]`` (unnormalised
    log-probabilities of the next character at every position), or ``[B, V, T]`` with
    ``channels_first``. Every sequence starts from a zero hidden and cell state.
    """

    def __init__(self, vocab_size: int, embed: int = 64, hidden: int = 256, layers: int = 2,
                 dropout: float = 0.0, channels_first: bool = False) -> None:
        super().__init__()
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2; got {vocab_size}")
        self.vocab_size = vocab_size
        self.channels_first = channels_first
        self.embed = nn.Embedding(vocab_size, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True,
                            dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` int64 ``[B, T]`` -> logits float32 ``[B, T, V]`` (``[B, V, T]`` if channels_first)."""
        h, _ = self.lstm(self.embed(x))
        logits = self.head(self.drop(h))
        return logits.transpose(1, 2) if self.channels_first else logits


def sequence_loss(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of next-character predictions, in nats.

    Args:
        logits: float ``[B, T, V]`` (the default ``CharLSTM`` layout).
        y: int64 targets ``[B, T]``.
        reduction: ``"mean"`` over all B*T positions (the training loss) or ``"sum"`` (for exact
            averages over uneven evaluation batches).

    Returns:
        A scalar tensor: mean (or summed) negative log-likelihood in nats per character.
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction=reduction)


def bits_per_char(mean_nats):
    """Convert a mean cross-entropy in nats per character to bits per character (divide by ln 2).

    Works for floats and tensors. A uniform guess over V characters scores log2(V) (6.19 bits for 73).
    """
    return mean_nats / LN2
