"""Which rank holds the others back: per-rank figures gathered at the end of a run.

In a synchronous collective every rank finishes together, so per-rank collective times cannot show a
slow link: the fast ranks simply wait. Two measurements can:

* **compute** (forward + backward + optimizer step without communication, per rank): a rank whose
  compute is well above the median is a compute straggler (a slower or busier machine);
* **a link probe** (:func:`probe_links`): one hop at a time, rank ``r`` sends a fixed payload to rank
  ``(r + 1) % P`` while every other rank waits, so each hop's rate is that of the two hosts' links
  alone. A host with a slow link slows both hops it takes part in; with P >= 3 hosts a single slow
  link is the rank whose two hops are both slow (with P = 2 there is one pair and no telling which
  end is slow).

:func:`find_stragglers` names the rank in each case (all figures are identical on every rank).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import collective_device
from .compute import device_clock

#: A rank is named when its link rate is below this fraction of the median (or its compute time above
#: the inverse multiple of the median).
SLOW_FRACTION = 0.5


def probe_links(payload_bytes: int = 1 << 18, rounds: int = 2, group: dist.ProcessGroup | None = None,
                device: torch.device | None = None) -> list[float]:
    """Rates in bytes/s of the hops rank ``r`` -> rank ``(r + 1) % P``, ``r = 0 .. P-1``, each measured
    alone (a barrier before each hop; the best of ``rounds``). Collective: every rank calls it and
    gets the same list (empty for one rank). Costs ``rounds * P`` transfers of ``payload_bytes``.

    Raises:
        ValueError: if ``payload_bytes`` < 4 or ``rounds`` < 1.
    """
    if payload_bytes < 4 or rounds < 1:
        raise ValueError(f"payload_bytes must be >= 4 and rounds >= 1, got {payload_bytes} and {rounds}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return []
    device = device or collective_device(group)
    buf = torch.zeros(payload_bytes // 4, dtype=torch.float32, device=device)
    clock = device_clock(device)
    seconds = torch.full((world,), float("inf"), dtype=torch.float64, device="cpu")  # host timings
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    for _ in range(rounds):
        for r in range(world):
            dst = (r + 1) % world
            dist.barrier(group)
            if rank == r:
                dist.send(buf, ranks[dst], group=group)
            elif rank == dst:
                t0 = clock()
                dist.recv(buf, ranks[r], group=group)
                seconds[r] = min(float(seconds[r]), clock() - t0)
    seconds = torch.where(torch.isinf(seconds), torch.zeros_like(seconds), seconds)  # only receivers timed
    shared = seconds.to(device)
    dist.all_reduce(shared, group=group)  # each hop was timed by exactly one rank
    return [buf.numel() * 4 / s if s > 0 else float("inf") for s in shared.cpu().tolist()]


def find_stragglers(compute_s: list[float], iteration_s: list[float], hop_rates: list[float]) -> dict[str, Any]:
    """Per-rank figures and the straggler each reveals.

    Args:
        compute_s: compute-only seconds per step of each rank (index = rank).
        iteration_s: mean iteration seconds of each rank.
        hop_rates: :func:`probe_links` (bytes/s of hop ``r -> r+1``).

    Returns:
        ``{"per_rank": [{"rank", "compute_s", "iteration_s", "link_mbit"}...], "slow_link_rank": r or
        None, "slow_compute_rank": r or None, "note": str}``: ``link_mbit`` is the faster of the
        rank's two hops in Mbit/s (a fast host has at least one fast hop; ``None`` for P < 3); a rank is
        named when its link rate is below :data:`SLOW_FRACTION` of the median, or its compute above
        the median (with 2 ranks: the other's) divided by it.
    """
    world = len(compute_s)
    links: list[float | None] = [None] * world
    if world >= 3 and len(hop_rates) == world:
        links = [max(hop_rates[(i - 1) % world], hop_rates[i]) * 8 / 1e6 for i in range(world)]
    per_rank = [{"rank": i, "compute_s": compute_s[i], "iteration_s": iteration_s[i], "link_mbit": links[i]}
                for i in range(world)]
    out: dict[str, Any] = {"per_rank": per_rank, "slow_link_rank": None, "slow_compute_rank": None}
    notes = []
    if links[0] is not None:
        median = statistics.median(links)
        slow = min(range(world), key=lambda i: links[i])
        if links[slow] < SLOW_FRACTION * median:
            out["slow_link_rank"] = slow
            notes.append(f"rank {slow}'s link: {links[slow]:.1f} Mbit/s (median {median:.1f})")
    if world >= 2:
        reference = statistics.median(compute_s) if world >= 3 else min(compute_s)
        slow = max(range(world), key=lambda i: compute_s[i])
        if reference > 0 and compute_s[slow] * SLOW_FRACTION > reference:
            out["slow_compute_rank"] = slow
            notes.append(f"rank {slow}'s compute: {compute_s[slow] * 1e3:.1f} ms per step "
                         f"({'median' if world >= 3 else 'other rank'} {reference * 1e3:.1f})")
    if world == 2 and len(hop_rates) == 2:
        notes.append(f"link between ranks 0 and 1: {min(hop_rates) * 8 / 1e6:.1f} Mbit/s (2 ranks: no telling which end)")
    out["note"] = "; ".join(notes) if notes else "none"
    return out


def gather_stragglers(compute_s: float, iteration_s: float, group: dist.ProcessGroup | None = None,
                      device: torch.device | None = None) -> dict[str, Any]:
    """Gather this rank's ``compute_s`` and ``iteration_s``, probe the links, and return
    :func:`find_stragglers` (identical on every rank). Collective."""
    device = device or collective_device(group)
    world = dist.get_world_size(group)
    mine = torch.zeros(2 * world, dtype=torch.float64, device=device)
    rank = dist.get_rank(group)
    mine[2 * rank], mine[2 * rank + 1] = compute_s, iteration_s
    dist.all_reduce(mine, group=group)
    figures = mine.cpu().tolist()
    return find_stragglers(figures[0::2], figures[1::2], probe_links(group=group, device=device))
