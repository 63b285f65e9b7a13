"""OSCAR's part B through the coded ring (``mode="asc"``): :func:`reduce_coded` all-reduces the
quantised non-zero part with :func:`gradsync.comm.ring.ring_all_reduce_coded`, every hop entropy-coded by
the bucket's adaptive ASC models (:class:`gradsync.coding.asc.ASCRingCoder`), the ring's chunks cut so
their coded sizes balance (:func:`element_costs`). Source and reconstruction:
:mod:`gradsync.algorithms.oscar` (Majhi et al. 2026, reconstructed from the abstract: no paper text is
public).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from gradsync.comm.collectives import all_gather_flat
from gradsync.comm.ring import balanced_bounds, equal_bounds, ring_all_reduce_coded

if TYPE_CHECKING:  # gradsync.coding needs the 'oscar' extra; only mode='asc' imports it
    from gradsync.coding.asc import ASCRingCoder

__all__ = ["coders_from_state", "element_costs", "reduce_coded"]


def reduce_coded(state: Any, q: torch.Tensor, idx_b: torch.Tensor, agg: torch.Tensor, key: int, p: int,
                 L: int) -> None:
    """Sum ``q[idx_b]`` over the ranks through the coded ring into ``agg[idx_b]``.

    Args:
        state: the bucket's :class:`~gradsync.algorithms.oscar.splitting.OscarState` (its ASC models
            ``coders[key]``, previous aggregate, counters and balance statistics are updated).
        q: ``(n,)`` int32 quantised bucket (values in ``[-L, L]``).
        idx_b: int64 coordinates of part B (ascending).
        agg: ``(n,)`` int32 aggregate, written at ``idx_b``.
        key: the bucket's id.
        p: world size; L: quantisation levels per sign.

    Raises:
        ValueError: if ``p * L > 2**24`` (the ASC alphabet's limit).
    """
    pg = state.comm_group
    t0 = time.perf_counter()
    max_abs = p * L
    if max_abs > (1 << 24):
        raise ValueError(f"mode='asc' needs world_size * levels <= 2**24, got {max_abs}")
    coder = state.coders.get(key)
    if coder is None or coder.max_abs != max_abs or coder.world_size != p:
        from gradsync.coding.asc import ASCRingCoder

        coder = ASCRingCoder(p, max_abs, alpha=state.asc_alpha, decay=state.asc_decay)
        state.coders[key] = coder
    qb = q[idx_b].contiguous()
    if state.chunking == "balanced":
        prev = state.prev_agg.get(key)
        costs = element_costs(coder, prev[idx_b] if prev is not None else None, qb.numel())
        bounds = balanced_bounds(costs, p)
    else:
        bounds = equal_bounds(qb.numel(), p)
    state.compress_seconds += time.perf_counter() - t0
    qb, rs = ring_all_reduce_coded(qb, bounds, coder.encode, coder.decode, group=pg)
    t0 = time.perf_counter()
    coder.end_iteration(qb)
    agg[idx_b] = qb
    state.encode_seconds += rs.encode_seconds
    state.decode_seconds += rs.decode_seconds
    state.coded_hops += rs.hops
    state.coded_elements += sum(rs.rs_numel) + sum(rs.ag_numel)
    state.coded_bytes += rs.total_bytes
    state.compress_seconds += rs.encode_seconds + rs.decode_seconds
    state.count_payload(rs.total_bytes, "p2p")  # ring hops as sent, length headers included
    sent = [b for b in rs.rs_bytes]
    if sent:
        mean = sum(sent) / len(sent)
        state.ring_balance.append(max(sent) / mean if mean > 0 else 1.0)
    state.compress_seconds += time.perf_counter() - t0
    if state.global_balance and p > 1:
        mine = torch.tensor(rs.rs_bytes, dtype=torch.float64)
        allb = torch.zeros(p * mine.numel(), dtype=torch.float64)
        all_gather_flat(allb, mine, group=pg)
        state.count_collective(mine, kind="allgather")
        per_step = allb.view(p, -1)
        mean = per_step.mean(0)
        ok = mean > 0
        if bool(ok.any()):
            state.ring_balance_global.append(float((per_step.max(0).values[ok] / mean[ok]).mean()))


def element_costs(coder: "ASCRingCoder", prev_vals: torch.Tensor | None, m: int) -> torch.Tensor:
    """Estimated coded bits per element: ``-log2 p(prev aggregate value)`` under the shared
    all-gather model (identical on every rank); uniform before any history."""
    counts = torch.from_numpy(coder.ag_counts)
    if prev_vals is None or float(counts.sum()) == 0.0:
        return torch.ones(m, dtype=torch.float64)
    probs = (counts + coder.alpha) / (counts.sum() + coder.alpha * counts.numel())
    bits = -torch.log2(probs)
    return bits[prev_vals.to(torch.int64) + coder.max_abs]



def coders_from_state(coders: dict[Any, Any]) -> dict[int, "ASCRingCoder"]:
    """ASC coders rebuilt from their state dicts (only ``mode="asc"`` has any, so only it imports
    :mod:`gradsync.coding`)."""
    if not coders:
        return {}
    from gradsync.coding.asc import ASCRingCoder

    return {int(k): ASCRingCoder.from_state_dict(c) for k, c in coders.items()}
