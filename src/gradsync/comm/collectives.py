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


def dense_allreduce(x: torch.Tensor, group: dist.ProcessGroup | None = None,
                    counter: Callable[..., None] | None = None) -> torch.futures.Future:
    """Average ``x`` (any shape and floating dtype) over ranks in place: ``x /= P``, then one
    all-reduce SUM, as DDP's built-in reduction does. ``counter(x)`` records the bytes handed over.
    Returns a future of ``x``."""
    x.div_(dist.get_world_size(group))
    if counter is not None:
        counter(x)
    return dist.all_reduce(x, group=group, async_op=True).get_future().then(lambda _: x)
