"""Start-up check that every rank runs the same algorithm configuration.

A mismatch (say rank 1 compresses at K=4 and rank 0 at K=3) would launch collectives of different
sizes and hang the job; instead each rank all-gathers a SHA-256 digest of its configuration and, on
a mismatch, all-gathers the configurations to name the differing fields, then raises on every rank.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .collectives import all_gather_flat, collective_device


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on their configuration; ``fields`` maps field name to the per-rank values."""

    def __init__(self, fields: dict[str, list[Any]]):
        self.fields = fields
        parts = [
            f"{name!r}: " + ", ".join(f"rank {r} = {v!r}" for r, v in enumerate(values))
            for name, values in sorted(fields.items())
        ]
        super().__init__("configuration differs across ranks; " + "; ".join(parts))


def config_digest(config: Mapping[str, Any]) -> bytes:
    """SHA-256 (32 bytes) of the JSON form of ``config`` with sorted keys."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).digest()


def check_config_agreement(config: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Collective: raise :class:`ConfigMismatchError` on every rank unless all configs are equal.

    Costs one all-gather of 32 bytes per rank when the configurations agree; the digest travels as
    a uint8 tensor on :func:`~gradsync.comm.collectives.collective_device` of ``group`` (CUDA for
    NCCL, CPU for Gloo).

    Raises:
        ConfigMismatchError: naming each differing field and its value on every rank.
    """
    world = dist.get_world_size(group)
    device = collective_device(group)
    mine = torch.frombuffer(bytearray(config_digest(config)), dtype=torch.uint8).to(device)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    all_gather_flat(gathered, mine, group=group)
    if all(torch.equal(gathered.view(world, -1)[r], mine) for r in range(world)):
        return
    configs: list[Any] = [None] * world
    dist.all_gather_object(configs, dict(config), group=group)
    keys = sorted(set().union(*(c.keys() for c in configs)))
    missing = object()
    differing = {}
    for k in keys:
        values = [c.get(k, missing) for c in configs]
        if any(v != values[0] for v in values):
            differing[k] = ["<absent>" if v is missing else v for v in values]
    raise ConfigMismatchError(differing)
