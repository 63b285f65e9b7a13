"""An emulated cluster on one machine: network namespaces, veth pairs, a Linux bridge and ``tc tbf``.

Lifecycle of the cluster (:class:`EmulatedCluster`: build, run processes inside hosts, change rates,
tear down) and removal of what killed runs left behind (:func:`cleanup_stale`). The wiring is in
:mod:`gradsync.cluster.topology`, the ``ip`` / ``tc`` commands and the burst policy in
:mod:`gradsync.cluster.commands`, scheduled rate changes in :mod:`gradsync.cluster.schedule`.

Each host ``i`` is a network namespace with one interface on a bridge that lives in its own
namespace, so nothing in the root namespace changes. Both ends of every host link get a token-bucket
filter (``tc qdisc add dev D root tbf rate R burst B latency 50ms``, ``B`` = 4 ms at the link rate,
at least 16 kb, by default: :func:`gradsync.cluster.commands.auto_burst`), so traffic leaving a host
is shaped on the host side and traffic entering it on the bridge side: each host has ``R`` Mbit/s in
each direction. ``tc qdisc change`` alters the rate live (:meth:`EmulatedCluster.set_bandwidth`,
:class:`gradsync.cluster.schedule.BandwidthSchedule`).

Delay needs the ``netem`` qdisc; where the kernel lacks it (as on the machines this project was
developed on) asking for ``latency_ms`` raises :class:`NetemUnavailable`. Without root or without
``ip``/``tc`` (iproute2) the cluster falls back to loopback without shaping (``shaped = False``,
``reason`` says why, ``label`` says "NOT shaped").

Names carry a per-run prefix ``gs`` + 6 hex digits; everything created is removed on
:meth:`EmulatedCluster.close` (idempotent), at interpreter exit (atexit) and on SIGINT/SIGTERM (the
previous handlers are restored and then invoked). A record ``/run/gradsync-netns/<prefix>.pid`` names
the owning process so :func:`cleanup_stale` can remove what a killed run left behind.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from gradsync.cluster.commands import (
    ClusterError,
    NetemUnavailable,
    check_burst,
    kill_netns_pids,
    list_netns,
    netem_available,
    qdisc_add_commands,
    qdisc_change_command,
    resolve_burst,
    run,
    why_unshaped,
)
from gradsync.cluster.topology import Topology
from gradsync.validation import check_float, check_int

logger = logging.getLogger(__name__)

__all__ = ["RECORD_DIR", "EmulatedCluster", "cleanup_stale"]

RECORD_DIR = "/run/gradsync-netns"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix: str = "gs", force: bool = False) -> list[str]:
    """Delete namespaces left by emulated clusters whose owning process is gone.

    Matches namespaces named ``<run>br`` / ``<run>h<i>`` where ``<run>`` is ``prefix`` (a full run
    prefix such as ``gs1a2b3c``, or the default ``gs`` for every run) followed by the rest of
    ``gs`` + 6 hex digits. A run is removed when its record names a dead process; runs with a live
    owner, or (unless ``force``) without a record, are left alone. Processes still inside a removed
    namespace are killed (SIGKILL, by pid). Returns the namespaces deleted.
    """
    if why_unshaped() is not None:
        return []
    pat = re.compile(r"^(gs[0-9a-f]{6})(br|h\d+)$")
    runs: dict[str, list[str]] = {}
    for ns in list_netns():
        m = pat.match(ns)
        if m and m.group(1).startswith(prefix):
            runs.setdefault(m.group(1), []).append(ns)
    removed = []
    for run_prefix, names in runs.items():
        rec = os.path.join(RECORD_DIR, f"{run_prefix}.pid")
        try:
            with open(rec) as fh:
                pid = int(fh.read().strip())
        except (OSError, ValueError):
            pid = None
        if pid is None and not force:
            logger.info("cleanup_stale: %s has no owner record; skipped (force=True removes it)", run_prefix)
            continue
        if pid is not None and _pid_alive(pid) and not force:
            logger.info("cleanup_stale: %s still owned by live pid %d; skipped", run_prefix, pid)
            continue
        for ns in sorted(names, key=lambda n: n.endswith("br")):  # hosts first, bridge last
            kill_netns_pids(ns)
            if run(["ip", "netns", "del", ns], check=False).returncode == 0:
                removed.append(ns)
        try:
            os.unlink(rec)
        except OSError:
            pass
    if removed:
        logger.warning("cleanup_stale removed %s", ", ".join(removed))
    return removed


class EmulatedCluster:
    """N emulated hosts with shaped links; use as a context manager.

    Args:
        hosts: number of hosts (one rank per host), 1..250.
        bandwidth_mbit: link rate in Mbit/s (10**6 bit/s) for every host, or one rate per host
            (to model a slow host); each in (0, 1e6].
        burst: tbf bucket size: ``"auto"`` (default; per link, :func:`gradsync.cluster.commands.auto_burst`
            of the link's current rate, so ``max(16 kb, 4 ms at the rate)``, recomputed when the rate
            changes) or a fixed ``tc`` size such as ``"32kb"`` for every link.
        latency_ms: one-way host-to-host delay in milliseconds; needs ``netem`` (half the delay is
            put on each of the two shaped interfaces a packet crosses). ``None``: no delay.
        mode: ``"auto"`` (namespaces when root with iproute2, else loopback), ``"netns"`` (raise
            :class:`ClusterError` when impossible) or ``"loopback"`` (never shape).
        prefix: run prefix (``gs`` + 6 hex digits); random by default.

    Attributes:
        shaped: True when links are shaped; ``reason`` says why not otherwise.
        label: e.g. ``"emulated 4 hosts, tbf 100 Mbit/s"`` or ``"loopback, NOT shaped (not root)"``.

    Raises:
        ValueError: for bad arguments. NetemUnavailable: ``latency_ms`` given without netem.
        ClusterError: a set-up command failed (whatever was created is removed first).
    """

    def __init__(
        self,
        hosts: int,
        bandwidth_mbit: float | Sequence[float],
        burst: str = "auto",
        latency_ms: float | None = None,
        mode: str = "auto",
        prefix: str | None = None,
    ) -> None:
        self.hosts = check_int("hosts", hosts, 1, 250)
        if isinstance(bandwidth_mbit, (list, tuple)):
            if len(bandwidth_mbit) != self.hosts:
                raise ValueError(
                    f"bandwidth_mbit must have one rate per host ({self.hosts}), "
                    f"got {len(bandwidth_mbit)}"
                )
            rates = [check_float(f"bandwidth_mbit[{i}]", b, 0.0, 1e6, low_inclusive=False)
                     for i, b in enumerate(bandwidth_mbit)]
        else:
            rates = [check_float("bandwidth_mbit", bandwidth_mbit, 0.0, 1e6,
                                 low_inclusive=False)] * self.hosts
        self.rates_mbit: list[float] = rates
        self.burst = check_burst(burst)
        self.latency_ms = (None if latency_ms is None else
                           check_float("latency_ms", latency_ms, 0.0, 10000.0))
        if mode not in ("auto", "netns", "loopback"):
            raise ValueError(f"mode must be one of auto, netns, loopback; got {mode!r}")
        self.topology = Topology.random(self.hosts, prefix)
        self.prefix = self.topology.prefix
        self.mode = mode
        self.shaped = False
        self.reason: str | None = None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._closed = False
        self._started = False
        self._lock = threading.RLock()
        self._prev_handlers: dict[int, Any] = {}

    # ------------------------------------------------------------------ names
    @property
    def bridge_ns(self) -> str:
        """Name of the namespace holding the bridge."""
        return self.topology.bridge_ns

    def namespace(self, i: int) -> str:
        """Network namespace name of host ``i`` (only exists when ``shaped``)."""
        return self.topology.namespace(i)

    def ifname(self, i: int) -> str:
        """Interface of host ``i`` inside its namespace, for ``GLOO_SOCKET_IFNAME`` ("lo" unshaped)."""
        i = self._host(i)
        return self.topology.host_if(i) if self.shaped else "lo"

    def address(self, i: int) -> str:
        """IPv4 address of host ``i`` (``10.X.Y.(i+1)``; ``127.0.0.1`` unshaped)."""
        i = self._host(i)
        if not self.shaped:
            return "127.0.0.1"
        return self.topology.address(i)

    def _host(self, i: int) -> int:
        return self.topology.host_index(i)

    def link_burst(self, i: int) -> str:
        """The tc burst of host ``i``'s link at its current rate (see ``burst``)."""
        return resolve_burst(self.burst, self.rates_mbit[self._host(i)])

    @property
    def label(self) -> str:
        """Human-readable description of the network, for every report."""
        if not self.shaped:
            return f"loopback, NOT shaped ({self.reason})"
        uniq = sorted(set(self.rates_mbit))
        rate = (f"{uniq[0]:g}" if len(uniq) == 1 else "/".join(f"{r:g}" for r in self.rates_mbit))
        lat = f", {self.latency_ms:g} ms one-way (netem)" if self.latency_ms else ""
        return f"emulated {self.hosts} hosts, tbf {rate} Mbit/s{lat}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> EmulatedCluster:
        """Create namespaces, links and qdiscs (or pick the loopback fallback). Idempotent."""
        with self._lock:
            if self._started:
                return self
            if self._closed:
                raise ClusterError("cluster was closed; create a new EmulatedCluster")
            self._started = True
            why = "loopback requested" if self.mode == "loopback" else why_unshaped()
            if why is not None:
                if self.mode == "netns":
                    raise ClusterError(f"cannot build an emulated cluster: {why}")
                if self.latency_ms:
                    raise NetemUnavailable(f"latency_ms needs netem on shaped links, but {why}")
                self.reason = why
                logger.warning("emulated cluster unavailable (%s): using loopback, NOT shaped", why)
                return self
            self._install_handlers()
            try:
                self._build()
            except BaseException:
                self.close()
                raise
            self.shaped = True
            logger.info("%s (prefix %s)", self.label, self.prefix)
            return self

    def _build(self) -> None:
        os.makedirs(RECORD_DIR, exist_ok=True)
        with open(os.path.join(RECORD_DIR, f"{self.prefix}.pid"), "w") as fh:
            fh.write(str(os.getpid()))
        topo = self.topology
        self._run_all(topo.bridge_commands())
        for i in range(self.hosts):
            self._run_all(topo.host_commands(i))
            if i == 0 and self.latency_ms and not netem_available(topo.namespace(i), topo.host_if(i)):
                raise NetemUnavailable(
                    "latency_ms needs the netem qdisc, which this kernel does not have "
                    "(tc: 'Specified qdisc kind is unknown'); omit latency_ms / --latency"
                )
            for ns, dev in topo.shaped_links(i):
                self._run_all(qdisc_add_commands(ns, dev, self.rates_mbit[i], self.link_burst(i),
                                                 self.latency_ms))

    def _run_all(self, argvs: Sequence[Sequence[str]]) -> None:
        """Run each command; record every namespace created so :meth:`close` removes it."""
        for argv in argvs:
            run(argv)
            if list(argv[:3]) == ["ip", "netns", "add"]:
                self._created.append(argv[3])

    def set_bandwidth(self, host: int | None, mbit: float) -> None:
        """Change the rate of host ``host``'s link (both directions), or of every host when
        ``None``, to ``mbit`` Mbit/s, live (``tc qdisc change``). Unshaped: logs a warning only.

        Raises:
            ValueError: bad host index or rate. ClusterError: ``tc`` failed or the cluster is closed.
        """
        mbit = check_float("mbit", mbit, 0.0, 1e6, low_inclusive=False)
        targets = range(self.hosts) if host is None else [self._host(host)]
        with self._lock:
            if self._closed:
                raise ClusterError("cluster is closed")
            if not self.shaped:
                logger.warning("set_bandwidth(%s, %g): links are NOT shaped (%s); ignored",
                               host, mbit, self.reason)
                return
            burst = resolve_burst(self.burst, mbit)
            for i in targets:
                for ns, dev in self.topology.shaped_links(i):
                    run(qdisc_change_command(ns, dev, mbit, burst, self.latency_ms))
                self.rates_mbit[i] = mbit
        logger.info("bandwidth of %s set to %g Mbit/s", "all hosts" if host is None else
                    f"host {host}", mbit)

    def qdisc_show(self, i: int, bridge_side: bool = False) -> str:
        """``tc qdisc show`` output for host ``i``'s interface (or its bridge port)."""
        i = self._host(i)
        if not self.shaped:
            return ""
        ns, dev = self.topology.shaped_links(i)[1 if bridge_side else 0]
        return run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside host ``i`` (``ip netns exec``); plain ``Popen`` when unshaped.

        ``env`` (if given) is the full environment; other keyword arguments go to ``Popen``.
        The process is tracked and killed at :meth:`close` if still running.
        """
        i = self._host(i)
        with self._lock:
            if self._closed or not self._started:
                raise ClusterError("cluster is not running (use it as a context manager)")
            full = list(argv)
            if self.shaped:
                full = ["ip", "netns", "exec", self.namespace(i), *full]
            proc = subprocess.Popen(full, env=None if env is None else dict(env), **kwargs)
            self._procs.append(proc)
            return proc

    def reachable(self, src: int, dst: int, timeout: float = 2.0) -> bool:
        """Send one ICMP echo request from host ``src`` to host ``dst`` (a raw socket inside the
        source namespace; no ``ping`` binary needed). True when a reply arrives within ``timeout``."""
        script = (
            "import socket,struct,sys,time,os\n"
            "def ck(b):\n"
            " b+=b'\\0'*(len(b)%2); s=sum(struct.unpack('!%dH'%(len(b)//2),b))\n"
            " s=(s>>16)+(s&0xffff); s+=s>>16; return ~s&0xffff\n"
            "ident=os.getpid()&0xffff; h=struct.pack('!BBHHH',8,0,0,ident,1); d=b'gradsync'\n"
            "p=struct.pack('!BBHHH',8,0,ck(h+d),ident,1)+d\n"
            "s=socket.socket(socket.AF_INET,socket.SOCK_RAW,socket.IPPROTO_ICMP)\n"
            "s.settimeout(float(sys.argv[2])); s.sendto(p,(sys.argv[1],0)); end=time.time()+float(sys.argv[2])\n"
            "while time.time()<end:\n"
            " try: r,a=s.recvfrom(2048)\n"
            " except socket.timeout: break\n"
            " ihl=(r[0]&15)*4; t,_,_,i,_=struct.unpack('!BBHHH',r[ihl:ihl+8])\n"
            " if t==0 and i==ident and a[0]==sys.argv[1]: sys.exit(0)\n"
            "sys.exit(1)\n"
        )
        proc = self.popen(src, [sys.executable, "-c", script, self.address(dst), str(timeout)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return proc.wait(timeout=timeout + 10) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False

    def close(self) -> None:
        """Kill tracked processes still running, delete every namespace (and so every veth, the
        bridge and the qdiscs) created, remove the owner record, restore signal handlers.
        Idempotent; safe to call from atexit and signal handlers."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        logger.warning("process %d did not exit after SIGKILL", proc.pid)
            for ns in reversed(self._created):
                kill_netns_pids(ns)
                p = run(["ip", "netns", "del", ns], check=False)
                if p.returncode != 0 and ns in list_netns():
                    logger.error("could not delete namespace %s: %s", ns, p.stderr.strip())
            self._created.clear()
            try:
                os.unlink(os.path.join(RECORD_DIR, f"{self.prefix}.pid"))
            except OSError:
                pass
            self._restore_handlers()
            if self.shaped:
                logger.info("emulated cluster %s removed", self.prefix)

    # ------------------------------------------------------------------ signals / atexit
    def _install_handlers(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) == signal.SIG_IGN:
                continue  # ignored on purpose (nohup, a background job of a script): keep it ignored
            try:
                self._prev_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # pragma: no cover - non-main interpreter
                pass

    def _restore_handlers(self) -> None:
        atexit.unregister(self.close)
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in list(self._prev_handlers.items()):
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, prev)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        logger.warning("signal %d: removing emulated cluster %s", signum, self.prefix)
        self.close()
        if callable(prev):
            prev(signum, frame)
        elif prev == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN: nothing more to do
