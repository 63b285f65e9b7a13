"""Emulated cluster (gradsync.cluster): namespaces, tbf shaping, a real Gloo all-reduce, teardown.

Needs root and iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gradsync.cluster import (
    BandwidthSchedule,
    ClusterError,
    EmulatedCluster,
    NetemUnavailable,
    cleanup_stale,
)
from gradsync.cluster.netns import RECORD_DIR

_WHY = None
if os.geteuid() != 0:
    _WHY = "not root: network namespaces and tc need root"
elif shutil.which("ip") is None or shutil.which("tc") is None:
    _WHY = "ip/tc (iproute2) not installed"
if _WHY:
    print(f"\ntest_cluster: skipping emulated-cluster tests: {_WHY}")
needs_root = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links_with(prefix: str) -> str:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    return "\n".join(line for line in out.splitlines() if prefix in line)


# rank script: warm up, then time REPS all-reduces of NUMEL fp32; wait for "go" on stdin; repeat
_SCRIPT = textwrap.dedent("""
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    x = torch.ones(int(os.environ["NUMEL"]))
    dist.all_reduce(torch.ones(1000))
    for phase in range(2):
        ts = []
        for _ in range(int(os.environ["REPS"])):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            ts.append(time.perf_counter() - t0)
        assert float(x[0]) > 1
        ts.sort()
        print(f"PHASE {phase} {ts[len(ts) // 2]:.6f}", flush=True)
        if phase == 0:
            sys.stdin.readline()
    dist.destroy_process_group()
""")


@needs_root
def test_two_hosts_allreduce_matches_tbf_rate():
    numel = 1 << 20  # 4 MiB of fp32
    nbytes = numel * 4
    with EmulatedCluster(2, 100.0) as c:
        assert c.shaped, c.reason
        assert c.label == "emulated 2 hosts, tbf 100 Mbit/s"
        names = _netns()
        assert {c.namespace(0), c.namespace(1), c.bridge_ns} <= set(names)
        assert "rate 100Mbit" in c.qdisc_show(0) and "rate 100Mbit" in c.qdisc_show(1, True)
        assert c.reachable(0, 1) and c.reachable(1, 0)

        procs = []
        for i in range(2):
            env = dict(os.environ, RANK=str(i), NUMEL=str(numel), REPS="3",
                       MASTER_ADDR=c.address(0), MASTER_PORT="29533",
                       GLOO_SOCKET_IFNAME=c.ifname(i), OMP_NUM_THREADS="1")
            procs.append(c.popen(i, [sys.executable, "-c", _SCRIPT], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE))

        def phase_time(p):
            line = p.stdout.readline()
            if not line.startswith("PHASE"):
                p.kill()
                raise AssertionError(f"rank failed: {line!r} {p.stderr.read()[-2000:]}")
            return float(line.split()[2])

        slow = max(phase_time(p) for p in procs)
        c.set_bandwidth(None, 400.0)
        assert "rate 400Mbit" in c.qdisc_show(1)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        fast = max(phase_time(p) for p in procs)
        for p in procs:
            assert p.wait(timeout=30) == 0, p.stderr.read()[-2000:]
        # ring all-reduce on P=2: each rank sends 2(P-1)/P * n = n bytes over its R link
        expect = nbytes * 8 / 100e6
        print(f"\n4 MiB all-reduce, 2 hosts: 100 Mbit/s {slow * 1e3:.1f} ms "
              f"(tbf expectation {expect * 1e3:.1f} ms, ratio {slow / expect:.3f}); "
              f"400 Mbit/s {fast * 1e3:.1f} ms (expectation {expect / 4 * 1e3:.1f} ms)")
        assert abs(slow - expect) / expect < 0.30
        assert fast < 0.6 * slow
    prefix = c.prefix
    assert not any(n.startswith(prefix) for n in _netns())
    assert _links_with(prefix) == ""
    assert not os.path.exists(os.path.join(RECORD_DIR, f"{prefix}.pid"))
    c.close()  # idempotent


@needs_root
def test_teardown_when_body_raises_and_idempotent():
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(3, [50.0, 100.0, 100.0]) as c:
            assert c.label == "emulated 3 hosts, tbf 50/100/100 Mbit/s"
            assert "rate 50Mbit" in c.qdisc_show(0, bridge_side=True)
            sleeper = c.popen(2, [sys.executable, "-c", "import time; time.sleep(60)"])
            assert signal.getsignal(signal.SIGTERM) != handler_before
            raise RuntimeError("boom")
    assert sleeper.poll() is not None  # killed at teardown
    assert not any(n.startswith(c.prefix) for n in _netns())
    assert signal.getsignal(signal.SIGTERM) == handler_before
    c.close()
    with pytest.raises(ClusterError):
        c.popen(0, ["true"])


def _owner_process(sigint: str) -> tuple[subprocess.Popen, str]:
    """A process that builds a 2-host cluster with SIGINT set to ``sigint`` ("default" or
    "ignore": a background job of a script, or pytest run that way, inherits SIGINT ignored)."""
    code = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGINT, signal.{'default_int_handler' if sigint == 'default' else 'SIG_IGN'})
        from gradsync.cluster import EmulatedCluster
        c = EmulatedCluster(2, 100.0).start()
        print(c.prefix, flush=True)
        time.sleep(60)
    """)
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=env)
    prefix = p.stdout.readline().strip()
    assert prefix.startswith("gs") and any(n.startswith(prefix) for n in _netns())
    return p, prefix


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_in_owner_process_removes_everything(sig):
    p, prefix = _owner_process("default")
    p.send_signal(sig)
    rc = p.wait(timeout=20)
    assert rc != 0  # SIGTERM: killed by the re-raised signal; SIGINT: KeyboardInterrupt
    assert not any(n.startswith(prefix) for n in _netns())


