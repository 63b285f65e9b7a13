"""Measured accuracy costs of gradient-synchronisation settings: the steps each setting needed to
reach a target accuracy against dense all-reduce in the same run, as published in ``docs/results.md``. ``gradsync doctor``
(:mod:`gradsync.profiler.advise`) weighs predicted iteration times with them.

Every row copies a number printed there, with the command that produced it; nothing here is
estimated. A setting without a row is "not measured". The full grid (every setting, several models
and world sizes) is a separate piece of work; add its rows here when it exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AccuracyCost", "MEASURED_COSTS", "LOSSLESS"]


@dataclass(frozen=True)
class AccuracyCost:
    """Steps to a target accuracy of one setting and of dense all-reduce in the same run.

    Attributes:
        entry: the setting as a ``gradsync bench --algorithms`` entry (``covap:ratio=2:cast=fp16``).
        steps: steps the setting needed to reach ``target`` (median over ``seeds``).
        dense_steps: steps dense all-reduce needed in the same run (same seeds, same batches).
        world_size: ranks of the run.
        seeds: seeds the medians are over.
        workload: what was trained (workload and model).
        target: the quality threshold (e.g. ``80 % test accuracy``).
        source: the docs/results.md section and the command that printed the numbers.
        optimizer: the optimizer family of the run (``"sgd"``: SGD with momentum; ``"adamw"``).
        not_reached: the setting missed the target on too many seeds for a summary (``steps`` is then
            the budget, a lower bound, and the extra steps count as infinite).
    """

    entry: str
    steps: int
    dense_steps: int
    world_size: int
    seeds: int
    workload: str
    target: str
    source: str
    optimizer: str = "sgd"
    not_reached: bool = False

    @property
    def extra_steps(self) -> float:
        """Fraction of extra steps over dense: ``steps / dense_steps - 1`` (negative: fewer); infinite
        when ``not_reached``."""
        return math.inf if self.not_reached else self.steps / self.dense_steps - 1.0


_FMNIST = "fashion-mnist, resnet8"
_TARGET = "dense's mean final accuracy - 0.5 points (89.54 %), one-cycle recipe, 2 epochs (936 steps)"
_GRID = ("docs/results.md, 'Time to quality, MLPerf-style (gradsync sweep)': gradsync sweep --algorithms "
         "allreduce,fp16,powersgd:matrix_approximation_rank=2,covap:ratio=3:cast=fp16,"
         "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16,covap:ratio=4:cast=fp16 --seeds 0,1,2,3,4 "
         "--hosts 2 --bandwidths 5,15,40 --epochs 2 --eval-every 39; steps: olympic mean over 5 seeds")
#: dense all-reduce's olympic-mean steps to the target in that grid (seeds: 897, 780, 819, not reached, 819)
_DENSE_STEPS = 845


def _grid(entry: str, steps: int, not_reached: bool = False) -> AccuracyCost:
    return AccuracyCost(entry, steps, _DENSE_STEPS, 2, 5, _FMNIST, _TARGET, _GRID, not_reached=not_reached)


#: Every published measurement (docs/results.md), SGD with Nesterov momentum. Several rows may cover one
#: setting (different world sizes); :func:`gradsync.profiler.advise.advise` uses the one closest in world
#: size. A setting that missed the target on 2 or more of the 5 seeds (so the olympic mean keeps a seed
#: that never reached it) is ``not_reached``; its ``steps`` are the budget, a lower bound.
MEASURED_COSTS: tuple[AccuracyCost, ...] = (
    _grid("fp16", 858),                                                   # 897/858/819/819, seed 0 missed
    _grid("powersgd:matrix_approximation_rank=4", 936, not_reached=True),  # reached on 3 of 5 seeds
    _grid("powersgd:matrix_approximation_rank=2", 936, not_reached=True),  # 0 of 5 (mean final 89.02 %)
    _grid("covap:ratio=2:cast=fp16", 936, not_reached=True),               # 1 of 5 (89.35 %)
    _grid("covap:ratio=3:cast=fp16", 936, not_reached=True),               # 0 of 5 (88.38 %)
    _grid("covap:ratio=4:cast=fp16", 936, not_reached=True),               # 0 of 5 (87.26 %)
)

#: Settings whose arithmetic equals dense all-reduce's (no accuracy cost by construction or by
#: measurement), with the reason. ``bf16`` is a cast like ``fp16`` but has no measurement: it is
#: not listed and :mod:`~gradsync.profiler.advise` labels it a cast counted as lossless.
LOSSLESS: dict[str, str] = {
    "allreduce": "the reference (DDP's own arithmetic)",
    "dear": ("bitwise-identical training losses to allreduce at all 100 steps (docs/results.md, DeAR: "
             "gradsync train --max-steps 100 with allreduce and dear)"),
}
