"""QSGD stochastic quantisation (Alistarh, Grubic, Li, Tomioka & Vojnovic, "QSGD: Communication-Efficient
SGD via Gradient Quantization and Encoding", NeurIPS 2017, §3.1, eq. (1))."""

from __future__ import annotations

from typing import Any

import torch

from gradsync.compressors.base import Compressor, Ctx, Payload
from gradsync.validation import check_int


class QSGDCompressor(Compressor):
    """Quantise ``x`` to ``s`` levels of ``||x||_2`` with stochastic rounding.

    ``Q(x_i) = ||x||_2 * sign(x_i) * xi_i / s`` where ``xi_i = floor(l) + Bernoulli(l - floor(l))`` and
    ``l = s |x_i| / ||x||_2``, so ``E[Q(x)] = x`` (unbiased; variance bound of the paper's Lemma 3.1).

    Args:
        levels: s, number of quantisation levels, in [1, 32767] (s <= 127 packs into int8, else
            int16). Fixed-width levels are sent; the paper's Elias coding is not applied.
        seed: base seed for the rounding (mixed with step, key and rank).

    Payload: ``(signed levels int8/int16 [n], norm float32 [1])``. The norm differs between ranks, so
    payloads are not summable: aggregation ``"allgather"``.

    Raises:
        ValueError: if ``levels`` is outside [1, 32767].
    """

    name = "qsgd"
    fixed_size = True
    aggregation = "allgather"

    def __init__(self, levels: int = 127, seed: int = 0):
        super().__init__(seed)
        self.levels = check_int("levels", levels, 1, 32767)
        self._dtype = torch.int8 if self.levels <= 127 else torch.int16

    def compress(self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0) -> tuple[Payload, Ctx]:
        self._check_input(x)
        n = x.numel()
        norm = x.norm().reshape(1) if n else torch.zeros(1, device=x.device)
        if float(norm) == 0.0:
            return (torch.zeros(n, dtype=self._dtype, device=x.device), norm), Ctx(numel=n, selected=n)
        scaled = x.abs() / norm * self.levels
        lower = scaled.floor()
        # Drawn on the CPU (reproducible across device types), then moved to x's device.
        u = torch.rand(n, generator=self._generator(step, key, rank), device="cpu").to(x.device)
        level = lower + (u < (scaled - lower)).to(scaled.dtype)
        q = (level * x.sign()).to(self._dtype)
        return (q, norm), Ctx(numel=n, selected=n)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        q, norm = payload
        return q.to(torch.float32) * (norm.to(torch.float32) / self.levels)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "levels": self.levels}
