"""A restored hook state meets a fresh DDP: its first iteration runs in the recorded bucket layout.

DDP builds its buckets twice: its first iteration puts every gradient in one bucket (torch 2.13,
``find_unused_parameters=False``), then it rebuilds them in the order the gradients became ready, and
keeps those. A run resumed in fresh processes (``gradsync.wrap``, the integrations: anything that
loads the state into a DDP before its first iteration) therefore meets its restored per-bucket state
(residuals, PowerSGD's warm-start factors, sketches, the compressor's per-bucket selection) with one
bucket that holds every parameter, in another order, for one iteration. Compressing that bucket as it
is would not repeat the uninterrupted run (top-k over a different set, residuals of other buckets;
powersgd-overlap refused it).

The hook wrapper of every communication-hook algorithm (:func:`~gradsync.algorithms.protocol.settling_hook`,
given the model) therefore records each iteration's layout (``((parameter name, numel), ...)`` per
bucket, :func:`~gradsync.feedback.residual.bucket_layout`); the state's ``state_dict()`` carries it
under :data:`LAYOUT_KEY` and ``load_state_dict()`` takes it back. In the first iteration after a
load, a bucket that holds every recorded parameter in another layout is cut into the recorded buckets
(:class:`RecordedBucket`: each one's gradients gathered by name), the hook runs on each of them in
order, in this hook call, exactly as in the uninterrupted run, and the results are scattered back
into DDP's bucket when all of them completed (a copy in the future's callback, no collective there).
After that iteration DDP has rebuilt its buckets (in the same gradient-ready order), so the layouts
match and the hook sees DDP's own buckets again. Another mismatch is left to the algorithm (COVAP's
remapped buckets, the residual memory's re-bucketing by name).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm.buckets import gradient_offsets
from ..comm.futures import then
from ..feedback.residual import _is_named, bucket_layout

#: Key of the recorded layout in a hook state's ``state_dict()`` (a list of buckets, each a list of
#: ``[parameter name, numel]``), added and removed by :class:`~gradsync.algorithms.protocol.Algorithm`.
LAYOUT_KEY = "__gradsync_bucket_layout__"

_RECORDED = "_gradsync_bucket_layout"    # state attribute: the last complete iteration's layout
_RESTORED = "_gradsync_restored_layout"  # state attribute: the loaded layout, until the next iteration ends
_RECORDING = "_gradsync_recording"       # state attribute: this iteration's layouts so far, by bucket index


class RecordedBucket:
    """A ``GradBucket`` stand-in for recorded bucket ``index``: its own buffer, the gradients of
    ``params`` (in the recorded order) gathered from DDP's bucket; the methods the hooks use."""

    def __init__(self, index: int, is_last: bool, buffer: torch.Tensor, params: list[torch.Tensor]):
        self._index, self._last, self._buffer, self._params = index, is_last, buffer, params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Views of :meth:`buffer`, one per parameter, in its shape."""
        out, cur = [], 0
        for p in self._params:
            out.append(self._buffer[cur:cur + p.numel()].view(p.shape))
            cur += p.numel()
        return out


def saved_layout(state: Any) -> list[list[list[Any]]] | None:
    """The layout to save with ``state`` (a loaded one no iteration has replaced yet, else the last
    complete iteration's), as lists; ``None`` when the state has seen none."""
    layout = getattr(state, _RESTORED, None) or getattr(state, _RECORDED, None)
    return None if not layout else [[[name, int(n)] for name, n in bucket] for bucket in layout]


def restore_layout(state: Any, layout: Any) -> None:
    """Take a saved layout back (from :data:`LAYOUT_KEY`): the next iteration runs in it."""
    buckets = [tuple((str(name), int(n)) for name, n in bucket) for bucket in layout]
    setattr(state, _RESTORED, buckets)
    setattr(state, _RECORDED, buckets)


def call_in_recorded_layout(hook: Any, state: Any, bucket: Any, names: dict[int, str]) -> torch.futures.Future:
    """``hook(state, bucket)``, recording the bucket's layout; in the first iteration after a restore,
    a bucket that holds every recorded parameter in another layout runs as the recorded buckets."""
    layout = bucket_layout(bucket, names)
    if not _is_named(layout):
        return hook(state, bucket)
    index, last = bucket.index(), bucket.is_last()
    restored = getattr(state, _RESTORED, None)
    if restored is not None and last:
        setattr(state, _RESTORED, None)  # DDP rebuilds its buckets after its first iteration
    if (restored is not None and index == 0 and last and layout not in restored
            and sorted(layout) == sorted(item for b in restored for item in b)):
        setattr(state, _RECORDED, restored)
        return _as_recorded(hook, state, bucket, names, restored)
    recording = state.__dict__.setdefault(_RECORDING, {})
    if index == 0:
        recording.clear()
    recording[index] = layout
    if last:
        setattr(state, _RECORDED, [recording[i] for i in sorted(recording)])
    return hook(state, bucket)


def _as_recorded(hook: Any, state: Any, bucket: Any, names: dict[int, str],
                 layout: list[tuple]) -> torch.futures.Future:
    buf = bucket.buffer()
    where = {names[id(p)]: (off, p) for (off, _), p in zip(gradient_offsets(bucket), bucket.parameters())}
    parts = []
    for i, recorded in enumerate(layout):
        grads = torch.cat([buf[where[name][0]:where[name][0] + n] for name, n in recorded])
        parts.append(RecordedBucket(i, i == len(layout) - 1, grads, [where[name][1] for name, _ in recorded]))
    futures = [hook(state, part) for part in parts]  # every collective issued here, in bucket order

    def scatter(done: torch.futures.Future) -> torch.Tensor:
        for recorded, fut in zip(layout, done.value()):
            result, cur = fut.value(), 0  # value() raises the hook's error
            for name, n in recorded:
                off = where[name][0]
                buf[off:off + n].copy_(result[cur:cur + n])
                cur += n
        return buf

    return then(torch.futures.collect_all(futures), scatter)
