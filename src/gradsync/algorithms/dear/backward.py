"""DeAR's backward stage: fill the fusion buffers, reduce-scatter them, average the shards.

A post-accumulate-grad hook copies each gradient into its group's flat buffer and replaces ``p.grad``
by a placeholder (:mod:`~gradsync.algorithms.dear.guard`); when every parameter of a group is
ready its reduce-scatter is launched, in descending group order on every rank (Zhang et al., arXiv
2302.12445, Sec. 3: wait-free back-propagation). An optional ``grad_filter`` (e.g. dear-covap) sees
each group's flat gradient first and may drop it, replace it or ask for a :class:`StridedShard`.
:class:`ReduceScatterStage` is held by :class:`~gradsync.algorithms.dear.DeAR`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..base import count_bytes, count_dense
from .amp import LossScaling
from .communicator import Communicator
from .groups import FusionGroup
from .guard import DeARGradPlaceholder, is_placeholder
from .state import Counters, IterationState
from .timing import WaitTimers

#: ``grad_filter(flat, step, group) -> None | bool | Tensor | StridedShard``, DeAR's compression filter.
#: A ``grad_filter`` is called as ``grad_filter(flat, step, group)`` on each group before its reduce-
#: scatter, where ``flat`` is the group's flat gradient (1-D view of ``numel`` elements, the
#: parameters' dtype, parameter order; already multiplied by ``1 / scale`` when a ``grad_scaler`` is
#: known, and with non-finite values replaced by 0 - the step is then skipped on every rank), ``step``
#: the iteration (:attr:`iteration`) and ``group`` the group index. It may modify ``flat`` in place and
#: return ``None``/``True``, return a tensor of the same shape to send instead, or return ``False`` to
#: send nothing for this group this iteration (the group then gets a zero averaged gradient; the
#: decision must be identical on every rank), or return a :class:`StridedShard` to communicate only
#: ``flat[start::stride]`` (the size must be identical on every rank). Its run time is added to
#: ``compress_seconds``. A filter that is an :class:`~gradsync.algorithms.protocol.Algorithm` (e.g.
#: ``CovapGradFilter``) has its ``state_dict()`` saved and restored with DeAR's and its ``rollback()``
#: called on a skipped step; a plain callable has no state.
GradFilter = Callable[[torch.Tensor, int, int], Any]


@dataclass(frozen=True)
class StridedShard:
    """A ``grad_filter`` result asking DeAR to reduce-scatter / all-gather only the elements
    ``flat[start::stride]`` of a group, whose values to send are ``values`` (1-D,
    ``len(range(start, numel, stride))`` elements, the group's dtype or a narrower floating dtype
    such as float16 to communicate in). The other positions get a zero averaged gradient. Only this
    compact tensor (plus the used flags and padding, in ``values``' dtype) is communicated.
    ``averaged``: ``values`` are already divided by the world size (a narrow wire dtype whose sum
    must not overflow, as torch's ``fp16_compress_hook`` divides first); the used flags are then
    divided too and the reduced sum is not divided again."""

    start: int
    stride: int
    values: torch.Tensor
    averaged: bool = False


class ReduceScatterStage:
    """Gradient hooks, reduce-scatter launches and their completion for a DeAR wrapper.

    Args:
        state: the shared :class:`~gradsync.algorithms.dear.state.IterationState`; this stage writes
            ``next_launch``, ``reduced`` and the groups' backward state.
        comm: the :class:`~gradsync.algorithms.dear.communicator.Communicator` (``reduce_scatter_async``).
        amp: the :class:`~gradsync.algorithms.dear.amp.LossScaling` that unscales each group before its
            ``grad_filter`` and reduce-scatter.
        grad_filter: the optional :data:`GradFilter`.
        counters: the :class:`~gradsync.algorithms.dear.state.Counters` (bytes, collectives, skipped
            buckets; ``iteration`` is the filter's ``step``).
        timers: the :class:`~gradsync.algorithms.dear.timing.WaitTimers` (``compress_seconds``,
            ``rs_wait_seconds``).
        world_size: ``P``.
    """

    def __init__(self, state: IterationState, comm: Communicator, amp: LossScaling, grad_filter: GradFilter | None,
                 counters: Counters, timers: WaitTimers, world_size: int) -> None:
        self._state = state
        self._comm = comm
        self._amp = amp
        self._filter = grad_filter
        self._counters = counters
        self._timers = timers
        self._world_size = world_size
        self._no_sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the context only accumulate into ``p.grad`` (see :meth:`DeAR.no_sync
        <gradsync.algorithms.dear.DeAR.no_sync>`)."""
        old = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = old

    def grad_hook(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``p``: copy its gradient into its group's buffer,
        replace ``p.grad`` by a placeholder and launch the reduce-scatters that are ready.

        Raises:
            RuntimeError: on a second backward pass before ``step()``, or a sparse gradient.
        """
        if self._no_sync:
            return
        st = self._state
        k, slot = st.param_loc[id(p)]
        g = st.groups[k]
        if g.ready[slot] or g.launched or st.reduced:
            raise RuntimeError(
                "DeAR: a second backward pass before step(); accumulate gradients with DeAR.no_sync()"
            )
        if p.grad is None or is_placeholder(p.grad):
            return
        if p.grad.is_sparse:
            raise RuntimeError("DeAR does not support sparse gradients")
        off = g.offsets[slot]
        g.grad_buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
        g.grad_buf[g.numel + slot] = 1.0
        p.grad = DeARGradPlaceholder(p)  # the local gradient is consumed; misuse now raises
        g.ready[slot] = True
        g.n_ready += 1
        if g.n_ready == len(g.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        st = self._state
        while st.next_launch >= 0 and st.groups[st.next_launch].n_ready == len(st.groups[st.next_launch].params):
            self._launch(st.groups[st.next_launch])
            st.next_launch -= 1

    def _launch(self, g: FusionGroup) -> None:
        for slot, ok in enumerate(g.ready):  # params without a gradient on this rank send zeros
            if not ok:
                off = g.offsets[slot]
                g.grad_buf[off:off + g.params[slot].numel()].zero_()
                g.grad_buf[g.numel + slot] = 0.0
        g.launched = True
        g.all_used = all(g.ready)
        g.skipped = False
        g.unscaled = False
        g.sel = None
        count_dense(self._counters, g.nbytes, self._world_size)
        self._amp.unscale_group(g)
        if self._filter is not None:
            with self._timers.timed("compress_seconds"):
                self._run_filter(g)
            if g.skipped:
                self._counters.buckets_skipped += 1
                return
        src, dst = (g.c_in, g.c_shard) if g.sel is not None else (g.grad_buf, g.shard)
        g.rs_work = self._comm.reduce_scatter_async(dst, src)
        count_bytes(self._counters, src.numel() * src.element_size(), "reduce_scatter", self._world_size)

    def _run_filter(self, g: FusionGroup) -> None:
        """Call the ``grad_filter`` on ``g``'s flat gradient and apply its answer to ``g``."""
        flat = g.grad_buf[: g.numel]
        out = self._filter(flat, self._counters.iteration, g.index)
        if out is False:
            g.skipped = True
        elif isinstance(out, StridedShard):
            self._compact(g, out)
        elif isinstance(out, torch.Tensor):
            if out.shape != flat.shape:
                raise RuntimeError(f"grad_filter returned shape {tuple(out.shape)}, expected {tuple(flat.shape)}")
            flat.copy_(out)

    def _compact(self, g: FusionGroup, sel: StridedShard) -> None:
        """Pack ``sel.values`` and the used flags into compact buffers padded to a multiple of P."""
        m = len(range(sel.start, g.numel, sel.stride))
        if sel.values.shape != (m,):
            raise RuntimeError(f"StridedShard.values has shape {tuple(sel.values.shape)}, expected ({m},)")
        n_flags = len(g.params)
        if not sel.values.is_floating_point():
            raise RuntimeError(f"StridedShard.values must be floating point, got {sel.values.dtype}")
        P = self._world_size
        padded = -(-(m + n_flags) // P) * P
        wire, dev = sel.values.dtype, g.grad_buf.device
        g.c_in = torch.zeros(padded, dtype=wire, device=dev)
        g.c_in[:m] = sel.values
        g.c_in[m:m + n_flags] = g.grad_buf[g.numel:g.numel + n_flags]
        if sel.averaged:
            g.c_in[m:m + n_flags].div_(P)
        g.c_shard = torch.zeros(padded // P, dtype=wire, device=dev)
        g.c_out = torch.zeros(padded, dtype=wire, device=dev)
        g.sel = sel

    def finish(self) -> None:
        """Launch the missing reduce-scatters, wait for all, average the shards (idempotent).
        No update of the previous ``step()`` may be pending (its all-gathers read the shards)."""
        st = self._state
        if st.reduced:
            return
        while st.next_launch >= 0:  # finalisation: same order on every rank
            self._launch(st.groups[st.next_launch])
            st.next_launch -= 1
        with self._timers.timed("rs_wait_seconds"):
            for g in reversed(st.groups):
                if g.rs_work is not None:
                    g.rs_work.wait()
                    g.rs_work = None
        for g in st.groups:
            if g.skipped:
                g.gathered.zero_()
                g.gathered[g.numel: g.numel + len(g.params)] = 1.0
            elif g.sel is None:
                g.shard.div_(self._world_size)
            elif not g.sel.averaged:
                g.c_shard.div_(self._world_size)
            g.ready = [False] * len(g.params)
            g.n_ready = 0
            g.launched = False
        st.next_launch = len(st.groups) - 1
        st.reduced = True

    def discard(self) -> None:
        """On a skipped step: drop this iteration's compact buffers (nothing is all-gathered)."""
        for g in self._state.groups:
            g.sel = g.c_in = g.c_shard = g.c_out = None
