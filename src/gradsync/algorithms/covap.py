"""COVAP: overlapping-aware gradient compression with a coarse-grained filter.

Source: Lin Meng, Yuzhong Sun, Weimin Li, "Near-Linear Scaling Data Parallel Training with
Overlapping-Aware Gradient Compression", arXiv 2311.04499 (2023), §3; the reference code calls it
OGC. Its error-feedback aliasing bugs are not reproduced: this module implements the stated intent.

The filter is deterministic: it depends only on the iteration number and the static bucket layout,
so every rank selects the same elements and a plain all-reduce still works.

* Tensor sharding: with ``m`` the median bucket numel, bucket ``b`` of numel ``n_b`` is cut into
  ``c_b = 1`` interleaved shards if ``floor(n_b / m - 0.3) <= 0``, else ``min(floor(n_b/m - 0.3) + 1, K)``;
  shard ``s`` holds elements ``s, s + c_b, s + 2 c_b, ...``.
* Round-robin schedule: shard ``s`` of bucket ``b`` has global id ``G = sum_{b'<b} c_b' + s`` and is
  sent at iteration ``t`` iff ``(G + t) mod K == 0``, so each element is sent once every K iterations
  and at most one shard of a bucket is sent per iteration. A bucket with no selected shard launches no
  collective (DDP receives an already-completed future of zeros), except the last bucket, which
  all-reduces the iteration's finite vote (:class:`~gradsync.feedback.finite.FiniteGuard`, 4 bytes);
  when it sends, the vote is one more element of its shard. A non-finite step keeps the residuals
  as they were and gives NaN to every rank, so GradScaler skips it once, as with DDP.
* Discounted error feedback: ``x = lambda_t e + g`` (:class:`~gradsync.feedback.discounted.CovapDiscount`
  as the schedule of a :class:`~gradsync.feedback.residual.ResidualMemory`); the selected shard of ``x``
  is all-reduced (averaged), everything unsent stays in ``e``. Unsent positions have zero gradient this
  step; momentum and weight decay still apply (a deliberate choice, as in the reference code).
* K from the CCR: with ``ratio="auto"`` K = ceil(CCR) in [1, ``max_ratio``]. ``gradsync train`` and
  ``bench`` measure the communication-to-computation ratio before training and call
  :meth:`CovapFilter.calibrate`; wherever else the hook runs (``build_hook``, ``gradsync.wrap``, the
  integrations) it calibrates itself from its own first iterations: it times the backward pass and
  its collectives (the dense start-up all-reduces and K = 1 iterations, :mod:`.covap_adapt`), and at
  iteration ``max(start_iter, 1 + AUTO_CALIBRATION_STEPS)`` every rank takes the same K from one
  all-reduce issued in the hook body. ``auto`` then keeps following the network every
  ``adapt_every`` (default :data:`AUTO_ADAPT_EVERY`) steps.
* Compression starts at ``start_iter`` (default 2), after DDP's bucket rebuild, like PowerSGD's
  ``start_powerSGD_iter``; the bucket layout is recorded during the dense iterations before it. A
  state restored from a checkpoint into a fresh DDP does not wait for DDP to rebuild its
  buckets: each parameter is found by name in the recorded layout and compressed exactly as it would
  have been there, so a resumed run continues the uninterrupted one.

:class:`CovapFilter` (sharding, schedule, K and the residual memory) is the one object shared by the
DDP hook here and DeAR's pipeline (:mod:`gradsync.algorithms.dear.covap`).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import logging
from dataclasses import astuple, dataclass, replace
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..comm.collectives import dense_allreduce
from ..compressors.cast import CASTS, cast_dtype
from ..compressors.covap_shards import MAX_RATIO, CovapPlan, ratio_for_ccr
from ..feedback.discounted import CovapDiscount, default_ramp
from ..feedback.residual import ResidualMemory, _is_named, bucket_layout, parameter_names
from ..options import AUTO, Options, option
from ..validation import check_float, check_int
from .base import HookState
from .covap_adapt import CommTimer, RatioAdapter, StepTiming
from .spec import hook_algorithm

log = logging.getLogger(__name__)

#: ``adapt_every`` of ``ratio="auto"`` unless given (a fixed ratio defaults to 0, K fixed): one
#: 4-number all-reduce every 20 steps.
AUTO_ADAPT_EVERY = 20
#: Timed iterations a self-calibrating ``auto`` state averages (median) before its first choice of K:
#: iterations 1.. (iteration 0 runs before DDP's bucket rebuild and opens the connections).
AUTO_CALIBRATION_STEPS = 3


@dataclass(frozen=True)
class CovapOptions(Options):
    """Options of ``covap``."""

    OWNER = "covap"
    ratio: Union[int, str] = option(3, "COVAP compression ratio K: each gradient element is sent once every "
                                    "K iterations; 'auto' sets K = ceil(measured CCR)", low=1, high=MAX_RATIO)
    adapt_every: Optional[int] = option(None, "re-choose K from the hook's own timing of its collectives every "
                                        "this many steps (0: K fixed; default 20 with ratio 'auto', else 0)",
                                        low=0, high=1_000_000, units="steps")
    cast: Optional[str] = option(None, "send the selected shard as fp16 or bf16 (rounding error kept in the "
                                 "error-feedback residual); default: the bucket's dtype", choices=CASTS)
    max_ratio: int = option(MAX_RATIO, "largest K that 'auto' and adapt_every may choose (a large K hides the "
                            "communication but costs accuracy per step)", low=1, high=MAX_RATIO)


class CovapFilter:
    """COVAP's coarse-grained filter with discounted error feedback, for any bucket layout.

    Args:
        ratio: K in [1, 32] (1 reproduces dense all-reduce), or ``"auto"``: K = 1 until
            :meth:`calibrate` receives the CCR.
        lam0, ramp_steps: discount constants; ``None`` takes the reference values for K
            (``lam0=0.5, D=50`` for K <= 8, else ``0.2, 100``).
        max_ratio: largest K :meth:`calibrate` may choose, in [1, 32] (default 32).

    Raises:
        ValueError: for arguments outside those ranges, or a fixed ``ratio`` above ``max_ratio``.
    """

    max_ratio = MAX_RATIO  # for filters pickled before the option existed

    def __init__(self, ratio: Union[int, str] = 3, lam0: Optional[float] = None,
                 ramp_steps: Optional[int] = None, max_ratio: int = MAX_RATIO):
        self.auto = ratio == AUTO
        self.max_ratio = check_int("max_ratio", max_ratio, 1, MAX_RATIO)
        self.ratio = 1 if self.auto else check_int("ratio", ratio, 1, self.max_ratio)
        self.calibrated = False
        self._explicit_ramp = (None if lam0 is None else check_float("lam0", lam0, 0.0, 1.0),
                               None if ramp_steps is None else check_int("ramp_steps", ramp_steps, 1))
        self.memory = ResidualMemory(beta=CovapDiscount())
        self._set_ramp()
        self.plan: Optional[CovapPlan] = None

    def _set_ramp(self) -> None:
        lam0, steps = self._explicit_ramp
        d_lam0, d_steps = default_ramp(self.ratio)
        self.memory.beta.lam0 = d_lam0 if lam0 is None else lam0
        self.memory.beta.ramp_steps = d_steps if steps is None else steps

    @property
    def discount(self) -> CovapDiscount:
        return self.memory.beta

    @property
    def needs_ccr(self) -> bool:
        return self.auto and not self.calibrated

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Set K = ceil(``ccr``) in [1, ``max_ratio``] (``ccr`` must be identical on every rank, e.g.
        all-reduced MAX). Returns ``{"ccr": ccr, "ratio": K}``."""
        self.set_ratio(ratio_for_ccr(ccr, self.max_ratio))
        self.calibrated = True
        return {"ccr": float(ccr), "ratio": self.ratio}

    def set_ratio(self, ratio: int, keep_discount: bool = False) -> None:
        """Change K (every rank must pass the same value, between iterations); the plan is rebuilt for
        the new K and the residuals are kept. With ``keep_discount`` the discount schedule stays as
        it is (a change during training must not lower the discount of residuals already held);
        otherwise it takes the reference constants for the new K (unless given explicitly).

        Raises:
            ValueError: if ``ratio`` is outside [1, 32].
        """
        self.ratio = check_int("ratio", ratio, 1, MAX_RATIO)
        if not keep_discount:
            self._set_ramp()
        self.plan = None

    def plan_for(self, numels: Sequence[int]) -> CovapPlan:
        """The plan for bucket sizes ``numels`` (rebuilt when the sizes or K changed)."""
        if self.plan is None or self.plan.numels != tuple(int(n) for n in numels):
            self.plan = CovapPlan.build(list(numels), self.ratio)
        return self.plan

    def split(self, key: int, flat: torch.Tensor, iteration: int, ef_step: int,
              layout: Any = None, send_dtype: Optional[torch.dtype] = None,
              world: int = 1) -> Optional[Tuple[int, int, torch.Tensor]]:
        """Error-compensate bucket ``key``'s flat gradient (1-D, ``plan.numels[key]`` elements, any
        floating dtype, not modified) and select this iteration's shard; the unsent rest becomes the
        residual, kept in float32 on ``flat``'s device.

        Args:
            send_dtype: dtype of the returned values (default float32). A narrower dtype (the
                bucket's bfloat16/float16, or a ``cast``) sends what the bucket holds; the rounding
                error of the selected values stays in the residual, so no gradient mass is lost.
            world: the selected values are divided by ``world`` (>= 1, e.g. the world size) in
                float32 before they are narrowed to ``send_dtype``, as torch's
                ``fp16_compress_hook`` does, so a sum over ``world`` ranks overflows only where the
                average would; the residual holds ``x - world * float(sent)``.

        Returns:
            ``None`` if the bucket sends nothing at ``iteration``, else ``(shard, c, values)`` with
            ``values = x[shard::c] / world`` (``send_dtype``, ``ceil((n - shard) / c)`` elements, local
            and not yet summed) for ``c`` shards of the bucket.
        """
        x = self.memory.compensate(flat, key, layout, step=ef_step)
        shard = self.plan.selected_shard(key, iteration)
        if shard is None:
            self.memory.store(key, x)
            return None
        c = self.plan.shards[key]
        values, x[shard::c] = narrow(x[shard::c], send_dtype, world)
        self.memory.store(key, x)
        return shard, c, values

    def residuals_to(self, device: torch.device) -> None:
        """Move the residuals to ``device`` as float32 (a state restored on the CPU meets CUDA buckets)."""
        memory = self.memory
        for k, e in memory.residuals.items():
            if e.device != device or e.dtype != torch.float32:
                memory.residuals[k] = e.to(device=device, dtype=torch.float32)

    def config(self) -> dict[str, Any]:
        return {"ratio": AUTO if self.needs_ccr else self.ratio, "lam0": self.discount.lam0,
                "ramp_steps": self.discount.ramp_steps, "max_ratio": self.max_ratio}

    def stats(self) -> dict[str, Any]:
        return {"covap_k": self.ratio, "shards": list(self.plan.shards) if self.plan else []}

    def state_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "auto": self.auto, "calibrated": self.calibrated,
                "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.auto = bool(state["auto"])
        self.set_ratio(int(state["ratio"]))
        self.calibrated = bool(state["calibrated"])
        self.memory.load_state_dict(state["memory"])


