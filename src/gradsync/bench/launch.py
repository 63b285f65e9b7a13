"""Start the ranks of a benchmark: one process per emulated host, or on loopback without shaping.

The ranks are commands (``python -m gradsync.bench.worker CONFIG RESULT``) started and watched by
:class:`gradsync.launch.LocalRanks`, the launcher ``gradsync train`` and the tests use too.
"""

from __future__ import annotations

from typing import Any

from ..launch import RankFailure, run_module_ranks
from .config import BenchConfig

#: Raised when a benchmark rank fails (an alias kept for callers of this module).
RankError = RankFailure


def run_ranks(cfg: BenchConfig, cluster: Any = None, module: str = "gradsync.bench.worker",
              deadline_s: float | None = None) -> dict[str, Any]:
    """Run ``python -m <module> CONFIG RESULT`` on ``cfg.hosts`` ranks and return rank 0's result.

    With ``cluster`` (an :class:`~gradsync.cluster.netns.EmulatedCluster`) rank ``i`` runs inside
    host ``i`` (``ip netns exec``) with ``GLOO_SOCKET_IFNAME`` set to that host's interface and
    rendezvous at host 0's address; otherwise all ranks run on 127.0.0.1. Rank 0's stdout is
    shown; the other ranks' stdout and every rank's stderr go to logs whose tail is reported when
    a rank fails (:func:`gradsync.launch.run_module_ranks`).

    Raises:
        RankError: when a rank fails (the others are stopped) or the run exceeds ``deadline_s``.
    """
    shaped = cluster is not None and cluster.shaped
    return run_module_ranks(module, cfg.to_json(), cfg.hosts,
                            master_addr=cluster.address(0) if shaped else "127.0.0.1",
                            socket_ifname=cluster.ifname if shaped else "lo",
                            env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
                            popen=cluster.popen if shaped else None, deadline_s=deadline_s)
