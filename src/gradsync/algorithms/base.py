"""Common state of every gradsync DDP communication hook: process group, step counter, statistics.

A gradsync algorithm is a picklable *state* object plus a module-level *hook* function
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, registered with
``ddp.register_comm_hook(state, hook)`` (the pattern of ``torch.distributed.algorithms.ddp_comm_hooks``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import wire_bytes
from ..comm.futures import drain_at_exit
from ..feedback.finite import FiniteGuard
from .protocol import Algorithm


class HookState(Algorithm):
    """Base state: process group, iteration counter and byte/time counters; the
    :class:`~gradsync.algorithms.protocol.Algorithm` protocol with the counters as :meth:`stats`.

    Args:
        process_group: group the collectives run on (``None`` = default group).

    Attributes:
        iteration: number of completed backward passes seen by the hook (advanced when the bucket with
            ``bucket.is_last()`` is processed), identical on every rank.
        payload_bytes: total bytes of the tensors this rank handed to collectives (int).
        wire_bytes: total bytes this rank put on the network for them (float; see
            :func:`gradsync.comm.collectives.wire_bytes` for the formula per collective kind).
        dense_payload_bytes / dense_wire_bytes: the same two figures for a dense all-reduce of every
            bucket seen (the reference the compression ratio is taken against).
        collectives: number of collectives launched.
        buckets_skipped: number of buckets for which no collective was launched.
        compress_seconds: wall-clock seconds spent in compression/decompression code on this rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        self.process_group = process_group
        init_counters(self)
        drain_at_exit()  # the last step's callbacks are released before the interpreter finalizes

    # -- helpers for hooks ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def count_collective(self, *tensors: torch.Tensor, kind: str = "allreduce",
                         world_size: int | None = None) -> tuple[int, float]:
        """Record one collective of ``kind`` (see :func:`~gradsync.comm.collectives.wire_bytes`)
        whose input on this rank is ``tensors`` (for ``"allgather"``: this rank's contribution).

        Args:
            tensors: the tensors handed to the collective (any shape and dtype).
            kind: collective kind, one of :data:`~gradsync.comm.collectives.WIRE_KINDS`.
            world_size: ranks of the group it runs on (default: :attr:`world_size`).

        Returns:
            ``(payload_bytes, wire_bytes)`` added by this call.

        Raises:
            ValueError: for an unknown ``kind``.
        """
        payload = sum(t.numel() * t.element_size() for t in tensors)
        return payload, self.count_payload(payload, kind, world_size=world_size)

    def count_payload(self, payload_bytes: int, kind: str = "allreduce", collectives: int = 1,
                      world_size: int | None = None) -> float:
        """:meth:`count_collective` for ``collectives`` collectives of ``payload_bytes`` bytes in
        all (for hooks that do not hold the tensors, e.g. torch's own hooks); returns the wire bytes
        added."""
        return count_bytes(self, payload_bytes, kind, self.world_size if world_size is None else world_size,
                           collectives)

    def end_bucket(self, bucket: Any) -> float:
        """Account the dense size of ``bucket`` (:func:`count_dense`) and advance ``iteration`` after
        the last bucket. Returns the dense wire bytes added."""
        return self.end_bucket_of(bucket.buffer(), bucket.is_last())

    def end_bucket_of(self, buf: torch.Tensor, is_last: bool) -> float:
        """:meth:`end_bucket` for a bucket given by its flat buffer and ``is_last()`` flag."""
        wire = count_dense(self, buf.numel() * buf.element_size(), self.world_size)
        if is_last:
            self.iteration += 1
        return wire

    class _Timer:
        def __init__(self, state: "HookState"):
            self.state = state

        def __enter__(self):
            self.t0 = time.perf_counter()

        def __exit__(self, *exc):
            self.state.compress_seconds += time.perf_counter() - self.t0

    def compression_timer(self) -> "HookState._Timer":
        """Context manager adding the elapsed time to ``compress_seconds``."""
        return HookState._Timer(self)

    @property
    def finite_guard(self) -> FiniteGuard:
        """The state's :class:`~gradsync.feedback.finite.FiniteGuard` (created at first use, also in
        states pickled before it existed): a step whose aggregated gradient is not finite restores the
        state it changed."""
        guard = self.__dict__.get("_finite_guard")
        if guard is None:
            guard = self._finite_guard = FiniteGuard()
        return guard

    def guarded(self, bucket: Any, fut: torch.futures.Future,
                verdict: "torch.futures.Future | torch.Tensor | None" = None) -> torch.futures.Future:
        """A compressed iteration's bucket future under :attr:`finite_guard` (after its
        ``begin(iteration, self._snapshot)``): tracked, or for the last bucket the future that
        completes after the iteration's finite decision (``verdict``: the guard element summed over
        ranks, ``None`` when only aggregated values decide), which restores :meth:`_restore` and
        returns NaN in the last bucket when the step is not finite."""
        if not bucket.is_last():
            return self.finite_guard.track(fut)
        return self.finite_guard.finish(fut, verdict, self._restore)

    def settle(self) -> None:
        """Apply a rollback :attr:`finite_guard` deferred (a non-finite step whose flag lives on an
        accelerator: :meth:`~gradsync.feedback.finite.FiniteGuard.settle`)."""
        guard = self.__dict__.get("_finite_guard")
        if guard is not None:
            guard.settle()

    def _snapshot(self) -> Any:
        """What a rolled-back step restores (:class:`~gradsync.feedback.finite.FiniteGuard`)."""
        return None

    def _restore(self, saved: Any) -> None:
        """Put back :meth:`_snapshot`'s result."""

    # -- reporting and checkpoints ------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative counters of :func:`counter_stats`."""
        return counter_stats(self)

    def config(self) -> dict[str, Any]:
        """Configuration fields that must be identical on every rank (checked at start-up)."""
        return {"algorithm": type(self).__name__}

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])

    # Process groups cannot be pickled; a restored state uses the default group.
    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["process_group"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


def init_counters(obj: Any) -> None:
    """Set the counters every algorithm reports (see :class:`HookState`) to zero on ``obj``."""
    obj.iteration = 0
    obj.payload_bytes = 0
    obj.wire_bytes = 0.0
    obj.dense_payload_bytes = 0
    obj.dense_wire_bytes = 0.0
    obj.collectives = 0
    obj.buckets_skipped = 0
    obj.compress_seconds = 0.0


def count_bytes(obj: Any, payload_bytes: int, kind: str, world_size: int, collectives: int = 1) -> float:
    """Add ``collectives`` collectives of ``kind`` with ``payload_bytes`` bytes of input on this rank
    to the counters of ``obj`` (:func:`init_counters`) over a group of ``world_size`` ranks.

    ``payload_bytes`` grows by ``payload_bytes``; ``wire_bytes`` by
    :func:`gradsync.comm.collectives.wire_bytes` ``(kind, payload_bytes, world_size)``. Every
    algorithm counts through this function. Returns the wire bytes added (float).

    Raises:
        ValueError: for an unknown ``kind`` (see :data:`~gradsync.comm.collectives.WIRE_KINDS`).
    """
    wire = wire_bytes(kind, payload_bytes, world_size)
    obj.collectives += collectives
    obj.payload_bytes += int(payload_bytes)
    obj.wire_bytes += wire
    return wire


def count_dense(obj: Any, nbytes: int, world_size: int) -> float:
    """Add the dense reference of ``nbytes`` gradient bytes (one bucket or fusion group in its own
    dtype, no padding) to ``obj``: ``dense_payload_bytes += nbytes`` and ``dense_wire_bytes +=``
    the ring all-reduce wire bytes of ``nbytes`` over ``world_size`` ranks. Returns the latter."""
    wire = wire_bytes("allreduce", nbytes, world_size)
    obj.dense_payload_bytes += int(nbytes)
    obj.dense_wire_bytes += wire
    return wire


#: The counters of a hook's ``stats()`` that add up when one run uses several hooks in turn (the ladder's rungs,
#: auto's candidates).
ADDITIVE_COUNTERS = ("wire_bytes", "payload_bytes", "collectives", "compress_seconds", "buckets_skipped")


def compression_ratio(dense_wire: float, wire: float) -> float:
    """``dense_wire / wire``: 1.0 when both are 0 (nothing sent, e.g. one rank), ``inf`` when only
    ``wire`` is 0 (every bucket was dropped)."""
    if wire:
        return dense_wire / wire
    return float("inf") if dense_wire else 1.0


def counter_stats(obj: Any) -> dict[str, Any]:
    """The common statistics of any algorithm object with the :func:`init_counters` counters, all
    cumulative over this rank's iterations:

    * ``iteration``: completed iterations;
    * ``wire_bytes``: bytes this rank put on the network (float; per collective kind as in
      :func:`gradsync.comm.collectives.wire_bytes`: ring all-reduce ``2 (P-1)/P n``, all-gather
      ``(P-1) m``, reduce-scatter ``(P-1)/P n``, point-to-point as sent);
    * ``dense_wire_bytes``: the wire bytes of a ring all-reduce of every uncompressed bucket;
    * ``payload_bytes`` / ``dense_payload_bytes``: bytes of the tensors handed to the collectives /
      of the uncompressed buckets (what the wire figures are computed from);
    * ``compression_ratio``: ``dense_wire_bytes / wire_bytes`` (see :func:`compression_ratio`), so
      an algorithm that moves as much traffic as dense all-reduce reports 1.0 whatever collectives
      it uses;
    * ``collectives``, ``buckets_skipped`` (no collective launched), ``compress_seconds`` (s).
    """
    return {
        "iteration": obj.iteration,
        "wire_bytes": obj.wire_bytes,
        "dense_wire_bytes": obj.dense_wire_bytes,
        "payload_bytes": obj.payload_bytes,
        "dense_payload_bytes": obj.dense_payload_bytes,
        "collectives": obj.collectives,
        "buckets_skipped": obj.buckets_skipped,
        "compress_seconds": obj.compress_seconds,
        "compression_ratio": compression_ratio(obj.dense_wire_bytes, obj.wire_bytes),
    }
