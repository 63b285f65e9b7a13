"""Plain collectives shared by every algorithm: dense all-reduce of a flat gradient, and flat-tensor
all-gather and reduce-scatter under the name each torch version prefers.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases (>= 2.2) have only the former.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_flat(output [P*n], input [n], group=None, async_op=False)``."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_flat(output [n], input [P*n], op=SUM, group=None, async_op=False)``."""


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
    all-reduce SUM, as DDP's built-in reduction does. ``counter(x)`` records the bytes handed over.
    Returns a future of ``x``."""
    x.div_(dist.get_world_size(group))
    if counter is not None:
        counter(x)
    return dist.all_reduce(x, group=group, async_op=True).get_future().then(lambda _: x)
