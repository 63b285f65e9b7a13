"""Communication-to-computation ratio (CCR): the time of a dense all-reduce of every bucket *without
overlap* divided by the backward compute time (Meng, Sun & Li 2023, arXiv 2311.04499, §3). Every rank
measures locally and the CCR is all-reduced with MAX, so every rank gets the same value; algorithms
that choose a setting from it (COVAP's K) receive it through ``Synchroniser.calibrate``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather_flat, collective_device, reduce_scatter_flat
from ..validation import check_float, check_int
from .compute import device_clock


@dataclass(frozen=True)
class CCRMeasurement:
    """Result of :func:`measure_ccr`: ``allreduce_s`` and ``backward_s`` (seconds, this rank) and
    ``ccr`` (all-reduced MAX over ranks)."""

    allreduce_s: float
    backward_s: float
    ccr: float


def time_dense_allreduce(
    numels: Sequence[int], group: dist.ProcessGroup | None = None, reps: int = 5,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
    budget_s: float | Callable[[float], float] | None = None,
) -> float:
    """Median seconds of blocking all-reduces of one ``dtype`` tensor per bucket, one after another
    (no overlap), after a one-element all-reduce that sets the connections up.

    Args:
        reps: timed repetitions (>= 1).
        budget_s: at most this many seconds (> 0) of timed repetitions, judged from the first one's
            time (MAX over the ranks, so every rank runs as many): ``reps`` is cut to
            ``budget_s / first`` but kept >= 1. A callable is given that first time (seconds) and
            returns the budget (it must return the same on every rank). None: ``reps``. On a slow
            network one dense all-reduce can take seconds.
        device: where the buckets live (the model's device); default
            :func:`~gradsync.comm.collectives.collective_device` of ``group`` (CUDA for NCCL, CPU for
            Gloo). On CUDA the device is synchronised before the clock is read.
        dtype: the buckets' dtype (the parameters' dtype: float32, or bfloat16/float16).
    """
    device = collective_device(group) if device is None else torch.device(device)
    tensors = [torch.zeros(int(n), dtype=dtype, device=device) for n in numels]

    def run() -> None:
        for t in tensors:
            dist.all_reduce(t, group=group)

    return _median_seconds(run, group, reps, device, budget_s)


def time_dense_rs_ag(numel: int, group: dist.ProcessGroup | None = None, reps: int = 3,
                     device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of a blocking reduce-scatter followed by an all-gather of ``numel`` ``dtype``
    elements (padded to a multiple of the world size): DeAR's pair, for calibrating the simulator.
    ``device`` as in :func:`time_dense_allreduce`."""
    world = dist.get_world_size(group)
    n = -(-int(numel) // world) * world
    device = collective_device(group) if device is None else torch.device(device)
    full = torch.zeros(n, dtype=dtype, device=device)
    shard = torch.zeros(n // world, dtype=dtype, device=device)

    def run() -> None:
        reduce_scatter_flat(shard, full, group=group)
        all_gather_flat(full, shard, group=group)

    return _median_seconds(run, group, reps, device)


def _median_seconds(run: Callable[[], None], group: dist.ProcessGroup | None, reps: int,
                    device: torch.device, budget_s: float | Callable[[float], float] | None = None) -> float:
    """Median wall-clock seconds of ``reps`` calls of ``run`` started together on every rank (a
    barrier before each), after a one-element all-reduce that sets the connections up (NCCL creates its
    communicators at the first collective). With ``budget_s`` the first call's time, MAX over the ranks,
    cuts ``reps`` to ``budget_s / first`` (at least 1, the first call included): on a slow network one
    dense all-reduce takes seconds, and an untimed full-size warm-up would cost as much again. On a CUDA
    ``device`` the device is synchronised before each clock read, since NCCL collectives return once
    enqueued."""
    reps = check_int("reps", reps, 1)
    if budget_s is not None and not callable(budget_s):
        check_float("budget_s", budget_s, 0.0, 1e6, low_inclusive=False)
    clock = device_clock(device)

    def timed() -> float:
        clock()
        dist.barrier(group=group)
        t0 = clock()
        run()
        return clock() - t0

    dist.all_reduce(torch.zeros(1, device=device), group=group)
    first = timed()
    if budget_s is not None:
        slowest = torch.tensor([first], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        slowest_s = max(float(slowest.item()), 1e-9)
        budget = budget_s(slowest_s) if callable(budget_s) else budget_s
        reps = max(1, min(reps, int(budget / slowest_s)))
    return statistics.median([first] + [timed() for _ in range(reps - 1)])


def measure_ccr(
    numels: Sequence[int], backward_s: float, group: dist.ProcessGroup | None = None, reps: int = 5,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
    budget_s: float | Callable[[float], float] | None = None,
) -> CCRMeasurement:
    """Collective: measure the dense all-reduce time of buckets ``numels`` (``dtype`` on ``device``,
    ``reps`` and ``budget_s`` as in :func:`time_dense_allreduce`) and return the CCR against
    ``backward_s`` (seconds), all-reduced with MAX so every rank gets the same value."""
    device = collective_device(group) if device is None else torch.device(device)
    allreduce_s = time_dense_allreduce(numels, group, reps, device, dtype, budget_s)
    ccr = torch.tensor([allreduce_s / max(backward_s, 1e-9)], dtype=torch.float64, device=device)
    dist.all_reduce(ccr, op=dist.ReduceOp.MAX, group=group)
    value = float(ccr.item())
    return CCRMeasurement(allreduce_s, backward_s, value)
