"""DeAR's forward stage: all-gather the averaged shards and apply the update group by group.

``step()`` starts the all-gathers; a forward-pre hook on each module of group ``k`` waits for the
all-gathers of every group up to ``k`` not applied yet, launches the next ones (``max_allgathers``
in flight) and applies the update of the group: the averaged gradient becomes ``p.grad``, the user's
optimizer runs on that group's parameters only with the hyper-parameters it had at ``step()``, and
``p.grad`` is cleared (Zhang et al., arXiv 2302.12445, Sec. 3: all-gather pipelined with the next
feed-forward). :class:`AllGatherStage` is a base of :class:`~gradsync.algorithms.dear.DeAR`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import count_bytes
from .groups import FusionGroup
from .guard import is_placeholder


class AllGatherStage:
    """All-gather launches and lazy optimizer application of a DeAR wrapper.

    Uses the host's ``_groups``, ``_module_group``, ``_pending``, ``_next_apply``, ``_next_ag``,
    ``_ag_inflight``, ``_hparams``, ``optimizer``, ``_opt_step``, ``model``, ``world_size``,
    ``comm`` and its ``_timed()``.
    """

    def _launch_next_ag(self) -> None:
        """Launch all-gathers in group order until ``max_allgathers`` are in flight."""
        while self._ag_inflight < self.comm.max_allgathers:
            while self._next_ag < len(self._groups) and self._groups[self._next_ag].skipped:
                self._next_ag += 1
            if self._next_ag >= len(self._groups):
                return
            g = self._groups[self._next_ag]
            out, src = (g.c_out, g.c_shard) if g.sel is not None else (g.gathered, g.shard)
            g.ag_work = self.comm.all_gather_async(out, src)
            count_bytes(self, src.numel() * src.element_size(), "allgather", self.world_size)  # src: the shard
            self._ag_inflight += 1
            self._next_ag += 1

    def _apply_through(self, k: int) -> None:
        if not self._pending:
            return
        while self._next_apply <= k:
            self._apply(self._groups[self._next_apply])
            self._next_apply += 1
        if self._next_apply >= len(self._groups):
            self._pending = False

    def _apply(self, g: FusionGroup) -> None:
        if g.ag_work is not None:
            with self._timed("ag_wait_seconds"):
                g.ag_work.wait()
            g.ag_work = None
            self._ag_inflight -= 1
        self._launch_next_ag()
        if g.sel is not None:  # expand the compact all-gather result; unsent positions are zero
            m, n_flags = len(range(g.sel.start, g.numel, g.sel.stride)), len(g.params)
            g.gathered.zero_()
            g.gathered[g.sel.start:g.numel:g.sel.stride] = g.c_out[:m]
            g.gathered[g.numel:g.numel + n_flags] = g.c_out[m:m + n_flags]
            g.sel = g.c_in = g.c_shard = g.c_out = None
        used = self._used_flags(g)
        # local gradients accumulated meanwhile (no_sync micro-batches) survive the update
        kept = [None if is_placeholder(p.grad) else p.grad for p in g.params]
        with torch.no_grad():
            for slot, p in enumerate(g.params):
                if used[slot]:
                    off = g.offsets[slot]
                    p.grad = g.gathered[off:off + p.numel()].view_as(p)
                else:
                    p.grad = None  # unused on every rank: the optimizer skips it, as under DDP
        subset = []
        for ui, ps in g.opt_groups:
            live = [p for p in ps if p.grad is not None]
            if live:
                subset.append({**self._hparams[ui], "params": live})
        if subset:
            saved = self.optimizer.param_groups
            self.optimizer.param_groups = subset
            try:
                self._opt_step()
            finally:
                self.optimizer.param_groups = saved
        for p, grad in zip(g.params, kept):
            p.grad = grad

    @staticmethod
    def _used_flags(g: FusionGroup) -> list[bool]:
        """Whether each parameter of ``g`` got a gradient on some rank. Read from the averaged used
        flags (a host sync on CUDA) only when a parameter got none on this rank: otherwise every
        flag is at least ``1 / P``."""
        if g.all_used or g.skipped:
            return [True] * len(g.params)
        return [f > 0 for f in g.gathered[g.numel: g.numel + len(g.params)].tolist()]

    def _module_pre_hook(self, module: nn.Module, args: Any) -> None:
        # the root's mode decides (a submodule in eval mode, e.g. frozen BatchNorm, is updated too)
        if self._pending and torch.is_grad_enabled() and self.model.training:
            self._apply_through(self._module_group[id(module)])

