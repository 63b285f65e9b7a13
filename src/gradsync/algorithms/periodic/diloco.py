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
``H``). Whether a step syncs and which fragment is decided from the step counter alone.

Overlap (the paper's Sec. 2.3, ``overlap = tau >= 1``): the sync's all-reduce is issued asynchronously
(``async_op=True``) after the inner step ``t`` with the outer gradient of that moment, training goes on,
and after inner step ``t + tau`` the training thread waits for it (``work.wait()``, never a ``.then``
callback, which Gloo runs on its own thread) and takes the outer step; the fragment's parameters then
become ``alpha x local + (1 - alpha) x synced copy`` (``overlap_mix = alpha``; 0, the default: the
synced copy, discarding the fragment's last ``tau`` local steps). ``tau <= H // F - 1``, so an
all-reduce is applied before the next one is issued. A checkpoint taken with one in flight waits for it
and saves its averaged tensors (``"pending"``), so a resumed run applies the same outer step at the same
step. ``overlap = 0`` (default): the all-reduce blocks and the outer step follows at once.

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

torchft's own DiLoCo, measured as a peer in the same run: :mod:`gradsync.algorithms.periodic.torchft_peer`
(``torchft-diloco``). Not done yet: 4-bit outer gradients (Sec. 2.4), the grid of issue 33.
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
class OuterLoopOptions(Options):
    """The options every DiLoCo implementation takes (``diloco``, ``torchft-diloco``)."""

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


@dataclass(frozen=True)
class DiLoCoOptions(OuterLoopOptions):
    """Options of ``diloco``."""

    OWNER = "diloco"
    outer_dtype: str = option("fp32", "dtype of DiLoCo's outer gradient on the wire (fp16, bf16: cast after dividing "
                              "by the world size, half the bytes; fp32: no cast)", choices=OUTER_DTYPES)

    overlap: int = option(0, "Streaming DiLoCo's tau (arXiv 2501.18512 Sec. 2.3): inner steps a fragment's "
                          "all-reduce runs behind training before its outer step is applied (0: blocking; at most "
                          "period // fragments - 1)", low=0, high=MAX_PERIOD, units="steps")
    overlap_mix: float = option(0.0, "Streaming DiLoCo's alpha, with overlap: a fragment's parameters become "
                                "alpha x local + (1 - alpha) x synced copy (0: the synced copy)", low=0.0, high=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fragments > self.period:
            raise ValueError(f"diloco.fragments must be an integer in [1, period={self.period}], got {self.fragments}")
        lag = self.period // self.fragments - 1
        if self.overlap > lag:
            raise ValueError(f"diloco.overlap must be an integer in [0, period // fragments - 1 = {lag}], "
                             f"got {self.overlap}")


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
        overlap: Streaming DiLoCo's ``tau``, an integer in ``[0, period // fragments - 1]``: inner steps
            between a sync's (asynchronous) all-reduce and its outer step (0: blocking, at once).
        overlap_mix: Streaming DiLoCo's ``alpha`` in ``[0, 1]``, used with ``overlap > 0``: the
            fragment's parameters become ``alpha x local + (1 - alpha) x synced copy`` (0: the synced
            copy, bitwise identical on every rank).

    Attributes:
        anchor: the synced copy ``theta^(t-H)``: one tensor per trainable parameter (same shape,
            dtype, device), identical on every rank.
        outer_optimizer: the ``torch.optim.SGD`` over :attr:`anchor`.
        bounds: ``F`` half-open ranges ``(lo, hi)`` of trainable-parameter indices, one per fragment.
        outer_steps_skipped: outer steps (of one fragment each) skipped for a non-finite averaged outer
            gradient.
        syncs: (the base's) fragment syncs issued: ``F`` per period.

    Raises:
        ValueError: if ``period`` is not an integer >= 1, ``fragments`` or ``overlap`` or
            ``overlap_mix`` is not in the range above, or ``outer_dtype`` is not one of fp32, fp16, bf16
            (the options dataclass checks the ranges first).
    """

    def __init__(self, module: nn.Module, period: int, outer_lr: float, outer_momentum: float,
                 process_group: Any = None, fragments: int = 1, outer_dtype: str = "fp32", overlap: int = 0,
                 overlap_mix: float = 0.0):
        super().__init__(module, period, process_group)
        fragments = self.check_fragments("diloco", fragments)
        lag = self.period // fragments - 1
        if isinstance(overlap, bool) or int(overlap) != overlap or not 0 <= overlap <= lag:
            raise ValueError(f"diloco.overlap must be an integer in [0, period // fragments - 1 = {lag}], "
                             f"got {overlap!r}")
        if not 0.0 <= overlap_mix <= 1.0:
            raise ValueError(f"diloco.overlap_mix must be in [0.0, 1.0], got {overlap_mix!r}")
        if outer_dtype not in WIRE_DTYPES:
            raise ValueError(f"diloco.outer_dtype must be one of {', '.join(OUTER_DTYPES)}; got {outer_dtype!r}")
        broadcast_module(module, process_group)
        self.outer_lr, self.outer_momentum = float(outer_lr), float(outer_momentum)
        self.fragments, self.outer_dtype = fragments, outer_dtype
        self.overlap, self.overlap_mix = int(overlap), float(overlap_mix)
        self._pending: Optional[dict[str, Any]] = None  # an overlapped sync in flight
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

    def _all_reduce_mean(self, parts: list[torch.Tensor], wire_dtype: Optional[torch.dtype],
                         works: list[Any]) -> torch.Tensor:
        """Concatenate ``parts`` (flat, :attr:`dtype`), divide by ``P``, cast to ``wire_dtype`` (``None``:
        no cast), all-reduce (sum) and count it; the mean on every rank, in ``wire_dtype`` (with
        ``overlap > 0`` once the work appended to ``works`` is waited for)."""
        flat = torch.cat(parts)
        flat /= self.world_size
        if wire_dtype is not None:
            flat = flat.to(wire_dtype)
        work = dist.all_reduce(flat, group=self.process_group, async_op=self.overlap > 0)
        if work is not None:
            works.append(work)
        self.count_allreduce(flat)
        return flat

    @torch.no_grad()
    def sync(self) -> None:
        """The sync of the fragment due at :attr:`step` (all of the model when ``fragments = 1``):
        all-reduce (mean) of its outer gradient (in :attr:`dtype`, or cast to 16 bits) and, with the
        last fragment, of the floating buffers (in the same all-reduce with ``outer_dtype="fp32"``, in a
        second one in :attr:`dtype` otherwise); then, at once (``overlap = 0``) or ``overlap`` inner
        steps later (:meth:`after_inner_step`), :meth:`_outer_step`."""
        f = fragment_at(self.step, self.period, self.fragments)
        lo, hi = self.bounds[f]
        parts = [(a - p).reshape(-1).to(self.dtype) for a, p in zip(self.anchor[lo:hi], self.params[lo:hi])]
        buffer_parts = [b.reshape(-1).to(self.dtype) for b in self.buffers] if f == self.fragments - 1 else []
        works: list[Any] = []
        if self.wire_dtype is None:  # one all-reduce, as DiLoCo without fragments always did
            averaged = [self._all_reduce_mean(parts + buffer_parts, None, works)]
        else:
            averaged = [self._all_reduce_mean(parts, self.wire_dtype, works)]
            if buffer_parts:
                averaged.append(self._all_reduce_mean(buffer_parts, None, works))
        if self.overlap == 0:
            self._outer_step(f, averaged)
        else:  # waited for and applied `overlap` steps later, on the training thread (no Gloo callback)
            self._pending = {"fragment": f, "apply_step": self.step + self.overlap, "averaged": averaged,
                             "works": works}

    def after_inner_step(self) -> bool:
        """:meth:`PeriodicAlgorithm.after_inner_step` (a fragment's all-reduce issued at its steps); with
        ``overlap > 0`` also, at the step ``overlap`` steps after an all-reduce was issued, its wait
        and its outer step. Returns whether this step issued a sync."""
        synced = super().after_inner_step()
        pending = self._pending
        if pending is not None and pending["apply_step"] == self.step:
            self._wait()
            self._pending = None
            with torch.no_grad():
                self._outer_step(pending["fragment"], pending["averaged"])
        return synced

    def _wait(self) -> None:
        """Wait for the in-flight all-reduce(s) of an overlapped sync (nothing if none)."""
        if self._pending is not None:
            for work in self._pending["works"]:
                work.wait()
            self._pending["works"] = []

    def _outer_step(self, f: int, averaged: list[torch.Tensor]) -> None:
        """Fragment ``f``'s outer step from its averaged outer gradient (``averaged[0]``, the buffers'
        mean after it or in ``averaged[1]``): the outer optimizer's step on its slice of :attr:`anchor`,
        its parameters set to it (with ``overlap > 0``: to ``overlap_mix x local + (1 - overlap_mix) x
        synced copy``), the buffers to their mean; nothing but the parameters reset to the synced copy
        when the mean is not finite."""
        lo, hi = self.bounds[f]
        anchor, params = self.anchor[lo:hi], self.params[lo:hi]
        buffers = self.buffers if f == self.fragments - 1 else []
        flat = averaged[0]
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
            if self.overlap_mix == 0.0:
                p.copy_(a)
            else:
                p.copy_(torch.lerp(a, p, self.overlap_mix))
        if len(averaged) == 2:
            flat, offset = averaged[1], 0
        for b in buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    def close(self) -> None:
        """Wait for an overlapped sync's all-reduce still in flight (it is not applied)."""
        self._wait()

    def stats(self) -> dict[str, Any]:
        """The base statistics plus ``outer_steps_skipped``."""
        return {**super().stats(), "outer_steps_skipped": self.outer_steps_skipped}

    def config(self) -> dict[str, Any]:
        return {"algorithm": "diloco", **super().config(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "fragments": self.fragments, "outer_dtype": self.outer_dtype,
                "overlap": self.overlap, "overlap_mix": self.overlap_mix}

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "syncs", "outer_steps_skipped", "anchor": [tensor per trainable parameter],
        "outer_optimizer": torch's SGD state_dict (momentum buffers)}``, and with an overlapped sync in
        flight (waited for here) ``"pending": {"fragment", "apply_step", "averaged": [flat tensors]}``."""
        out = {**super().state_dict(), "outer_steps_skipped": self.outer_steps_skipped,
               "anchor": [a.detach().clone() for a in self.anchor],
               "outer_optimizer": self.outer_optimizer.state_dict()}
        if self._pending is not None:
            self._wait()
            out["pending"] = {"fragment": self._pending["fragment"], "apply_step": self._pending["apply_step"],
                              "averaged": [t.clone() for t in self._pending["averaged"]]}
        return out

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
        pending = state.get("pending")
        self._pending = None if pending is None else {**pending, "works": []}


def _build(opts: DiLoCoOptions, ctx: Any) -> PeriodicSynchroniser:
    algorithm = DiLoCo(ctx.model, opts.period, opts.outer_lr, opts.outer_momentum, ctx.process_group,
                       opts.fragments, opts.outer_dtype, opts.overlap, opts.overlap_mix)
    return PeriodicSynchroniser("diloco", ctx, algorithm)


SPEC = AlgorithmSpec("diloco", "DiLoCo: H local steps of the job's optimizer, then an outer Nesterov step on the "
                     "all-reduced parameter deltas (Douillard et al., arXiv 2311.08105); with fragments, "
                     "Streaming DiLoCo's staggered partial syncs (arXiv 2501.18512)", DiLoCoOptions, _build)
