"""``gradsync train --hosts N --bandwidth R``: argument validation, the loopback fallback (labelled
NOT shaped) when namespaces cannot be built, and (as root) a killed rank on the emulated cluster."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync import cli
from gradsync.workloads import fashion_mnist

needs_data = pytest.mark.skipif(
    not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


def _network(*argv):
    from gradsync.cli.train import _train_network

    return _train_network(cli.build_parser().parse_args(["train", *argv]))


def test_hosts_and_workers_combinations(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert _network() == (2, None, None)
    assert _network("--workers", "3") == (3, None, None)
    assert _network("--hosts", "4", "--bandwidth", "25") == (4, 4, [25.0])
    assert _network("--hosts", "2", "--workers", "4", "--bandwidth", "25,50") == (4, 2, [25.0, 50.0])
    assert _network("--bandwidth", "100") == (2, 2, [100.0])  # one host per worker
    with pytest.raises(ValueError, match="workers must be a multiple of hosts"):
        _network("--hosts", "2", "--workers", "3", "--bandwidth", "25")
    with pytest.raises(ValueError, match="hosts needs --bandwidth"):
        _network("--hosts", "2")
    with pytest.raises(ValueError, match="hosts must be"):
        _network("--hosts", "0", "--bandwidth", "25")
    with pytest.raises(ValueError, match="bandwidth must give one rate or 2 rates"):
        _network("--hosts", "2", "--bandwidth", "1,2,3")
    with pytest.raises(ValueError, match="bandwidth must be Mbit/s"):
        _network("--hosts", "2", "--bandwidth", "fast")
    with pytest.raises(ValueError, match="latency and bandwidth-schedule need --bandwidth"):
        _network("--latency", "5")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ValueError, match="under torchrun"):
        _network("--hosts", "2", "--bandwidth", "25")


def test_cli_reports_bad_combination_as_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--hosts", "2", "--workers", "3", "--bandwidth", "25"])
    assert exc.value.code == 2
    assert "workers must be a multiple of hosts (2)" in capsys.readouterr().err


@needs_data
@pytest.mark.timeout(600)
def test_loopback_fallback_is_labelled(tmp_path, monkeypatch, capsys):
    from gradsync.cluster import netns

    monkeypatch.setattr(netns, "why_unshaped", lambda: "not root")
    out = tmp_path / "run"
    rc = cli.main(["train", "--hosts", "2", "--bandwidth", "50", "--algorithm", "covap", "--ratio", "2",
                   "--max-steps", "3", "--train-samples", "512", "--eval-samples", "200", "--no-progress",
                   "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    label = "loopback, NOT shaped (not root)"
    assert f"gradsync train: cannot emulate 2 hosts (not root): running on {label}" in text
    assert label in text.split("gradsync train: summary")[1], "the summary names the network"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["network"] == metrics["summary"]["network"] == label
    assert metrics["summary"]["world_size"] == 2 and metrics["summary"]["steps"] == 3
    assert metrics["summary"]["ratio"] == 2 and "covap (K=2)" in text


def _root_why():
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need root"
    from gradsync.cluster.commands import why_unshaped

    return why_unshaped()


@needs_data
@pytest.mark.skipif(_root_why() is not None, reason=_root_why() or "")
@pytest.mark.timeout(600)
def test_killed_rank_on_emulated_cluster_gives_one_message(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    timeout = 60
    proc = subprocess.Popen([sys.executable, "-m", "gradsync", "train", "--no-progress", "--hosts", "2",
                             "--bandwidth", "200", "--train-samples", "1280", "--max-steps", "500",
                             "--timeout", str(timeout)],
                            env=dict(os.environ, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "rank 1 did not reach step 3 within 300 s"
            slots = glob.glob(str(tmp / "gradsync-ranks-*" / "rank1"))
            if slots:
                step, pid = struct.unpack("<qq", Path(slots[0]).read_bytes()[:16])
                if step >= 3:
                    break
            time.sleep(0.1)
        prefix = next(line for line in open(f"/proc/{pid}/net/dev") if "gs" in line).split(":")[0].strip()[:8]
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=timeout + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "network: emulated 2 hosts, tbf 200 Mbit/s" in out
    lines = err.strip().splitlines()
    assert lines[0] == "gradsync train: rank 1 was killed by SIGKILL; stopped the other 1 rank(s)", err
    assert int(lines[1].split("last completed step:")[1]) >= 3
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix.startswith("gs") and prefix not in names, "the cluster's namespaces are removed"
