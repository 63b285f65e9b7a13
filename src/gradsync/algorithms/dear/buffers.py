"""Module buffers (BatchNorm statistics) under DeAR: rank 0's values at each training forward.

As DDP's ``broadcast_buffers=True``, but with the one broadcast per iteration issued in ``step()``
(never at a forward, so forwards run on some ranks only cannot desynchronise them): the broadcast
values are staged and written into the buffers by the root module's forward-pre hook of the next
training forward (see "Module buffers" in :mod:`gradsync.algorithms.dear`). :class:`BufferSync` is a
base of :class:`~gradsync.algorithms.dear.DeAR`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class BufferSync:
    """Staging and broadcast of module buffers of a DeAR wrapper.

    Uses the host's ``model``, ``broadcast_buffers``, ``world_size``, ``rs_group``,
    ``_mid_iteration()`` and ``_timed()``; owns ``_staged_buffers``.
    """

    model: nn.Module
    _staged_buffers: list[tuple[list[torch.Tensor], torch.Tensor]] | None

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        # no collective here: the buffers were broadcast in step() (or when the wrapper was built)
        if self._staged_buffers is not None and torch.is_grad_enabled() and module.training:
            unflatten_into(self._staged_buffers)

    def _drop_staged_buffers(self, *_: Any) -> None:
        self._staged_buffers = None

    def _stage_buffers(self, staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Keep ``staged`` (rank 0's buffers) for the training forwards until the next backward."""
        if self.broadcast_buffers and self.world_size > 1 and staged:
            self._staged_buffers = staged

    def _broadcast_buffers(self, group: dist.ProcessGroup | None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Rank 0's buffers, broadcast on ``group`` (the model's buffers are not written)."""
        buffers = list(self.model.buffers())
        if not buffers:
            return []
        with self._timed("buffer_seconds"):
            return self._broadcast_flat(buffers, group)

    def _broadcast(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        """Synchronous broadcast of ``tensors`` from the group's rank 0, in place."""
        unflatten_into(self._broadcast_flat(tensors, group))

    @staticmethod
    def _broadcast_flat(tensors: list[torch.Tensor],
                        group: dist.ProcessGroup | None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Coalesced synchronous broadcast from the group's rank 0, one flat tensor per dtype and
        device: ``[(tensors, rank 0's values flattened)]``; ``tensors`` are not written."""
        out = flatten(tensors)
        for _, flat in out:
            dist.broadcast(flat, group=group, group_src=0)
        return out

    def sync_buffers(self) -> None:
        """Give every rank rank 0's current module buffers now, and make them the ones the next
        training forward starts from (see "Module buffers" in the module docstring).

        Call it on every rank, between iterations (after ``step()``), after forwards that changed the
        buffers since ``step()`` and whose changes should be kept, e.g. a BatchNorm recalibration pass
        under ``no_grad``. One coalesced broadcast per buffer dtype; nothing on one rank.

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if self._mid_iteration():
            raise RuntimeError("sync_buffers must be called between iterations (after step())")
        if self.world_size > 1:
            staged = self._broadcast_buffers(self.rs_group)
            unflatten_into(staged)
            self._stage_buffers(staged)


def flatten(tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``[(tensors of one dtype and device, their values concatenated into a new 1-D tensor)]``."""
    by_dtype: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        return [(ts, torch.cat([t.detach().reshape(-1) for t in ts])) for ts in by_dtype.values()]


def unflatten_into(staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    """Copy each flat tensor of :meth:`BufferSync._broadcast_flat`'s result back into its tensors."""
    with torch.no_grad():
        for ts, flat in staged:
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

