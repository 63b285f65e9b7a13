"""Scheduled link-rate changes of an emulated cluster during a run (a background thread)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradsync.validation import check_float

if TYPE_CHECKING:
    from gradsync.cluster.netns import EmulatedCluster

logger = logging.getLogger(__name__)

__all__ = ["BandwidthSchedule"]


class BandwidthSchedule:
    """Change link rates during a run from a background thread.

    Args:
        cluster: a started :class:`EmulatedCluster`.
        steps: ``(seconds_from_start, mbit)`` pairs; applied in time order.
        host: host index to change, or ``None`` for every host.

    ``applied`` lists ``(seconds_from_start_actual, mbit)`` for the changes made. Use as a context
    manager (``start()`` on enter, ``stop()`` on exit) or call them directly.

    Raises:
        ValueError: for negative times or bad rates.
    """

    def __init__(self, cluster: EmulatedCluster, steps: Sequence[tuple[float, float]],
                 host: int | None = None) -> None:
        self.cluster = cluster
        self.steps = sorted(
            (check_float(f"steps[{j}] time", t, 0.0), check_float(f"steps[{j}] mbit", r, 0.0,
                                                                  1e6, low_inclusive=False))
            for j, (t, r) in enumerate(steps)
        )
        self.host = host
        self.applied: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def parse(text: str) -> list[tuple[float, float]]:
        """Parse ``"0:100,30:10,60:100"`` (seconds:Mbit/s pairs) into steps.

        Raises:
            ValueError: for a malformed entry.
        """
        out = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            t, sep, r = part.partition(":")
            if not sep:
                raise ValueError(f"bandwidth schedule entry must be seconds:mbit, got {part!r}")
            out.append((check_float("schedule time", t.strip(), 0.0),
                        check_float("schedule mbit", r.strip(), 0.0, 1e6, low_inclusive=False)))
        if not out:
            raise ValueError("bandwidth schedule is empty")
        return out

    def start(self) -> BandwidthSchedule:
        """Start the thread; times count from now."""
        if self._thread is not None:
            raise RuntimeError("schedule already started")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="gradsync-bw-schedule",
                                        daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        for t, mbit in self.steps:
            if self._stop.wait(max(0.0, self._t0 + t - time.monotonic())):
                return
            try:
                self.cluster.set_bandwidth(self.host, mbit)
                self.applied.append((time.monotonic() - self._t0, mbit))
            except Exception as exc:  # noqa: BLE001 - recorded, thread must not die silently
                self.errors.append(f"{type(exc).__name__}: {exc}")
                logger.error("bandwidth schedule step (%g s, %g Mbit/s) failed: %s", t, mbit, exc)

    def stop(self) -> None:
        """Stop the thread (pending changes are not applied)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> BandwidthSchedule:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
