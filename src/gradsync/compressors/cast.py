"""Precision casts (fp16 / bf16) and the identity compressor.

fp16 follows torch's ``fp16_compress_hook`` (torch.distributed.algorithms.ddp_comm_hooks.default_hooks);
bf16 is the same with ``torch.bfloat16`` (torch's ``bf16_compress_hook`` refuses Gloo; this one works).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from gradsync.compressors.base import Compressor, Ctx, Payload

#: Names of the narrow floating wire dtypes (COVAP's ``cast``, the AMP names) and their dtypes.
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CASTS = tuple(CAST_DTYPES)


def cast_dtype(cast: Optional[str]) -> Optional[torch.dtype]:
    """The wire dtype a ``cast`` option selects (``None``: no cast).

    Raises:
        ValueError: if ``cast`` is not one of fp16, bf16 or None.
    """
    if cast is None:
        return None
    if cast not in CAST_DTYPES:
        raise ValueError(f"cast must be one of {', '.join(CASTS)} or None; got {cast!r}")
    return CAST_DTYPES[cast]


class CastCompressor(Compressor):
    """Cast to a narrower floating dtype.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16`` (or the strings ``"fp16"``, ``"bf16"``).

    Payload: ``(x.to(dtype) [n],)``; linear and equal-sized, so aggregation ``"allreduce"`` (the
    communicator divides by the world size before summing, as torch's fp16 hook does, to avoid
    overflow).

    Raises:
        ValueError: for any other dtype.
    """

    name = "cast"
    aggregation = "allreduce"
    _DTYPES = {**CAST_DTYPES, **{d: d for d in CAST_DTYPES.values()}}

    def __init__(self, dtype: Any = torch.float16, seed: int = 0):
        super().__init__(seed)
        if dtype not in self._DTYPES:
            raise ValueError(f"dtype must be one of fp16, bf16, torch.float16, torch.bfloat16; got {dtype!r}")
        self.dtype = self._DTYPES[dtype]

    def compress(self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0) -> tuple[Payload, Ctx]:
        self._check_input(x)
        return (x.to(self.dtype),), Ctx(numel=x.numel(), selected=x.numel())

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0].to(torch.float32)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "dtype": "fp16" if self.dtype == torch.float16 else "bf16"}


class FP16Compressor(CastCompressor):
    """:class:`CastCompressor` to ``torch.float16`` (registry name ``"fp16"``)."""

    name = "fp16"

    def __init__(self, seed: int = 0):
        super().__init__(torch.float16, seed)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed}


class BF16Compressor(CastCompressor):
    """:class:`CastCompressor` to ``torch.bfloat16`` (registry name ``"bf16"``)."""

    name = "bf16"

    def __init__(self, seed: int = 0):
        super().__init__(torch.bfloat16, seed)

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed}


class IdentityCompressor(Compressor):
    """No compression: payload ``(x.clone() float32 [n],)``, aggregation ``"allreduce"``.

    Registry name ``"none"``; with it the compressed hook reproduces dense all-reduce.
    """

    name = "none"
    aggregation = "allreduce"

    def compress(self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0) -> tuple[Payload, Ctx]:
        self._check_input(x)
        return (x.clone(),), Ctx(numel=x.numel(), selected=x.numel())

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        return payload[0]
