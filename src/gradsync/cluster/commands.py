"""Command builders and runners for the emulated cluster: ``ip`` / ``tc`` argument lists, the tbf
burst policy, and thin wrappers that run them.

The builders are pure (they return ``argv`` lists and never run anything), so the exact commands can
be checked without root; :func:`run` executes one and raises :class:`ClusterError` on failure.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence

from gradsync.validation import check_float

logger = logging.getLogger(__name__)

__all__ = [
    "AUTO_BURST_SECONDS",
    "MIN_BURST_KB",
    "TBF_LATENCY",
    "ClusterError",
    "NetemUnavailable",
    "auto_burst",
    "check_burst",
    "kill_netns_pids",
    "list_netns",
    "netem_available",
    "qdisc_add_commands",
    "qdisc_change_command",
    "rate_arg",
    "resolve_burst",
    "run",
    "tbf_args",
    "why_unshaped",
]

#: queueing limit of every tbf qdisc (tc ``latency``)
TBF_LATENCY = "50ms"
#: the automatic burst holds this many seconds of traffic at the link rate ...
AUTO_BURST_SECONDS = 0.004
#: ... but never less than this many kilobytes (tc ``kb`` = 1024 bytes)
MIN_BURST_KB = 16


class ClusterError(RuntimeError):
    """A command that builds or changes the emulated cluster failed (message has its stderr)."""


class NetemUnavailable(ClusterError):
    """``latency_ms`` was requested but the kernel has no ``netem`` qdisc."""


# ---------------------------------------------------------------------------------- shaping values
def rate_arg(mbit: float) -> str:
    """tc rate for ``mbit`` Mbit/s (10**6 bit/s), in whole kbit/s (at least 1): ``100 -> "100000kbit"``."""
    return f"{max(1, round(mbit * 1000))}kbit"


def auto_burst(mbit: float) -> str:
    """The tbf bucket size the cluster uses by default for a link of ``mbit`` Mbit/s:
    ``max(16 kb, 4 ms at the link rate)`` in tc's ``kb`` (1024 bytes), e.g. ``100 -> "49kb"``,
    ``10 -> "16kb"``, ``1000 -> "489kb"``.

    Small enough that a burst does not hide the shaping of small gradients (a full bucket leaves at
    the speed of the underlying device: at 100 Mbit/s a 256 kb bucket lets a 256 KiB gradient through
    unshaped), and at least ``rate / HZ`` for HZ = 250, the minimum tc-tbf(8) asks for.

    Raises:
        ValueError: if ``mbit`` is not in (0, 1e6].
    """
    mbit = check_float("mbit", mbit, 0.0, 1e6, low_inclusive=False)
    return f"{max(MIN_BURST_KB, int(mbit * 1e6 / 8 * AUTO_BURST_SECONDS / 1024) + 1)}kb"


def check_burst(burst: str) -> str:
    """Validate a burst argument: ``"auto"`` or a tc size (``"32kb"``, ``"1.5mb"``, ``"4096"``).

    Raises:
        ValueError: for anything else.
    """
    if not isinstance(burst, str) or not (burst == "auto" or re.fullmatch(r"\d+(\.\d+)?[kmg]?b?", burst.lower())):
        raise ValueError(f"burst must be 'auto' or a tc size such as '256kb', got {burst!r}")
    return burst


def resolve_burst(burst: str, mbit: float) -> str:
    """The tc burst of a link of ``mbit`` Mbit/s: :func:`auto_burst` for ``"auto"``, else ``burst``."""
    return auto_burst(mbit) if burst == "auto" else burst


# ---------------------------------------------------------------------------------- tc builders
def tbf_args(mbit: float, burst: str) -> list[str]:
    """``tbf rate R burst B latency 50ms`` arguments (``burst`` already resolved)."""
    return ["tbf", "rate", rate_arg(mbit), "burst", burst, "latency", TBF_LATENCY]


def qdisc_add_commands(ns: str, dev: str, mbit: float, burst: str,
                       latency_ms: float | None = None) -> list[list[str]]:
    """Commands that shape ``dev`` in namespace ``ns``: a root tbf (handle ``10:``), or with a delay
    a root netem (handle ``1:``, ``latency_ms / 2`` ms: half of the one-way delay on each of the two
    shaped interfaces a packet crosses) with the tbf as its child."""
    tbf = tbf_args(mbit, burst)
    if latency_ms:
        half = f"{latency_ms / 2:g}ms"
        return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", half],
                ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf]]
    return [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "10:", *tbf]]


def qdisc_change_command(ns: str, dev: str, mbit: float, burst: str, latency_ms: float | None = None) -> list[str]:
    """``tc qdisc change`` of the tbf made by :func:`qdisc_add_commands` (live rate change)."""
    where = ["parent", "1:1", "handle", "10:"] if latency_ms else ["root", "handle", "10:"]
    return ["tc", "-n", ns, "qdisc", "change", "dev", dev, *where, *tbf_args(mbit, burst)]


# ---------------------------------------------------------------------------------- runners
def run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv`` (30 s timeout), capturing output.

    Raises:
        ClusterError: with ``check`` and a non-zero exit (the message has the command and stderr).
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    return proc


def why_unshaped() -> str | None:
    """Why this process cannot build namespaces (``"not root"``, iproute2 missing), or ``None``."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} (iproute2) not found"
    return None


def netem_available(namespace: str, device: str) -> bool:
    """Whether a ``netem`` qdisc can be created on ``device`` in ``namespace`` (tried, then removed).

    The device must belong to the caller and carry no root qdisc of its own yet.
    """
    p = run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "netem",
             "delay", "1ms"], check=False)
    if p.returncode != 0:
        logger.debug("netem probe failed: %s", p.stderr.strip())
        return False
    run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
    return True


def list_netns() -> list[str]:
    """Names of the network namespaces (``ip netns list``)."""
    p = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def kill_netns_pids(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (by pid, from ``ip netns pids``)."""
    p = run(["ip", "netns", "pids", ns], check=False)
    for tok in p.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
