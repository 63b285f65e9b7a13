"""Multi-node training on torchrun: one agent per emulated host (network namespace, shaped link),
c10d rendezvous across the hosts, as on real nodes (:mod:`gradsync.cluster.torchrun`).

Needs root (namespaces, tc) and Fashion-MNIST; skipped with the reason otherwise."""

import json
import os
import shutil
import subprocess
import sys
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
