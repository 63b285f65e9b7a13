"""Compressor interface: pure tensor -> payload -> tensor transforms (no communication).

Split after GRACE (Xu et al., "GRACE: A Compressed Communication Framework for Distributed Machine
Learning", ICDCS 2021): a *compressor* turns a flat gradient into a payload, an error-feedback
*memory* (:mod:`gradsync.feedback.residual`) adds and keeps the residual, and a *communicator*
(:mod:`gradsync.comm.sparse`) moves payloads between ranks. The communicator follows from the
compressor's :attr:`Compressor.aggregation`:

* ``"allreduce"``: the payload is linear in the input and has the same shape on every rank for the
  same step and key, so payloads from all ranks can be summed element-wise (casts, random-k with a
  shared seed, identity).
* ``"allgather"``: payloads differ in size or are not summable (top-k / DGC / RedSync indices,
  QSGD's per-rank norm, sign bits with a per-rank scale); every rank gathers every payload
  (padded to the largest size) and aggregates with :meth:`Compressor.aggregate`.
"""

from __future__ import annotations

import abc
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

#: A payload is a tuple of tensors; everything that differs between ranks lives in it.
Payload = tuple[torch.Tensor, ...]


@dataclass
class Ctx:
    """Rank-independent context needed to decompress a payload.

    Attributes:
        numel: number of elements of the compressed 1-D input.
        selected: number of input elements the payload represents (k for sparsifiers, numel for
            casts and quantisers); ``selected / numel`` is the density achieved.
        extra: compressor-specific rank-independent data (e.g. random-k's shared indices).
    """

    numel: int
    selected: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def density(self) -> float:
        """Fraction of the input's elements carried by the payload (1.0 for an empty input)."""
        return self.selected / self.numel if self.numel else 1.0


def derive_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (e.g. base seed, step, bucket index, rank)."""
    h = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def payload_device(*payloads: Payload) -> torch.device:
    """Device of the first tensor of the first non-empty payload (``cpu`` when there is none): where
    decompressed and aggregated tensors are created, so they stay beside the data they describe."""
    for p in payloads:
        for t in p:
            return t.device
    return torch.device("cpu")


def make_generator(*parts: int) -> torch.Generator:
    """CPU ``torch.Generator`` seeded with :func:`derive_seed` of ``parts``.

    Random draws are made on the CPU with it (``device="cpu"``) and then moved to the data's device,
    so every rank and every device type draws the same numbers for the same seed."""
    g = torch.Generator()
    g.manual_seed(derive_seed(*parts))
    return g


class Compressor(abc.ABC):
    """Base class of all gradsync compressors.

    Subclasses set :attr:`name` and :attr:`aggregation` and implement :meth:`compress` and
    :meth:`decompress`. Compressors hold no per-step state: randomness is derived from
    ``(seed, step, key[, rank])`` so a run resumed from a checkpoint repeats the same choices.

    Attributes:
        name: registry name.
        aggregation: ``"allreduce"`` or ``"allgather"`` (see module docstring).
        fixed_size: True if the payload's tensor sizes depend only on the input size (and step), so
            they are equal on every rank and the all-gather communicator can skip gathering sizes.
        shared_randomness: True if every rank must draw the same random numbers for a given
            ``(step, key)`` (random-k); False if ranks should draw independently (the ``rank``
            argument of :meth:`compress` is then mixed into the seed).
    """

    name: str = "base"
    aggregation: str = "allgather"
    fixed_size: bool = False
    shared_randomness: bool = False

    def __init__(self, seed: int = 0):
        from gradsync.validation import check_int

        self.seed = check_int("seed", seed, 0, None)

    # -- transforms ---------------------------------------------------------------------------
    @abc.abstractmethod
    def compress(self, x: torch.Tensor, step: int = 0, key: int = 0, rank: int = 0) -> tuple[Payload, Ctx]:
        """Compress a 1-D float32 tensor ``x`` of n elements.

        Args:
            x: 1-D ``torch.float32`` tensor on any device (not modified); the payload's tensors are
                on ``x``'s device.
            step: training step (int >= 0), used for schedules and random seeds.
            key: stable id of the tensor (bucket index), used for random seeds.
            rank: this process's rank; only mixed into the seed when ``shared_randomness`` is False.

        Returns:
            ``(payload, ctx)``: a tuple of tensors and the rank-independent :class:`Ctx`.
        """

    @abc.abstractmethod
    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        """Return the 1-D float32 tensor of ``ctx.numel`` elements that ``payload`` encodes, on the
        payload's device."""

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> torch.Tensor:
        """Sum of the decompressed payloads of all ranks (1-D float32, ``ctx.numel`` elements).

        Used by the all-gather communicator; sparse compressors override it with one scatter-add.
        The result lives on the payloads' device (CPU if there are none).
        """
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=payload_device(*payloads))
        for p in payloads:
            out.add_(self.decompress(p, ctx))
        return out

    # -- helpers ------------------------------------------------------------------------------
    def _generator(self, step: int, key: int, rank: int) -> torch.Generator:
        if self.shared_randomness:
            return make_generator(self.seed, step, key)
        return make_generator(self.seed, step, key, rank, 1)

    @staticmethod
    def _check_input(x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(
                "x must be a 1-D torch.float32 tensor, got "
                + (f"{x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(type(x)))
            )

    def config(self) -> dict[str, Any]:
        """Constructor arguments (identical on every rank); ``make_compressor(**config())`` rebuilds it."""
        return {"name": self.name, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint: compressors are stateless apart from their configuration."""
        return {"config": self.config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` was saved from an identically configured compressor.

        Raises:
            ValueError: if the saved configuration differs from this compressor's.
        """
        if state.get("config") != self.config():
            raise ValueError(f"compressor checkpoint {state.get('config')} does not match {self.config()}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"


class SparseCompressor(Compressor):
    """Sparsifier whose payload is ``(values float32 [k], indices int32 [k])``, k varying by rank."""

    aggregation = "allgather"

    def __init__(self, density: float, seed: int = 0):
        from gradsync.validation import check_float

        super().__init__(seed)
        self.density = check_float("density", density, 0.0, 1.0, low_inclusive=False)

    def k_for(self, numel: int, density: float | None = None) -> int:
        """Number of elements to keep: ``ceil(density * numel)``, at least 1 for a non-empty input."""
        d = self.density if density is None else density
        if numel == 0:
            return 0
        return max(1, min(numel, math.ceil(round(d * numel, 6))))

    @staticmethod
    def _pack(x: torch.Tensor, indices: torch.Tensor) -> tuple[Payload, Ctx]:
        indices = indices.to(torch.int64)
        values = x.index_select(0, indices)
        return (values, indices.to(torch.int32)), Ctx(numel=x.numel(), selected=int(indices.numel()))

    def decompress(self, payload: Payload, ctx: Ctx) -> torch.Tensor:
        values, indices = payload
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out.index_put_((indices.to(torch.int64),), values.to(torch.float32), accumulate=True)
        return out

    def aggregate(self, payloads: Sequence[Payload], ctx: Ctx) -> torch.Tensor:
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=payload_device(*payloads))
        if payloads:
            values = torch.cat([p[0].to(torch.float32) for p in payloads])
            indices = torch.cat([p[1].to(torch.int64) for p in payloads])
            out.index_add_(0, indices, values)
        return out

    def config(self) -> dict[str, Any]:
        return {**super().config(), "density": self.density}
