"""``diloco``: DiLoCo, local inner steps and an outer Nesterov step on the averaged parameter deltas.

Source: Arthur Douillard, Qixuan Feng, Andrei A. Rusu, Rachita Chhaparia, Yani Donchev, Adhiguna
Kuncoro, Marc'Aurelio Ranzato, Arthur Szlam, Jiajun Shen, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105 (2023), Sec. 2 and Algorithm 1: every worker runs
``H`` steps of the inner optimizer (AdamW there; here the job's optimizer, its state kept across
outer steps as in the paper), then the outer gradient ``Delta = theta^(t-H) - theta_i^(t)`` is averaged
over the workers and the outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the
paper's Sec. 3) updates the shared parameters ``theta^(t-H)``, which every worker takes as its new
parameters.

Here: ``theta^(t-H)`` is the *synced copy* (:attr:`DiLoCo.anchor`, one tensor per trainable parameter,
same shape, dtype and device), identical on every rank; the outer gradient of every trainable
parameter and the module's floating-point buffers are flattened in their promoted dtype (float32 for
a float32 model), divided by ``P`` and summed with one all-reduce; the outer optimizer is
``torch.optim.SGD(anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)``; the
parameters are then set to the updated copy and the buffers to their average. Every rank runs the same
arithmetic on the same all-reduced tensor, so every rank ends the outer step with bitwise identical
parameters. With ``outer_lr=1`` and ``outer_momentum=0`` the outer step is plain averaging
(``theta - mean(theta - theta_i) = mean(theta_i)``, up to float rounding), i.e. ``local-sgd``.

A non-finite averaged outer gradient (a rank diverged) changes no state: the synced copy and the
outer momentum stay, every rank's parameters go back to the synced copy, the buffers stay local, and
``outer_steps_skipped`` counts it (the decision is on the all-reduced tensor, the same on every rank).

Not done yet: Streaming DiLoCo's fragments (arXiv 2501.18512), fp16/bf16 outer gradients on the wire,
torchft's DiLoCo as a measured peer, a simulator plan, the grid of issue 33.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...options import Options, option
from ..spec import AlgorithmSpec
from .base import PeriodicAlgorithm, PeriodicSynchroniser, broadcast_module
from .local_sgd import MAX_PERIOD


@dataclass(frozen=True)
class DiLoCoOptions(Options):
    """Options of ``diloco``."""

    OWNER = "diloco"
    period: int = option(16, "H: local optimizer steps between synchronisations (local-sgd: parameter "
                         "averages; diloco: outer steps)", low=1, high=MAX_PERIOD, units="steps")
    outer_lr: float = option(0.7, "DiLoCo's outer learning rate (Nesterov SGD on the averaged parameter deltas)",
                             low=0.0, high=10.0, low_open=True)
    outer_momentum: float = option(0.9, "DiLoCo's outer Nesterov momentum (0: plain outer SGD)", low=0.0, high=1.0,
                                   high_open=True)


class DiLoCo(PeriodicAlgorithm):
    """DiLoCo's outer loop (see the module docstring). Built on every rank (collective: it broadcasts
    rank 0's parameters and buffers, as DDP does, then copies the parameters into the synced copy).

    Args:
        module: the model on its device.
        period: ``H >= 1`` inner steps per outer step.
        outer_lr: outer learning rate, > 0 (paper: 0.7).
        outer_momentum: outer Nesterov momentum in [0, 1) (paper: 0.9; 0 gives plain SGD).
        process_group: the data-parallel group (``None`` = default group).

    Attributes:
        anchor: the synced copy ``theta^(t-H)``: one tensor per trainable parameter (same shape,
            dtype, device), identical on every rank.
        outer_optimizer: the ``torch.optim.SGD`` over :attr:`anchor`.
        outer_steps_skipped: outer steps skipped for a non-finite averaged outer gradient.

    Raises:
        ValueError: if ``period`` is not an integer >= 1 (the options dataclass checks the ranges of
            all three first).
    """

    def __init__(self, module: nn.Module, period: int, outer_lr: float, outer_momentum: float,
                 process_group: Any = None):
        super().__init__(module, period, process_group)
        broadcast_module(module, process_group)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.outer_momentum > 0)
        self.dtype = functools.reduce(torch.promote_types, [t.dtype for t in (*self.params, *self.buffers)],
                                      torch.float32)
        self.outer_steps_skipped = 0

    @torch.no_grad()
    def sync(self) -> None:
        """One outer step: all-reduce (mean) of the outer gradients and the floating buffers
        (``numel()`` elements in :attr:`dtype`), the outer optimizer's step on :attr:`anchor`, the
        parameters set to it."""
        parts = [(a - p).reshape(-1).to(self.dtype) for a, p in zip(self.anchor, self.params)]
        parts += [b.reshape(-1).to(self.dtype) for b in self.buffers]
        flat = torch.cat(parts)
        flat /= self.world_size
        dist.all_reduce(flat, group=self.process_group)
        self.count_allreduce(flat)
        if not bool(torch.isfinite(flat).all()):
            self.outer_steps_skipped += 1
            for a, p in zip(self.anchor, self.params):
                p.copy_(a)
            return
        offset = 0
        for a in self.anchor:
            a.grad = flat[offset:offset + a.numel()].view_as(a).to(a.dtype)
            offset += a.numel()
        self.outer_optimizer.step()
        for a, p in zip(self.anchor, self.params):
            a.grad = None
            p.copy_(a)
        for b in self.buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    def stats(self) -> dict[str, Any]:
        """The base statistics plus ``outer_steps_skipped``."""
        return {**super().stats(), "outer_steps_skipped": self.outer_steps_skipped}

    def config(self) -> dict[str, Any]:
        return {"algorithm": "diloco", **super().config(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum}

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "syncs", "outer_steps_skipped", "anchor": [tensor per trainable parameter],
        "outer_optimizer": torch's SGD state_dict (momentum buffers)}``."""
        return {**super().state_dict(), "outer_steps_skipped": self.outer_steps_skipped,
                "anchor": [a.detach().clone() for a in self.anchor],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (tensors already on the module's device, or moved there by
        torch's optimizer loader).

        Raises:
            ValueError: if the synced copy's shapes do not match the module's trainable parameters.
        """
        anchor = state["anchor"]
        if len(anchor) != len(self.anchor) or any(a.shape != b.shape for a, b in zip(anchor, self.anchor)):
            raise ValueError("diloco: the checkpoint's synced copy does not match the model's trainable parameters "
                             f"({len(anchor)} tensors, the model has {len(self.anchor)})")
        super().load_state_dict(state)
        self.outer_steps_skipped = int(state.get("outer_steps_skipped", 0))
        with torch.no_grad():
            for a, saved in zip(self.anchor, anchor):
                a.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])


def _build(opts: DiLoCoOptions, ctx: Any) -> PeriodicSynchroniser:
    algorithm = DiLoCo(ctx.model, opts.period, opts.outer_lr, opts.outer_momentum, ctx.process_group)
    return PeriodicSynchroniser("diloco", ctx, algorithm)


SPEC = AlgorithmSpec("diloco", "DiLoCo: H local steps of the job's optimizer, then an outer Nesterov step on the "
                     "all-reduced parameter deltas (Douillard et al., arXiv 2311.08105)", DiLoCoOptions, _build)
