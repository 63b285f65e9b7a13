"""Communicators for compressed payloads over ``torch.distributed`` (GRACE's ``Allreduce`` and
``Allgather`` communicators; Xu et al., ICDCS 2021).

* :func:`allreduce_payload`: every payload tensor has the same shape on every rank and is linear; each
  is divided by the world size and summed with one all-reduce per tensor.
* :func:`allgather_payload`: payloads differ in size between ranks. Gloo cannot all-gather uneven
  sizes, so the element counts are all-gathered first (one int64 all-gather), then every rank packs
  its payload tensors into one byte vector padded to the largest rank's byte count and one
  ``all_gather_into_tensor`` moves them all.
* :func:`communicate`: picks one of the two from ``compressor.aggregation`` and returns a future of the
  averaged dense tensor ``(1/P) * sum_r decompress(payload_r)``.

All collectives are *issued* in the calling thread, in call order (safe to call from a DDP comm hook
body, never from a ``Future.then`` callback: Gloo runs callbacks on its own threads in an order that differs
between ranks). The returned futures' callbacks
only unpack and decompress locally.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from gradsync.comm.collectives import all_gather_flat, collective_device
from gradsync.comm.futures import completed, then
from gradsync.compressors.base import Compressor, Ctx, Payload

Counter = Callable[..., None]


def allreduce_payload(
    payload: Payload, group: dist.ProcessGroup | None = None, counter: Counter | None = None
) -> torch.futures.Future:
    """Average equal-shaped linear payload tensors over ranks.

    Args:
        payload: tuple of floating tensors, same shapes and dtypes on every rank (not modified).
        group: process group (``None`` = default).
        counter: called as ``counter(tensor, kind=...)`` for every tensor handed to a collective,
            with the collective kind of :func:`gradsync.comm.collectives.wire_bytes`
            (``"allreduce"`` here; ``"allgather"`` in :func:`allgather_payload`, with this rank's
            padded contribution), e.g. ``HookState.count_collective``, which records payload and
            wire bytes.

    Returns:
        Future of a list of tensors: ``sum_r payload_r[i] / P`` for each i (dtypes kept; the division
        happens before the sum, in the payload's dtype, like torch's ``fp16_compress_hook``).
    """
    world = dist.get_world_size(group)
    tensors = [t.div(world) for t in payload]
    futs = []
    for t in tensors:
        if counter is not None:
            counter(t, kind="allreduce")
        futs.append(dist.all_reduce(t, group=group, async_op=True).get_future())
    if not futs:
        return completed([])
    return then(torch.futures.collect_all(futs), lambda _: tensors)


def allgather_payload(
    payload: Payload,
    group: dist.ProcessGroup | None = None,
    counter: Counter | None = None,
    fixed_size: bool = False,
) -> torch.futures.Future:
    """All-gather payloads whose tensor sizes differ between ranks (padded to the maximum).

    Every rank must pass the same number of tensors with the same dtypes (sizes may differ), all on
    one device (the payload's; the sizes and the packed bytes travel on it, so NCCL gets CUDA
    tensors for a CUDA payload).
    Two collectives: a blocking all-gather of the sizes (int64 ``[P * m]`` for m tensors), then an
    asynchronous ``all_gather_into_tensor`` of the packed bytes (uint8 ``[P * max_bytes]``).
    With ``fixed_size=True`` (the caller guarantees equal sizes on every rank, e.g. top-k) the
    sizes all-gather is skipped.

    Returns:
        Future of a list (one entry per rank, in rank order) of payload tuples, unpadded.
    """
    world = dist.get_world_size(group)
    device = payload[0].device if payload else collective_device(group)
    dtypes = [t.dtype for t in payload]
    itemsizes = [t.element_size() for t in payload]
    numels = [t.numel() for t in payload]
    if fixed_size:
        all_sizes = [numels] * world
    else:
        sizes = torch.tensor(numels, dtype=torch.int64, device=device)
        gathered = torch.empty(world * len(payload), dtype=torch.int64, device=device)
        if counter is not None:
            counter(sizes, kind="allgather")
        all_gather_flat(gathered, sizes, group=group)
        flat = gathered.tolist()  # the sizes are needed on the host (one device sync)
        all_sizes = [flat[r * len(payload) : (r + 1) * len(payload)] for r in range(world)]
    nbytes = [[n * size for n, size in zip(row, itemsizes)] for row in all_sizes]
    max_bytes = max(sum(row) for row in nbytes) if len(payload) else 0

    def unpack(out: torch.Tensor) -> list[Payload]:
        result = []
        for r in range(world):
            chunk = out[r * max_bytes : (r + 1) * max_bytes]
            off = 0
            tensors = []
            for j, dt in enumerate(dtypes):
                nb = nbytes[r][j]
                tensors.append(chunk[off : off + nb].clone().view(dt))
                off += nb
            result.append(tuple(tensors))
        return result

    if max_bytes == 0:
        return completed(unpack(torch.empty(0, dtype=torch.uint8, device=device)))
    local = torch.zeros(max_bytes, dtype=torch.uint8, device=device)
    off = 0
    for t in payload:
        b = t.detach().contiguous().view(-1).view(torch.uint8)
        local[off : off + b.numel()] = b
        off += b.numel()
    out = torch.empty(world * max_bytes, dtype=torch.uint8, device=device)
    if counter is not None:
        counter(local, kind="allgather")  # padded contribution: (P-1) * max_bytes on the wire
    work = all_gather_flat(out, local, group=group, async_op=True)
    return then(work.get_future(), lambda _: unpack(out))


def communicate(
    compressor: Compressor,
    payload: Payload,
    ctx: Ctx,
    group: dist.ProcessGroup | None = None,
    counter: Counter | None = None,
    timer: Callable[[], ContextManager] | None = None,
) -> torch.futures.Future:
    """Send ``payload`` with the communicator ``compressor.aggregation`` asks for and aggregate.

    Args:
        compressor: the compressor that produced ``payload`` (its ``aggregation`` picks the pattern).
        payload, ctx: output of ``compressor.compress``; ``ctx`` must be rank-independent.
        group: process group (``None`` = default).
        counter: byte counter, see :func:`allreduce_payload`.
        timer: context-manager factory wrapped around the local decompression/aggregation (e.g.
            ``HookState.compression_timer``).

    Returns:
        Future of the averaged dense tensor, 1-D float32 with ``ctx.numel`` elements.

    Raises:
        ValueError: if ``compressor.aggregation`` is neither ``"allreduce"`` nor ``"allgather"``.
    """
    timer = timer or contextlib.nullcontext
    world = dist.get_world_size(group)
    if compressor.aggregation == "allreduce":

        def finish_reduce(fut: torch.futures.Future) -> torch.Tensor:
            with timer():
                return compressor.decompress(tuple(fut.value()), ctx)

        return then(allreduce_payload(payload, group, counter), finish_reduce)
    if compressor.aggregation == "allgather":

        def finish_gather(fut: torch.futures.Future) -> torch.Tensor:
            with timer():
                return compressor.aggregate(fut.value(), ctx).div_(world)

        return then(allgather_payload(payload, group, counter, compressor.fixed_size), finish_gather)
    raise ValueError(f"compressor aggregation must be allreduce or allgather, got {compressor.aggregation!r}")


__all__: Sequence[str] = ["allgather_payload", "allreduce_payload", "communicate"]
