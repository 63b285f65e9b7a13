"""Start the training ranks: under ``torchrun`` use its environment, otherwise start local workers
(:class:`gradsync.launch.LocalRanks`, which stops the others and reports when one dies).

Local workers join a process group on 127.0.0.1 (a free port is chosen); ``--backend auto`` picks
NCCL for them only with one CUDA device per rank, for ranks on an emulated cluster never, and under
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) when the rank's ``LOCAL_RANK`` names a
CUDA device (:func:`choose_backend`), so the same command scales from a laptop to a cluster.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm.futures import shutdown_process_group
from ..launch import LocalRanks, RankFailure, local_start_method, run_module_ranks
from .config import TrainConfig


#: Set by ``gradsync train --launcher torchrun`` in its agents' environment: the emulated network's label.
EMULATED_NETWORK_VAR = "GRADSYNC_EMULATED_NETWORK"


def under_torchrun() -> bool:
    """True when the process was started by torchrun (or another launcher setting its variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


LAUNCHERS = ("torchrun", "local", "emulated")


def choose_backend(requested: str, launcher: str, world: int, local_rank: int) -> tuple[str, str]:
    """The process-group backend of one rank and why: ``(backend, reason)``.

    ``requested`` ``"gloo"``/``"nccl"`` is kept. ``"auto"``: under torchrun NCCL iff CUDA (with NCCL)
    is available and ``local_rank`` < the CUDA device count; for local ranks (``launcher`` ``"local"``,
    ``world`` ranks on this host) NCCL iff there is one CUDA device per rank; for ranks on an emulated
    cluster (``"emulated"``) always Gloo: their hosts share this machine's devices (every rank has
    ``LOCAL_RANK`` 0 on a host of its own) and NCCL would bypass the shaped links. Every rank of one
    host decides alike (device count and ``world`` are the host's).

    Raises:
        ValueError: for ``launcher`` not one of torchrun, local, emulated.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if requested != "auto":
        return requested, "--backend " + requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0
    if launcher == "emulated":
        return "gloo", "auto: ranks on emulated hosts (NCCL would bypass the shaped links)"
    if launcher == "torchrun":
        if local_rank < gpus:
            return "nccl", f"auto: torchrun, LOCAL_RANK {local_rank} < {gpus} CUDA device(s)"
        return "gloo", (f"auto: torchrun, no CUDA device with NCCL for LOCAL_RANK {local_rank} "
                        f"({gpus} CUDA device(s))")
    if gpus >= world:
        return "nccl", f"auto: {world} local ranks, {gpus} CUDA device(s): one per rank"
    return "gloo", f"auto: {world} local ranks, {gpus} CUDA device(s) with NCCL (NCCL needs one per rank)"


def _run_rank(rank: int, world: int, local_rank: int, cfg: TrainConfig, launcher: str) -> dict[str, Any] | None:
    """One rank: join the process group (backend from :func:`choose_backend`), train, and always
    destroy the group on the way out (an exception included), so nothing gradsync started is left
    for interpreter teardown. Rank 0's results say which backend was used and why."""
    from .loop import run

    backend, reason = choose_backend(cfg.backend, launcher, world, local_rank)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        result = run(cfg, device)
    finally:
        shutdown_process_group()
    if result is not None:
        result["summary"]["backend"] = f"{backend} ({reason})"
    return result


def _local_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any] | None:
    return _run_rank(rank, world, rank, cfg, "local")


class TrainingFailed(RankFailure):
    """A local training rank failed and the others were stopped; :meth:`report` is the message for
    the user: which rank, how it ended, the last completed step, the newest complete checkpoint
    and the command that resumes from it."""

    def __init__(self, failure: RankFailure, checkpoint_dir: str | None):
        super().__init__(failure.failed, failure.exits, failure.steps, failure.timed_out,
                         timeout=failure.timeout, results=failure.results)
        self.checkpoint = None
        if checkpoint_dir:
            from .checkpoint import latest_checkpoint

            self.checkpoint = latest_checkpoint(checkpoint_dir, warn=False)

    def report(self, argv: Sequence[str] | None = None) -> str:
        """The message, with a resume command built from ``argv`` (default ``sys.argv[1:]``)."""
        lines = [f"gradsync train: {self.failed.describe()}"
                 + (f"; stopped the other {len(self.exits) - 1} rank(s)" if len(self.exits) > 1 else "")]
        step = self.last_step
        if not step and self.failed.error is not None:
            return lines[0]  # failed while starting (a configuration or data error): nothing to resume
        lines.append(f"  last completed step: {step if step else 'none'}")
        if self.checkpoint is None:
            lines.append("  no complete checkpoint to resume from (write them with --checkpoint DIR "
                         "--checkpoint-every N)")
        else:
            info = self.checkpoint
            lines.append(f"  newest checkpoint: {info.path} (step {info.step}, epoch {info.epoch})")
            lines.append(f"  resume with: {resume_command(argv, str(info.path))}")
        return "\n".join(lines)


