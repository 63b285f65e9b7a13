"""Top-k sparsification (Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
EMNLP 2017, §3: keep the k entries of largest magnitude)."""

from __future__ import annotations

import torch

from gradsync.compressors.base import Ctx, Payload, SparseCompressor


class TopKCompressor(SparseCompressor):
    """Keep the ``k = ceil(density * n)`` entries of largest ``|x|``.

    Args:
        density: fraction of entries kept, in (0, 1] (0.01 = 100x compression of the values).
        seed: unused (top-k is deterministic); kept for a uniform constructor.

    Payload: ``(values float32 [k], indices int32 [k])``; aggregation ``"allgather"``.

    Raises:
        ValueError: if ``density`` is outside (0, 1].
    """

    name = "topk"
    fixed_size = True  # k = ceil(density * n) on every rank

    def compress(
        self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0, density: float | None = None
    ) -> tuple[Payload, Ctx]:
        """Select the top-k entries of ``x`` (1-D float32). ``density`` overrides the configured one
        for this call (used by GraVAC's candidate search)."""
        self._check_input(x)
        k = self.k_for(x.numel(), density)
        if k == 0:
            return self._pack(x, torch.empty(0, dtype=torch.int64, device=x.device))
        _, idx = torch.topk(x.abs(), k, sorted=False)
        return self._pack(x, idx)
