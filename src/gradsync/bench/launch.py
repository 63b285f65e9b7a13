"""Start the ranks of a benchmark: one process per emulated host, or on loopback without shaping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..comm.rendezvous import free_port
from .config import BenchConfig


class RankError(RuntimeError):
    """A rank exited with an error; the message carries the end of its output."""


def run_ranks(cfg: BenchConfig, cluster: Any = None, module: str = "gradsync.bench.worker",
              deadline_s: float | None = None) -> dict[str, Any]:
    """Run ``python -m <module> CONFIG RESULT`` on ``cfg.hosts`` ranks and return rank 0's result.

    With ``cluster`` (an :class:`~gradsync.cluster.netns.EmulatedCluster`) rank ``i`` runs inside
    host ``i`` and rendezvous uses host 0's address; otherwise all ranks run on 127.0.0.1.

    Raises:
        RankError: when a rank fails (the others are stopped) or the run exceeds ``deadline_s``.
    """
    with tempfile.TemporaryDirectory(prefix="gradsync-bench-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(cfg.to_json())
        port = free_port()
        procs, logs = [], []
        for r in range(cfg.hosts):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(cfg.hosts), LOCAL_RANK="0",
                       MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
            argv = [sys.executable, "-m", module, str(cfg_path), str(out_path)]
            log = open(Path(tmp) / f"rank{r}.log", "w+")
            logs.append(log)
            out = None if r == 0 else log
            if cluster is not None and cluster.shaped:
                env.update(MASTER_ADDR=cluster.address(0), GLOO_SOCKET_IFNAME=cluster.ifname(r))
                procs.append(cluster.popen(r, argv, env=env, stdout=out, stderr=log))
            else:
                env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=log))
        start = time.monotonic()
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed:
                    raise RankError(_failure(failed[0], procs, logs))
                if deadline_s is not None and time.monotonic() - start > deadline_s:
                    raise RankError(f"benchmark exceeded {deadline_s:.0f} s")
                time.sleep(0.2)
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                raise RankError(_failure(failed[0], procs, logs))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            for log in logs:
                log.close()
        import json

        return json.loads(out_path.read_text())


def _failure(rank: int, procs, logs) -> str:
    logs[rank].flush()
    logs[rank].seek(0)
    tail = logs[rank].read()[-3000:]
    return f"rank {rank} exited with code {procs[rank].returncode}:\n{tail}"
