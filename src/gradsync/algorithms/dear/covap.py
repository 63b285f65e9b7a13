"""COVAP's coarse-grained filter inside DeAR's reduce-scatter / all-gather pipeline ("dear-covap").

No published system combines them: DeAR (Zhang et al., "DeAR: Accelerating Distributed Deep Learning
with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445) overlaps the two halves of all-reduce
with backward and the next forward; COVAP (Meng, Sun & Li, arXiv 2311.04499, see
:mod:`gradsync.algorithms.covap`) sends each gradient element once every K iterations by a
round-robin schedule over interleaved shards of each bucket. Here DeAR's fusion groups play the role
of DDP's buckets and the same :class:`~gradsync.algorithms.covap.CovapFilter` decides: a dropped group
launches no collective at all, and a sharded group reduce-scatters and all-gathers only its selected
shard (:class:`~gradsync.algorithms.dear.StridedShard`). Discounted error feedback keeps what was not
sent.

DeAR has no bucket rebuild, so compression starts at iteration 0. If the fusion tuner regroups
(``fusion_mb="auto"``) the plan is rebuilt for the new groups and the residuals are dropped (logged).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...compressors.cast import cast_dtype
from ...feedback.finite import FiniteGuard
from ..covap import CovapFilter
from ..protocol import Algorithm
from .backward import StridedShard

log = logging.getLogger(__name__)


class CovapGradFilter(Algorithm):
    """``grad_filter`` for :class:`~gradsync.algorithms.dear.DeAR` applying COVAP per fusion group.

    Args:
        ratio: K in [1, 32] (1 = no compression) or ``"auto"`` (K from :meth:`calibrate`).
        max_ratio: largest K ``"auto"`` may choose, in [1, 32]; ``None`` (default): 2 with
            ``"auto"``, else 32 (as :class:`~gradsync.algorithms.covap.CovapFilter`).
        cast: ``"fp16"``, ``"bf16"`` or ``None`` (default: the parameters' dtype): the selected
            values are reduce-scattered and all-gathered in that dtype (half the bytes of float32);
            the rounding error of the cast stays in the error-feedback residual, as with
            ``covap``'s ``cast``.

    Raises:
        ValueError: if ``ratio`` or ``max_ratio`` is outside [1, 32], ``ratio`` above ``max_ratio``,
            or ``cast`` not one of fp16, bf16, None.
    """

    def __init__(self, ratio: int | str = 3, max_ratio: int | None = None, cast: str | None = None):
        self.filter = CovapFilter(ratio, max_ratio=max_ratio)
        self.cast_dtype = cast_dtype(cast)
        self.cast = cast
        self._dear: Any = None

    def bind(self, dear: Any) -> "CovapGradFilter":
        """Attach to the DeAR wrapper whose ``group_sizes()`` define the layout. Returns ``self``."""
        self._dear = dear
        return self

    @property
    def ratio(self) -> int:
        return self.filter.ratio

    @property
    def plan(self) -> Any:
        return self.filter.plan

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype the selected shards travel in when ``cast`` is set (``None``: the parameters'),
        for timing the CCR that ``"auto"`` is calibrated from."""
        return self.cast_dtype

    @property
    def needs_ccr(self) -> bool:
        return self.filter.needs_ccr

    def calibrate(self, ccr: float) -> dict[str, Any]:
        return self.filter.calibrate(ccr)

    def set_ratio(self, ratio: int) -> None:
        """Change K (every rank must pass the same value); the plan is rebuilt and residuals kept."""
        self.filter.set_ratio(ratio)

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        return {"covap_k": self.filter.ratio}

    def config(self) -> dict[str, Any]:
        return {**{"covap_" + k if k == "ratio" else k: v for k, v in self.filter.config().items()},
                "cast": self.cast}

    def stats(self) -> dict[str, Any]:
        return self.filter.stats()

    def __call__(self, flat: torch.Tensor, step: int, group: int) -> Any:
        """Filter group ``group``'s flat gradient (1-D, ``numel`` elements) at iteration ``step``:
        ``False`` (dropped this step), the tensor to send (group of one shard, no ``cast``), or a
        :class:`StridedShard` holding ``x[s::c]`` (in the ``cast`` dtype when set)."""
        sizes = list(self._dear.group_sizes())
        old = self.filter.plan
        if old is not None and old.numels != tuple(sizes):
            log.warning("DeAR fusion groups changed; rebuilding the COVAP plan and dropping residuals")
            self.filter.memory.clear()
        self.filter.plan_for(sizes)
        wire = self.cast_dtype or flat.dtype
        self.guard.begin(step, self.filter.memory.snapshot)
        cast = self.cast_dtype is not None  # divided by P before the narrow sum, as covap's cast
        world = self._dear.world_size if cast else 1
        selected = self.filter.split(group, flat, step, step, send_dtype=wire, world=world)
        if selected is None:
            return False
        shard, c, values = selected  # residuals stay float32, holding the rounding error of the wire dtype
        return values if c == 1 and wire == flat.dtype else StridedShard(shard, c, values, averaged=cast)

    @property
    def guard(self) -> FiniteGuard:
        """Holds the residuals as they were before the current iteration (see :meth:`rollback`)."""
        guard = self.__dict__.get("_guard")
        if guard is None:
            guard = self._guard = FiniteGuard()
        return guard

    def rollback(self) -> None:
        """Put the residuals back as they were before this iteration: DeAR calls it on every rank
        when GradScaler skips the step (its found-inf is all-reduced), so a skipped step changes no
        state (:mod:`gradsync.feedback.finite`)."""
        self.guard.rollback(self.filter.memory.restore)

    def state_dict(self) -> dict[str, Any]:
        return self.filter.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.filter.load_state_dict(state)
