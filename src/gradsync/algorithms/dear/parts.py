"""DeAR's collaborators wired together (:class:`Parts`, built by :func:`build_parts`), and the work that
needs several of them: finishing the reduction, ending an iteration, registering the hooks.

Each collaborator is given only what it uses; what they share within an iteration is the
:class:`~gradsync.algorithms.dear.state.IterationState` and the
:class:`~gradsync.algorithms.dear.state.Counters`. :class:`~gradsync.algorithms.dear.DeAR` holds one
:class:`Parts` beside its :class:`~gradsync.algorithms.dear.communicator.Communicator` and tuner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..protocol import Algorithm
from .amp import LossScaling
from .backward import GradFilter, ReduceScatterStage
from .buffers import BufferSync
from .communicator import Communicator
from .forward import AllGatherStage
from .guard import OptimizerGuard
from .state import Counters, IterationState
from .timing import WaitTimers


@dataclass
class Parts:
    """The collaborators of one DeAR wrapper."""

    state: IterationState  # the fusion layout and the iteration's cursors (shared)
    counters: Counters  # this rank's cumulative counters (shared)
    timers: WaitTimers  # times blocks into the counters
    guard: OptimizerGuard  # the user's optimizer: guarded, stepped one group at a time
    amp: LossScaling  # the GradScaler: unscaling, inf/nan check
    rs: ReduceScatterStage  # gradient hooks, reduce-scatters, grad_filter
    ag: AllGatherStage  # all-gathers, the update applied in the next forward
    buffers: BufferSync  # rank 0's module buffers for the training forwards

    def finish_reduce(self) -> None:
        """Apply the leftovers of the previous update, then launch the missing reduce-scatters, wait
        for all and average the shards (idempotent within an iteration). Collective."""
        if self.state.reduced:
            return
        self.ag.flush()
        self.rs.finish()

    def end_iteration(self, optimizer: torch.optim.Optimizer, filter_state: Algorithm) -> None:
        """``step()`` once the GradScaler is known: finish the reduction, end the scaler's iteration,
        then either start the update's all-gathers or, when the scaler skips the step (inf/nan on
        some rank), roll ``filter_state`` back and drop this iteration's gradients; the next forward's
        buffers are broadcast in between. Collective."""
        self.finish_reduce()
        skip = self.amp.end_iteration(optimizer)
        self.state.reduced = False
        self.counters.iteration += 1
        if skip:
            self.counters.steps_skipped += 1
            filter_state.rollback()  # a skipped step changes no filter state (residuals)
            self.guard.drop_placeholders()
            self.rs.discard()
        else:
            # the update is applied later, but it is this iteration's optimizer step for a scheduler
            self.guard.mark_stepped()
        # the next forward's buffer broadcast, every iteration (never decided by local state), while
        # the link is idle (every reduce-scatter is done); the buffers are written at that forward
        self.buffers.stage_next_forward()
        if not skip:
            self.ag.start(optimizer.param_groups)  # the hyper-parameters as they are now
        self.timers.poll()

    def register_hooks(self, model: nn.Module, modules: list[tuple[nn.Module, list[nn.Parameter]]]) -> list[Any]:
        """Register the hooks on ``model`` and on ``modules`` (``[(module, its synchronised
        parameters)]``) and guard the optimizer; returns the hook handles."""
        handles = [model.register_forward_pre_hook(self.buffers.root_pre_hook, prepend=True)]
        for m in model.modules():  # loading buffers (e.g. a checkpoint) makes step()'s broadcast stale
            handles.append(m.register_load_state_dict_pre_hook(self.buffers.drop_staged))
        for m, _ in modules:
            handles.append(m.register_forward_pre_hook(self.ag.module_pre_hook))
        for _, ps in modules:
            for p in ps:
                handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self.guard.install()
        return handles

    def _grad_hook(self, p: torch.Tensor) -> None:
        self.buffers.drop_staged()  # a backward started: later forwards keep their local buffers
        self.rs.grad_hook(p)


def build_parts(model: nn.Module, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                comm: Communicator, grad_filter: GradFilter | None, grad_scaler: torch.amp.GradScaler | None,
                broadcast_buffers: bool, rank: int, world_size: int) -> Parts:
    """The collaborators of a DeAR wrapper over ``params`` (its synchronised parameters, on one
    device), with no fusion group yet (:meth:`IterationState.set_layout` cuts them)."""
    device = params[0].device
    state, counters = IterationState(), Counters()
    timers = WaitTimers(counters, device)
    guard = OptimizerGuard(optimizer, params)
    amp = LossScaling(state, comm.rs_group, rank, world_size, device, grad_scaler, grad_filter is not None)
    return Parts(
        state=state, counters=counters, timers=timers, guard=guard, amp=amp,
        rs=ReduceScatterStage(state, comm, amp, grad_filter, counters, timers, world_size),
        ag=AllGatherStage(state, comm, guard, model, counters, timers, world_size),
        buffers=BufferSync(model, comm.rs_group, world_size, broadcast_buffers, timers),
    )
