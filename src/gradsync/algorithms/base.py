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


class HookState:
    """Base state: process group, iteration counter and byte/time counters.

    Args:
        process_group: group the collectives run on (``None`` = default group).

    Attributes:
        iteration: number of completed backward passes seen by the hook (advanced when the bucket with
            ``bucket.is_last()`` is processed), identical on every rank.
        bytes_sent: total bytes of the tensors handed to collectives by this rank (int).
        collectives: number of collectives launched.
        buckets_skipped: number of buckets for which no collective was launched.
        compress_seconds: wall-clock seconds spent in compression/decompression code on this rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        self.process_group = process_group
        init_counters(self)

    # -- helpers for hooks ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def count_collective(self, *tensors: torch.Tensor) -> None:
        """Record the bytes of ``tensors`` handed to one collective."""
        self.collectives += 1
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def end_bucket(self, bucket: Any) -> None:
        """Account the dense size of ``bucket`` and advance ``iteration`` after the last bucket."""
        self.end_bucket_of(bucket.buffer(), bucket.is_last())

    def end_bucket_of(self, buf: torch.Tensor, is_last: bool) -> None:
        """:meth:`end_bucket` for a bucket given by its flat buffer and ``is_last()`` flag."""
        self.dense_bytes += buf.numel() * buf.element_size()
        if is_last:
            self.iteration += 1

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

    # -- controller calls (see gradsync.algorithms.synchroniser) ----------------------------------
    #: True when the algorithm chooses a setting from the measured CCR (then :meth:`calibrate` is called).
    needs_ccr = False

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Receive the all-reduced CCR (identical on every rank); return what was chosen from it."""
        return {}

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """Receive the finished step's wall-clock ``seconds`` and this rank's ``samples``; return
        per-step figures worth logging (none by default)."""
        return {}

    # -- reporting and checkpoints ------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative counters: ``bytes_sent`` and ``dense_bytes`` (bytes), ``collectives``,
        ``buckets_skipped``, ``compress_seconds`` (s), ``iteration``, and ``compression_ratio``
        (dense bytes / bytes sent, 1.0 before anything was sent)."""
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
    obj.bytes_sent = 0
    obj.dense_bytes = 0
    obj.collectives = 0
    obj.buckets_skipped = 0
    obj.compress_seconds = 0.0


def counter_stats(obj: Any) -> dict[str, Any]:
    """The common statistics of any algorithm object with the ``HookState`` counters
    (``iteration``, ``bytes_sent``, ``dense_bytes``, ``collectives``, ``buckets_skipped``,
    ``compress_seconds``), plus ``compression_ratio`` = dense bytes / bytes sent (1.0 before anything
    was sent)."""
    return {
        "iteration": obj.iteration,
        "bytes_sent": obj.bytes_sent,
        "dense_bytes": obj.dense_bytes,
        "collectives": obj.collectives,
        "buckets_skipped": obj.buckets_skipped,
        "compress_seconds": obj.compress_seconds,
        "compression_ratio": (obj.dense_bytes / obj.bytes_sent) if obj.bytes_sent else 1.0,
    }
