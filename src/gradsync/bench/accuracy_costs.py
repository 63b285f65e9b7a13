"""Accuracy-cost rows: each setting's steps to a quality target against dense all-reduce in the same
grid, as data (``benchmarks/data/accuracy_costs.json``, schema :data:`SCHEMA`), written by
``gradsync sweep`` into its folder (``accuracy_costs.json``) with the command, commit, machine and
seeds, and merged into the data file by ``benchmarks/merge_accuracy_costs.py``. The quality model
(:mod:`gradsync.profiler.quality_model`) is fitted on these rows; auto reads none of them.

A row: ``entry``, ``model`` (``workload:model``), ``world_size``, ``optimizer``, ``seeds`` (count),
``per_seed_steps`` (steps to the target per seed, ``None`` where the seed missed it), ``steps`` (the
olympic mean over >= 5 seeds, else the median, a missed seed counting as never), ``dense_steps``
(the same for the dense entry), ``not_reached`` (more than one seed missed, or the aggregate is
never), ``budget_steps``, ``target``, ``source`` (the command), ``commit``, ``machine``, ``note``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

__all__ = ["SCHEMA", "aggregate_steps", "cost_rows", "merge_rows", "provenance"]

SCHEMA = "gradsync-accuracy-costs/1"


def aggregate_steps(per_seed: Sequence[Optional[int]]) -> float:
    """Steps to the target over seeds: the olympic mean (drop the fewest and the most, average the
    rest) over >= 5 seeds, else the median; a missed seed (``None``) counts as ``math.inf``.

    Raises:
        ValueError: for an empty ``per_seed``.
    """
    if not per_seed:
        raise ValueError("per_seed must hold at least one seed's steps")
    values = sorted(math.inf if s is None else float(s) for s in per_seed)
    return statistics.fmean(values[1:-1]) if len(values) >= 5 else statistics.median(values)


def provenance(cwd: Optional[os.PathLike[str] | str] = None) -> tuple[str, str]:
    """``(commit, machine)``: the git commit of ``cwd`` (short hash, ``"unknown"`` outside a git
    checkout) and the machine in words (architecture, processor, cores, torch, accelerator)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=cwd or Path(__file__).parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    machine = (f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores, "
               f"torch {torch.__version__}, {device}")
    return commit, machine


def cost_rows(quality: dict[str, Any], *, model: str, optimizer: str, command: str, commit: str, machine: str,
              dense: str = "allreduce", skip: Iterable[str] = ("auto",)) -> list[dict[str, Any]]:
    """One row per entry of a sweep's merged quality summary (``sweep.json``'s ``"quality"``) but the
    dense one and ``skip``.

    Args:
        quality: :func:`gradsync.bench.sweep.merge_quality`'s result (``entries[e]["steps_by_seed"]``,
            ``seeds``, ``target``, ``budget_steps``, ``world_size``).
        model: ``workload:model`` (:attr:`gradsync.workloads.Workload.key`).
        optimizer: the recipe's optimizer family (``"sgd"``, ``"adamw"``).
        command, commit, machine: where the rows come from.

    Returns:
        The rows (schema :data:`SCHEMA`).

    Raises:
        ValueError: if ``dense`` is not among the entries (its steps are every row's reference).
    """
    entries = quality["entries"]
    if dense not in entries:
        raise ValueError(f"dense must be an entry of the sweep ({', '.join(entries)}); got {dense!r}")
    budget = int(quality["budget_steps"])
    dense_steps = aggregate_steps(entries[dense]["steps_by_seed"])
    skipped = {dense, *skip}
    rows = []
    for entry, e in entries.items():
        if entry in skipped:
            continue
        per_seed = [None if s is None else int(s) for s in e["steps_by_seed"]]
        steps = aggregate_steps(per_seed)
        missed = sum(s is None for s in per_seed)
        rows.append({
            "entry": entry, "model": model, "world_size": int(quality["world_size"]), "optimizer": optimizer,
            "seeds": len(per_seed), "per_seed_steps": per_seed,
            "steps": budget if math.isinf(steps) else round(steps, 1),
            "dense_steps": budget if math.isinf(dense_steps) else round(dense_steps, 1),
            "not_reached": missed > 1 or math.isinf(steps), "budget_steps": budget,
            "target": quality["target"], "source": command, "commit": commit, "machine": machine,
            "note": "/".join("-" if s is None else str(s) for s in per_seed),
        })
    return rows


def merge_rows(existing: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``existing`` with ``new`` appended, a new row replacing an existing one of the same model,
    world size, entry and source command (the same grid run again)."""
    def key(r: dict[str, Any]) -> tuple:
        return r["model"], r["world_size"], r["entry"], r.get("source")

    keys = {key(r) for r in new}
    return [r for r in existing if key(r) not in keys] + list(new)
