"""Python callbacks on collective futures that cannot abort a rank at interpreter exit.

A callback chained with ``Future.then`` runs on the process group's worker thread (Gloo's ``runLoop``),
and that thread releases the callback only after every callback of the completed future ran, which
takes the GIL. DDP waits on the chained future, which completes *inside* the callback, so the training
loop can finish, the script can end and the interpreter can start finalizing before the worker has
released the callback; the worker then finds a finalizing interpreter, leaves its thread through a
``noexcept`` frame and the rank dies with SIGABRT ("terminate called without an active exception")
after training succeeded. Seen in about 1 in 20 runs of ``examples/torchrun_covap.py``; its core dump
shows ``PythonFunctionGuard`` released from ``Future::markCompleted`` under
``ProcessGroupGloo::runLoop`` while the main thread is in ``Py_FinalizeEx``. torch's
``destroy_process_group`` does not wait for it.

:func:`then` hands ``Future.then`` a fresh wrapper of the callback, holds the callback itself and a
weak reference to the wrapper: the reference dies exactly when the worker thread has released the
wrapper, and since the callback (with whatever it captured) is still held here, that release frees
only the wrapper and never runs code that could let go of the GIL half-way; the callback is dropped
later, on the thread that calls :func:`then` or :func:`drain`. :func:`drain` (an ``atexit``
handler, registered on first use, and called by :func:`shutdown_process_group`) waits, with the GIL
released, until every tracked callback has run and been released (collectives still in flight at
exit included, at most :data:`DRAIN_TIMEOUT_S` seconds).
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Any, Callable

import torch

#: Callbacks tracked at most; older ones (collectives that never completed, e.g. after a failed peer)
#: are forgotten rather than accumulated.
MAX_TRACKED = 4096

#: Seconds :func:`drain` waits at most for tracked callbacks to run and be released (a collective
#: that never completes, e.g. after a failed peer, delays the exit by this much, not forever).
DRAIN_TIMEOUT_S = 5.0

#: Seconds :func:`drain` then leaves the GIL free for callbacks it cannot see: those that torch's own
#: hooks (``fp16_compress_hook``, ``powerSGD_hook``) chain inside the futures they return.
SETTLE_S = 0.02

_lock = threading.Lock()
_callbacks: collections.deque = collections.deque()  # (weakref to the wrapper, callback)
_registered = False


def completed(value: Any) -> torch.futures.Future:
    """A future that already holds ``value`` (a hook's result that needs no collective: a bucket
    passed through, an empty exchange)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
    """``fut.then(fn)``, tracked so that :func:`drain` can wait until the worker thread released
    ``fn``.

    Args:
        fut: a future from a collective (``Work.get_future()``) or chained from one.
        fn: called with ``fut`` once it completes, on the thread that completes it; its return value
            is the value of the returned future.

    Returns:
        The future of ``fn``'s result, as ``torch.futures.Future.then``.
    """
    def call(f: torch.futures.Future) -> Any:
        return fn(f)

    drain_at_exit()
    child = fut.then(call)
    with _lock:
        _callbacks.append((weakref.ref(call), fn))
    _prune()
    return child


def _prune() -> None:
    """Forget the oldest callbacks already released by their worker thread (and any beyond
    :data:`MAX_TRACKED`); they are freed here, outside the lock, on the calling thread."""
    released = []
    with _lock:
        while _callbacks and (_callbacks[0][0]() is None or len(_callbacks) > MAX_TRACKED):
            released.append(_callbacks.popleft())
    del released


def drain_at_exit() -> None:
    """Register :func:`drain` as an ``atexit`` handler (once per process). Hook states call it, so a
    job whose hooks return torch's own futures still waits :data:`SETTLE_S` at exit."""
    global _registered
    if _registered:
        return
    with _lock:
        if not _registered:
            atexit.register(drain)
            _registered = True


def drain(timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Wait, with the GIL released, until every tracked callback has run and been released by its
    worker thread (a collective still in flight at exit completes, and its callback runs, before
    the interpreter finalizes), at most ``timeout_s`` seconds in all; then leave the GIL free for
    :data:`SETTLE_S` seconds. Safe to call several times and from any thread."""
    deadline = time.monotonic() + timeout_s
    with _lock:
        tracked = list(_callbacks)
    for ref, _ in tracked:
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.0005)
    del tracked
    _prune()
    settle = time.monotonic() + SETTLE_S
    while time.monotonic() < settle:
        time.sleep(0.001)


def shutdown_process_group() -> None:
    """End a job's distributed part: :func:`drain`, collect the reference cycles that keep DDP's
    reducer (and with it the group) alive, then ``torch.distributed.destroy_process_group()``.

    Dropping the group's last reference joins its worker threads on the calling thread, which holds
    the GIL; a worker still waiting for the GIL to release a callback would never finish, so the
    callbacks are released first."""
    import gc

    import torch.distributed as dist

    drain()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
