"""Scaled sign compression of EF-SignSGD (Karimireddy, Rebjock, Stich & Jaggi, "Error Feedback Fixes
SignSGD and other Gradient Compression Schemes", ICML 2019, Algorithm 1: ``C(x) = (||x||_1 / d) sign(x)``).
Use it with error feedback (:mod:`gradsync.feedback.residual`) as the paper does."""

from __future__ import annotations

import torch

from gradsync.compressors.base import Compressor, Ctx, Payload

_SHIFTS = torch.arange(8, dtype=torch.uint8, device="cpu")  # moved to the payload's device when used
_WEIGHTS = (2 ** torch.arange(8, device="cpu")).to(torch.uint8)


class SignSGDCompressor(Compressor):
    """``C(x) = mean(|x|) * sign(x)`` with 1 bit per element (sign(0) taken as +1).

    Args:
        seed: unused (deterministic).

    Payload: ``(sign bits uint8 [ceil(n / 8)], scale float32 [1])``; the scale differs between ranks,
    so aggregation is ``"allgather"``.
    """

    name = "signsgd"
    fixed_size = True
    aggregation = "allgather"

    def compress(self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0) -> tuple[Payload, Ctx]:
        self._check_input(x)
        n = x.numel()
        scale = x.abs().mean().reshape(1) if n else torch.zeros(1, device=x.device)
        bits = (x >= 0).to(torch.uint8)
        pad = (-n) % 8
        if pad:
            bits = torch.cat([bits, torch.zeros(pad, dtype=torch.uint8, device=x.device)])
        packed = (bits.view(-1, 8) * _WEIGHTS.to(x.device)).sum(dim=1, dtype=torch.int32).to(torch.uint8)
        return (packed, scale), Ctx(numel=n, selected=n)

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        packed, scale = payload
        bits = ((packed.unsqueeze(1) >> _SHIFTS.to(packed.device)) & 1).flatten()[: ctx.numel]
        return (bits.to(torch.float32) * 2.0 - 1.0) * scale.to(torch.float32)
