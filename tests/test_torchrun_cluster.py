"""Multi-node training on torchrun: one agent per emulated host (network namespace, shaped link),
c10d rendezvous across the hosts, as on real nodes (:mod:`gradsync.cluster.torchrun`).

Needs root (namespaces, tc) and Fashion-MNIST; skipped with the reason otherwise."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.cluster import EmulatedCluster
from gradsync.cluster.torchrun import TorchrunNodes, wait_all
from gradsync.comm.rendezvous import free_port
from gradsync.workloads import fashion_mnist

_WHY = None
if os.geteuid() != 0:
    _WHY = "not root: network namespaces and tc need root"
elif shutil.which("ip") is None or shutil.which("tc") is None:
    _WHY = "ip/tc (iproute2) not installed"
elif not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists():
    _WHY = "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

TRAIN = ["train", "--algorithm", "covap", "--ratio", "2", "--max-steps", "8", "--eval-samples", "200",
         "--seed", "3", "--timeout", "60"]


def _losses(out: Path) -> list[tuple[int, float, float]]:
    its = json.loads((out / "metrics.json").read_text())["iterations"]
    return [(i["step"], i["loss"], i["wire_bytes"]) for i in its]


def _torchrun(tmp_path: Path, hosts: int, nproc: int, args: list[str], mbit: float = 50) -> tuple[list[int], dict]:
    nodes = TorchrunNodes(nproc_per_node=nproc, port=free_port(), rdzv_id=f"t{os.getpid()}")
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(hosts)]
    try:
        with EmulatedCluster(hosts, mbit, mode="netns") as cluster:
            procs = nodes.start(cluster, "gradsync", args, stdout=lambda i: logs[i], stderr=subprocess.STDOUT,
                                cwd=str(tmp_path))
            codes = wait_all(procs, timeout_s=300)
            label = cluster.label
    finally:
        for f in logs:
            f.close()
    return codes, {"label": label, "logs": [(tmp_path / f"node{i}.log").read_text() for i in range(hosts)]}


def test_two_nodes_one_process_each_match_the_local_launcher(tmp_path):
    local = subprocess.run([sys.executable, "-m", "gradsync", *TRAIN, "--workers", "2", "--out", str(tmp_path / "local")],
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    codes, run = _torchrun(tmp_path, 2, 1, [*TRAIN, "--out", str(tmp_path / "multi")])
    assert codes == [0, 0], run["logs"]
    summary = json.loads((tmp_path / "multi" / "metrics.json").read_text())["summary"]
    assert summary["world_size"] == 2
    expected, got = _losses(tmp_path / "local"), _losses(tmp_path / "multi")
    assert len(got) == 8
    # same seed, same data shards per rank, same collectives: identical per-step losses and wire bytes
    assert got == expected, (got, expected)


def test_cli_launcher_torchrun_two_nodes_two_processes_each(tmp_path):
    """``gradsync train --hosts 2 --workers 4 --launcher torchrun``: the command the README shows."""
    out = tmp_path / "multi"
    run = subprocess.run([sys.executable, "-m", "gradsync", "train", "--hosts", "2", "--workers", "4", "--bandwidth", "50",
                          "--launcher", "torchrun", "--algorithm", "covap", "--ratio", "2", "--max-steps", "4",
                          "--eval-samples", "200", "--timeout", "60", "--out", str(out)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torchrun: 2 agents x 2 processes" in run.stdout, run.stdout
    result = json.loads((out / "metrics.json").read_text())
    assert result["summary"]["world_size"] == 4
    assert result["network"] == "torchrun agents on emulated 2 hosts, tbf 50 Mbit/s", result["network"]
    losses = [i["loss"] for i in result["iterations"]]
    assert len(losses) == 4 and all(0 < x < 10 for x in losses), losses


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_worker_when(agent: subprocess.Popen, ready: Path, timeout_s: float = 240) -> int:
    """SIGKILL the training worker under torchrun ``agent`` as soon as ``ready`` exists; its pid."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert agent.poll() is None, "the agent ended before the checkpoint appeared"
        assert time.monotonic() < deadline, f"{ready} did not appear"
        time.sleep(0.02)
    workers = [c for c in _children(agent.pid) if b"gradsync" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    return workers[0]


@pytest.mark.parametrize("algorithm", [["--algorithm", "covap", "--ratio", "2"], ["--algorithm", "dear"]],
                         ids=["covap", "dear"])
def test_elastic_restart_resumes_from_the_newest_checkpoint(tmp_path, algorithm):
    """2 nodes, --max-restarts 1, one node's worker SIGKILLed after the step-10 checkpoint: torchrun
    restarts both workers, ``--resume latest`` continues from step 10 (it started fresh the first
    time, when there was none) and the losses equal the uninterrupted run's from there on. Each host
    checkpoints into its own directory (no shared filesystem); the nodes agree on the step. One
    restart is enough because the agents do not share their TCPStore with the workers
    (:data:`gradsync.cluster.torchrun.ELASTIC_ENV`); with the sharing it took up to 3."""
    common = ["train", *algorithm, "--max-steps", "20", "--eval-samples", "200", "--seed", "5", "--timeout", "60",
              "--checkpoint-every", "5"]
    codes, _ = _torchrun(tmp_path, 2, 1, [*common, "--checkpoint", str(tmp_path / "ck0"), "--out", str(tmp_path / "whole")])
    assert codes == [0, 0]

    # no shared filesystem: each host checkpoints into a directory of its own
    nodes = TorchrunNodes(port=free_port(), rdzv_id=f"r{os.getpid()}", max_restarts=1)
    args = [[*common, "--checkpoint", str(tmp_path / f"ck1-host{i}"), "--resume", "latest",
             "--out", str(tmp_path / "restarted")] for i in range(2)]
    logs = [open(tmp_path / f"restart{i}.log", "w") for i in range(2)]
    try:
        with EmulatedCluster(2, 50, mode="netns") as cluster:
            agents = nodes.start(cluster, "gradsync", args, stdout=lambda i: logs[i], stderr=subprocess.STDOUT)
            _kill_worker_when(agents[1], tmp_path / "ck1-host1" / "step10" / "manifest.node1.json")
            codes = wait_all(agents, timeout_s=300)
    finally:
        for f in logs:
            f.close()
    text = [(tmp_path / f"restart{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], text
    assert "starting from scratch" in text[0] + text[1], "the first attempt should have said it starts fresh"
    whole = {s: (loss, wire) for s, loss, wire in _losses(tmp_path / "whole")}
    assert "resuming from" in text[0] and "step10 (step 10" in text[0], text[0]
    for i in range(2):  # each host's directory holds only its own node's files and manifest
        names = sorted(p.name for p in (tmp_path / f"ck1-host{i}" / "step10").iterdir())
        assert names == [f"manifest.node{i}.json", f"rank{i}.pt"], names
    after = _losses(tmp_path / "restarted")  # steps 1-10 restored from the checkpoint, 11-20 trained again
    assert [s for s, _, _ in after] == list(range(1, 21)), after
    assert all(whole[s] == (loss, wire) for s, loss, wire in after), (after, whole)
