"""COVAP's DDP communication hook: per bucket, record the layout (start-up iterations), select this
iteration's shard through :class:`~gradsync.algorithms.covap.CovapFilter`, all-reduce it and
scatter it back (one launch path, :func:`_send`, for the recorded and the remapped layouts).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...comm.collectives import dense_allreduce
from ...comm.futures import completed, then
from ...feedback.residual import _is_named
from .filter import narrow
from .state import CovapState

log = logging.getLogger(__name__)


def _timed_dense(state: CovapState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Dense all-reduce of ``bucket`` (a start-up iteration), timed when the state keeps a timer."""
    buf = bucket.buffer()
    timer = state.timer
    ident = timer.launched(buf.numel()) if timer is not None else None
    fut = dense_allreduce(buf, state.process_group, state.count_collective)
    state.end_bucket(bucket)
    if ident is None:
        return fut

    def done(f: torch.futures.Future) -> torch.Tensor:
        timer.completed(ident)
        return f.value()

    return then(fut, done)


def covap_hook(state: CovapState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook applying COVAP to one bucket.

    ``bucket.buffer()`` is the local flat gradient, ``[numel]`` of the parameters' floating dtype
    (float32, bfloat16 or float16) on their device; the returned future holds the averaged gradient
    of the same shape, dtype and device with unsent positions zero. The shard is sent in the
    bucket's dtype (as DDP's own reduction does), or with ``state.cast`` in float16/bfloat16
    (divided by the world size in float32 before the cast, then summed in that dtype); residuals are
    kept in float32. A compressed iteration is decided finite or not on every rank together
    (:class:`~gradsync.feedback.finite.FiniteGuard`): its last bucket's all-reduce carries one more
    element (or, when that bucket sends nothing, a 1-element all-reduce is issued for it), and a
    non-finite result restores the residuals and returns NaN in the last bucket, so GradScaler skips
    the step on every rank. Bytes counted: the contiguous shard handed to ``all_reduce``
    (``numel / c_b`` elements, one more in the last bucket) or nothing for a dropped bucket (4 bytes
    when it is the last). With ``state.adapter``, the first call of an iteration may
    all-reduce the timing window and change K (:meth:`CovapState.step_boundary`); from
    ``state.dense_from`` on, K is 1 (:meth:`CovapState.enter_dense_tail`).

    Raises:
        RuntimeError: if the bucket layout differs from the one recorded during warm-up (other than
            right after a restore, before DDP's bucket rebuild).
    """
    buf = bucket.buffer()
    index = bucket.index()
    t = state.iteration
    world = state.world_size
    layout = state.layout_of(bucket)
    timer = state.timer
    if timer is not None:
        state.step_boundary(buf)
        timer.bucket_ready(buf.numel(), buf.device)
    if state.dense_from and t >= state.dense_from:
        state.enter_dense_tail()
    if t < state.start_iter:
        if state._layout_iter != t:  # keep only this iteration's layout (DDP may
            state.layouts.clear()                      # rebuild into fewer buckets)
            state._layout_iter = t
        state.layouts[index] = layout
        if bucket.is_last() and t == state.start_iter - 1:  # the layout compression will run on
            state.check_buckets(buf.element_size())
        return _timed_dense(state, bucket)

    if state.layouts.get(index) != layout:
        if not state._awaiting_rebuild:
            raise RuntimeError(f"COVAP bucket {index} holds {buf.numel()} elements in a layout that differs "
                               f"from the one recorded during warm-up; the bucket layout changed")
        state.filter.plan_for(state.recorded_numels())
        state.filter.residuals_to(buf.device)
        recorded = state.filter.memory.index()
        if state.param_names is not None and _is_named(layout) and all(name in recorded for name, _ in layout):
            return _remapped_bucket(state, bucket, layout)
        log.warning("COVAP: DDP has not rebuilt its buckets since the state was restored and the state has no "
                    "parameter names (pass model=); bucket %d is all-reduced densely this iteration", index)
        state.finite_guard.begin(t, state._snapshot)
        return _decide(state, bucket, _timed_dense(state, bucket))
    if bucket.is_last():
        state._awaiting_rebuild = False

    state.filter.plan_for(state.recorded_numels())
    guard = state.finite_guard
    guard.begin(t, state._snapshot)
    with state.compression_timer():
        selected = state.filter.split(index, buf, t, t - state.start_iter, send_dtype=state.send_dtype(buf),
                                      world=world)
        guard.check(state.filter.memory.residuals[index], *selected[2:] if selected else ())
    if selected is None:
        return _send(state, bucket, None, None)
    shard, c, values = selected
    return _send(state, bucket, values, (shard, c))


def _send(state: CovapState, bucket: dist.GradBucket, send: Optional[torch.Tensor],
          where: Any) -> torch.futures.Future:
    """All-reduce ``send`` (this rank's selected values, already divided by the world size; ``None``:
    the bucket sends nothing) and scatter the sum into the zeroed bucket at ``where`` (``(shard, c)``
    for ``buf[shard::c]``, or an index tensor). The iteration's last bucket carries the
    :class:`~gradsync.feedback.finite.FiniteGuard` element (or all-reduces it alone when it sends
    nothing) and its future completes after the iteration's decision."""
    buf = bucket.buffer()
    guard = state.finite_guard
    last = bucket.is_last()
    if send is None:
        buf.zero_()
        state.buckets_skipped += 1
        state.end_bucket(bucket)
        return _decide(state, bucket, completed(buf))
    if last:
        send = torch.cat([send, guard.local_element(send.dtype, send.device)])
    state.count_collective(send)
    state.end_bucket(bucket)
    timer = state.timer
    # gradient elements only: the CCR's scale (dense / sent), which the FiniteGuard element is not part of
    ident = timer.launched(send.numel() - int(last)) if timer is not None else None
    work = dist.all_reduce(send, group=state.process_group, async_op=True)

    def scatter_back(f: torch.futures.Future) -> torch.Tensor:
        if ident is not None:
            timer.completed(ident)
        received = f.value()[0]
        if last:
            guard.agree(received[-1:])
            received = received[:-1]
        buf.zero_()
        if isinstance(where, tuple):
            buf[where[0]::where[1]] = received
        else:
            buf[where] = received.to(buf.dtype)
        return buf

    return _decide(state, bucket, then(work.get_future(), scatter_back), carried=True)


def _decide(state: CovapState, bucket: dist.GradBucket, fut: torch.futures.Future,
            carried: bool = False) -> torch.futures.Future:
    """Track a compressed iteration's bucket future; at the last bucket return the future that
    completes after the iteration's finite decision (a verdict all-reduce is issued here when the
    last bucket's own collective did not carry it)."""
    verdict = None
    if bucket.is_last() and not carried:
        verdict = state.finite_guard.launch_verdict(state.process_group, bucket.buffer().device,
                                                    state.count_collective)
    return state.guarded(bucket, fut, verdict)


def _remapped_bucket(state: CovapState, bucket: dist.GradBucket, layout: Any) -> torch.futures.Future:
    """COVAP on a bucket whose layout is not the recorded one (a fresh DDP before its bucket rebuild):
    every parameter's residual is read from and written to its recorded bucket by name (the residual
    memory's :meth:`~gradsync.feedback.residual.ResidualMemory.read` / ``write``), so each element
    gets exactly the error feedback and the send decision it would have had there; the selected
    elements of all parameters of this bucket travel in one all-reduce."""
    buf = bucket.buffer()
    t = state.iteration
    plan = state.filter.plan
    memory = state.filter.memory
    lam = state.filter.discount(t - state.start_iter)
    where = memory.index()
    state.remapped_buckets += 1
    sends, positions, parts = [], [], []
    send_dtype = state.send_dtype(buf)
    world = state.world_size
    guard = state.finite_guard
    guard.begin(t, state._snapshot)
    with state.compression_timer():
        cur = 0
        for (name, n), e in zip(layout, memory.read(layout)):
            b, off, _ = where[name]
            x = buf[cur:cur + n].to(torch.float32, copy=True)
            if e is not None:
                x.add_(e, alpha=lam)
            shard = plan.selected_shard(b, t)
            if shard is not None:
                c = plan.shards[b]
                first = (shard - off) % c
                sent, x[first::c] = narrow(x[first::c], send_dtype, world)
                sends.append(sent)
                positions.append(torch.arange(cur + first, cur + n, c, device=buf.device))
            guard.check(x)
            parts.append(x)
            cur += n
        memory.write(layout, torch.cat(parts), guard.copy_on_write)
    if not sends:
        return _send(state, bucket, None, None)
    send = torch.cat(sends)
    guard.check(send)
    return _send(state, bucket, send, torch.cat(positions))
