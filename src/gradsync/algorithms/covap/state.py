"""State of COVAP's DDP communication hook (:class:`CovapState`): the filter, the recorded bucket
layouts (by parameter name, so a restored state survives a fresh DDP's bucket rebuild), the start-up
iterations, ``ratio="auto"``'s calibration and the K adaptation (see :mod:`gradsync.algorithms.covap`).
"""

from __future__ import annotations

import logging
from dataclasses import astuple, replace
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ...compressors.cast import cast_dtype
from ...feedback.residual import bucket_layout, layout_numels, parameter_names
from ...validation import check_dense_from, check_int
from ..base import HookState
from .adapt import CommTimer, RatioAdapter, StepTiming
from .filter import CovapFilter

log = logging.getLogger(__name__)

#: ``adapt_every`` of ``ratio="auto"`` unless given (a fixed ratio defaults to 0, K fixed): one
#: 4-number all-reduce every 20 steps.
AUTO_ADAPT_EVERY = 20
#: Timed iterations a self-calibrating ``auto`` state averages (median) before its first choice of K:
#: iterations 1.. (iteration 0 runs before DDP's bucket rebuild and opens the connections).
AUTO_CALIBRATION_STEPS = 3


class CovapState(HookState):
    """State of :func:`covap_hook`.

    Args:
        ratio: K in [1, 32] or ``"auto"`` (see :class:`CovapFilter`).
        process_group: group of the all-reduces (``None`` = default group).
        start_iter: first compressed iteration, >= 2 so DDP's bucket rebuild (after iteration 0)
            has happened and the layout was recorded in a dense iteration.
        lam0, ramp_steps: discounted-EF constants (see :class:`CovapFilter`).
        model: the module DDP wraps (optional): bucket layouts then name parameters, so residuals
            follow parameters when a restored state meets a differently bucketed DDP; with
            ``adapt_every`` the end of its forward pass starts the backward timing.
        adapt_every: re-choose K every this many compressed steps from the hook's timing of its
            own collectives (:mod:`gradsync.algorithms.covap.adapt`); 0: K stays fixed; ``None``
            (default): :data:`AUTO_ADAPT_EVERY` with ``ratio="auto"``, else 0. Every rank switches K
            at the same step boundary; residuals are kept. With ``ratio="auto"`` the state also
            calibrates K itself from its first iterations unless :meth:`calibrate` is called first.
        cast: ``"fp16"``, ``"bf16"`` or ``None`` (default: the bucket's dtype): the selected shard
            is divided by the world size in float32, then cast and all-reduced (summed) in that
            dtype, as torch's ``fp16_compress_hook``; the rounding error of the cast stays in the
            error-feedback residual.
        hysteresis: relative band of :class:`~gradsync.algorithms.covap.adapt.RatioAdapter`, in [0, 1).
        max_ratio: largest K that ``"auto"`` and ``adapt_every`` may choose, in [1, 32]; a fixed
            ``ratio`` must not exceed it. ``None`` (default): 2 with ``"auto"``
            (:data:`~gradsync.compressors.covap_shards.AUTO_MAX_RATIO`: a larger K missed dense
            quality on every seed measured), else 32 (COVAP's limit).
        dense_from: from this iteration on K = 1 (every element sent each step, the residual flushed
            into the first such step; ``adapt_every`` and ``"auto"`` no longer change K); 0 (default):
            never. Must be 0 or >= ``start_iter``.
        timer: the per-step timing source (default a new
            :class:`~gradsync.algorithms.covap.adapt.CommTimer`); tests pass one feeding chosen timings.

    Attributes:
        filter: the :class:`CovapFilter`.
        layouts: bucket index -> layout (parameter names and numels, or shapes) recorded during the
            dense start-up iterations: the :attr:`~gradsync.feedback.residual.ResidualMemory.layouts`
            of the filter's residual memory, which keeps each residual where these buckets put it.
        remapped_buckets: buckets compressed through the recorded layout after a restore, before
            DDP's bucket rebuild.
        bucket_warning: the warning of :func:`~gradsync.comm.buckets.bucket_overlap_warning` when the
            layout recorded at start-up has too few buckets to overlap with the backward pass (also
            logged once, on rank 0, and in :meth:`stats`), else ``None``.
        adapter: the :class:`~gradsync.algorithms.covap.adapt.RatioAdapter` (``None`` when K is fixed
            and not ``"auto"``).
        cast_dtype: the wire dtype selected by ``cast`` (``None``: the bucket's).

    Raises:
        ValueError: for arguments outside the ranges above (``cast`` not one of fp16, bf16, None).
    """

    # defaults for states pickled before these options existed
    adapter: Optional[RatioAdapter] = None
    timer: Any = None
    cast: Optional[str] = None
    cast_dtype: Optional[torch.dtype] = None
    bucket_warning: Optional[str] = None
    _boundary_iter = -1
    _forward_handle = None
    _wire_scale = 1.0
    dense_from = 0

    def __init__(self, ratio: Union[int, str] = 3, process_group: Optional[dist.ProcessGroup] = None,
                 start_iter: int = 2, lam0: Optional[float] = None, ramp_steps: Optional[int] = None,
                 model: Optional[torch.nn.Module] = None, adapt_every: Optional[int] = None,
                 cast: Optional[str] = None, hysteresis: float = 0.25, timer: Any = None,
                 max_ratio: Optional[int] = None, dense_from: int = 0):
        super().__init__(process_group)
        self.filter = CovapFilter(ratio, lam0, ramp_steps, max_ratio)
        self.start_iter = check_int("start_iter", start_iter, 2)
        self.dense_from = check_dense_from(dense_from, self.start_iter)
        self.cast_dtype = cast_dtype(cast)
        self.cast = cast
        if adapt_every is None:
            adapt_every = AUTO_ADAPT_EVERY if self.filter.auto else 0
        adapt_every = check_int("adapt_every", adapt_every, 0)
        self.adapter = (RatioAdapter(adapt_every, hysteresis, self.filter.max_ratio)
                        if adapt_every or self.filter.auto else None)
        self.timer = timer if timer is not None else (CommTimer() if self.adapter is not None else None)
        self._forward_handle = None
        if self.timer is not None and model is not None and timer is None:
            self._forward_handle = model.register_forward_hook(self.timer.forward_done)
        self._boundary_iter = -1
        self._wire_scale = 1.0
        self.param_names = parameter_names(model) if model is not None else None
        self._awaiting_rebuild = False
        self._layout_iter: Optional[int] = None  # the iteration whose layout `layouts` holds
        self.remapped_buckets = 0

    @property
    def layouts(self) -> dict[int, Any]:
        return self.filter.memory.layouts

    @layouts.setter
    def layouts(self, value: dict[int, Any]) -> None:
        self.filter.memory.layouts.clear()
        self.filter.memory.layouts.update(value)

    @property
    def ratio(self) -> int:
        return self.filter.ratio

    @property
    def needs_ccr(self) -> bool:
        return self.filter.needs_ccr

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Set K from the all-reduced CCR (see :meth:`CovapFilter.calibrate`); the state then does
        not calibrate itself, and the adaptation window restarts."""
        if self.adapter is not None:
            self.adapter.window.clear()
        return self.filter.calibrate(ccr)

    @property
    def calibration_iter(self) -> int:
        """The iteration at whose first hook call a self-calibrating ``auto`` state chooses K."""
        return max(self.start_iter, 1 + AUTO_CALIBRATION_STEPS)

    def close(self) -> None:
        """Remove the forward hook the state put on ``model`` (idempotent); the state stays usable
        (the backward time then starts at the first bucket)."""
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None

    def set_ratio(self, ratio: int) -> None:
        """Change K between iterations (same value on every rank); residuals are kept."""
        self.filter.set_ratio(ratio)

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype the selected shards travel in when ``cast`` is set (``None``: the bucket's)."""
        return self.cast_dtype

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        return {"covap_k": self.filter.ratio}

    def _observed(self, step: int, timing: Optional[StepTiming]) -> Optional[StepTiming]:
        """Step ``step``'s timing as the adaptation window takes it, or ``None``: compressed steps
        always; while ``auto`` waits for its CCR also the dense start-up steps after DDP's bucket
        rebuild (step >= 1), their communication scaled to the wire dtype of ``cast``."""
        if timing is None or step < 1:
            return None
        if step >= self.start_iter:
            return timing
        if self.needs_ccr:
            return replace(timing, comm_s=timing.comm_s * self._wire_scale)
        return None

    def step_boundary(self, buf: torch.Tensor) -> None:
        """At the first hook call of an iteration (every bucket of the previous one has completed;
        ``buf`` is that call's bucket): close the previous step's timing; every ``adapt_every``
        compressed steps (and once at :attr:`calibration_iter` while ``auto`` waits for its CCR),
        re-choose K on every rank together (a blocking MAX all-reduce issued here, in the hook body)."""
        t = self.iteration
        if self.adapter is None or self._boundary_iter == t:
            return
        self._boundary_iter = t
        if self.cast_dtype is not None:
            self._wire_scale = torch.finfo(self.cast_dtype).bits / 8 / buf.element_size()
        observed = self._observed(t - 1, self.timer.finish_step())
        if observed is not None:
            self.adapter.observe(observed)
        device = buf.device
        if self.needs_ccr:
            if t >= self.calibration_iter:
                self._calibrate_from_window(device)
            return
        if t > self.start_iter and self.adapter.due(t - self.start_iter):
            new = self.adapter.step_boundary(self.filter.ratio, self.process_group, device)
            if new != self.filter.ratio:
                log.info("COVAP: iteration %d, CCR estimate %.2f: K %d -> %d", t, self.adapter.last["ccr"],
                         self.filter.ratio, new)
                self.filter.set_ratio(new, keep_discount=True)

    def enter_dense_tail(self) -> None:
        """At the first hook call of an iteration >= ``dense_from``: K = 1 from now on (the discount
        schedule kept), whatever ``auto`` or the adaptation chose; a no-op once K is 1."""
        if self.filter.ratio != 1:
            log.info("COVAP: iteration %d >= dense_from: K %d -> 1 (dense tail)", self.iteration, self.filter.ratio)
            self.filter.set_ratio(1, keep_discount=True)

    def send_dtype(self, buf: torch.Tensor) -> torch.dtype:
        """The dtype the selected values of bucket ``buf`` travel in (``cast``, else the bucket's)."""
        return buf.dtype if self.cast_dtype is None else self.cast_dtype

    def _snapshot(self) -> Any:
        return self.filter.memory.snapshot()

    def _restore(self, saved: Any) -> None:
        self.filter.memory.restore(saved)

    def check_buckets(self, element_size: int) -> Optional[str]:
        """Once the start-up iterations have recorded DDP's layout: set :attr:`bucket_warning` (and
        log it on rank 0) when there are too few buckets for K (``auto`` before calibration: K = 1)
        to overlap with the backward pass. Returns the warning or ``None``."""
        from ...comm.buckets import bucket_overlap_warning

        msg = bucket_overlap_warning(self.recorded_numels(), element_size, 1 if self.needs_ccr else self.ratio)
        if msg is not None and msg != self.bucket_warning and dist.get_rank(self.process_group) == 0:
            log.warning("COVAP: %s", msg)
        self.bucket_warning = msg
        return msg

    def _calibrate_from_window(self, device: torch.device) -> None:
        """``auto``'s first K, from the start-up window, identical on every rank (one all-reduce);
        a window without information (no backward time seen) retries at the next iteration."""
        self.adapter.step_boundary(self.filter.ratio, self.process_group, device, initial=True)
        ccr = self.adapter.last["ccr"]
        if ccr >= 0:
            self.filter.calibrate(ccr)
            log.info("COVAP ratio=auto: iteration %d, CCR %.2f from the hook's own timing: K = %d",
                     self.iteration, ccr, self.filter.ratio)

    def layout_of(self, bucket: dist.GradBucket) -> Any:
        return bucket_layout(bucket, self.param_names)

    def recorded_numels(self) -> list[int]:
        """Elements per bucket of the recorded layout, in bucket order."""
        return [sum(layout_numels(self.layouts[i])) for i in range(len(self.layouts))]

    def bucket_numels(self) -> Optional[list[int]]:
        """:meth:`recorded_numels` once a layout was recorded, else ``None`` (DDP's buckets apply)."""
        return list(self.recorded_numels()) if self.layouts else None

    def config(self) -> dict[str, Any]:
        return {"algorithm": "covap", "start_iter": self.start_iter, **self.filter.config(),
                "adapt_every": self.adapter.adapt_every if self.adapter else 0, "cast": self.cast,
                "dense_from": self.dense_from}

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s.update(self.filter.stats())
        s["ef_discount"] = self.filter.discount(max(0, self.iteration - self.start_iter))
        s["remapped_buckets"] = self.remapped_buckets
        if self.bucket_warning is not None:
            s["bucket_warning"] = self.bucket_warning
        if self.adapter is not None:
            s["covap_k_changes"] = self.adapter.changes
            s.update({"covap_" + k: v for k, v in self.adapter.last.items()})
        return s

    def state_dict(self) -> dict[str, Any]:
        """Iteration, recorded layouts, the filter (K, residuals, discount) and, with
        ``adapt_every``, the adapter's counters."""
        out = {**super().state_dict(), "layouts": dict(self.layouts), "filter": self.filter.state_dict()}
        if self.adapter is not None:
            out["adapter"] = self.adapter.state_dict()
            if self._boundary_iter != self.iteration:  # the last step is still open: the window holds it
                pending = self._observed(self.iteration - 1, self.timer.peek_step())
                if pending is not None:
                    out["adapter"]["window"].append(astuple(pending))
        return out

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_forward_handle"] = None  # a hook handle belongs to this process's module
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        legacy = d.pop("layouts", None)  # states pickled before the layouts moved into the memory
        d.pop("_param_index", None)
        super().__setstate__(d)
        if legacy:
            self.layouts = legacy

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. A fresh DDP has not rebuilt its buckets yet: until its
        layout equals the recorded one, each parameter is compressed exactly as in its recorded bucket
        (found by name, so the run continues as if uninterrupted); without parameter names
        (``model`` not given) those buckets are all-reduced densely and the residuals wait."""
        super().load_state_dict(state)
        self.filter.load_state_dict(state["filter"])
        self.layouts = {int(k): v for k, v in state["layouts"].items()}
        if self.adapter is not None and "adapter" in state:
            self.adapter.load_state_dict(state["adapter"])
        if self.timer is not None:
            self.timer.discard_step()
        self._boundary_iter = -1
        self._awaiting_rebuild = True

