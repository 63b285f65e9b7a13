"""Trace-driven simulator of one data-parallel training iteration with wait-free back-propagation.

A :class:`~gradsync.sim.profile.Profile` records, for one model on one worker, the forward, backward
and optimizer compute times and, for every DDP gradient bucket (in DDP reduction order), its size and
the time after the start of backward at which it becomes ready. An
:class:`~gradsync.sim.plans.AlgorithmPlan` says, per bucket, which collectives an algorithm launches
(kind and bytes) and what compression overhead it adds. :func:`simulate` replays the profile on an
alpha-beta network (:mod:`gradsync.sim.costmodel`):

* Wait-free back-propagation (WFBP; Zhang et al., "Poseidon", USENIX ATC 2017; PyTorch DDP, Li et al.,
  VLDB 2020, Sec. 3.2.3): the collective(s) of bucket ``i`` start at
  ``max(ready_i, end of the previous collective)``; one collective at a time, FIFO in bucket order.
  A collective of phase ``"next_hook"`` is launched by bucket ``i+1``'s hook (the last bucket's
  by its own), which first waits for bucket ``i``'s collectives: backward stalls for that wait and
  every later ready time moves by the stall.
* Iteration time ``= max(forward_end + backward_s + stalls, end of last backward-phase collective)
  + optimizer_s + compression overhead + the "after_step" collectives`` (run back to back after the
  optimizer step, overlapping nothing, or only the compute of the next ``overlap_steps`` iterations: the
  periodic algorithms' syncs,
  :class:`~gradsync.sim.plans.PeriodicPlan`). ``forward_end = forward_s`` unless the plan has
  forward-phase collectives (DeAR's all-gathers, see :class:`~gradsync.sim.plans.DeARPlan`).
* Compute-only time ``= forward_s + backward_s + optimizer_s``; exposed communication
  ``= iteration - compute - compression overhead``; scaling efficiency ``= compute-only / iteration``.

Compression overhead is added serially (never overlapped): an upper bound for hooks that compress on
the autograd thread. Plans whose bucket selection changes from step to step (COVAP) are simulated over
their whole period and averaged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gradsync.comm.collectives import wire_bytes
from gradsync.sim.costmodel import Network, collective_time
from gradsync.sim.plans import AlgorithmPlan, BucketPlan, make_plan
from gradsync.sim.profile import Profile, load_profile
from gradsync.validation import check_float, check_int

__all__ = ["Result", "simulate", "sweep"]


@dataclass(frozen=True)
class Result:
    """Simulated iteration, averaged over the plan's period. Times in seconds, bytes per rank.

    ``exposed_comm_s = iteration_s - compute_s - compression_s`` (communication not hidden under
    compute); ``scaling_efficiency = compute_s / iteration_s``; ``comm_s`` is the total time the
    network is busy; ``payload_bytes`` the bytes of the collectives' input buffers per rank and
    ``wire_bytes`` the bytes each rank sends under the ring algorithms.
    """

    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    scaling_efficiency: float
    compression_s: float = 0.0
    comm_s: float = 0.0
    payload_bytes: float = 0.0
    wire_bytes: float = 0.0


def _wire_bytes(kind: str, nbytes: float, p: int) -> float:
    """Wire bytes of a plan step through the one formula the algorithms count with
    (:func:`gradsync.comm.collectives.wire_bytes`); a plan's ``"allgather"`` gives the full gathered
    vector (this rank contributes 1/P of it), ``"sparse_allgather"`` this rank's payload."""
    if kind == "allgather":
        return wire_bytes("allgather", nbytes / p, p)
    if kind == "sparse_allgather":
        return wire_bytes("allgather", nbytes, p)
    return wire_bytes(kind, nbytes, p)  # allreduce, reduce_scatter


def _overlapped_end(start: float, cost: float, compute_end: float, eta: float) -> float:
    """End time of a collective of ``cost`` seconds starting at ``start`` when it progresses at rate
    ``eta`` (0 < eta <= 1) while compute runs (until ``compute_end``) and at full rate after."""
    if start >= compute_end or eta >= 1.0:
        return start + cost
    capacity = (compute_end - start) * eta
    if cost <= capacity:
        return start + cost / eta
    return compute_end + (cost - capacity)


