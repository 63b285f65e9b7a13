"""Timing of DeAR's waits and filter: wall clock on CPU, CUDA events on the current stream on CUDA.

On CUDA a ``.wait()`` returns at once on the host; what matters is how long the current stream
stalls on the collective (exposed communication), measured by a pair of CUDA events read lazily
(no host sync in the hooks). :class:`WaitTimers` is a base of :class:`~gradsync.algorithms.dear.DeAR`.
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
    """Adds the duration of timed blocks to float counters (seconds) of the host.

    Uses the host's ``_cuda_timing`` (bool), ``_device`` and ``_timing_events``
    (``[(counter name, start event, end event)]``).
    """

    _cuda_timing: bool
    _device: torch.device
    _timing_events: list[tuple[str, Any, Any]]

    @contextlib.contextmanager
    def _timed(self, counter: str) -> Iterator[None]:
        """Add the duration of the block to the float attribute ``counter`` (seconds). On CPU: wall
        clock. On CUDA: the time the current stream takes to pass the block's work (for a
        ``.wait()``, how long the stream stalls on the collective: exposed communication), from a
        pair of CUDA events read later by :meth:`_read_timings` (no host sync here)."""
        if not self._cuda_timing:
            t0 = time.perf_counter()
            yield
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
            return
        stream = torch.cuda.current_stream(self._device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._timing_events.append((counter, start, end))

    def _read_timings(self, wait: bool) -> None:
        """Add the elapsed time of recorded CUDA event pairs to their counters: all of them
        (``wait``, synchronising on the last) or those already completed (no host sync)."""
        done = 0
        for counter, start, end in self._timing_events:
            if not wait and not end.query():
                break
            end.synchronize()
            setattr(self, counter, getattr(self, counter) + start.elapsed_time(end) / 1e3)
            done += 1
        del self._timing_events[:done]
