"""COVAP's coarse-grained filter with discounted error feedback, for any bucket layout (Meng, Sun &
Li, arXiv 2311.04499, §3; see :mod:`gradsync.algorithms.covap`): the plan (sharding and round-robin
schedule, :class:`~gradsync.compressors.covap_shards.CovapPlan`), K and the residual memory. Used by
the DDP hook (:mod:`.hook`) and DeAR's pipeline (:mod:`gradsync.algorithms.dear.covap`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from ...compressors.covap_shards import AUTO_MAX_RATIO, MAX_RATIO, CovapPlan, ratio_for_ccr
from ...feedback.discounted import CovapDiscount, default_ramp
from ...feedback.residual import ResidualMemory
from ...options import AUTO
from ...validation import check_float, check_int

log = logging.getLogger(__name__)


class CovapFilter:
    """COVAP's coarse-grained filter with discounted error feedback, for any bucket layout.

    Args:
        ratio: K in [1, 32] (1 reproduces dense all-reduce), or ``"auto"``: K = 1 until
            :meth:`calibrate` receives the CCR, then K = ceil(CCR) in [1, ``max_ratio``].
        lam0, ramp_steps: discount constants; ``None`` takes the reference values for K
            (``lam0=0.5, D=50`` for K <= 8, else ``0.2, 100``).
        max_ratio: largest K :meth:`calibrate` may choose, in [1, 32]; ``None`` (default):
            :data:`~gradsync.compressors.covap_shards.AUTO_MAX_RATIO` (2) with ``"auto"``, whose
            larger K cost dense quality on every seed measured, else 32 (COVAP's limit).

    Raises:
        ValueError: for arguments outside those ranges, or a fixed ``ratio`` above ``max_ratio``.
    """

    max_ratio = MAX_RATIO  # for filters pickled before the option existed

    def __init__(self, ratio: Union[int, str] = 3, lam0: Optional[float] = None,
                 ramp_steps: Optional[int] = None, max_ratio: Optional[int] = None):
        self.auto = ratio == AUTO
        if max_ratio is None:
            max_ratio = AUTO_MAX_RATIO if self.auto else MAX_RATIO
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
        all-reduced MAX). Returns ``{"ccr": ccr, "ratio": K}``, plus ``"ccr_ratio"``: ceil(``ccr``)
        where ``max_ratio`` lowered it."""
        uncapped = ratio_for_ccr(ccr, MAX_RATIO)
        self.set_ratio(min(uncapped, self.max_ratio))
        self.calibrated = True
        out = {"ccr": float(ccr), "ratio": self.ratio}
        if uncapped > self.ratio:
            out["ccr_ratio"] = uncapped
            log.info("COVAP ratio=auto: CCR %.2f calls for K = %d to hide the communication; K = %d (max_ratio): "
                     "a larger K costs accuracy per step (max_ratio=%d lifts the cap)", ccr, uncapped, self.ratio,
                     MAX_RATIO)
        return out

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

