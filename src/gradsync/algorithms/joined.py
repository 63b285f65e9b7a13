"""A one-bucket hook on DDP's many buckets: the iteration's buckets joined into one at its last bucket.

gradsync runs torch's PowerSGD hook on one DDP bucket (:mod:`gradsync.algorithms.powersgd`: its ``.then``
callbacks launch collectives, which Gloo orders differently on different ranks when several buckets are in
flight), which a job fixes when it builds DDP (``bucket_cap_mb``). A job whose DDP has many buckets (a
torchrun script, Lightning, the online ``auto``) reaches the same computation with :func:`joined_hook`:
every bucket but the last returns a pending future; the last runs the hook once on all of them
concatenated (:class:`JoinedBucket`, index 0, last, as DDP's single bucket), and its result is copied back
into each bucket's buffer before their futures complete. Nothing runs before the last bucket, as with
one bucket; the price is one copy of the gradients each way.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.buckets import gradient_offsets
from ..comm.futures import then
from .meter import ProxyBucket

__all__ = ["JoinedBucket", "joined_hook"]

Hook = Callable[[Any, Any], torch.futures.Future]


class JoinedBucket(ProxyBucket):
    """``buckets`` (DDP ``GradBucket``\\ s or :class:`~gradsync.algorithms.meter.ProxyBucket`\\ s of one
    backward, in DDP's order) as the one bucket DDP gives a single-bucket hook: their buffers concatenated
    (``buffer()``: ``[sum of numels]``, their dtype and device, a copy), index 0, last, their gradients'
    views and parameters in order."""

    def __init__(self, buckets: Sequence[Any]):  # noqa: D107  (no super(): nothing to copy from)
        self._buffer = torch.cat([b.buffer() for b in buckets])
        self._index, self._last, self._grads, at = 0, True, [], 0
        for b in buckets:
            self._grads += [self._buffer[at + o:at + o + g.numel()].view(g.shape) for o, g in gradient_offsets(b)]
            at += b.buffer().numel()
        self._params = [p for b in buckets for p in b.parameters()]


def joined_hook(hook: Hook) -> Hook:
    """``hook`` (a DDP communication hook written for one bucket) on any bucket layout: the module
    docstring. The returned hook keeps the buckets of the iteration in progress; every rank sees the same
    buckets in the same order (DDP's rebuilt layout), so every rank runs ``hook`` once per iteration alike.

    Errors: an exception of ``hook``'s future is set on every held bucket's future too (DDP raises it).
    """
    held: list[tuple[Any, torch.futures.Future]] = []

    def run(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not bucket.is_last():
            pending: torch.futures.Future = torch.futures.Future()
            held.append((bucket, pending))
            return pending
        if not held:
            return hook(state, bucket)
        buckets = [b for b, _ in held] + [bucket]
        pending = [p for _, p in held]
        held.clear()

        def scatter(fut: torch.futures.Future) -> torch.Tensor:
            try:
                out = fut.value()
            except Exception as error:
                for p in pending:
                    p.set_exception(error)
                raise
            out = out[0] if isinstance(out, list) else out
            at = 0
            for b in buckets:
                buf = b.buffer()
                buf.copy_(out[at:at + buf.numel()])
                at += buf.numel()
            for b, p in zip(buckets, pending):
                p.set_result(b.buffer())
            return bucket.buffer()

        return then(hook(state, JoinedBucket(buckets)), scatter)

    return run
