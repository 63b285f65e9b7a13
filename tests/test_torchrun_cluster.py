"""Multi-node training on torchrun: one agent per emulated host (network namespace, shaped link),
c10d rendezvous across the hosts, as on real nodes (:mod:`gradsync.cluster.torchrun`).

Needs root (namespaces, tc) and Fashion-MNIST; skipped with the reason otherwise."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distributed import cluster_skip_reason
from gradsync.cluster import EmulatedCluster
from gradsync.cluster.torchrun import TorchrunNodes, wait_all
from gradsync.comm.rendezvous import free_port
from cli_runner import run_cli

_WHY = cluster_skip_reason(needs_fashion_mnist=True)
pytestmark = pytest.mark.skipif(_WHY is not None, reason=_WHY or "")

# covap: error-feedback residuals and the schedule step go through the checkpoint and the restart (DeAR's
# resume is the same code under either launcher: tests/test_train_e2e.py resumes it locally)
ALGORITHMS = {"covap": ["--algorithm", "covap", "--ratio", "2"]}


def _train_args(algorithm: str, checkpoint: Path) -> list[str]:
    # batch 16 (not the recipe's 64): the reference and the restarted run compute a quarter per step; what is
    # compared (losses and wire bytes, step by step, bitwise) does not depend on the batch size
    return ["train", *ALGORITHMS[algorithm], "--max-steps", "12", "--batch-size", "16", "--eval-samples", "200",
            "--seed", "5", "--timeout", "60", "--checkpoint", str(checkpoint), "--checkpoint-every", "3"]


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """The uninterrupted local-launcher run (``--workers 2``) of each algorithm: the reference."""
    out = {}
    for name in ALGORITHMS:
        d = tmp_path_factory.mktemp(f"local-{name}")
        run = run_cli([*_train_args(name, d / "ck"), "--workers", "2", "--out", str(d / "out")], timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        out[name] = _losses(d / "out")
    return out


def _losses(out: Path) -> list[tuple[int, float, float]]:
    its = json.loads((out / "metrics.json").read_text())["iterations"]
    return [(i["step"], i["loss"], i["wire_bytes"]) for i in its]


def test_cli_launcher_torchrun_two_nodes_two_processes_each(tmp_path):
    """``gradsync train --hosts 2 --workers 4 --launcher torchrun``: the command the README shows."""
    out = tmp_path / "multi"
    run = run_cli(["train", "--hosts", "2", "--workers", "4", "--bandwidth", "50", "--launcher", "torchrun",
                   "--algorithm", "covap", "--ratio", "2", "--max-steps", "4", "--batch-size", "16",
                   "--eval-samples", "200", "--timeout", "60", "--out", str(out)], timeout=400)
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


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_elastic_restart_resumes_from_the_newest_checkpoint(tmp_path, algorithm, local_runs):
    """2 nodes, --max-restarts 1, one node's worker SIGKILLed after the step-6 checkpoint: torchrun
    restarts both workers, ``--resume latest`` continues from step 6 (it started fresh the first
    time, when there was none) and the per-step losses and wire bytes equal the local launcher's
    uninterrupted run: steps 1-6 from the first torchrun attempt, 7-12 from the restarted one. Each host
    checkpoints into its own directory (no shared filesystem); the nodes agree on the step. One
    restart is enough because the agents do not share their TCPStore with the workers
    (:data:`gradsync.cluster.torchrun.ELASTIC_ENV`); with the sharing it took up to 3."""
    # no shared filesystem: each host checkpoints into a directory of its own
    nodes = TorchrunNodes(port=free_port(), rdzv_id=f"r{os.getpid()}", max_restarts=1)
    args = [[*_train_args(algorithm, tmp_path / f"ck1-host{i}"), "--resume", "latest",
             "--out", str(tmp_path / "restarted")] for i in range(2)]
    logs = [open(tmp_path / f"restart{i}.log", "w") for i in range(2)]
    try:
        with EmulatedCluster(2, 200, mode="netns") as cluster:
            agents = nodes.start(cluster, "gradsync", args, stdout=lambda i: logs[i], stderr=subprocess.STDOUT)
            _kill_worker_when(agents[1], tmp_path / "ck1-host1" / "step6" / "manifest.node1.json")
            codes = wait_all(agents, timeout_s=300)
    finally:
        for f in logs:
            f.close()
    text = [(tmp_path / f"restart{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], text
    assert "starting from scratch" in text[0] + text[1], "the first attempt should have said it starts fresh"
    assert "resuming from" in text[0] and "step6 (step 6" in text[0], text[0]
    for i in range(2):  # each host's directory holds only its own node's files and manifest
        names = sorted(p.name for p in (tmp_path / f"ck1-host{i}" / "step6").iterdir())
        assert names == [f"manifest.node{i}.json", f"rank{i}.pt"], names
    after = _losses(tmp_path / "restarted")  # steps 1-6 restored from the checkpoint, 7-12 trained again
    assert after == local_runs[algorithm], (after, local_runs[algorithm])
