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

Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication", arXiv
2501.18512, Sec. 2.2, streaming partial updates, sequential pattern), ``fragments = F > 1``: the
trainable parameters, in module order, are cut into ``F`` contiguous groups of whole tensors with about
equal element counts (:func:`gradsync.comm.fragments.fragment_bounds`, from the shapes alone: the same
on every rank). Fragment ``f`` syncs after the inner steps ``t`` with ``t % H == ((f+1) H // F) % H``
(:func:`gradsync.comm.fragments.fragment_offsets`): each fragment once per period, the ``F`` syncs
``H / F`` steps apart, the last fragment at the multiples of ``H`` (``F = 1`` is the schedule above; the
first sync of fragment ``f < F-1`` comes after only ``(f+1) H // F`` steps). A fragment's sync is the
outer step above restricted to it: one all-reduce of its outer gradient, the outer optimizer's step on
its slice of the synced copy only (its momentum buffers only: the other fragments' copies have no
``.grad``, which torch's SGD skips), its parameters set to its updated copy; the other fragments keep
training locally. The floating buffers are averaged with the last fragment (at the multiples of
``H``). Whether a step syncs and which fragment is decided from the step counter alone. Not done: the
paper's overlap of a fragment's all-reduce with the next ``tau`` inner steps and its mixing factor
``alpha`` (Sec. 2.3): here the all-reduce blocks (``tau = 0``, the fragment's parameters replaced by
the synced copy, ``alpha = 0``).

16-bit outer gradients on the wire (``outer_dtype`` ``"fp16"`` or ``"bf16"``; the paper's Sec. 2.4
quantises them further, to 4-bit floats, which is not done here): the outer gradient, already divided
by ``P`` (to stay in fp16's range), is cast to 16 bits before the all-reduce (the sum of the ``P``
terms is accumulated in 16 bits) and cast back to each parameter's dtype for the outer step, which
runs in the parameters' dtype as before; the wire bytes are counted at 2 bytes per element. The
buffers (BatchNorm statistics) are not an outer gradient: with a 16-bit ``outer_dtype`` they are
averaged in a second all-reduce in their promoted dtype (float32), so a model with floating buffers
sends two collectives on the last fragment's step. ``"fp32"`` (the default) casts nothing: the
promoted dtype as above.

A non-finite averaged outer gradient (a rank diverged, or an fp16 overflow) changes no state: the
synced copy and the outer momentum of the fragment stay, every rank's parameters of the fragment go
back to its synced copy, the buffers stay local, and ``outer_steps_skipped`` counts it (the decision
is on the all-reduced tensor, the same on every rank).

Not done yet: torchft's DiLoCo as a measured peer, the overlap above (Sec. 2.3), the grid of issue 33.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...comm.fragments import fragment_at, fragment_bounds
from ...options import Options, option
from ..spec import AlgorithmSpec
from .base import PeriodicAlgorithm, PeriodicSynchroniser, broadcast_module
from .local_sgd import MAX_PERIOD

#: ``outer_dtype`` values and the dtype each puts on the wire (``None``: no cast)
WIRE_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
OUTER_DTYPES = tuple(WIRE_DTYPES)


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
    fragments: int = option(1, "Streaming DiLoCo (arXiv 2501.18512 Sec. 2.2): contiguous groups of the trainable "
                            "parameters, each synced once per period at staggered steps, period/fragments apart "
                            "(1: the whole model every period; at most period and the number of trainable tensors)",
                            low=1, high=MAX_PERIOD)
    outer_dtype: str = option("fp32", "dtype of DiLoCo's outer gradient on the wire (fp16, bf16: cast after dividing "
                              "by the world size, half the bytes; fp32: no cast)", choices=OUTER_DTYPES)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fragments > self.period:
            raise ValueError(f"diloco.fragments must be an integer in [1, period={self.period}], got {self.fragments}")


class DiLoCo(PeriodicAlgorithm):
    """DiLoCo's outer loop, optionally streamed by fragments (see the module docstring). Built on every
    rank (collective: it broadcasts rank 0's parameters and buffers, as DDP does, then copies the
    parameters into the synced copy).

    Args:
        module: the model on its device.
        period: ``H >= 1`` inner steps per outer step (per fragment).
        outer_lr: outer learning rate, > 0 (paper: 0.7).
        outer_momentum: outer Nesterov momentum in [0, 1) (paper: 0.9; 0 gives plain SGD).
        process_group: the data-parallel group (``None`` = default group).
        fragments: ``F``, an integer in ``[1, min(period, number of trainable parameter tensors)]``
            (1: the whole model at every multiple of ``period``).
        outer_dtype: ``"fp32"`` (no cast), ``"fp16"`` or ``"bf16"``: the outer gradient's dtype on
            the wire.

    Attributes:
        anchor: the synced copy ``theta^(t-H)``: one tensor per trainable parameter (same shape,
            dtype, device), identical on every rank.
        outer_optimizer: the ``torch.optim.SGD`` over :attr:`anchor`.
        bounds: ``F`` half-open ranges ``(lo, hi)`` of trainable-parameter indices, one per fragment.
        outer_steps_skipped: outer steps (of one fragment each) skipped for a non-finite averaged outer
            gradient.

    Raises:
        ValueError: if ``period`` is not an integer >= 1, ``fragments`` is not in the range above, or
            ``outer_dtype`` is not one of fp32, fp16, bf16 (the options dataclass checks the ranges
            first).
    """

    def __init__(self, module: nn.Module, period: int, outer_lr: float, outer_momentum: float,
                 process_group: Any = None, fragments: int = 1, outer_dtype: str = "fp32"):
        super().__init__(module, period, process_group)
        most = min(self.period, len(self.params))
        if isinstance(fragments, bool) or int(fragments) != fragments or not 1 <= fragments <= most:
            raise ValueError(f"diloco.fragments must be an integer in [1, min(period, trainable parameter tensors) "
                             f"= {most}], got {fragments!r}")
        if outer_dtype not in WIRE_DTYPES:
            raise ValueError(f"diloco.outer_dtype must be one of {', '.join(OUTER_DTYPES)}; got {outer_dtype!r}")
        broadcast_module(module, process_group)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.fragments, self.outer_dtype = int(fragments), outer_dtype
        self._wire_dtype = WIRE_DTYPES[outer_dtype]
        self.bounds = fragment_bounds([p.numel() for p in self.params], self.fragments)
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer_optimizer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.outer_momentum > 0)
        self.dtype = functools.reduce(torch.promote_types, [t.dtype for t in (*self.params, *self.buffers)],
                                      torch.float32)
        self.outer_steps_skipped = 0

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The outer gradient's dtype on the wire (``torch.float16``, ``torch.bfloat16``), ``None`` with
        ``outer_dtype="fp32"`` (no cast)."""
        return self._wire_dtype

    def due(self, step: int) -> bool:
        """Whether a fragment syncs after inner step ``step`` (:func:`~gradsync.comm.fragments.fragment_at`;
        ``fragments = 1``: ``step % period == 0``)."""
        return fragment_at(step, self.period, self.fragments) is not None

    def _all_reduce_mean(self, parts: list[torch.Tensor], wire_dtype: Optional[torch.dtype]) -> torch.Tensor:
        """Concatenate ``parts`` (flat, :attr:`dtype`), divide by ``P``, cast to ``wire_dtype`` (``None``:
        no cast), all-reduce (sum) and count it; the mean on every rank, in ``wire_dtype``."""
        flat = torch.cat(parts)
        flat /= self.world_size
        if wire_dtype is not None:
            flat = flat.to(wire_dtype)
        dist.all_reduce(flat, group=self.process_group)
        self.count_allreduce(flat)
        return flat

    @torch.no_grad()
    def sync(self) -> None:
        """One outer step of the fragment due at :attr:`step` (all of the model when ``fragments = 1``):
        all-reduce (mean) of its outer gradient (in :attr:`dtype`, or cast to 16 bits) and, with the
        last fragment, of the floating buffers (in the same all-reduce with ``outer_dtype="fp32"``, in a
        second one in :attr:`dtype` otherwise); the outer optimizer's step on its slice of
        :attr:`anchor`; its parameters set to it; the buffers set to their average."""
        f = fragment_at(self.step, self.period, self.fragments)
        lo, hi = self.bounds[f]
        anchor, params = self.anchor[lo:hi], self.params[lo:hi]
        buffers = self.buffers if f == self.fragments - 1 else []
        parts = [(a - p).reshape(-1).to(self.dtype) for a, p in zip(anchor, params)]
        buffer_parts = [b.reshape(-1).to(self.dtype) for b in buffers]
        if self.wire_dtype is None:  # one all-reduce, as DiLoCo without fragments always did
            flat = self._all_reduce_mean(parts + buffer_parts, None)
            averaged = [flat]
        else:
            flat = self._all_reduce_mean(parts, self.wire_dtype)
            averaged = [flat] + ([self._all_reduce_mean(buffer_parts, None)] if buffer_parts else [])
        if not all(bool(torch.isfinite(t).all()) for t in averaged):
            self.outer_steps_skipped += 1
            for a, p in zip(anchor, params):
                p.copy_(a)
            return
        offset = 0
        for a in anchor:
            a.grad = flat[offset:offset + a.numel()].view_as(a).to(a.dtype)
            offset += a.numel()
        self.outer_optimizer.step()
        for a, p in zip(anchor, params):
            a.grad = None
            p.copy_(a)
        if len(averaged) == 2:
            flat, offset = averaged[1], 0
        for b in buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    def stats(self) -> dict[str, Any]:
        """The base statistics plus ``outer_steps_skipped``."""
        return {**super().stats(), "outer_steps_skipped": self.outer_steps_skipped}

    def config(self) -> dict[str, Any]:
        return {"algorithm": "diloco", **super().config(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "fragments": self.fragments, "outer_dtype": self.outer_dtype}

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
    algorithm = DiLoCo(ctx.model, opts.period, opts.outer_lr, opts.outer_momentum, ctx.process_group,
                       opts.fragments, opts.outer_dtype)
    return PeriodicSynchroniser("diloco", ctx, algorithm)


SPEC = AlgorithmSpec("diloco", "DiLoCo: H local steps of the job's optimizer, then an outer Nesterov step on the "
                     "all-reduced parameter deltas (Douillard et al., arXiv 2311.08105); with fragments, "
                     "Streaming DiLoCo's staggered partial syncs (arXiv 2501.18512)", DiLoCoOptions, _build)
