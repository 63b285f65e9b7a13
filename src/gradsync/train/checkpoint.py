"""Per-rank training checkpoints: model, optimizer, LR scheduler, RNG and the algorithm's state
(error-feedback residuals, controller state), so a resumed run continues where it stopped.

Each rank writes ``DIR/rank{r}.pt`` (residuals differ between ranks); files are written to a
temporary name and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def checkpoint_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.pt"


def save_checkpoint(directory: str | os.PathLike, rank: int, payload: dict[str, Any]) -> Path:
    """Write ``payload`` for ``rank`` atomically; returns the file path."""
    path = checkpoint_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(directory: str | os.PathLike, rank: int) -> dict[str, Any]:
    """Read ``rank``'s checkpoint.

    Raises:
        FileNotFoundError: naming the missing file (a checkpoint needs one file per rank).
    """
    path = checkpoint_file(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found (resume needs one rank*.pt per rank, "
                                "written by --checkpoint with the same world size)")
    return torch.load(path, map_location="cpu", weights_only=False)