def _simulate_step(profile: Profile, plans: list[BucketPlan], p: int, net: Network,
                   eta: float = 1.0) -> tuple:
    n = len(profile.buckets)
    if len(plans) != n:
        raise ValueError(f"plan gave {len(plans)} bucket plans for {n} buckets")
    total_numel = profile.total_numel
    comm_free = 0.0
    comm_busy = 0.0
    payload = wire = 0.0
    # forward phase: collectives needed by the next forward, FIFO in forward (reverse bucket) order
    fwd_t = 0.0
    has_fwd = any(s.phase == "forward" for bp in plans for s in bp.steps)
    if has_fwd:
        for i in reversed(range(n)):
            for s in plans[i].steps:
                if s.phase == "forward":
                    cost = collective_time(s.kind, s.nbytes, p, net)
                    comm_free += cost
                    comm_busy += cost
            fwd_t = max(fwd_t, comm_free) + profile.forward_s * profile.buckets[i].numel / total_numel
    else:
        fwd_t = profile.forward_s
    forward_end = fwd_t
    # backward phase: wait-free back-propagation, FIFO in bucket order; a hook that waits for the
    # previous bucket's collectives before launching its "next_hook" steps stalls backward
    stall = 0.0
    waiting: tuple[float, list] | None = None  # (end of the awaited collectives, steps to launch)

    def launch(steps: list, at: float) -> None:
        nonlocal comm_free, comm_busy
        for s in steps:
            cost = collective_time(s.kind, s.nbytes, p, net)
            comm_free = _overlapped_end(max(comm_free, at), cost, forward_end + profile.backward_s + stall, eta)
            comm_busy += cost

    def hook_waits(at: float) -> float:
        nonlocal stall, waiting
        if waiting is None:
            return at
        awaited, steps = waiting
        waiting = None
        stall += max(0.0, awaited - at)
        at = max(at, awaited)
        launch(steps, at)
        return at

    for b, bp in zip(profile.buckets, plans):
        hook = hook_waits(forward_end + b.ready_s + stall)
        launch([s for s in bp.steps if s.phase == "backward"], hook)
        later = [s for s in bp.steps if s.phase == "next_hook"]
        if later:
            waiting = (comm_free, later)
    if waiting is not None:  # the last bucket's hook launches its own
        hook_waits(forward_end + profile.buckets[-1].ready_s + stall)
    for bp in plans:
        for s in bp.steps:
            payload += s.nbytes
            wire += _wire_bytes(s.kind, s.nbytes, p)
    overhead = sum(bp.overhead_s for bp in plans)
    iteration = max(forward_end + profile.backward_s + stall, comm_free) + profile.optimizer_s + overhead
    for bp in plans:  # after the optimizer step, back to back; hidden only by later iterations' compute
        for s in bp.steps:
            if s.phase == "after_step":
                cost = collective_time(s.kind, s.nbytes, p, net)
                iteration += max(0.0, cost - eta * s.overlap_steps * profile.compute_s)
                comm_busy += cost
    return iteration, overhead, comm_busy, payload, wire


def simulate(profile: Profile | Mapping[str, Any] | str, plan: AlgorithmPlan | str,
             world_size: int, network: Network, overlap_efficiency: float = 1.0) -> Result:
    """Predict one training iteration of ``profile`` under ``plan`` on ``world_size`` ranks.

    See the module docstring for the timeline model (wait-free back-propagation, FIFO collectives,
    alpha-beta costs). ``profile`` may be anything :func:`load_profile` takes; ``plan`` a plan or a
    :func:`make_plan` spec. ``world_size = 1`` has no communication. ``overlap_efficiency`` (0, 1]
    is the rate at which a collective progresses while backward compute runs (1 = communication is
    free to overlap; below 1 when compute and communication share saturated CPUs, as with Gloo on
    a few cores); after backward it runs at full rate.

    Raises:
        ValueError: for a bad profile, plan spec, ``world_size < 1``, a non-Network ``network`` or
            ``overlap_efficiency`` outside (0, 1].
    """
    profile = load_profile(profile)
    if isinstance(plan, str):
        plan = make_plan(plan)
    if not isinstance(plan, AlgorithmPlan):
        raise ValueError(f"plan must be an AlgorithmPlan or a spec string, got {type(plan).__name__}")
    p = check_int("world_size", world_size, 1)
    if not isinstance(network, Network):
        raise ValueError(f"network must be a gradsync.sim.Network, got {type(network).__name__}")
    period = check_int("plan.period", plan.period, 1)
    eta = check_float("overlap_efficiency", overlap_efficiency, 0.0, 1.0, low_inclusive=False)
    acc = np.zeros(5)
    for step in range(period):
        acc += _simulate_step(profile, plan.bucket_plans(profile, p, step), p, network, eta)
    iteration, overhead, comm_busy, payload, wire = (acc / period).tolist()
    compute = profile.compute_s
    exposed = max(0.0, iteration - compute - overhead)
    eff = compute / iteration if iteration > 0 else 1.0
    return Result(iteration, compute, exposed, eff, overhead, comm_busy, payload, wire)


def sweep(
    profile: Profile | Mapping[str, Any] | str,
    plans: Sequence[AlgorithmPlan | str],
    world_sizes: Sequence[int],
    bandwidths_gbps: Sequence[float],
    latency_s: float = 0.0,
    overlap_efficiency: float = 1.0,
) -> list[dict[str, Any]]:
    """Simulate every (plan, world size, bandwidth) combination; one dict per row.

    Row keys: ``algorithm, world_size, bandwidth_gbps, latency_s, iteration_s, compute_s,
    exposed_comm_s, compression_s, scaling_efficiency, payload_bytes, wire_bytes, comm_s, speedup``
    (see :class:`Result`) where ``speedup`` is
    the first plan's iteration time divided by this row's (same world size and bandwidth).

    Raises:
        ValueError: for empty lists or bad values (see :func:`simulate`, :class:`Network`).
    """
    profile = load_profile(profile)
    if not plans or not world_sizes or not bandwidths_gbps:
        raise ValueError("plans, world_sizes and bandwidths_gbps must be non-empty")
    built = [make_plan(p) if isinstance(p, str) else p for p in plans]
    rows = []
    for bw in bandwidths_gbps:
        net = Network(bw, latency_s)
        for ws in world_sizes:
            base = None
            for plan in built:
                r = simulate(profile, plan, ws, net, overlap_efficiency)
                if base is None:
                    base = r.iteration_s
                rows.append({
                    "algorithm": plan.name, "world_size": int(ws),
                    "bandwidth_gbps": net.bandwidth_gbps, "latency_s": net.latency_s,
                    "iteration_s": r.iteration_s, "compute_s": r.compute_s,
                    "exposed_comm_s": r.exposed_comm_s, "compression_s": r.compression_s,
                    "scaling_efficiency": r.scaling_efficiency, "payload_bytes": r.payload_bytes,
                    "wire_bytes": r.wire_bytes, "comm_s": r.comm_s,
                    "speedup": base / r.iteration_s if r.iteration_s > 0 else 1.0,
                })
    return rows
