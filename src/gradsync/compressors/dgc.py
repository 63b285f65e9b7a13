"""Deep Gradient Compression's sparsifier (Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression",
ICLR 2018): threshold estimated from a random sample (§3.1 and the DGC code's sampling), adjusted so the
number selected is near k, with DGC's warm-up of the density (§3.4 "warm-up training": sparsity
75%, 93.75%, 98.4375%, 99.6% over the first epochs, then the target).

The threshold adjustment follows the GraVAC reference code (Tyagi & Swany, arXiv 2305.12201): up to 10 times,
multiply the threshold by 1.3 if more than 1.3k entries are selected, by 0.7 if fewer than 0.7k.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradsync.compressors.base import Ctx, Payload, SparseCompressor
from gradsync.validation import check_float, check_int


class DGCCompressor(SparseCompressor):
    """Sampled-threshold sparsifier with density warm-up.

    Args:
        density: target fraction kept, in (0, 1].
        sample_ratio: fraction of entries sampled to estimate the threshold, in (0, 1] (DGC: 0.01);
            at least ``min(n, 1000)`` entries are sampled.
        warmup_steps: steps per warm-up stage (0 = no warm-up). Stage i (0-based) keeps
            ``max(density, 0.25 ** (i + 1))``; after ``warmup_stages`` stages the target applies.
            Set it to the number of steps per epoch to reproduce DGC's per-epoch schedule.
        warmup_stages: number of warm-up stages (DGC: 4).
        max_adjust: maximum threshold adjustments (reference: 10).
        seed: base seed for sampling (mixed with step, key and rank).

    Payload: ``(values float32 [m], indices int32 [m])`` with m near k; aggregation ``"allgather"``.

    Raises:
        ValueError: on any argument outside the ranges above.
    """

    name = "dgc"

    def __init__(
        self,
        density: float,
        sample_ratio: float = 0.01,
        warmup_steps: int = 0,
        warmup_stages: int = 4,
        max_adjust: int = 10,
        seed: int = 0,
    ):
        super().__init__(density, seed)
        self.sample_ratio = check_float("sample_ratio", sample_ratio, 0.0, 1.0, low_inclusive=False)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, None)
        self.warmup_stages = check_int("warmup_stages", warmup_stages, 0, 64)
        self.max_adjust = check_int("max_adjust", max_adjust, 0, 1000)

    def density_at(self, step: int) -> float:
        """Density used at ``step`` (warm-up schedule, then the target)."""
        if self.warmup_steps > 0:
            stage = step // self.warmup_steps
            if stage < self.warmup_stages:
                return max(self.density, 0.25 ** (stage + 1))
        return self.density

    def compress(
        self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0, density: float | None = None
    ) -> tuple[Payload, Ctx]:
        self._check_input(x)
        n = x.numel()
        d = self.density_at(step) if density is None else density
        k = self.k_for(n, d)
        if n == 0:
            return self._pack(x, torch.empty(0, dtype=torch.int64, device=x.device))
        absx = x.abs()
        m = min(n, max(math.ceil(n * self.sample_ratio), 1000))
        if m < n:
            # Sample positions drawn on the CPU (reproducible across device types), moved to x's device.
            pos = torch.randint(0, n, (m,), generator=self._generator(step, key, rank), device="cpu")
            sample = absx[pos.to(x.device)]
        else:
            sample = absx
        ks = max(1, min(m, math.ceil(m * d)))
        thr = float(torch.topk(sample, ks, sorted=False)[0].min())
        mask = self._select(absx, thr)
        nnz = int(mask.sum())
        for _ in range(self.max_adjust):
            if nnz > 1.3 * k:
                if thr > 0:
                    thr *= 1.3
                else:  # every non-zero was selected: start from the smallest non-zero magnitude
                    thr = float(absx[absx > 0].min())
            elif nnz < 0.7 * k and thr > 0:
                thr *= 0.7
            else:
                break
            mask = self._select(absx, thr)
            nnz = int(mask.sum())
        return self._pack(x, mask.nonzero().flatten())

    @staticmethod
    def _select(absx: torch.Tensor, thr: float) -> torch.Tensor:
        # A zero threshold would select every zero entry; keep only non-zeros then.
        return absx > 0 if thr <= 0 else absx >= thr

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "sample_ratio": self.sample_ratio,
            "warmup_steps": self.warmup_steps,
            "warmup_stages": self.warmup_stages,
            "max_adjust": self.max_adjust,
        }
