"""Compute-only timing of a training step: forward, backward and optimizer step without communication."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

@dataclass
class ComputeTiming:
    """Median compute-only seconds of a training step (no communication): forward, backward and
    optimizer step."""

    forward_s: float
    backward_s: float
    optimizer_s: float

    @property
    def step_s(self) -> float:
        """forward + backward (the compute a communication hook can overlap with)."""
        return self.forward_s + self.backward_s


def time_compute(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], steps: int = 3) -> ComputeTiming:
    """Time ``steps`` training steps of a private copy of ``model`` (no hooks, no communication)
    after one untimed step; ``model`` itself is not changed. Returns the medians in seconds.

    Raises:
        ValueError: if ``batches`` is empty or ``steps`` < 1.
    """
    if not batches or steps < 1:
        raise ValueError("time_compute needs at least one batch and steps >= 1")
    local = copy.deepcopy(model)
    opt = make_optimizer(local.parameters())
    fwd, bwd, upd = [], [], []
    for i in range(steps + 1):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_fn(local(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
    return ComputeTiming(statistics.median(fwd), statistics.median(bwd), statistics.median(upd))