def resume_command(argv: Sequence[str] | None, checkpoint: str) -> str:
    """``gradsync`` + ``argv`` (default ``sys.argv[1:]``) with ``--resume`` set to ``checkpoint``."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        out.append(a)
    return shlex.join(["gradsync", *out, "--resume", checkpoint])


def launch(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run training on every rank and return rank 0's results (``None`` on other torchrun ranks).

    Local ranks are forked, or spawned where CUDA is available
    (:func:`gradsync.launch.local_start_method`), by :class:`gradsync.launch.LocalRanks`.

    Raises:
        TrainingFailed: when a local rank fails (exception, exit code or signal); the other ranks
            are stopped first.
    """
    if under_torchrun():
        return _run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         int(os.environ.get("LOCAL_RANK", "0")), cfg, "torchrun")
    with LocalRanks(cfg.workers) as ranks:
        ranks.start_function(_local_rank, (cfg,), start_method=local_start_method())
        try:
            return ranks.join()[0]
        except RankFailure as exc:
            raise TrainingFailed(exc, cfg.checkpoint) from None


def network_label(cfg: TrainConfig) -> str:
    """How a run without an emulated cluster communicates, for the summary and ``metrics.json``."""
    if under_torchrun():
        if os.environ.get(EMULATED_NETWORK_VAR):  # agents started by gradsync train --launcher torchrun
            return f"torchrun agents on {os.environ[EMULATED_NETWORK_VAR]}"
        return f"torchrun (MASTER_ADDR {os.environ['MASTER_ADDR']}), the real network, not emulated"
    return "loopback, NOT shaped (no --hosts/--bandwidth)"


def launch_on_cluster(cfg: TrainConfig, cluster: Any, deadline_s: float | None = None) -> dict[str, Any]:
    """Run training as ``cfg.workers`` command ranks (``python -m gradsync.train.worker``) on the
    hosts of ``cluster`` (a started :class:`gradsync.cluster.EmulatedCluster`); return rank 0's results.

    Ranks are spread evenly: rank ``r`` runs inside host ``r // (workers / hosts)`` (``ip netns
    exec``), with ``GLOO_SOCKET_IFNAME`` set to that host's interface, ``LOCAL_RANK`` = its index on
    the host, and rendezvous at host 0's bridge address. An unshaped cluster (not root: its ``label``
    says "NOT shaped") runs the ranks on 127.0.0.1, forked where
    :func:`gradsync.launch.local_start_method` allows. Rank 0's stdout is shown; every rank's
    stderr (and the other ranks' stdout) go to logs whose tail is reported when a rank fails.

    Raises:
        ValueError: if ``cfg.workers`` is not a multiple of ``cluster.hosts``.
        TrainingFailed: when a rank fails (exception, exit code or signal) or the run exceeds
            ``deadline_s``; the other ranks are stopped first.
    """
    import json

    if cfg.workers % cluster.hosts:
        raise ValueError(f"workers must be a multiple of hosts ({cluster.hosts}), got {cfg.workers}")
    per_host = cfg.workers // cluster.hosts

    def popen(rank: int, argv: Sequence[str], env: dict[str, str], **kwargs: Any):
        env = dict(env, LOCAL_RANK=str(rank % per_host), LOCAL_WORLD_SIZE=str(per_host))
        return cluster.popen(rank // per_host, argv, env=env, **kwargs)

    try:
        return run_module_ranks("gradsync.train.worker", json.dumps(cfg.to_dict()), cfg.workers,
                                master_addr=cluster.address(0),
                                socket_ifname=lambda r: cluster.ifname(r // per_host),
                                popen=popen if cluster.shaped else None, deadline_s=deadline_s)
    except RankFailure as exc:
        raise TrainingFailed(exc, cfg.checkpoint) from None