@needs_root
def test_an_ignored_sigint_stays_ignored():
    p, prefix = _owner_process("ignore")
    try:
        p.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=1)
        assert any(n.startswith(prefix) for n in _netns()), "the cluster must survive an ignored SIGINT"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) != 0
        assert not any(n.startswith(prefix) for n in _netns())
    finally:
        p.kill()


@needs_root
def test_cleanup_stale_removes_dead_owner_runs_only():
    c = EmulatedCluster(1, 10.0).start()
    try:
        # a live owner (this process): left alone
        assert cleanup_stale(c.prefix) == []
        dead = subprocess.Popen(["true"])
        dead.wait()
        with open(os.path.join(RECORD_DIR, f"{c.prefix}.pid"), "w") as fh:
            fh.write(str(dead.pid))
        removed = cleanup_stale(c.prefix)
        assert sorted(removed) == sorted([c.namespace(0), c.bridge_ns])
        assert not any(n.startswith(c.prefix) for n in _netns())
    finally:
        c.close()  # idempotent after the namespaces are already gone


@needs_root
def test_bandwidth_schedule_and_netem_absent():
    with EmulatedCluster(2, 100.0) as c:
        steps = BandwidthSchedule.parse("0.1:20, 0.3:300")
        assert steps == [(0.1, 20.0), (0.3, 300.0)]
        with BandwidthSchedule(c, steps) as sched:
            time.sleep(0.2)
            assert "rate 20Mbit" in c.qdisc_show(1)
            time.sleep(0.3)
        assert [m for _, m in sched.applied] == [20.0, 300.0] and not sched.errors
        assert "rate 300Mbit" in c.qdisc_show(0, bridge_side=True)
        assert c.rates_mbit == [300.0, 300.0]
    c2 = EmulatedCluster(2, 100.0, latency_ms=5.0)
    try:
        c2.start()
    except NetemUnavailable as exc:  # this project's kernels: netem absent
        assert "netem" in str(exc)
    else:  # a kernel with netem: delay and tbf are both installed
        try:
            assert "netem" in c2.qdisc_show(0) and "tbf" in c2.qdisc_show(0)
        finally:
            c2.close()
    assert not any(n.startswith(c2.prefix) for n in _netns())


def test_loopback_fallback_and_arguments():
    c = EmulatedCluster(2, 100.0, mode="loopback")
    with c:
        assert not c.shaped and c.reason == "loopback requested"
        assert c.label == "loopback, NOT shaped (loopback requested)"
        assert c.address(1) == "127.0.0.1" and c.ifname(0) == "lo"
        c.set_bandwidth(None, 10.0)  # warns, no effect
        p = c.popen(1, [sys.executable, "-c", "print('hi')"], stdout=subprocess.PIPE, text=True)
        assert p.communicate(timeout=30)[0].strip() == "hi"
    with pytest.raises(NetemUnavailable):
        EmulatedCluster(2, 100.0, mode="loopback", latency_ms=3).start()
    for call in (
        lambda: EmulatedCluster(0, 100.0),
        lambda: EmulatedCluster(2, 0.0),
        lambda: EmulatedCluster(2, [100.0]),
        lambda: EmulatedCluster(2, 100.0, burst="lots"),
        lambda: EmulatedCluster(2, 100.0, mode="cloud"),
        lambda: EmulatedCluster(2, 100.0, prefix="xx"),
        lambda: EmulatedCluster(2, 100.0, latency_ms=-1),
        lambda: c.address(5),
        lambda: BandwidthSchedule.parse("10"),
        lambda: BandwidthSchedule.parse(""),
        lambda: BandwidthSchedule(c, [(-1.0, 10.0)]),
    ):
        with pytest.raises(ValueError):
            call()


