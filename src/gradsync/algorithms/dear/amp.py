"""Loss scaling (``torch.amp.GradScaler``) and gradient clipping on DeAR's reduced shards.

Each rank holds ``1/P`` of every averaged gradient after the reduce-scatter, so unscaling, the
inf/nan check (one all-reduce of a flag) and the global norm (one all-reduce of a scalar) work on the
shards, and the unscaled / clipped shards are what is all-gathered (Zhang et al., arXiv 2302.12445,
Sec. 3: all-reduce = reduce-scatter + all-gather). :class:`LossScaling` is held by
:class:`~gradsync.algorithms.dear.DeAR`; it uses GradScaler's private ``_scale`` and
``_per_optimizer_states`` (as ``GradScaler.unscale_`` / ``step`` do), kept in this one module.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ...validation import check_float
from .groups import FusionGroup
from .state import IterationState


class LossScaling:
    """The GradScaler of a DeAR wrapper: unscaling before the ``grad_filter`` or on the reduced
    shards, the inf/nan check shared by every rank, and the end of the scaler's iteration.

    Args:
        state: the shared :class:`~gradsync.algorithms.dear.state.IterationState` (its groups are read).
        group: the process group of the found-inf all-reduce (DeAR's reduce-scatter group).
        rank, world_size: this rank and ``P`` in ``group``.
        device: the parameters' device.
        scaler: the GradScaler given at construction, or ``None``.
        has_filter: a ``grad_filter`` sees the gradients (they are then kept finite, and a scaler
            that comes after the filter saw loss-scaled gradients is refused).
    """

    def __init__(self, state: IterationState, group: dist.ProcessGroup, rank: int, world_size: int,
                 device: torch.device, scaler: torch.amp.GradScaler | None, has_filter: bool) -> None:
        self._state = state
        self._group = group
        self._rank = rank
        self._world_size = world_size
        self._device = device
        self._scaler = scaler
        self._has_filter = has_filter
        self._filtered_scaled = False  # the grad_filter ran while no GradScaler was known
        self._inv_scale: torch.Tensor | None = None  # 1 / scale used by the hooks this iteration
        self._found_inf: torch.Tensor | None = None  # (1,) float32 on the device: local, then global
        self._found_inf_global = False  # _found_inf was all-reduced

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (given at construction or to :meth:`adopt`)."""
        return self._scaler

    def unscale_group(self, g: FusionGroup) -> None:
        """Before ``g``'s reduce-scatter (and ``grad_filter``), with a known GradScaler: ``g``'s flat
        gradient ``*= 1/scale`` and non-finite values are recorded (no host sync); with a
        ``grad_filter`` they are also replaced by 0."""
        if self._has_filter:
            self._filtered_scaled |= self._scaler is None
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return
        flat = g.grad_buf[: g.numel]
        if self._inv_scale is None:  # once per iteration, as GradScaler.unscale_
            self._inv_scale = scaler._scale.double().reciprocal().float().to(g.grad_buf.device)
            self._found_inf = torch.zeros(1, dtype=torch.float32, device=g.grad_buf.device)
        torch._amp_foreach_non_finite_check_and_unscale_([flat], self._found_inf, self._inv_scale)
        if self._has_filter:  # keep inf/nan out of the filter's residuals
            flat.nan_to_num_(0.0, 0.0, 0.0)
        g.unscaled = True

    def adopt(self, scaler: torch.amp.GradScaler | None) -> None:
        """Remember ``scaler`` (a ``step``/``unscale_`` argument) as the one in use.

        Raises:
            ValueError: if it conflicts with the known one, or comes after the ``grad_filter`` saw
                loss-scaled gradients.
        """
        if scaler is None or scaler is self._scaler:
            return
        if self._scaler is not None:
            raise ValueError("scaler must be the GradScaler DeAR uses (given at construction as grad_scaler, or "
                             "to an earlier step()/unscale_()) or None; got a different GradScaler")
        if self._filtered_scaled and scaler.is_enabled():
            raise ValueError(
                "scaler: the grad_filter (e.g. dear-covap's error-feedback residuals) already saw this run's "
                "gradients without a GradScaler, i.e. in loss-scaled units; pass the scaler when building "
                "DeAR (DeAR(..., grad_scaler=scaler), gradsync.wrap(..., scaler=scaler)) instead of only to "
                "step()/unscale_()/clip_grad_norm_()")
        self._scaler = scaler

    def unscale(self, scaler: torch.amp.GradScaler) -> None:
        """Divide the averaged shards not unscaled yet by ``scaler``'s scale and all-reduce (MAX) the
        found-inf flag over the group. Call it once this iteration's reduction is finished
        (``state.reduced``). Idempotent within an iteration; nothing for a disabled scaler. Collective.

        Raises:
            RuntimeError: if the scaler has no scale yet (``scaler.scale(loss)`` was not called).
        """
        if not scaler.is_enabled():
            return
        if self._found_inf_global:
            return
        if scaler._scale is None:
            raise RuntimeError("GradScaler has no scale yet: call scaler.scale(loss).backward() first")
        dev = self._device
        inv = scaler._scale.double().reciprocal().float().to(dev)
        found = self._found_inf if self._found_inf is not None else torch.zeros(1, device=dev)
        for g in self._state.groups:
            if g.skipped or g.unscaled:
                continue
            view = g.shard_grads(self._rank, self._world_size)
            if view.numel():
                torch._amp_foreach_non_finite_check_and_unscale_([view], found, inv)
            g.unscaled = True
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self._group)
        self._found_inf = found
        self._found_inf_global = True

    def end_iteration(self, optimizer: torch.optim.Optimizer) -> bool:
        """At ``step()``, once the reduction is finished: with an enabled scaler, unscale (:meth:`unscale`),
        record the global found-inf for ``optimizer`` and ``scaler.update()``. Then forget this
        iteration's scale and flag. Returns whether the update is skipped (inf/nan on some rank)."""
        scaler = self._scaler
        skip = False
        if scaler is not None and scaler.is_enabled():
            self.unscale(scaler)
            found = self._found_inf
            record_found_inf(scaler, optimizer, found)
            scaler.update()
            skip = bool(found.item() > 0)
        self._inv_scale = None
        self._found_inf = None
        self._found_inf_global = False
        return skip