def narrow(values: torch.Tensor, send_dtype: Optional[torch.dtype], world: int = 1
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sent, kept)`` for float32 ``values`` about to be summed over ``world`` ranks: ``sent`` is
    ``values / world`` (divided in float32) in ``send_dtype`` (``None``: float32) and ``kept =
    values - world * float(sent)`` (float32, what the residual keeps: zero for a float32 send, the
    rounding error of a narrower one)."""
    sent = values / world if world != 1 else values.clone()
    if send_dtype is None or send_dtype == torch.float32:
        return sent, torch.zeros_like(values)
    sent = sent.to(send_dtype)
    return sent, values - sent.to(torch.float32) * world


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
            own collectives (:mod:`gradsync.algorithms.covap_adapt`); 0: K stays fixed; ``None``
            (default): :data:`AUTO_ADAPT_EVERY` with ``ratio="auto"``, else 0. Every rank switches K
            at the same step boundary; residuals are kept. With ``ratio="auto"`` the state also
            calibrates K itself from its first iterations unless :meth:`calibrate` is called first.
        cast: ``"fp16"``, ``"bf16"`` or ``None`` (default: the bucket's dtype): the selected shard
            is divided by the world size in float32, then cast and all-reduced (summed) in that
            dtype, as torch's ``fp16_compress_hook``; the rounding error of the cast stays in the
            error-feedback residual.
        hysteresis: relative band of :class:`~gradsync.algorithms.covap_adapt.RatioAdapter`, in [0, 1).
        max_ratio: largest K that ``"auto"`` and ``adapt_every`` may choose, in [1, 32] (default 32,
            COVAP's limit); a fixed ``ratio`` must not exceed it.
        timer: the per-step timing source (default a new
            :class:`~gradsync.algorithms.covap_adapt.CommTimer`); tests pass one feeding chosen timings.

    Attributes:
        filter: the :class:`CovapFilter`.
        layouts: bucket index -> layout (parameter names and numels, or shapes) recorded during the
            dense start-up iterations.
        remapped_buckets: buckets compressed through the recorded layout after a restore, before
            DDP's bucket rebuild.
        bucket_warning: the warning of :func:`~gradsync.comm.buckets.bucket_overlap_warning` when the
            layout recorded at start-up has too few buckets to overlap with the backward pass (also
            logged once, on rank 0, and in :meth:`stats`), else ``None``.
        adapter: the :class:`~gradsync.algorithms.covap_adapt.RatioAdapter` (``None`` when K is fixed
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

    def __init__(self, ratio: Union[int, str] = 3, process_group: Optional[dist.ProcessGroup] = None,
                 start_iter: int = 2, lam0: Optional[float] = None, ramp_steps: Optional[int] = None,
                 model: Optional[torch.nn.Module] = None, adapt_every: Optional[int] = None,
                 cast: Optional[str] = None, hysteresis: float = 0.25, timer: Any = None,
                 max_ratio: int = MAX_RATIO):
        super().__init__(process_group)
        self.filter = CovapFilter(ratio, lam0, ramp_steps, max_ratio)
        self.start_iter = check_int("start_iter", start_iter, 2)
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
        self.layouts: dict[int, Any] = {}
        self._awaiting_rebuild = False
        self._layout_iter: Optional[int] = None  # the iteration whose layout `layouts` holds
        self._param_index: Optional[dict[str, tuple[int, int]]] = None
        self.remapped_buckets = 0

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
        from ..comm.buckets import bucket_overlap_warning

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
        return [sum(_numels(self.layouts[i])) for i in range(len(self.layouts))]

    def bucket_numels(self) -> Optional[list[int]]:
        """:meth:`recorded_numels` once a layout was recorded, else ``None`` (DDP's buckets apply)."""
        return list(self.recorded_numels()) if self.layouts else None

    def param_index(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (recorded bucket index, element offset in it), for named layouts."""
        if self._param_index is None:
            self._param_index = {}
            for b, layout in self.layouts.items():
                off = 0
                for item in layout:
                    if _is_named((item,)):
                        self._param_index[item[0]] = (b, off)
                    off += _numels((item,))[0]
        return self._param_index

    def config(self) -> dict[str, Any]:
        return {"algorithm": "covap", "start_iter": self.start_iter, **self.filter.config(),
                "adapt_every": self.adapter.adapt_every if self.adapter else 0, "cast": self.cast}

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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. A fresh DDP has not rebuilt its buckets yet: until its
        layout equals the recorded one, each parameter is compressed exactly as in its recorded bucket
        (found by name, so the run continues as if uninterrupted); without parameter names
        (``model`` not given) those buckets are all-reduced densely and the residuals wait."""
        super().load_state_dict(state)
        self.layouts = {int(k): v for k, v in state["layouts"].items()}
        self._param_index = None
        self.filter.load_state_dict(state["filter"])
        if self.adapter is not None and "adapter" in state:
            self.adapter.load_state_dict(state["adapter"])
        if self.timer is not None:
            self.timer.discard_step()
        self._boundary_iter = -1
        self._awaiting_rebuild = True


def _timed_dense(state: CovapState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Dense all-reduce of ``bucket`` (a start-up iteration), timed when the state keeps a timer."""
    buf = bucket.buffer()
    timer = state.timer
    ident = timer.launched(buf.numel()) if timer is not None else None
    fut = dense_allreduce(buf, state.process_group, state.count_collective)
    state.end_bucket(bucket)
    if ident is None:
        return fut

    def done(f: torch.futures.Future) -> torch.Tensor:
        timer.completed(ident)
        return f.value()

    return fut.then(done)


def _completed(buf: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def covap_hook(state: CovapState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook applying COVAP to one bucket.

    ``bucket.buffer()`` is the local flat gradient, ``[numel]`` of the parameters' floating dtype
    (float32, bfloat16 or float16) on their device; the returned future holds the averaged gradient
    of the same shape, dtype and device with unsent positions zero. The shard is sent in the
    bucket's dtype (as DDP's own reduction does), or with ``state.cast`` in float16/bfloat16
    (divided by the world size in float32 before the cast, then summed in that dtype); residuals are
    kept in float32. A compressed iteration is decided finite or not on every rank together
    (:class:`~gradsync.feedback.finite.FiniteGuard`): its last bucket's all-reduce carries one more
    element (or, when that bucket sends nothing, a 1-element all-reduce is issued for it), and a
    non-finite result restores the residuals and returns NaN in the last bucket, so GradScaler skips
    the step on every rank. Bytes counted: the contiguous shard handed to ``all_reduce``
    (``numel / c_b`` elements, one more in the last bucket) or nothing for a dropped bucket (4 bytes
    when it is the last). With ``state.adapter``, the first call of an iteration may
    all-reduce the timing window and change K (:meth:`CovapState.step_boundary`).

    Raises:
        RuntimeError: if the bucket layout differs from the one recorded during warm-up (other than
            right after a restore, before DDP's bucket rebuild).
    """
    buf = bucket.buffer()
    index = bucket.index()
    t = state.iteration
    world = state.world_size
    layout = state.layout_of(bucket)
    timer = state.timer
    if timer is not None:
        state.step_boundary(buf)
        timer.bucket_ready(buf.numel(), buf.device)
    if t < state.start_iter:
        if state._layout_iter != t:  # keep only this iteration's layout (DDP may
            state.layouts.clear()                      # rebuild into fewer buckets)
            state._param_index = None
            state._layout_iter = t
        state.layouts[index] = layout
        if bucket.is_last() and t == state.start_iter - 1:  # the layout compression will run on
            state.check_buckets(buf.element_size())
        return _timed_dense(state, bucket)

    if state.layouts.get(index) != layout:
        if not state._awaiting_rebuild:
            raise RuntimeError(f"COVAP bucket {index} holds {buf.numel()} elements in a layout that differs "
                               f"from the one recorded during warm-up; the bucket layout changed")
        state.filter.plan_for(state.recorded_numels())
        state.filter.residuals_to(buf.device)
        if state.param_names is not None and _is_named(layout) and all(
                name in state.param_index() for name, _ in layout):
            return _remapped_bucket(state, bucket, layout)
        log.warning("COVAP: DDP has not rebuilt its buckets since the state was restored and the state has no "
                    "parameter names (pass model=); bucket %d is all-reduced densely this iteration", index)
        state.finite_guard.begin(t, state._snapshot)
        return _decide(state, bucket, _timed_dense(state, bucket))
    if bucket.is_last():
        state._awaiting_rebuild = False

    state.filter.plan_for(state.recorded_numels())
    guard = state.finite_guard
    guard.begin(t, state._snapshot)
    with state.compression_timer():
        selected = state.filter.split(index, buf, t, t - state.start_iter, send_dtype=state.send_dtype(buf),
                                      world=world)
        guard.check(state.filter.memory.residuals[index], *selected[2:] if selected else ())
    if selected is None:
        return _send(state, bucket, None, None)
    shard, c, values = selected
    return _send(state, bucket, values, (shard, c))


def _send(state: CovapState, bucket: dist.GradBucket, send: Optional[torch.Tensor],
          where: Any) -> torch.futures.Future:
    """All-reduce ``send`` (this rank's selected values, already divided by the world size; ``None``:
    the bucket sends nothing) and scatter the sum into the zeroed bucket at ``where`` (``(shard, c)``
    for ``buf[shard::c]``, or an index tensor). The iteration's last bucket carries the
    :class:`~gradsync.feedback.finite.FiniteGuard` element (or all-reduces it alone when it sends
    nothing) and its future completes after the iteration's decision."""
    buf = bucket.buffer()
    guard = state.finite_guard
    last = bucket.is_last()
    if send is None:
        buf.zero_()
        state.buckets_skipped += 1
        state.end_bucket(bucket)
        return _decide(state, bucket, _completed(buf))
    if last:
        send = torch.cat([send, guard.local_element(send.dtype, send.device)])
    state.count_collective(send)
    state.end_bucket(bucket)
    timer = state.timer
    ident = timer.launched(send.numel()) if timer is not None else None
    work = dist.all_reduce(send, group=state.process_group, async_op=True)

    def scatter_back(f: torch.futures.Future) -> torch.Tensor:
        if ident is not None:
            timer.completed(ident)
        received = f.value()[0]
        if last:
            guard.agree(received[-1:])
            received = received[:-1]
        buf.zero_()
        if isinstance(where, tuple):
            buf[where[0]::where[1]] = received
        else:
            buf[where] = received.to(buf.dtype)
        return buf

    return _decide(state, bucket, work.get_future().then(scatter_back), carried=True)


def _decide(state: CovapState, bucket: dist.GradBucket, fut: torch.futures.Future,
            carried: bool = False) -> torch.futures.Future:
    """Track a compressed iteration's bucket future; at the last bucket return the future that
    completes after the iteration's finite decision (a verdict all-reduce is issued here when the
    last bucket's own collective did not carry it)."""
    verdict = None
    if bucket.is_last() and not carried:
        verdict = state.finite_guard.launch_verdict(state.process_group, bucket.buffer().device,
                                                    state.count_collective)
    return state.guarded(bucket, fut, verdict)


def _remapped_bucket(state: CovapState, bucket: dist.GradBucket, layout: Any) -> torch.futures.Future:
    """COVAP on a bucket whose layout is not the recorded one (a fresh DDP before its bucket rebuild):
    every parameter is found in the recorded layout by name, so each element gets exactly the error
    feedback and the send decision it would have had in its recorded bucket; the selected elements
    of all parameters of this bucket travel in one all-reduce."""
    buf = bucket.buffer()
    t = state.iteration
    plan = state.filter.plan
    memory = state.filter.memory
    lam = state.filter.discount(t - state.start_iter)
    where = state.param_index()
    state.remapped_buckets += 1
    sends, positions = [], []
    send_dtype = state.send_dtype(buf)
    world = state.world_size
    guard = state.finite_guard
    guard.begin(t, state._snapshot)
    with state.compression_timer():
        cur = 0
        for name, n in layout:
            b, off = where[name]
            x = buf[cur:cur + n].to(torch.float32, copy=True)
            if b in memory.residuals:
                e = guard.copy_on_write(memory.residuals, b)  # written in place below
                x.add_(e[off:off + n], alpha=lam)
            else:
                e = memory.residuals[b] = torch.zeros(plan.numels[b], dtype=torch.float32, device=buf.device)
            shard = plan.selected_shard(b, t)
            if shard is not None:
                c = plan.shards[b]
                first = (shard - off) % c
                sent, x[first::c] = narrow(x[first::c], send_dtype, world)
                sends.append(sent)
                positions.append(torch.arange(cur + first, cur + n, c, device=buf.device))
            guard.check(x)
            e[off:off + n] = x
            cur += n
    if not sends:
        return _send(state, bucket, None, None)
    send = torch.cat(sends)
    guard.check(send)
    return _send(state, bucket, send, torch.cat(positions))


def _numels(layout: Any) -> list[int]:
    """Element counts of the parameters in a bucket layout (named or shape tuples)."""
    out = []
    for item in layout:
        if len(item) == 2 and isinstance(item[0], str):
            out.append(int(item[1]))
        else:
            size = 1
            for d in item:
                size *= int(d)
            out.append(size)
    return out


def _make_hook(opts: CovapOptions, ctx: Any) -> Tuple[CovapState, Any]:
    return CovapState(ratio=opts.ratio, process_group=ctx.process_group, model=ctx.model,
                      adapt_every=opts.adapt_every, cast=opts.cast, max_ratio=opts.max_ratio), covap_hook


SPEC = hook_algorithm("covap", "COVAP coarse-grained filter, K from the measured CCR, discounted error feedback "
                      "(Meng, Sun & Li, arXiv 2311.04499)", CovapOptions, _make_hook)
