"""Which tensors PowerSGD compresses, and as what matrix (torch's ``powerSGD_hook`` rules; Vogels,
Karimireddy & Jaggi, NeurIPS 2019): shared by gradsync's hook (``powersgd-overlap``) and the
simulator's plan, so both count the same bytes."""

from __future__ import annotations

import math
from collections.abc import Sequence

#: torch's default: a tensor is compressed only where its rank-r factors are this many times smaller
MIN_COMPRESSION_RATE = 2


def compressed_matrix(shape: Sequence[int], rank: int) -> tuple[int, int] | None:
    """``(rows, cols)`` of the matrix ``tensor.view(shape[0], -1)`` that PowerSGD rank ``rank``
    compresses for a tensor of ``shape``, or ``None`` where the tensor is all-reduced uncompressed:
    one dimension, or factors ``(rows + cols) x rank`` not :data:`MIN_COMPRESSION_RATE` times smaller
    than ``rows x cols``."""
    if len(shape) <= 1:
        return None
    rows = shape[0]
    cols = math.prod(shape) // max(rows, 1)
    if (rows + cols) * rank * MIN_COMPRESSION_RATE < rows * cols:
        return rows, cols
    return None
