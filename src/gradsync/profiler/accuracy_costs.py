"""Measured accuracy costs of gradient-synchronisation settings: the steps each setting needed to
reach a target accuracy against dense all-reduce in the same run, as published in the README's
results section (``docs/results.md`` once the README is split). ``gradsync doctor``
(:mod:`gradsync.profiler.advise`) weighs predicted iteration times with them.

Every row copies a number printed there, with the command that produced it; nothing here is
estimated. A setting without a row is "not measured". The full grid (every setting, several models
and world sizes) is a separate piece of work; add its rows here when it exists.
"""

from __future__ import annotations

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
        source: the README results section and the command that printed the numbers.
        optimizer: the optimizer family of the run (``"sgd"``: SGD with momentum; ``"adamw"``).
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

    @property
    def extra_steps(self) -> float:
        """Fraction of extra steps over dense: ``steps / dense_steps - 1`` (negative: fewer)."""
        return self.steps / self.dense_steps - 1.0


_FMNIST = "fashion-mnist, resnet8"
_TARGET = "80 % test accuracy"
_PEERS = ("README Results, 'Time to accuracy against the best peers, 3 seeds': gradsync bench --hosts {h} "
          "--bandwidth {bw} --algorithms allreduce,fp16,powersgd:matrix_approximation_rank=1,"
          "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16 --lr 0.05 --steps 10 --warmup 3 "
          "--rounds 2 --to-accuracy 0.80 --seeds 0,1,2 --eval-every 25 --eval-samples 2000 "
          "--max-accuracy-steps 500 --table accuracy")
_PEERS_2 = _PEERS.format(h=2, bw=15) + " (the same steps at --bandwidth 10)"
_PEERS_4 = _PEERS.format(h=4, bw=10)
_DEMO_AUTO = ("README Results, 'make demo' notes: the demo command (gradsync bench --hosts 2 --bandwidth 5 "
              "... --to-accuracy 0.80 --eval-samples 2000) with --algorithms "
              "allreduce,fp16,covap:ratio=2:cast=fp16,covap:ratio=auto:cast=fp16; auto chose K=5")


def _peers(entry: str, steps: int, dense_steps: int, world_size: int) -> AccuracyCost:
    return AccuracyCost(entry, steps, dense_steps, world_size, 3, _FMNIST, _TARGET,
                        _PEERS_2 if world_size == 2 else _PEERS_4)


#: Every published measurement (README results). Several rows may cover one setting (different
#: world sizes); :func:`gradsync.profiler.advise.advise` uses the one closest in world size.
MEASURED_COSTS: tuple[AccuracyCost, ...] = (
    _peers("fp16", 225, 225, 2),
    _peers("powersgd:matrix_approximation_rank=1", 350, 225, 2),
    _peers("powersgd:matrix_approximation_rank=4", 275, 225, 2),
    _peers("covap:ratio=2:cast=fp16", 225, 225, 2),
    _peers("fp16", 175, 175, 4),
    _peers("powersgd:matrix_approximation_rank=1", 325, 175, 4),
    _peers("powersgd:matrix_approximation_rank=4", 175, 175, 4),
    _peers("covap:ratio=2:cast=fp16", 200, 175, 4),
    AccuracyCost("covap:ratio=5:cast=fp16", 275, 225, 2, 1, _FMNIST, _TARGET, _DEMO_AUTO),
)

#: Settings whose arithmetic equals dense all-reduce's (no accuracy cost by construction or by
#: measurement), with the reason. ``bf16`` is a cast like ``fp16`` but has no measurement: it is
#: not listed and :mod:`~gradsync.profiler.advise` labels it a cast counted as lossless.
LOSSLESS: dict[str, str] = {
    "allreduce": "the reference (DDP's own arithmetic)",
    "dear": ("bitwise-identical training losses to allreduce at all 100 steps (README Results, DeAR: "
             "gradsync train --max-steps 100 with allreduce and dear)"),
}
