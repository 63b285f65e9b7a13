"""Compute-only timing of a training step: forward, backward and optimizer step without communication."""

from __future__ import annotations

import contextlib
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
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], steps: int = 3,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> ComputeTiming:
    """Time ``steps`` training steps of a private copy of ``model`` (no hooks, no communication)
    after one untimed step; ``model`` itself is not changed. Returns the medians in seconds.
    ``autocast()`` gives the context the forward pass and loss run in (mixed precision: the
    ``torch.autocast`` of the training run), so the timing matches the training step.

    When the model's parameters are on a CUDA device, that device is synchronised before each
    clock read: CUDA kernels run asynchronously, so without it the forward time would include only
    the kernel launches and the backward time whatever the host happened to wait for.

    Raises:
        ValueError: if ``batches`` is empty or ``steps`` < 1.
    """
    if not batches or steps < 1:
        raise ValueError("time_compute needs at least one batch and steps >= 1")
    local = copy.deepcopy(model)
    opt = make_optimizer(local.parameters())
    clock = device_clock(local)
    fwd, bwd, upd = [], [], []
    for i in range(steps + 1):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        t0 = clock()
        with autocast():
            loss = loss_fn(local(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        opt.step()
        t3 = clock()
        if i:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
    return ComputeTiming(statistics.median(fwd), statistics.median(bwd), statistics.median(upd))


def device_clock(*sources: "nn.Module | torch.device | str | None") -> Callable[[], float]:
    """The one clock of every gradsync profile (compute timing, the per-bucket profile, the CCR's
    collectives, the hop rates): ``time.perf_counter`` that first synchronises every CUDA device
    among ``sources`` (modules: the devices of their parameters and buffers; devices; ``None`` is
    skipped). CUDA kernels and NCCL collectives run asynchronously, so an unsynchronised read times
    their launches. For CPU sources a plain ``perf_counter``."""
    devices: set[torch.device] = set()
    for src in sources:
        if isinstance(src, nn.Module):
            devices |= {t.device for t in (*src.parameters(), *src.buffers())}
        elif src is not None:
            devices.add(torch.device(src))
    devices = {d for d in devices if d.type == "cuda"}

    def clock() -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        return time.perf_counter()

    return clock
