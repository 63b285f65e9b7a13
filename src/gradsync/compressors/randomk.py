"""Random-k sparsification with indices shared by all ranks.

Source: Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k with error
feedback); GRACE's ``RandomKCompressor``. Values are not rescaled by n/k: the compressor is meant
to be used with error feedback, as in the sources.
"""

from __future__ import annotations

import torch

from gradsync.compressors.base import Ctx, Payload, SparseCompressor, payload_device


class RandomKCompressor(SparseCompressor):
    """Keep ``k = ceil(density * n)`` entries chosen uniformly without replacement.

    The indices depend only on ``(seed, step, key)``, so every rank picks the same ones and the
    values (``float32 [k]``) are summed with one all-reduce of k floats (aggregation
    ``"allreduce"``); the indices travel in the rank-independent ``ctx.extra["indices"]``.

    Args:
        density: fraction kept, in (0, 1].
        seed: base seed, must be identical on every rank.

    Raises:
        ValueError: if ``density`` is outside (0, 1] or ``seed`` is negative.
    """

    name = "randomk"
    aggregation = "allreduce"
    shared_randomness = True

    def compress(
        self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0, density: float | None = None
    ) -> tuple[Payload, Ctx]:
        self._check_input(x)
        n = x.numel()
        k = self.k_for(n, density)
        # Drawn on the CPU (same indices on every rank and device type), then moved to x's device.
        idx = torch.randperm(n, generator=self._generator(step, key, rank), device="cpu")[:k].to(x.device)
        values = x.index_select(0, idx)
        return (values,), Ctx(numel=n, selected=k, extra={"indices": idx})

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        values = payload[0]
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out.index_copy_(0, ctx.extra["indices"].to(values.device), values.to(torch.float32))
        return out

    def aggregate(self, payloads, ctx: Ctx) -> torch.Tensor:
        device = payload_device(*payloads)
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=device)
        idx = ctx.extra["indices"].to(device)
        for p in payloads:
            out.index_add_(0, idx, p[0].to(torch.float32))
        return out
