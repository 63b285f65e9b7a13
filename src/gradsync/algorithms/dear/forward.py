"""DeAR's forward stage: all-gather the averaged shards and apply the update group by group.

``step()`` starts the all-gathers; a forward-pre hook on each module of group ``k`` waits for the
all-gathers of every group up to ``k`` not applied yet, launches the next ones (``max_allgathers``
in flight) and applies the update of the group: the averaged gradient becomes ``p.grad``, the user's
optimizer runs on that group's parameters only with the hyper-parameters it had at ``step()``, and
``p.grad`` is cleared (Zhang et al., arXiv 2302.12445, Sec. 3: all-gather pipelined with the next
feed-forward). :class:`AllGatherStage` is held by :class:`~gradsync.algorithms.dear.DeAR`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..base import count_bytes
from .communicator import Communicator
from .groups import FusionGroup
from .guard import OptimizerGuard, is_placeholder
from .state import Counters, IterationState
from .timing import WaitTimers


class AllGatherStage:
    """All-gather launches and lazy optimizer application of a DeAR wrapper.

    Args:
        state: the shared :class:`~gradsync.algorithms.dear.state.IterationState`; this stage writes
            ``pending``, ``next_apply``, ``next_ag``, ``ag_inflight`` and the groups' ``ag_work``.
        comm: the :class:`~gradsync.algorithms.dear.communicator.Communicator` (``all_gather_async``,
            ``max_allgathers``).
        guard: the :class:`~gradsync.algorithms.dear.guard.OptimizerGuard` that steps the optimizer
            on one group's parameters.
        model: the wrapped module (its ``training`` flag decides whether a forward applies updates).
        counters: the :class:`~gradsync.algorithms.dear.state.Counters` (bytes, collectives).
        timers: the :class:`~gradsync.algorithms.dear.timing.WaitTimers` (``ag_wait_seconds``).
        world_size: ``P``.
    """

    def __init__(self, state: IterationState, comm: Communicator, guard: OptimizerGuard, model: nn.Module,
                 counters: Counters, timers: WaitTimers, world_size: int) -> None:
        self._state = state
        self._comm = comm
        self._guard = guard
        self._model = model
        self._counters = counters
        self._timers = timers
        self._world_size = world_size
        self._hparams: list[dict[str, Any]] = []

    def start(self, param_groups: list[dict[str, Any]]) -> None:
        """At ``step()``, once the shards are averaged: remember the optimizer's hyper-parameters
        (``param_groups`` as they are now, before any ``scheduler.step()``), mark the update pending
        and launch the first all-gathers."""
        self._hparams = [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in pg.items() if k != "params"}
            for pg in param_groups
        ]
        st = self._state
        st.pending = True
        st.next_apply = 0
        st.next_ag = 0
        self._launch_next()

    def _launch_next(self) -> None:
        """Launch all-gathers in group order until ``max_allgathers`` are in flight."""
        st = self._state
        while st.ag_inflight < self._comm.max_allgathers:
            while st.next_ag < len(st.groups) and st.groups[st.next_ag].skipped:
                st.next_ag += 1
            if st.next_ag >= len(st.groups):
                return
            g = st.groups[st.next_ag]
            out, src = (g.c_out, g.c_shard) if g.sel is not None else (g.gathered, g.shard)
            g.ag_work = self._comm.all_gather_async(out, src)
            # src is the shard
            count_bytes(self._counters, src.numel() * src.element_size(), "allgather", self._world_size)
            st.ag_inflight += 1
            st.next_ag += 1

    def apply_through(self, k: int) -> None:
        """Apply the pending update of every group up to index ``k`` (waits for their all-gathers)."""
        st = self._state
        if not st.pending:
            return
        while st.next_apply <= k:
            self._apply(st.groups[st.next_apply])
            st.next_apply += 1
        if st.next_apply >= len(st.groups):
            st.pending = False

    def flush(self) -> None:
        """Apply the whole pending update (nothing when none is pending)."""
        self.apply_through(len(self._state.groups) - 1)

    def _apply(self, g: FusionGroup) -> None:
        if g.ag_work is not None:
            with self._timers.timed("ag_wait_seconds"):
                g.ag_work.wait()
            g.ag_work = None
            self._state.ag_inflight -= 1
        self._launch_next()
        if g.sel is not None:  # expand the compact all-gather result; unsent positions are zero
            m, n_flags = len(range(g.sel.start, g.numel, g.sel.stride)), len(g.params)
            g.gathered.zero_()
            g.gathered[g.sel.start:g.numel:g.sel.stride] = g.c_out[:m]
            g.gathered[g.numel:g.numel + n_flags] = g.c_out[m:m + n_flags]
            g.sel = g.c_in = g.c_shard = g.c_out = None
        used = _used_flags(g)
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
            self._guard.step_groups(subset)
        for p, grad in zip(g.params, kept):
            p.grad = grad

    def module_pre_hook(self, module: nn.Module, args: Any) -> None:
        """Forward-pre hook of each module of a group: a training forward applies the pending update
        of every group up to the module's."""
        # the root's mode decides (a submodule in eval mode, e.g. frozen BatchNorm, is updated too)
        if self._state.pending and torch.is_grad_enabled() and self._model.training:
            self.apply_through(self._state.module_group[id(module)])


def _used_flags(g: FusionGroup) -> list[bool]:
    """Whether each parameter of ``g`` got a gradient on some rank. Read from the averaged used
    flags (a host sync on CUDA) only when a parameter got none on this rank: otherwise every
    flag is at least ``1 / P``."""
    if g.all_used or g.skipped:
        return [True] * len(g.params)
    return [f > 0 for f in g.gathered[g.numel: g.numel + len(g.params)].tolist()]
