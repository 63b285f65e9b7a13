"""Measured accuracy costs of gradient-synchronisation settings: the steps each setting needed to
reach a target accuracy against dense all-reduce in the same run, as published in ``docs/results.md``. ``gradsync doctor``
(:mod:`gradsync.profiler.advise`) weighs predicted iteration times with them.

Every row copies a number printed there, with the command that produced it; nothing here is
estimated. A setting without a row is "not measured". Rows carry the model they were measured on
(:attr:`AccuracyCost.model`): a job whose model has rows is advised from those alone
(:func:`rows_for_model`), since a cost does not carry from one model to another.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["AccuracyCost", "MEASURED_COSTS", "LOSSLESS", "rows_for_model", "rows_for_world_size"]


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
        budget_steps: the run's budget in iterations (the one-cycle schedule's length); a setting with a
            dense tail (``dense_from`` in ``entry``) is offered to other budgets with its tail starting at
            the same fraction of the budget.
        model: the measured job as ``workload:model`` (``fashion-mnist:resnet8``); a job whose own model
            has rows is advised from those rows alone (:func:`rows_for_model`).
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
    budget_steps: int = 0
    model: str = ""

    @property
    def extra_steps(self) -> float:
        """Fraction of extra steps over dense: ``steps / dense_steps - 1`` (negative: fewer); infinite
        when ``not_reached``."""
        return math.inf if self.not_reached else self.steps / self.dense_steps - 1.0


_FMNIST = "fashion-mnist, resnet8"
_BUDGET = 936  # the one-cycle recipe's 2 epochs at batch 64 per rank, 2 ranks
_TARGET = "dense's mean final accuracy - 0.5 points (89.54 %), one-cycle recipe, 2 epochs (936 steps)"
_GRID = ("docs/results.md, 'Time to quality, MLPerf-style (gradsync sweep)': gradsync sweep --algorithms "
         "allreduce,fp16,powersgd:matrix_approximation_rank=2,covap:ratio=3:cast=fp16,"
         "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16,covap:ratio=4:cast=fp16 --seeds 0,1,2,3,4 "
         "--hosts 2 --bandwidths 5,15,40 --epochs 2 --eval-every 39; steps: olympic mean over 5 seeds")
#: dense all-reduce's olympic-mean steps to the target in that grid (seeds: 897, 780, 819, not reached, 819)
_DENSE_STEPS = 845
_TAIL_TARGET = "dense's mean final accuracy - 0.5 points (89.46 %), one-cycle recipe, 2 epochs (936 steps)"
_TAIL_GRID = ("docs/results.md, 'Time to quality: PowerSGD ranks, dense tails and auto (gradsync sweep)': gradsync sweep "
              "--algorithms allreduce,fp16,powersgd:matrix_approximation_rank=4,powersgd:matrix_approximation_rank=8,"
              "powersgd:matrix_approximation_rank=16,powersgd:matrix_approximation_rank=4:dense_from=700,"
              "powersgd:matrix_approximation_rank=4:dense_from=800,auto --seeds 0,1,2,3,4 --hosts 2 --bandwidths 5,15,40 "
              "--epochs 2 --eval-every 39 --out runs/grid (this machine; the COVAP tails in the same folder, section "
              "'Time to quality with a dense tail'); steps: olympic mean over 5 seeds")
#: dense all-reduce's olympic-mean steps to the target in the dense-tail grid (seeds: 897, 780, 780, 819, 819)
_TAIL_DENSE_STEPS = 806

_OVERLAP_TARGET = "dense's mean final accuracy - 0.5 points (89.27 %), one-cycle recipe, 2 epochs (936 steps)"
_OVERLAP_GRID = ("docs/results.md, 'Time to quality: PowerSGD overlapped with backward (gradsync sweep)': gradsync sweep "
                 "--algorithms allreduce,fp16,bf16,powersgd:matrix_approximation_rank=8,"
                 "powersgd-overlap:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=4:dense_from=700,"
                 "auto --seeds 0,1,2,3,4 --hosts 2 --bandwidths 5,15,40 --epochs 2 --eval-every 39 --out runs/grid-overlap "
                 "(a machine whose CPU rounds differently from the dense-tail grid's: dense's finals differ); steps: "
                 "olympic mean over 5 seeds")
#: dense all-reduce's olympic-mean steps to the target in the overlap grid (seeds: 858, 780, 819, 858, 819)
_OVERLAP_DENSE_STEPS = 832
_EXTRA_GRID = ("docs/results.md, 'Grid cells: COVAP with fp32 shards and top-k': gradsync sweep --quality-target 0.89266 "
               "--algorithms covap:ratio=2,covap:ratio=4,topk:density=0.01 --seeds 0,1,2 --hosts 2 --epochs 2 "
               "--eval-every 39 --out runs/grid-extra (its loopback runs, the overlap grid's target and machine); steps: "
               "median over 3 seeds, against dense's 819 (858/780/819 on those seeds in the overlap grid); COVAP with fp32 "
               "shards is not among auto's candidates (fp16 moves its bytes), so only its results.md row has it")


_KJV = "kjv-transformer, char-transformer (845k parameters), AdamW"
_KJV_TARGET = "dense's mean final bits per character + 0.5 % (2.9992), one-cycle recipe, 1 epoch (400 steps)"
_KJV_GRID = ("docs/results.md, 'Time to quality on the character transformer with AdamW (gradsync sweep)': gradsync "
             "sweep --workload kjv-transformer --algorithms allreduce,fp16,powersgd:matrix_approximation_rank=4:"
             "dense_from=300,auto --seeds 0,1,2 --hosts 2 --bandwidths 10,30,100,300 --eval-every 40 --steps 10 --warmup 3 "
             "--rounds 1 --out runs/kjv; steps: median over 3 seeds")

# One measured grid each: every field of its rows but the entry, its steps and not_reached (:func:`_row`).
_GRID_ROW = AccuracyCost("", 0, _DENSE_STEPS, 2, 5, _FMNIST, _TARGET, _GRID, budget_steps=_BUDGET,
                         model="fashion-mnist:resnet8")
_TAIL_ROW = AccuracyCost("", 0, _TAIL_DENSE_STEPS, 2, 5, _FMNIST, _TAIL_TARGET, _TAIL_GRID, budget_steps=_BUDGET,
                         model="fashion-mnist:resnet8")
_OVERLAP_ROW = AccuracyCost("", 0, _OVERLAP_DENSE_STEPS, 2, 5, _FMNIST, _OVERLAP_TARGET, _OVERLAP_GRID,
                            budget_steps=_BUDGET, model="fashion-mnist:resnet8")
_EXTRA_ROW = AccuracyCost("", 0, 819, 2, 3, _FMNIST, _OVERLAP_TARGET, _EXTRA_GRID, budget_steps=_BUDGET,
                          model="fashion-mnist:resnet8")
_THREE_TARGET = "dense's mean final accuracy - 0.5 points (88.88 %), one-cycle recipe, 2 epochs (624 steps)"
_THREE_GRID = ("docs/results.md, 'Time to quality at 3 hosts, 5 seeds (gradsync sweep)': gradsync sweep --algorithms "
               "allreduce,fp16,powersgd:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=8,"
               "powersgd-overlap:matrix_approximation_rank=4:dense_from=467,auto --seeds 0,1,2,3,4 --hosts 3 "
               "--bandwidths 5,15,40 --epochs 2 --eval-every 26 --out runs/grid3-overlap (the overlap grid's machine); "
               "steps: olympic mean over 5 seeds")
# dense all-reduce at 3 ranks: 572/494/546/546/598 steps
_THREE_ROW = AccuracyCost("", 0, 555, 3, 5, _FMNIST, _THREE_TARGET, _THREE_GRID, budget_steps=624,
                          model="fashion-mnist:resnet8")
_KJV_ROW = AccuracyCost("", 0, 360, 2, 3, _KJV, _KJV_TARGET, _KJV_GRID, optimizer="adamw", budget_steps=400,
                        model="kjv-transformer:char-transformer")


_WIDE = "fashion-mnist, resnet8-w32 (308k parameters)"
_WIDE_TARGET = "dense's mean final accuracy - 0.5 points (90.11 %), one-cycle recipe, 2 epochs (936 steps)"
_WIDE_GRID = ("docs/results.md, 'Time to quality on the larger CNN (gradsync sweep)': gradsync sweep --model resnet8-w32 "
              "--algorithms allreduce,fp16,powersgd:matrix_approximation_rank=4,powersgd:matrix_approximation_rank=8,"
              "powersgd:matrix_approximation_rank=4:dense_from=700,auto --seeds 0,1,2 --hosts 2 --bandwidths 5,15,40 "
              "--epochs 2 --eval-every 26 --out runs/grid-w32; steps: median over 3 seeds")
# dense all-reduce: 884/832/832 steps
_WIDE_ROW = AccuracyCost("", 0, 832, 2, 3, _WIDE, _WIDE_TARGET, _WIDE_GRID, budget_steps=_BUDGET,
                         model="fashion-mnist:resnet8-w32")


def _row(grid: AccuracyCost, entry: str, steps: int, not_reached: bool = False) -> AccuracyCost:
    return dataclasses.replace(grid, entry=entry, steps=steps, not_reached=not_reached)


#: Every published measurement (docs/results.md), SGD with Nesterov momentum unless ``optimizer`` says
#: otherwise. Several rows may cover one setting (different world sizes);
#: :func:`gradsync.profiler.advise.advise` uses the rows of the world size closest to the job's
#: (:func:`rows_for_world_size`). A setting that missed the target on 2 or more of the 5 seeds (so the
#: olympic mean keeps a seed that never reached it) is ``not_reached``; its ``steps`` are the budget, a
#: lower bound. A newer grid's
#: rows replace an older grid's where both measured a setting (overlap > dense-tail > first grid); each
#: row's cost is relative to dense in its own grid.
MEASURED_COSTS: tuple[AccuracyCost, ...] = (
    # the overlap grid, the newest: its fp16, bf16 and PowerSGD r=8 rows replace the older grids' (832, 806 and
    # 858 steps against dense's 806)
    _row(_OVERLAP_ROW, "fp16", 819),                                                     # 819/858/819/819/819
    _row(_OVERLAP_ROW, "bf16", 832),                                                     # 858/819/780/858/819
    _row(_OVERLAP_ROW, "powersgd:matrix_approximation_rank=8", 832),                     # 858/741/858/819/819
    _row(_OVERLAP_ROW, "powersgd-overlap:matrix_approximation_rank=8", 780),             # 858/780/780/780/780
    _row(_OVERLAP_ROW, "powersgd-overlap:matrix_approximation_rank=4:dense_from=700", 858),  # 897/858/780/-/819
    _row(_EXTRA_ROW, "topk:density=0.01", 936, not_reached=True),                    # 0 of 3 (88.22 %)
    # 3 ranks: a 3-rank job is advised from these rows alone (rows_for_world_size)
    _row(_THREE_ROW, "fp16", 563),                                                       # 572/572/572/546/546
    _row(_THREE_ROW, "powersgd:matrix_approximation_rank=8", 598),                       # 598/598/572/-/598
    _row(_THREE_ROW, "powersgd-overlap:matrix_approximation_rank=8", 624, not_reached=True),  # 598/572/572/-/-
    _row(_THREE_ROW, "powersgd-overlap:matrix_approximation_rank=4:dense_from=467", 624,
         not_reached=True),                                                              # -/572/572/-/-
    _row(_TAIL_ROW, "powersgd:matrix_approximation_rank=4", 936, not_reached=True),  # reached on 3 of 5 seeds
    _row(_TAIL_ROW, "powersgd:matrix_approximation_rank=16", 858),                   # 858/858/858/858/819
    _row(_TAIL_ROW, "powersgd:matrix_approximation_rank=4:dense_from=700", 910),     # 936/858/897/-/897
    _row(_TAIL_ROW, "powersgd:matrix_approximation_rank=4:dense_from=800", 936, not_reached=True),  # -/858/897/-/858
    _row(_TAIL_ROW, "covap:ratio=2:cast=fp16:dense_from=700", 936, not_reached=True),  # 0 of 5 (89.26 %)
    _row(_TAIL_ROW, "covap:ratio=3:cast=fp16:dense_from=700", 936, not_reached=True),  # 0 of 5 (88.66 %)
    _row(_GRID_ROW, "powersgd:matrix_approximation_rank=2", 936, not_reached=True),  # 0 of 5 (mean final 89.02 %)
    _row(_GRID_ROW, "covap:ratio=2:cast=fp16", 936, not_reached=True),               # 1 of 5 (89.35 %)
    _row(_GRID_ROW, "covap:ratio=3:cast=fp16", 936, not_reached=True),               # 0 of 5 (88.38 %)
    _row(_GRID_ROW, "covap:ratio=4:cast=fp16", 936, not_reached=True),               # 0 of 5 (87.26 %)
    # the same recipe on the ResNet-8 at width 32 (3 seeds): PowerSGD r=4 loses more there
    _row(_WIDE_ROW, "fp16", 858),                                                        # 858/832/858
    _row(_WIDE_ROW, "powersgd:matrix_approximation_rank=8", 884),                        # 884/884/884
    _row(_WIDE_ROW, "powersgd:matrix_approximation_rank=4", 936, not_reached=True),      # 0 of 3 (89.98 %)
    _row(_WIDE_ROW, "powersgd:matrix_approximation_rank=4:dense_from=700", 936, not_reached=True),  # 1 of 3 (90.03 %)
    # AdamW: the character transformer (dense: 360/360/360 steps)
    _row(_KJV_ROW, "fp16", 360),                                                      # 360/360/360
    _row(_KJV_ROW, "powersgd:matrix_approximation_rank=4:dense_from=300", 400, not_reached=True),  # 0 of 3 (3.29 bits)
)

#: Settings whose arithmetic equals dense all-reduce's (no accuracy cost by construction or by
#: measurement), with the reason. The casts (``fp16``, ``bf16``) are not listed: both have measured rows
#: in :data:`MEASURED_COSTS`.
LOSSLESS: dict[str, str] = {
    "allreduce": "the reference (DDP's own arithmetic)",
    "dear": ("bitwise-identical training losses to allreduce at all 100 steps (docs/results.md, DeAR: "
             "gradsync train --max-steps 100 with allreduce and dear)"),
}


def rows_for_model(costs: Sequence[AccuracyCost], model: str | None) -> list[AccuracyCost]:
    """The rows of ``costs`` that advise a job of ``model`` (``workload:model``, e.g.
    ``fashion-mnist:resnet8-w32``): that model's own rows where it has any (an accuracy cost measured on
    one model does not carry to another: PowerSGD r=4 with a dense tail reached the target on 4 of 5
    seeds of the ResNet-8 and on 1 of 3 at twice its width), else every row; ``None``: every row."""
    own = [c for c in costs if model is not None and c.model == model]
    return own if own else list(costs)


def rows_for_world_size(costs: Sequence[AccuracyCost], world_size: int) -> list[AccuracyCost]:
    """The rows of ``costs`` measured at the world size closest to ``world_size`` (ranks): a cost does not
    carry from one world size to another either (gradsync's PowerSGD r=8 overlapped with backward reached
    the target on 5 of 5 seeds at 2 ranks and on 3 of 5 at 3), and mixing rows of two world sizes would
    rank one setting by one count of steps against another by another. Empty ``costs``: empty."""
    if not costs:
        return []
    nearest = min(abs(c.world_size - world_size) for c in costs)
    return [c for c in costs if abs(c.world_size - world_size) == nearest]