def test_auto_falls_back_when_not_root(monkeypatch):
    from gradsync.cluster import netns

    monkeypatch.setattr(netns, "why_unshaped", lambda: "not root")
    with EmulatedCluster(2, 100.0) as c:
        assert not c.shaped and c.label == "loopback, NOT shaped (not root)"
    with pytest.raises(ClusterError, match="not root"):
        EmulatedCluster(2, 100.0, mode="netns").start()
    assert netns.cleanup_stale() == []


def test_auto_burst_policy_and_commands():
    from gradsync.cluster import Topology, auto_burst
    from gradsync.cluster.commands import qdisc_add_commands, qdisc_change_command, resolve_burst

    # max(16 kb, 4 ms at the link rate), in tc kb (1024 bytes): the policy bench used
    for mbit in (1.0, 5.0, 20.0, 32.0, 33.0, 100.0, 1000.0, 25_000.0):
        want = max(16, int(mbit * 1e6 / 8 * 0.004 / 1024) + 1)
        assert auto_burst(mbit) == f"{want}kb"
    assert auto_burst(100.0) == "49kb" and auto_burst(10.0) == "16kb"
    assert resolve_burst("auto", 1000.0) == "489kb" and resolve_burst("32kb", 1000.0) == "32kb"
    with pytest.raises(ValueError, match="mbit"):
        auto_burst(0.0)
    assert qdisc_add_commands("ns", "d", 100.0, "49kb") == [
        ["tc", "-n", "ns", "qdisc", "add", "dev", "d", "root", "handle", "10:",
         "tbf", "rate", "100000kbit", "burst", "49kb", "latency", "50ms"]]
    netem = qdisc_add_commands("ns", "d", 10.0, "16kb", latency_ms=5.0)
    assert netem[0][-3:] == ["netem", "delay", "2.5ms"] and netem[1][7:10] == ["parent", "1:1", "handle"]
    assert qdisc_change_command("ns", "d", 10.0, "16kb")[4:10] == ["change", "dev", "d", "root", "handle", "10:"]
    topo = Topology(2, "gs0a1b2c", (30, 4))
    assert topo.namespaces() == ["gs0a1b2cbr", "gs0a1b2ch0", "gs0a1b2ch1"]
    assert topo.address(1) == "10.30.4.2" and topo.shaped_links(1) == [("gs0a1b2ch1", "gs0a1b2ce1"),
                                                                         ("gs0a1b2cbr", "gs0a1b2cb1")]
    assert ["ip", "-n", "gs0a1b2ch0", "addr", "add", "10.30.4.1/24", "dev", "gs0a1b2ce0"] in topo.host_commands(0)
    with pytest.raises(ValueError, match="host index"):
        topo.namespace(2)
    with pytest.raises(ValueError, match="prefix"):
        Topology(2, "xx", (1, 1))
    # the cluster's default is the same policy, per link and at the current rate
    c = EmulatedCluster(2, [100.0, 1000.0])
    assert c.burst == "auto" and c.link_burst(0) == "49kb" and c.link_burst(1) == "489kb"
    assert EmulatedCluster(2, 100.0, burst="32kb").link_burst(1) == "32kb"


def _burst_bytes(qdisc: str) -> float:
    """The tbf burst in bytes from ``tc qdisc show`` ("burst 49Kb", "burst 500625b")."""
    import re

    m = re.search(r"burst (\d+(?:\.\d+)?)([KMG]?)b", qdisc)
    assert m, qdisc
    return float(m.group(1)) * {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}[m.group(2)]


@needs_root
def test_auto_burst_installed_and_follows_rate_changes():
    with EmulatedCluster(2, [100.0, 20.0]) as c:
        assert c.shaped, c.reason
        # the kernel stores the burst in timer ticks, so tc shows it rounded (within 1 %)
        for side in (False, True):
            assert _burst_bytes(c.qdisc_show(0, side)) == pytest.approx(49 * 1024, rel=0.01)
            assert _burst_bytes(c.qdisc_show(1, side)) == pytest.approx(16 * 1024, rel=0.01)
        c.set_bandwidth(1, 1000.0)
        for side in (False, True):
            assert "rate 1Gbit" in c.qdisc_show(1, side)
            assert _burst_bytes(c.qdisc_show(1, side)) == pytest.approx(489 * 1024, rel=0.01)
