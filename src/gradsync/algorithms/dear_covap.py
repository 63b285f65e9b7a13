"""COVAP's coarse-grained filter inside DeAR's reduce-scatter / all-gather pipeline ("dear-covap").

No published system combines them: DeAR (Zhang et al., arXiv 2302.12445) overlaps the two halves of
all-reduce with backward and the next forward; COVAP (Meng, Sun & Li, arXiv 2311.04499, see
:mod:`gradsync.algorithms.covap`) sends each gradient element once every K iterations by a round-robin
schedule over interleaved shards of each bucket. Here DeAR's fusion groups play the role of DDP's
buckets: the median-group sharding rule and the schedule are the same, a dropped group launches no
collective at all, and a sharded group reduce-scatters and all-gathers only its selected shard
(:class:`~gradsync.algorithms.dear.StridedShard`). Discounted error feedback keeps what was not sent.

DeAR has no bucket rebuild, so compression starts at iteration 0. If the fusion tuner regroups
(``fusion_mb="auto"``) the plan is rebuilt for the new groups and the residuals are dropped (logged).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..feedback.discounted import DiscountedErrorFeedback, default_ramp
from ..validation import check_int
from ..compressors.covap_shards import MAX_RATIO, CovapPlan
from .dear import StridedShard

log = logging.getLogger(__name__)


class CovapGradFilter:
    """``grad_filter`` for :class:`~gradsync.algorithms.dear.DeAR` applying COVAP per fusion group.

    Args:
        ratio: K in [1, 32] (1 = no compression).

    Raises:
        ValueError: if ``ratio`` is outside [1, 32].
    """

    def __init__(self, ratio: int = 3):
        self.ratio = check_int("ratio", ratio, 1, MAX_RATIO)
        self.feedback = DiscountedErrorFeedback(*default_ramp(self.ratio))
        self.plan: CovapPlan | None = None
        self._dear: Any = None

    def bind(self, dear: Any) -> "CovapGradFilter":
        """Attach to the DeAR wrapper whose ``group_sizes()`` define the layout. Returns ``self``."""
        self._dear = dear
        return self

    def set_ratio(self, ratio: int) -> None:
        """Change K (every rank must pass the same value); the plan is rebuilt and residuals kept."""
        self.ratio = check_int("ratio", ratio, 1, MAX_RATIO)
        self.feedback.lam0, self.feedback.ramp_steps = default_ramp(self.ratio)
        self.plan = None

    def config(self) -> dict[str, Any]:
        return {"covap_ratio": self.ratio, "lam0": self.feedback.lam0, "ramp_steps": self.feedback.ramp_steps}

    def _plan_for(self, group: int, numel: int) -> CovapPlan:
        if self.plan is None or group >= len(self.plan.numels) or self.plan.numels[group] != numel:
            if self.plan is not None:
                log.warning("DeAR fusion groups changed; rebuilding the COVAP plan and dropping residuals")
                self.feedback.residuals.clear()
            self.plan = CovapPlan.build(list(self._dear.group_sizes()), self.ratio)
        return self.plan

    def __call__(self, flat: torch.Tensor, step: int, group: int) -> Any:
        """Filter group ``group``'s flat gradient (1-D, ``numel`` elements) at iteration ``step``:
        ``False`` (dropped this step), the full tensor (group of one shard), or a
        :class:`StridedShard` holding ``x[s::c]``."""
        plan = self._plan_for(group, flat.numel())
        x = self.feedback.add(group, flat, step)
        shard = plan.selected_shard(group, step)
        if shard is None:
            self.feedback.store(group, x)
            return False
        c = plan.shards[group]
        if c == 1:
            self.feedback.residuals.pop(group, None)
            return x
        values = x[shard::c].clone()
        x[shard::c] = 0
        self.feedback.store(group, x)
        return StridedShard(shard, c, values)

    def state_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "feedback": self.feedback.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_ratio(int(state["ratio"]))
        self.feedback.load_state_dict(state["feedback"])
