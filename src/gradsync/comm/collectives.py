"""Plain collectives shared by every algorithm: dense all-reduce of a flat gradient, flat-tensor
all-gather and reduce-scatter under the name each torch version prefers, and :func:`wire_bytes`, the
one place where the bytes a collective puts on the network are computed.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases (>= 2.2) have only the former.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .futures import then

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_flat(output [P*n], input [n], group=None, async_op=False)``."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_flat(output [n], input [P*n], op=SUM, group=None, async_op=False)``."""


#: Collective kinds :func:`wire_bytes` understands.
WIRE_KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "p2p")


def wire_bytes(kind: str, payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends on the network for one collective of ``kind`` over ``world_size`` ranks.

    Bandwidth terms of the ring algorithms (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 2009; Thakur, Rabenseifner & Gropp, "Optimization
    of collective communication operations in MPICH", IJHPCA 2005), which is what NCCL's ring and
    Gloo's ring / bcube all-reduce send per rank for large messages. Every rank of the group gets the
    same figure, so counters stay identical across ranks. With ``P = world_size``:

    * ``"allreduce"``: ``payload_bytes`` = n, the tensor reduced (same on every rank);
      returns ``2 (P-1)/P * n`` (P-1 reduce-scatter and P-1 all-gather steps of n/P bytes).
    * ``"reduce_scatter"``: ``payload_bytes`` = n, the full input vector; returns ``(P-1)/P * n``.
    * ``"allgather"``: ``payload_bytes`` = m, this rank's contribution (its input; the padded size
      when contributions are padded to the largest); returns ``(P-1) * m`` (a ring all-gather
      forwards every other rank's block once). An all-gather of shards ``m = n/P`` thus sends
      ``(P-1)/P * n``, the same as a reduce-scatter of n.
    * ``"broadcast"``: ``payload_bytes`` = n; returns ``(P-1)/P * n``. Convention: any broadcast
      tree or pipelined ring (Gloo, NCCL) makes P-1 copies of n in total, one per receiving rank;
      the total ``(P-1) * n`` is attributed equally to the P ranks (the root of a binomial tree sends
      more, a leaf nothing), so the figure is the same on every rank.
    * ``"p2p"``: ``payload_bytes`` = what this rank actually sent point-to-point (e.g. the hops of
      :mod:`gradsync.comm.ring`, headers included); returned unchanged.

    With ``world_size == 1`` every collective returns 0.0 (nothing leaves the process).

    Args:
        kind: one of :data:`WIRE_KINDS`.
        payload_bytes: bytes, >= 0 (int or float).
        world_size: ranks in the group the collective runs on, >= 1.

    Returns:
        float, bytes.

    Raises:
        ValueError: for an unknown ``kind``, ``payload_bytes < 0`` or ``world_size < 1``.
    """
    if kind not in WIRE_KINDS:
        raise ValueError(f"kind must be one of {', '.join(WIRE_KINDS)}; got {kind!r}")
    if not payload_bytes >= 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size}")
    p = int(world_size)
    n = float(payload_bytes)
    if kind == "p2p":
        return n
    if p == 1:
        return 0.0
    if kind == "allreduce":
        return 2.0 * (p - 1) * n / p
    if kind == "allgather":
        return (p - 1) * n
    return (p - 1) * n / p  # reduce_scatter, broadcast


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend takes for collectives that describe no data of
    their own (configuration digests, timings, statistics).

    ``torch.device("cpu")`` for a Gloo (or MPI) group and for a group with several backends one of
    which serves the CPU (``"cpu:gloo,cuda:nccl"``); for an accelerator-only group (NCCL, XCCL, ...)
    the accelerator this process uses (``torch.cuda.current_device()`` for NCCL), since NCCL accepts
    CUDA tensors only. Tensors that describe data (a gradient bucket, a payload) should instead
    live on that data's device.

    Raises:
        ValueError: if no process group is initialised (from ``torch.distributed``).
    """
    kinds = _device_types(group)
    if not kinds or "cpu" in kinds:
        return torch.device("cpu")
    kind = kinds[0]
    module = getattr(torch, kind, None)
    if module is not None and hasattr(module, "current_device"):
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def max_over_ranks(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Collective: each of ``values`` (float64 on :func:`collective_device`) replaced by its MAX over
    the ranks of ``group``, in one all-reduce: figures every rank must decide from alike (times,
    spreads, errors)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _device_types(group: dist.ProcessGroup | None) -> list[str]:
    """Device types ``group`` supports ("cpu", "cuda", ...), from the group or its backend name."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    kinds = getattr(pg, "_device_types", None)
    if kinds is not None:
        return [d.type for d in kinds]
    backend = str(dist.get_backend(group)).lower()  # older torch: infer from the backend name
    return ["cpu"] if "gloo" in backend or "mpi" in backend else ["cuda"]


def dense_allreduce(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                    counter: Callable[..., None] | None = None) -> torch.futures.Future:
    """Average ``x`` (any shape and floating dtype) over ranks in place: ``x /= P``, then one
    all-reduce SUM, as DDP's built-in reduction does. ``counter(x, kind="allreduce")`` records the
    bytes (e.g. ``HookState.count_collective``). Returns a future of ``x``."""
    x.div_(dist.get_world_size(group))
    if counter is not None:
        counter(x, kind="allreduce")
    return then(dist.all_reduce(x, group=group, async_op=True).get_future(), lambda _: x)
