"""RedSync's threshold search (Fang, Fu, Yang & Wang, "RedSync: Reducing Synchronization Bandwidth for
Distributed Deep Learning Training System", JPDC 2019, §4 "trimmed top-k"/binary-search selection),
as used by the GraVAC reference code (Tyagi & Swany, arXiv 2305.12201)."""

from __future__ import annotations

from typing import Any

import torch

from gradsync.compressors.base import Ctx, Payload, SparseCompressor
from gradsync.validation import check_float, check_int


class RedSyncCompressor(SparseCompressor):
    """Binary search of the threshold ``thr = mean|x| + r (max|x| - mean|x|)`` over r in [0, 1].

    Each iteration counts ``nnz = #{|x| > thr}``; it stops when ``k < nnz < 2k``
    (``k = ceil(density * n)``), when the interval of r is narrower than ``min_interval``, or after
    ``max_iters`` iterations. Too many selected moves r up, too few moves r down. If the search ends
    with nothing selected (e.g. all |x| equal), the entries equal to max|x| are kept.

    Args:
        density: target fraction kept, in (0, 1]. Since thr >= mean|x|, densities above the share of
            entries above the mean are not reachable; the search then ends at r near 0.
        min_interval: stop width of the r interval, in (0, 1] (reference: 0.2).
        max_iters: maximum iterations (>= 1).
        seed: unused (deterministic).

    Payload: ``(values float32 [m], indices int32 [m])``; aggregation ``"allgather"``.

    Raises:
        ValueError: on arguments outside the ranges above.
    """

    name = "redsync"

    def __init__(self, density: float, min_interval: float = 0.2, max_iters: int = 20, seed: int = 0):
        super().__init__(density, seed)
        self.min_interval = check_float("min_interval", min_interval, 0.0, 1.0, low_inclusive=False)
        self.max_iters = check_int("max_iters", max_iters, 1, 1000)

    def compress(
        self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0, density: float | None = None
    ) -> tuple[Payload, Ctx]:
        self._check_input(x)
        n = x.numel()
        k = self.k_for(n, density)
        if n == 0:
            return self._pack(x, torch.empty(0, dtype=torch.int64, device=x.device))
        absx = x.abs()
        mean = float(absx.mean())
        mx = float(absx.max())
        lo, hi = 0.0, 1.0
        mask = absx > mean
        for _ in range(self.max_iters):
            r = 0.5 * (lo + hi)
            thr = mean + r * (mx - mean)
            mask = absx > thr
            nnz = int(mask.sum())
            if k < nnz < 2 * k:
                break
            if nnz >= 2 * k:
                lo = r  # too many selected: raise the threshold
            else:
                hi = r  # too few: lower it
            if hi - lo < self.min_interval:
                break
        if not bool(mask.any()) and mx > 0:
            mask = absx >= mx
        return self._pack(x, mask.nonzero().flatten())

    def config(self) -> dict[str, Any]:
        return {**super().config(), "min_interval": self.min_interval, "max_iters": self.max_iters}
