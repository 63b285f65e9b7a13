"""Ordered bucket worker: runs each DDP bucket's multi-collective reduction off the autograd thread.

The OSCAR and count-sketch reductions are several dependent collectives (scale all-reduce, sketch
all-reduce, ring steps). On Gloo they cannot be chained from ``Future.then`` callbacks: callbacks run
in different orders on different ranks when several buckets are in flight, and the collectives
mismatch or deadlock. Instead one worker thread per state runs the reductions in the order the hooks
were called, which DDP keeps identical on every rank, while backward goes on, on a process group
of their own (see :class:`OrderedBucketWorker`).
"""

from typing import Any, Callable

import torch
import torch.distributed as dist

from ...comm.futures import completed

__all__ = ["OrderedBucketWorker", "check_cpu", "dense_bucket", "reduce_bucket"]


def check_cpu(buf: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``buf`` is not a CPU tensor (the coders and sketches run on CPU)."""
    if buf.device.type != "cpu":
        raise ValueError(f"OSCAR/count-sketch hooks need CPU buckets (Gloo), got device {buf.device}")


class OrderedBucketWorker:
    """Mixin: runs each bucket's whole reduction on one background thread, in bucket order, on a
    private process group.

    One worker thread per state runs the submitted reductions in submission order; communication
    overlaps the rest of the backward pass. ``overlap = False`` (class or instance attribute) runs
    them in the hook body instead.

    **Private process group.** While the worker communicates, DDP's own thread issues collectives on
    the model's process group (with ``find_unused_parameters=True`` the all-reduce of the
    unused-parameter map, launched once the last bucket is marked ready). Two threads issuing
    collectives on one Gloo group interleave them differently on different ranks (the job aborts
    with ``gloo::EnforceNotMet ... Received data size doesn't match expected size``). So at the
    first overlapped hook call the state creates its own group over the same ranks with
    ``dist.new_group`` (a store rendezvous, no collective on the default group); DDP calls the
    first hook of the first backward on every rank at the same point, so every rank of the default
    group creates it in the same order relative to its other ``new_group`` calls. All collectives
    of the reduction run on :attr:`comm_group`. If ``process_group`` is a strict subgroup of the
    default group (``new_group`` would need the ranks outside it too) the reduction runs in the hook
    body instead, which is ordered with DDP's collectives by construction. The thread pool and
    the private group are not pickled; an unpickled state creates new ones.
    """

    overlap = True

    @property
    def comm_group(self) -> "dist.ProcessGroup | None":
        """Group the reduction's collectives run on: the private group once the worker created
        one, else ``process_group`` (``None`` = default group)."""
        group = self.__dict__.get("_worker_group")
        return self.process_group if group is None else group  # type: ignore[attr-defined]

    def _runs_in_background(self) -> bool:
        """Create the private group at the first call (collective over the default group's ranks);
        ``False`` if the reduction must run in the hook body."""
        if not self.overlap:
            return False
        if "_worker_group" in self.__dict__:
            return self.__dict__["_worker_group"] is not None
        pg = self.process_group  # type: ignore[attr-defined]
        if pg is None or dist.get_world_size(pg) == dist.get_world_size():
            ranks = None if pg is None else sorted(dist.get_process_group_ranks(pg))
            self._worker_group = dist.new_group(ranks=ranks, group_desc="gradsync-bucket-worker")
        else:
            self._worker_group = None
        return self._worker_group is not None

    def _submit(self, work: Callable[[], torch.Tensor]) -> torch.futures.Future:
        if not self._runs_in_background():
            return completed(work())
        pool = self.__dict__.get("_pool")
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-bucket")
        fut: torch.futures.Future = torch.futures.Future()

        def job() -> None:
            try:
                fut.set_result(work())
            except BaseException as exc:  # noqa: BLE001 - DDP re-raises it in backward
                fut.set_exception(exc)

        pool.submit(job)
        return fut

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()  # type: ignore[misc]
        d.pop("_pool", None)
        d.pop("_worker_group", None)
        return d


def dense_bucket(state: Any, buf: torch.Tensor) -> torch.Tensor:
    """Plain averaging all-reduce of ``buf`` in place (the warm-up before ``start_iter``); counted in
    ``payload_bytes`` and ``wire_bytes`` like every collective, and also in
    ``state.warmup_wire_bytes`` (so per-step figures can leave the warm-up out)."""
    dist.all_reduce(buf, group=state.comm_group)
    state.warmup_wire_bytes += state.count_collective(buf, kind="allreduce")[1]
    buf.div_(state.world_size)
    return buf


def reduce_bucket(state: Any, bucket: dist.GradBucket, after_last: Callable[[], None] | None = None
                  ) -> torch.futures.Future:
    """Dense all-reduce before ``start_iter``, then ``state.reduce`` of the flat bucket, in place,
    advancing the iteration counters; submitted to the state's bucket worker. A compressed iteration
    whose aggregated buckets are not all finite (identical on every rank: these reductions carry a
    local inf into every rank's result) restores ``state._snapshot()`` and returns NaN in its last
    bucket (:class:`~gradsync.feedback.finite.FiniteGuard`), so GradScaler skips it on every rank.

    Args:
        state: an :class:`OrderedBucketWorker` hook state with ``reduce(flat, key)``, ``start_iter``,
            ``iteration`` and ``compressed_iterations``.
        bucket: the DDP bucket.
        after_last: called after the last bucket of an iteration (on the worker).

    Returns:
        Future holding the bucket buffer (averaged gradient, same shape and dtype).

    Raises:
        ValueError: if the bucket is not on the CPU.
    """
    buf, index, is_last = bucket.buffer(), bucket.index(), bucket.is_last()
    check_cpu(buf)

    def work() -> torch.Tensor:
        if state.iteration < state.start_iter:
            dense_bucket(state, buf)
        else:
            guard = state.finite_guard
            guard.begin(state.iteration, state._snapshot)
            buf.copy_(state.reduce(buf.view(-1), index).view_as(buf))
            guard.agree(buf)  # the aggregated bucket, identical on every rank
            if is_last:
                state.compressed_iterations += 1
                guard.conclude(state._restore, buf)
        state.end_bucket_of(buf, is_last)
        if is_last and after_last is not None:
            after_last()
        return buf

    return state._submit(work)
