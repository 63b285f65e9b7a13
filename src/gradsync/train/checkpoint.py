"""Per-rank training checkpoints: model, optimizer, LR scheduler, RNG and the algorithm's state
(error-feedback residuals, controller state), so a resumed run continues where it stopped. The files
(durable writes, manifests, agreement across ranks, verified loads) are
:mod:`gradsync.train.checkpoint_files`, whose API is re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .checkpoint_files import (  # noqa: F401  (re-exported: the file API a training checkpoint uses)
    CheckpointInfo, CheckpointSaveError, FORMAT, IncompleteCheckpoint, MANIFEST, agree_latest, checkpoint_file,
    epoch_dir, from_safe, latest_checkpoint, load_checkpoint, manifest_name, node_of, read_checkpoint_info,
    resolve_resume, save_checkpoint, save_rank_file, step_dir, to_safe, verified_checkpoints, write_manifest)


def rng_state() -> dict[str, Any]:
    """torch's CPU generator state, and every CUDA device's when CUDA is initialised."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any] | torch.Tensor) -> None:
    """Restore :func:`rng_state` (or a bare CPU state tensor, as older checkpoints stored)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_batches(loader: Any, ckpt: dict[str, Any] | None) -> Any:
    """An iterator over ``loader`` for the first epoch of a resumed run, positioned and seeded as
    the uninterrupted run was when ``ckpt`` was written.

    Creating a DataLoader iterator draws from torch's global generator, so an end-of-epoch
    checkpoint (``epoch_step`` 0) restores the RNG before the iterator is made, and a mid-epoch
    one after it has skipped the ``epoch_step`` batches already trained on. With ``ckpt`` None
    this is ``iter(loader)``.
    """
    if ckpt is None:
        return iter(loader)
    skip = int(ckpt.get("epoch_step", 0))
    if skip == 0:
        set_rng_state(ckpt["rng"])
        return iter(loader)
    it = iter(loader)
    for _ in range(skip):
        next(it)
    set_rng_state(ckpt["rng"])
    return it


def save_training_checkpoint(directory: str | os.PathLike, cfg: Any, dp: Any, sched: Any, *, epoch: int,
                             epoch_step: int, step: int, train_seconds: float,
                             iterations: list[dict[str, Any]], epochs: list[dict[str, Any]],
                             scaler: Any = None) -> Path:
    """Save the training state of this rank (collective, see :func:`save_checkpoint`).

    ``dp`` is the :class:`~gradsync.algorithms.synchroniser.Synchroniser` (flushed first, so a
    pending DeAR update is in the parameters), ``sched`` the LR scheduler; ``epoch`` is the epoch
    the run continues in and ``epoch_step`` the batches of it already trained on (0 after an epoch);
    ``scaler`` the ``torch.amp.GradScaler`` of an fp16 run (its loss scale and growth tracker are saved).
    """
    dp.flush()
    payload = {"config": cfg.to_dict(), "epoch": epoch, "epoch_step": epoch_step, "step": step,
               "train_seconds": train_seconds, "model": dp.module.state_dict(),
               "optimizer": dp.optimizer.state_dict(), "scheduler": sched.state_dict(),
               "algorithm": dp.state_dict(), "rng": rng_state(), "iterations": iterations,
               "epochs": epochs}
    if scaler is not None:
        payload["scaler"] = scaler.state_dict()
    return save_checkpoint(directory, payload, step=step, epoch=epoch, algorithm=cfg.algorithm)


def restore_training(cfg: Any, dp: Any, sched: Any, scaler: Any = None) -> dict[str, Any] | None:
    """Load the checkpoint ``cfg.resume`` names (``"latest"``: see :func:`resolve_resume`) into the
    model, optimizer, LR scheduler, algorithm state and ``scaler`` (a GradScaler); return it (epoch, step, logs; its RNG state
    is restored by :func:`resume_batches`), or None when ``latest`` found nothing. Collective.

    Raises:
        FileNotFoundError: if this rank's file is missing.
        ValueError: if the checkpoint was written by another algorithm or world size.
        IncompleteCheckpoint: if the file does not match its manifest.
    """
    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    path = resolve_resume(cfg.resume, cfg.checkpoint, rank, world)
    if path is None:
        return None
    ckpt = load_checkpoint(path, rank, world)
    if ckpt["config"]["algorithm"] != cfg.algorithm:
        raise ValueError(f"resume: checkpoint was written by algorithm {ckpt['config']['algorithm']!r}, "
                         f"not {cfg.algorithm!r}")
    dp.module.load_state_dict(ckpt["model"])
    dp.optimizer.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    dp.load_state_dict(ckpt["algorithm"])
    if scaler is not None and "scaler" in ckpt:
        scaler.load_state_dict(ckpt["scaler"])
    return ckpt
