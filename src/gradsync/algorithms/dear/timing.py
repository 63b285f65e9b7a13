"""Timing of DeAR's waits and filter: wall clock on CPU, CUDA events on the current stream on CUDA.

On CUDA a ``.wait()`` returns at once on the host; what matters is how long the current stream
stalls on the collective (exposed communication), measured by a pair of CUDA events read lazily
(no host sync in the hooks). :class:`WaitTimers` is held by :class:`~gradsync.algorithms.dear.DeAR`
and passed to the stages it times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

#: CUDA timing event pairs kept unread before ``step()`` waits for them
MAX_TIMING_EVENTS = 4096


class WaitTimers:
    """Adds the duration of timed blocks to float counters (seconds) of ``counters``.

    Args:
        counters: the object holding the counters (e.g. :class:`~gradsync.algorithms.dear.state.Counters`):
            :meth:`timed`'s ``counter`` names one of its float attributes.
        device: the parameters' device; on CUDA the blocks are timed by events on its current stream.
    """

    def __init__(self, counters: Any, device: torch.device) -> None:
        self._counters = counters
        self._device = device
        self._cuda = device.type == "cuda"
        self._events: list[tuple[str, Any, Any]] = []  # [(counter name, start event, end event)]

    def _add(self, counter: str, seconds: float) -> None:
        setattr(self._counters, counter, getattr(self._counters, counter) + seconds)

    @contextlib.contextmanager
    def timed(self, counter: str) -> Iterator[None]:
        """Add the duration of the block to the float counter ``counter`` (seconds). On CPU: wall
        clock. On CUDA: the time the current stream takes to pass the block's work (for a
        ``.wait()``, how long the stream stalls on the collective: exposed communication), from a
        pair of CUDA events read later by :meth:`read` (no host sync here)."""
        if not self._cuda:
            t0 = time.perf_counter()
            yield
            self._add(counter, time.perf_counter() - t0)
            return
        stream = torch.cuda.current_stream(self._device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._events.append((counter, start, end))

    def read(self, wait: bool) -> None:
        """Add the elapsed time of recorded CUDA event pairs to their counters: all of them
        (``wait``, synchronising on the last) or those already completed (no host sync)."""
        done = 0
        for counter, start, end in self._events:
            if not wait and not end.query():
                break
            end.synchronize()
            self._add(counter, start.elapsed_time(end) / 1e3)
            done += 1
        del self._events[:done]

    def poll(self) -> None:
        """Once per iteration: read the completed event pairs (no host sync), or all of them once
        more than :data:`MAX_TIMING_EVENTS` are unread."""
        if self._events:
            self.read(wait=len(self._events) > MAX_TIMING_EVENTS)
