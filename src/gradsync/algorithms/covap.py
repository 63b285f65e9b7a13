"""COVAP: overlapping-aware gradient compression with a coarse-grained filter.

Source: Lin Meng, Yuzhong Sun, Weimin Li, "Near-Linear Scaling Data Parallel Training with
Overlapping-Aware Gradient Compression", arXiv 2311.04499 (2023); the reference code calls it OGC.
Restated from ``shared/specs/algorithms.md`` §1; the reference code's error-feedback aliasing bugs are
not reproduced: this module implements the stated intent.

The filter is deterministic: it depends only on the iteration number and the static DDP bucket
layout, so every rank selects the same elements and a plain all-reduce still works.

* Tensor sharding: with ``m`` the median bucket numel, bucket ``b`` of numel ``n_b`` is cut into
  ``c_b = 1`` interleaved shards if ``floor(n_b / m - 0.3) <= 0``, else ``min(floor(n_b/m - 0.3) + 1, K)``;
  shard ``s`` holds elements ``s, s + c_b, s + 2 c_b, ...``.
* Round-robin schedule: shard ``s`` of bucket ``b`` has global id ``G = sum_{b'<b} c_b' + s`` and is
  sent at iteration ``t`` iff ``(G + t) mod K == 0``, so each element is sent once every K iterations
  and at most one shard of a bucket is sent per iteration. A bucket with no selected shard launches no
  collective (DDP receives an already-completed future of zeros).
* Discounted error feedback (:class:`~gradsync.feedback.discounted.DiscountedErrorFeedback`):
  ``x = lambda_t e + g``; the selected shard of ``x`` is all-reduced (averaged), everything unsent
  stays in ``e``. Unsent positions have zero gradient this step; momentum and weight decay still
  apply (a deliberate choice, as in the reference code).
* Compression starts at ``start_iter`` (default 2), after DDP's bucket rebuild, like PowerSGD's
  ``start_powerSGD_iter``; bucket sizes are recorded during the dense iterations before it.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

from typing import Any

import torch
import torch.distributed as dist

from ..comm.sparse import dense_allreduce
from ..compressors.covap_shards import MAX_RATIO, CovapPlan
from ..feedback.discounted import DiscountedErrorFeedback, default_ramp
from ..validation import check_float, check_int
from .base import HookState

class CovapState(HookState):
    """State of :func:`covap_hook`.

    Args:
        ratio: K in [1, 32]; 1 reproduces dense all-reduce. ``set_ratio`` may change it before
            compression starts (``--ratio auto`` measures the CCR first).
        process_group: group of the all-reduces (``None`` = default group).
        start_iter: first compressed iteration, >= 2 so DDP's bucket rebuild (after iteration 0)
            has happened and the layout was recorded in a dense iteration.
        lam0, ramp_steps: discounted-EF constants; ``None`` takes the reference values for K
            (``lam0=0.5, D=50`` for K <= 8, else ``0.2, 100``).

    Raises:
        ValueError: for arguments outside the ranges above.
    """

    def __init__(
        self,
        ratio: int = 3,
        process_group: dist.ProcessGroup | None = None,
        start_iter: int = 2,
        lam0: float | None = None,
        ramp_steps: int | None = None,
    ):
        super().__init__(process_group)
        self.ratio = check_int("ratio", ratio, 1, MAX_RATIO)
        self.start_iter = check_int("start_iter", start_iter, 2)
        self._explicit_ramp = (lam0, ramp_steps)
        d_lam0, d_steps = default_ramp(self.ratio)
        self.feedback = DiscountedErrorFeedback(
            d_lam0 if lam0 is None else check_float("lam0", lam0, 0.0, 1.0),
            d_steps if ramp_steps is None else check_int("ramp_steps", ramp_steps, 1),
        )
        self.bucket_numels: dict[int, int] = {}
        self.plan: CovapPlan | None = None

    def set_ratio(self, ratio: int) -> None:
        """Change K before compression has started (every rank must pass the same value).

        Raises:
            ValueError: if ``ratio`` is outside [1, 32].
            RuntimeError: if compression has already started.
        """
        ratio = check_int("ratio", ratio, 1, MAX_RATIO)
        if self.plan is not None:
            raise RuntimeError("set_ratio must be called before COVAP compression starts")
        self.ratio = ratio
        lam0, steps = self._explicit_ramp
        d_lam0, d_steps = default_ramp(ratio)
        self.feedback.lam0 = d_lam0 if lam0 is None else lam0
        self.feedback.ramp_steps = d_steps if steps is None else steps

    def config(self) -> dict[str, Any]:
        return {"algorithm": "covap", "ratio": self.ratio, "start_iter": self.start_iter,
                "lam0": self.feedback.lam0, "ramp_steps": self.feedback.ramp_steps}

    def _plan(self) -> CovapPlan:
        if self.plan is None:
            n = len(self.bucket_numels)
            if sorted(self.bucket_numels) != list(range(n)):
                raise RuntimeError(f"COVAP saw bucket indices {sorted(self.bucket_numels)} during warm-up")
            self.plan = CovapPlan.build([self.bucket_numels[i] for i in range(n)], self.ratio)
        return self.plan

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["ratio"] = self.ratio
        s["shards"] = list(self.plan.shards) if self.plan else []
        compressed = max(0, self.iteration - self.start_iter)
        s["ef_discount"] = self.feedback.discount(compressed)
        return s

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ratio": self.ratio, "bucket_numels": dict(self.bucket_numels),
                "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ratio = int(state["ratio"])
        self.bucket_numels = {int(k): int(v) for k, v in state["bucket_numels"].items()}
        self.plan = None
        self.feedback.load_state_dict(state["feedback"])


def covap_hook(state: CovapState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook applying COVAP to one bucket.

    ``bucket.buffer()`` is the local flat gradient, float ``[numel]``; the returned future holds the
    averaged gradient of the same shape with unsent positions zero. Bytes counted: the contiguous
    shard handed to ``all_reduce`` (``numel / c_b`` elements) or nothing for a dropped bucket.

    Raises:
        RuntimeError: if a bucket's size differs from the layout recorded during warm-up.
    """
    buf = bucket.buffer()
    index = bucket.index()
    t = state.iteration
    world = state.world_size
    if t < state.start_iter:
        state.bucket_numels[index] = buf.numel()
        fut = dense_allreduce(buf, state.process_group, state.count_collective)
        state.end_bucket(bucket)
        return fut

    plan = state._plan()
    if index >= len(plan.numels) or plan.numels[index] != buf.numel():
        raise RuntimeError(
            f"COVAP bucket {index} has {buf.numel()} elements but the warm-up layout recorded "
            f"{plan.numels[index] if index < len(plan.numels) else 'none'}; bucket layout changed"
        )
    with state.compression_timer():
        x = state.feedback.add(index, buf, t - state.start_iter)
        shard = plan.selected_shard(index, t)
        if shard is None:
            state.feedback.store(index, x)
            buf.zero_()
        else:
            c = plan.shards[index]
            send = x[shard::c].div(world)
            x[shard::c] = 0
            state.feedback.store(index, x)
    if shard is None:
        state.buckets_skipped += 1
        state.end_bucket(bucket)
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    state.count_collective(send)
    state.end_bucket(bucket)
    work = dist.all_reduce(send, group=state.process_group, async_op=True)

    def scatter_back(f: torch.futures.Future) -> torch.Tensor:
        buf.zero_()
        buf[shard::c] = f.value()[0]
        return buf

    return work.get_future().then(scatter_back)
