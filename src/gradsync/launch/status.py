"""What the ranks of a local job report while they run and how they ended: a progress slot per
rank (:func:`rank_progress`), each rank's exit (:class:`RankExit`) and the failure the launcher raises
(:class:`RankFailure`)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import traceback
from dataclasses import dataclass
from typing import Any


#: Environment variable naming the directory with one progress file per rank.
PROGRESS_ENV = "GRADSYNC_PROGRESS_DIR"
_STEP = struct.Struct("<q")


class RankProgress:
    """Where this rank tells its launcher how far it got: ``report(step)`` once per completed step.

    The step is written with one ``pwrite`` of 8 bytes into a per-rank file under the launcher's
    temporary directory (about a microsecond; no collective, no lock), so the launcher can say which
    step every rank completed when one of them dies; the file's next 8 bytes hold the rank's process
    id. Without a local launcher (``torchrun``, or a plain process group) ``report`` does nothing.
    """

    def __init__(self, path: str | None, step: int = 0):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if path else None
        if self._fd is not None:
            os.pwrite(self._fd, _STEP.pack(int(step)) + _STEP.pack(os.getpid()), 0)

    def report(self, step: int) -> None:
        """Record that optimizer step ``step`` (1-based, counted over the whole run) is complete."""
        if self._fd is not None:
            os.pwrite(self._fd, _STEP.pack(int(step)), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def rank_progress(step: int = 0) -> RankProgress:
    """This rank's :class:`RankProgress`, starting at ``step`` (the step a resumed run starts
    from); a no-op one unless the rank was started by :class:`LocalRanks`."""
    directory, rank = os.environ.get(PROGRESS_ENV), os.environ.get("RANK")
    if not directory or rank is None or not os.path.isdir(directory):
        return RankProgress(None)
    return RankProgress(os.path.join(directory, f"rank{int(rank)}"), step)


def _read_step(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            data = f.read(_STEP.size)
    except OSError:
        return None
    return _STEP.unpack(data)[0] if len(data) == _STEP.size else None


@dataclass
class RankExit:
    """How one rank ended.

    ``exitcode`` follows ``subprocess``: negative for a signal (``-9`` is SIGKILL), ``None`` while
    running. ``error`` is ``"Type: message"`` of an exception the rank reported, ``where`` the
    innermost frame (``file:line in function``), ``traceback`` the full text; ``log_tail`` the end of
    a command rank's log; ``stopped`` is True when the launcher terminated it after another rank failed.
    """

    rank: int
    exitcode: int | None = None
    error: str | None = None
    where: str | None = None
    traceback: str | None = None
    log_tail: str | None = None
    stopped: bool = False

    @property
    def signal(self) -> str | None:
        """Name of the signal that ended the rank (``"SIGKILL"``), or None."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def failed(self) -> bool:
        return not self.stopped and (self.error is not None or self.exitcode not in (None, 0))

    def describe(self) -> str:
        """One phrase: ``"rank 1 was killed by SIGKILL"``, ``"rank 0 raised ValueError: ..."``."""
        if self.error is not None:
            return f"rank {self.rank} raised {self.error}" + (f" (at {self.where})" if self.where else "")
        if self.signal is not None:
            return f"rank {self.rank} was killed by {self.signal}"
        if self.exitcode is None:
            return f"rank {self.rank} did not finish"
        return f"rank {self.rank} exited with code {self.exitcode}"


class RankFailure(RuntimeError):
    """A local rank failed; the other ranks were stopped.

    Attributes:
        failed: the :class:`RankExit` of the rank that failed first (a rank that died by a signal or
            an exit code is preferred over ranks that raised afterwards, e.g. "connection closed").
        exits: every rank's :class:`RankExit`.
        steps: the last step each rank reported through :class:`RankProgress` (absent if none).
        timed_out: True when the ranks did not finish within ``join``'s ``timeout``.
        results: return values of the function ranks that finished, by rank.
    """

    def __init__(self, failed: RankExit, exits: dict[int, RankExit], steps: dict[int, int],
                 timed_out: bool = False, timeout: float | None = None,
                 results: dict[int, Any] | None = None):
        self.failed, self.exits, self.steps, self.timed_out = failed, exits, steps, timed_out
        self.timeout = timeout
        self.results = results or {}
        if timed_out:
            msg = f"ranks did not finish within {timeout or 0:.0f} s"
        else:
            msg = failed.describe()
        if self.last_step is not None:
            msg += f"; last step completed by every rank: {self.last_step}"
        if failed.log_tail:
            msg += ":\n" + failed.log_tail
        super().__init__(msg)

    @property
    def last_step(self) -> int | None:
        """The last step every rank completed (minimum over ranks), None if no rank reported one."""
        if not self.steps:
            return None
        return min(self.steps.get(r, 0) for r in self.exits)
