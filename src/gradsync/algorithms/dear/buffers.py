"""Module buffers (BatchNorm statistics) under DeAR: rank 0's values at each training forward.

As DDP's ``broadcast_buffers=True``, but with the one broadcast per iteration issued in ``step()``
(never at a forward, so forwards run on some ranks only cannot desynchronise them): the broadcast
values are staged and written into the buffers by the root module's forward-pre hook of the next
training forward (see "Module buffers" in :mod:`gradsync.algorithms.dear`). :class:`BufferSync` is
held by :class:`~gradsync.algorithms.dear.DeAR`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .timing import WaitTimers


class BufferSync:
    """Staging and broadcast of rank 0's module buffers for a DeAR wrapper's training forwards.

    Args:
        model: the wrapped module (its ``buffers()``).
        group: the process group of the per-iteration broadcast (DeAR's reduce-scatter group).
        world_size: ``P`` (nothing is broadcast on one rank).
        enabled: ``broadcast_buffers``: stage the broadcast values for the next training forward.
        timers: adds the broadcast time to its counter ``buffer_seconds``.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, world_size: int, enabled: bool,
                 timers: WaitTimers) -> None:
        self._model = model
        self._group = group
        self._world_size = world_size
        self._enabled = enabled
        self._timers = timers
        # rank 0's buffers for the training forwards until the next backward: [(buffers, flat copy)]
        self._staged: list[tuple[list[torch.Tensor], torch.Tensor]] | None = None

    def root_pre_hook(self, module: nn.Module, args: Any) -> None:
        """Forward-pre hook of the root module: a training forward starts from the staged buffers."""
        # no collective here: the buffers were broadcast in step() (or when the wrapper was built)
        if self._staged is not None and torch.is_grad_enabled() and module.training:
            unflatten_into(self._staged)

    def drop_staged(self, *_: Any) -> None:
        """Forget the staged buffers (a backward started, or buffers were loaded): later forwards keep
        their local buffers. Takes and ignores a hook's arguments."""
        self._staged = None

    def stage(self, staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Keep ``staged`` (rank 0's buffers, :func:`flatten`'s format) for the training forwards
        until the next backward (with ``enabled``, on more than one rank)."""
        if self._enabled and self._world_size > 1 and staged:
            self._staged = staged

    def stage_next_forward(self) -> None:
        """At ``step()`` (with ``enabled``, on more than one rank): broadcast rank 0's buffers and
        stage them for the next training forward. Collective."""
        if self._enabled and self._world_size > 1:
            self.stage(self._broadcast())

    def sync(self) -> None:
        """Write rank 0's current buffers into every rank's model now and stage them. Collective."""
        if self._world_size > 1:
            staged = self._broadcast()
            unflatten_into(staged)
            self.stage(staged)

    def _broadcast(self) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Rank 0's buffers, broadcast on the group (the model's buffers are not written)."""
        buffers = list(self._model.buffers())
        if not buffers:
            return []
        with self._timers.timed("buffer_seconds"):
            return broadcast_flat(buffers, self._group)


def broadcast_into(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Synchronous broadcast of ``tensors`` from the group's rank 0, in place."""
    unflatten_into(broadcast_flat(tensors, group))


def broadcast_flat(tensors: list[torch.Tensor],
                   group: dist.ProcessGroup | None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Coalesced synchronous broadcast from the group's rank 0, one flat tensor per dtype and
    device: ``[(tensors, rank 0's values flattened)]``; ``tensors`` are not written."""
    out = flatten(tensors)
    for _, flat in out:
        dist.broadcast(flat, group=group, group_src=0)
    return out


def flatten(tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``[(tensors of one dtype and device, their values concatenated into a new 1-D tensor)]``."""
    by_dtype: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        return [(ts, torch.cat([t.detach().reshape(-1) for t in ts])) for ts in by_dtype.values()]


def unflatten_into(staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    """Copy each flat tensor of :func:`broadcast_flat`'s (or :func:`flatten`'s) result back into its tensors."""
    with torch.no_grad():
        for ts, flat in staged:
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

