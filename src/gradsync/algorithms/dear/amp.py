"""Loss scaling (``torch.amp.GradScaler``) and gradient clipping on DeAR's reduced shards.

Each rank holds ``1/P`` of every averaged gradient after the reduce-scatter, so unscaling, the
inf/nan check (one all-reduce of a flag) and the global norm (one all-reduce of a scalar) work on the
shards, and the unscaled / clipped shards are what is all-gathered (Zhang et al., arXiv 2302.12445,
Sec. 3: all-reduce = reduce-scatter + all-gather). :class:`LossScaling` is a base of
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


class LossScaling:
    """Unscaling, skip-on-inf and clipping of a DeAR wrapper.

    Uses the host's ``_scaler``, ``_inv_scale``, ``_found_inf``, ``_found_inf_global``,
    ``_filtered_scaled``, ``grad_filter``, ``_groups``, ``rank``, ``world_size``, ``rs_group``,
    ``_device`` and its ``_finish_reduce()`` / ``_live_shards()``.
    """

    def _hook_unscale(self, g: FusionGroup, flat: torch.Tensor) -> None:
        """With a known GradScaler: ``flat *= 1/scale`` and record non-finite values (no host sync)."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return
        if self._inv_scale is None:  # once per iteration, as GradScaler.unscale_
            self._inv_scale = scaler._scale.double().reciprocal().float().to(g.grad_buf.device)
            self._found_inf = torch.zeros(1, dtype=torch.float32, device=g.grad_buf.device)
        torch._amp_foreach_non_finite_check_and_unscale_([flat], self._found_inf, self._inv_scale)
        if self.grad_filter is not None:  # keep inf/nan out of the filter's residuals
            flat.nan_to_num_(0.0, 0.0, 0.0)
        g.unscaled = True

    def unscale_(self, scaler: torch.amp.GradScaler) -> None:
        """Finish this iteration's reduction and divide the averaged gradients by the loss scale.

        The counterpart of ``scaler.unscale_(optimizer)``: call it (or pass ``grad_scaler`` at
        construction) before :meth:`clip_grad_norm_` when the loss was scaled. Non-finite values are
        detected on every rank's shards and the flag is all-reduced (MAX) over the group, so every
        rank skips the same steps. Idempotent within an iteration; remembers ``scaler`` for later
        iterations. Collective: every rank must call it.

        Raises:
            ValueError: if ``scaler`` is not a ``torch.amp.GradScaler``, is not the GradScaler in use
                (given at construction or earlier), or comes after a ``grad_filter`` already saw
                loss-scaled gradients (pass it at construction).
            RuntimeError: if the scaler has no scale yet (``scaler.scale(loss)`` was not called).
        """
        check_scaler("scaler", scaler, allow_none=False)
        self._adopt_scaler(scaler)
        self._unscale(scaler)

    def _adopt_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Remember ``scaler`` (a ``step``/``unscale_`` argument) as the one in use, or raise if it
        conflicts with the known one or comes too late for the ``grad_filter``."""
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

    def _unscale(self, scaler: torch.amp.GradScaler) -> None:
        if not scaler.is_enabled():
            return
        self._finish_reduce()
        if self._found_inf_global:
            return
        if scaler._scale is None:
            raise RuntimeError("GradScaler has no scale yet: call scaler.scale(loss).backward() first")
        dev = self._device
        inv = scaler._scale.double().reciprocal().float().to(dev)
        found = self._found_inf if self._found_inf is not None else torch.zeros(1, device=dev)
        for g in self._groups:
            if g.skipped or g.unscaled:
                continue
            view = g.shard_grads(self.rank, self.world_size)
            if view.numel():
                torch._amp_foreach_non_finite_check_and_unscale_([view], found, inv)
            g.unscaled = True
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.rs_group)
        self._found_inf = found
        self._found_inf_global = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, like DDP + ``torch.nn.utils.clip_grad_norm_``.

        Call it after ``backward()`` and before :meth:`step`. It finishes this iteration's
        reduce-scatters, computes ``||g||_p`` over all averaged gradients (each rank holds ``1/P`` of
        them: local sums of ``|g|^p``, or the local max for ``p = inf``, are all-reduced), and
        multiplies every gradient by ``min(1, max_norm / (total + 1e-6))`` before the all-gather.
        With a known GradScaler (``grad_scaler=`` or an earlier :meth:`unscale_` / ``step(scaler)``)
        the gradients are unscaled first. Collective: every rank must call it.

        Args:
            max_norm: maximum norm, finite and >= 0.
            norm_type: ``p`` of the p-norm, > 0 (``float("inf")`` for the max norm).

        Returns:
            the total norm before clipping, a 0-d tensor on the parameters' device (float32 for
            float32/float16/bfloat16 gradients; computed in float32); inf/nan when gradients are
            not finite (the step is then skipped by ``step(scaler)``, as with torch).

        Raises:
            ValueError: for ``max_norm`` or ``norm_type`` out of range.
        """
        max_norm = check_float("max_norm", max_norm, 0.0, None)
        if not (isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool)
                and float(norm_type) == math.inf):
            norm_type = check_float("norm_type", norm_type, 0.0, None, low_inclusive=False)
        norm_type = float(norm_type)
        if self._scaler is not None:
            self._unscale(self._scaler)
        self._finish_reduce()
        shards = self._live_shards()
        dev = self._device
        if norm_type == math.inf:
            local = torch.zeros((), dtype=torch.float32, device=dev)
            for s in shards:
                if s.numel():
                    local = torch.maximum(local, s.detach().abs().max().float())
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.rs_group)
            total = local
        else:
            local = torch.zeros((), dtype=torch.float32, device=dev)
            for s in shards:
                if s.numel():
                    local = local + torch.linalg.vector_norm(s, norm_type, dtype=torch.float32) ** norm_type
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.rs_group)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            if s.numel():
                s.mul_(coef.to(s.dtype))
        return total

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (given at construction or to :meth:`step` / :meth:`unscale_`)."""
        return self._scaler


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

