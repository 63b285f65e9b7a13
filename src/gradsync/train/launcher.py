"""Start the training ranks: under ``torchrun`` use its environment, otherwise spawn local workers.

Local workers join a Gloo process group on 127.0.0.1 (a free port is chosen); under ``torchrun``
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` set) the backend is NCCL when CUDA is available, else
Gloo, so the same command scales from a laptop to a cluster.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..comm.rendezvous import free_port
from .config import TrainConfig


def under_torchrun() -> bool:
    """True when the process was started by torchrun (or another launcher setting its variables)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _backend_and_device(cfg: TrainConfig, local_rank: int) -> tuple[str, torch.device]:
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def _run_rank(rank: int, world: int, local_rank: int, cfg: TrainConfig) -> dict[str, Any] | None:
    from .loop import run

    backend, device = _backend_and_device(cfg, local_rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        return run(cfg, device)
    finally:
        dist.destroy_process_group()


def _spawned(index: int, world: int, port: int, cfg: TrainConfig, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result = _run_rank(index, world, index, cfg)
    if result is not None:
        queue.put(result)


def launch(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run training on every rank and return rank 0's results (``None`` on other torchrun ranks).

    Raises:
        torch.multiprocessing.ProcessRaisedException: when a spawned rank fails (its traceback
            is in the message); the other ranks are terminated.
    """
    if under_torchrun():
        return _run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         int(os.environ.get("LOCAL_RANK", 0)), cfg)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(_spawned, args=(cfg.workers, free_port(), cfg, queue),
                               nprocs=cfg.workers, join=False, start_method="spawn")
    # Read rank 0's result while waiting: a large result blocks its writer until it is read.
    result = None
    while True:
        if result is None and not queue.empty():
            result = queue.get()
        if procs.join(timeout=0.5):
            break
    if result is None and not queue.empty():
        result = queue.get()
    return result
