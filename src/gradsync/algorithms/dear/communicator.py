"""DeAR's communicator: the reduce-scatter and all-gather process groups and how each collective runs.

Two new groups with the ranks of the data-parallel group, so reduce-scatters (backward) and
all-gathers (next forward) can run concurrently (Zhang et al., arXiv 2302.12445, Sec. 3). The
reduce-scatter is ``"native"`` (``dist.reduce_scatter_tensor``) or ``"ring"`` (a bandwidth-optimal
point-to-point ring, :func:`gradsync.comm.ring.ring_reduce_scatter_tensor`, run on one worker thread
in launch order: Gloo's ``reduce_scatter_tensor`` costs a whole all-reduce). ``max_allgathers`` is
how many all-gathers the pipeline keeps in flight during the next forward.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...comm.collectives import all_gather_flat, reduce_scatter_flat
from ...comm.ring import ring_reduce_scatter_tensor

REDUCE_SCATTER_CHOICES = ("auto", "ring", "native")
#: ``max_allgathers`` value meaning "every group's all-gather at once"
ALL_ALLGATHERS = 1_000_000


class Communicator:
    """The two process groups of a DeAR wrapper and its collective launches.

    Building it is collective (``dist.new_group`` twice, on every rank of the default group).

    Args:
        process_group: the data-parallel group (``None`` = default group).
        timeout: timeout of the two new groups (``None``: the timeout of ``process_group``).
        reduce_scatter: ``"auto"``, ``"ring"`` or ``"native"`` (already validated); ``"auto"`` is
            ``"ring"`` when the reduce-scatter group's backend is Gloo, else ``"native"``.
        max_allgathers: >= 1 (already validated) or ``"auto"``: every group's all-gather at once
            (:data:`ALL_ALLGATHERS`) on Gloo, else 1 (DeAR's choice).

    Attributes:
        rs_group, ag_group: the reduce-scatter and all-gather groups.
        reduce_scatter: ``"ring"`` or ``"native"``.
        max_allgathers: all-gathers kept in flight.
    """

    def __init__(self, process_group: dist.ProcessGroup | None, timeout: timedelta | None,
                 reduce_scatter: str, max_allgathers: int | str):
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        if timeout is None:
            timeout = group_timeout(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.rs_group = dist.new_group(ranks, timeout=timeout)
        self.ag_group = dist.new_group(ranks, timeout=timeout)
        if reduce_scatter == "auto":
            reduce_scatter = "ring" if dist.get_backend(self.rs_group) == "gloo" else "native"
        self.reduce_scatter = reduce_scatter
        if max_allgathers == "auto":
            max_allgathers = ALL_ALLGATHERS if dist.get_backend(self.ag_group) == "gloo" else 1
        self.max_allgathers = max_allgathers
        # ring reduce-scatters run here, one at a time, in launch (= bucket) order
        self._ring_worker: concurrent.futures.ThreadPoolExecutor | None = None

    def reduce_scatter_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start the sum reduce-scatter of flat ``src`` into ``dst`` (``src.numel() / P`` elements);
        returns a work object with ``.wait()``."""
        if self.reduce_scatter == "ring" and self.world_size > 1:
            if self._ring_worker is None:
                self._ring_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dear-ring")
            return _FutureWork(self._ring_worker.submit(ring_reduce_scatter_tensor, dst, src, self.rs_group))
        return reduce_scatter_flat(dst, src, group=self.rs_group, async_op=True)

    def all_gather_async(self, out: torch.Tensor, src: torch.Tensor) -> Any:
        """Start the all-gather of every rank's ``src`` into flat ``out``; returns its work object."""
        return all_gather_flat(out, src, group=self.ag_group, async_op=True)

    def close(self) -> None:
        """Stop the ring worker thread (the groups stay; :meth:`destroy` releases them)."""
        if self._ring_worker is not None:
            self._ring_worker.shutdown(wait=True)
            self._ring_worker = None

    def destroy(self) -> None:
        """:meth:`close`, then destroy both process groups (collective)."""
        self.close()
        for g in (self.rs_group, self.ag_group):
            dist.destroy_process_group(g)


class _FutureWork:
    """``.wait()`` for a reduce-scatter running on DeAR's ring worker thread (re-raises its error)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True



def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group``'s CPU backend, or ``None`` (torch's default) if unknown."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None
