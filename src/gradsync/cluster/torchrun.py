"""torchrun across the hosts of an emulated cluster: one agent per host, as on real nodes.

Each host of a started :class:`~gradsync.cluster.EmulatedCluster` runs one ``torchrun`` agent
inside its network namespace::

    torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint HOST0:PORT
             --rdzv-id ID --rdzv-conf is_host=1|0 --local-addr HOST_i [--max-restarts R] -m MODULE ARGS

with ``GLOO_SOCKET_IFNAME`` set to the host's interface, so the c10d rendezvous, the process group
and every collective cross the shaped links exactly as between real nodes. Two flags are needed
only because the emulated hosts share one hostname that resolves to 127.0.0.1: ``--local-addr``
(otherwise the agents advertise the hostname, and the workers' ``MASTER_ADDR`` is 127.0.0.1) and
``--rdzv-conf is_host=1`` on host 0 (c10d cannot tell from the address which agent hosts its store).
On real nodes with resolvable hostnames neither is required. With ``--max-restarts``, set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` on every node (:data:`ELASTIC_ENV`, see there why).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..validation import check_int


#: Environment of every agent. With c10d rendezvous torchrun (2.13) lets the workers share the agents'
#: TCPStore across rendezvous rounds without a per-round prefix, so after a restart a worker can read
#: the previous round's address of a peer (Gloo: "connection refused", another restart; seen taking
#: 3 restarts for one killed worker). Opting out of the sharing gives every round a store of its own.
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class TorchrunNodes:
    """The ``torchrun`` agents of a multi-node job on an emulated cluster.

    Args:
        nproc_per_node: worker processes per host, >= 1.
        port: TCP port of the c10d rendezvous store on host 0, in [1024, 65535].
        rdzv_id: rendezvous id shared by the agents of one job.
        max_restarts: how often torchrun restarts the whole worker group after a worker fails
            (``--max-restarts``), >= 0.

    Raises:
        ValueError: for arguments outside those ranges.
    """

    nproc_per_node: int = 1
    port: int = 29400
    rdzv_id: str = "gradsync"
    max_restarts: int = 0

    def __post_init__(self) -> None:
        check_int("nproc_per_node", self.nproc_per_node, 1, 256)
        check_int("port", self.port, 1024, 65535)
        check_int("max_restarts", self.max_restarts, 0, 1000)
        if not self.rdzv_id or any(c.isspace() for c in self.rdzv_id):
            raise ValueError(f"rdzv_id must be a non-empty word, got {self.rdzv_id!r}")

    def command(self, cluster: Any, node: int, module: str, args: Sequence[str]) -> list[str]:
        """The agent command of host ``node`` (its argv, without the namespace prefix)."""
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(cluster.hosts), "--nproc-per-node", str(self.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.address(0)}:{self.port}",
                "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"is_host={1 if node == 0 else 0}",
                "--local-addr", cluster.address(node), "--max-restarts", str(self.max_restarts),
                "-m", module, *args]

    def start(self, cluster: Any, module: str, args: Sequence[str] | Sequence[Sequence[str]],
              env: Mapping[str, str] | None = None, **popen: Any) -> list[subprocess.Popen]:
        """Start one agent per host of the started ``cluster``, each running ``python -m module``
        with ``args`` (one list for every host, or one list per host, e.g. a checkpoint directory
        of its own). ``env`` (default: this process's) gains ``GLOO_SOCKET_IFNAME``; other keyword
        arguments go to ``Popen`` (a callable value is called with the host index first)."""
        per_host = [list(a) for a in args] if args and not isinstance(args[0], str) else [list(args)] * cluster.hosts
        if len(per_host) != cluster.hosts:
            raise ValueError(f"args must be one list or one list per host ({cluster.hosts}), got {len(per_host)}")
        procs = []
        for node in range(cluster.hosts):
            node_env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=cluster.ifname(node),
                            **ELASTIC_ENV)
            kwargs = {k: (v(node) if callable(v) else v) for k, v in popen.items()}
            procs.append(cluster.popen(node, self.command(cluster, node, module, per_host[node]), env=node_env,
                                       **kwargs))
        return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[int]:
    """Wait for every agent, ``timeout_s`` seconds in all; return their exit codes.

    Raises:
        subprocess.TimeoutExpired: if an agent is still running after ``timeout_s`` seconds
            (all agents are killed first).
    """
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * len(procs)
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise subprocess.TimeoutExpired([str(p.args) for p in procs], timeout_s)
        time.sleep(0.1)
    return [int(c) for c in codes]