def check_clip(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats.

    Raises:
        ValueError: ``max_norm`` not finite and >= 0, or ``norm_type`` not > 0 (``inf`` allowed).
    """
    max_norm = check_float("max_norm", max_norm, 0.0, None)
    if not (isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool)
            and float(norm_type) == math.inf):
        norm_type = check_float("norm_type", norm_type, 0.0, None, low_inclusive=False)
    return max_norm, float(norm_type)


def clip_shards(shards: list[torch.Tensor], max_norm: float, norm_type: float, group: dist.ProcessGroup,
                device: torch.device) -> torch.Tensor:
    """Clip the averaged gradients held as ``shards`` (this rank's 1-D views, modified in place) by
    their global ``norm_type``-norm over ``group`` (arguments checked by :func:`check_clip`); returns
    the norm before clipping (0-d float32 on ``device``), as :meth:`DeAR.clip_grad_norm_
    <gradsync.algorithms.dear.DeAR.clip_grad_norm_>`. Collective."""
    local = torch.zeros((), dtype=torch.float32, device=device)
    if norm_type == math.inf:
        for s in shards:
            if s.numel():
                local = torch.maximum(local, s.detach().abs().max().float())
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        for s in shards:
            if s.numel():
                local = local + torch.linalg.vector_norm(s, norm_type, dtype=torch.float32) ** norm_type
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for s in shards:
        if s.numel():
            s.mul_(coef.to(s.dtype))
    return total


def check_scaler(name: str, scaler: Any, allow_none: bool = True) -> None:
    if scaler is None and allow_none:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"{name} must be a torch.amp.GradScaler{' or None' if allow_none else ''}, "
                         f"got {type(scaler).__name__}")


def record_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                      found_inf: torch.Tensor) -> None:
    """Record ``found_inf`` as ``scaler.step(optimizer)`` would, so ``scaler.update()`` backs off or grows."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.STEPPED

