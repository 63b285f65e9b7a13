"""Settings of a ``gradsync bench`` run: typed fields validated once on construction, from which the
command-line flags are generated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from ..algorithms import REGISTRY, make_options, parse_entry
from ..options import AUTO, field_specs, option
from ..train.config import SharedConfig
from ..workloads import get_workload


@dataclass
class BenchConfig(SharedConfig):
    """Raises ValueError on construction naming the field and the allowed range. ``options`` holds
    algorithm options; each algorithm takes the ones it accepts, and a key no registered algorithm
    accepts is an error. An entry of ``algorithms`` is an algorithm name, optionally with its own
    options (``NAME:KEY=VALUE[:KEY=VALUE...]``, e.g. ``powersgd:matrix_approximation_rank=4`` or
    ``covap:ratio=2:cast=fp16``), which override ``options`` for that entry; the same algorithm may
    appear in several entries with different options (see :func:`parse_entry`). The entry ``auto``
    is the setting :mod:`gradsync.profiler.auto` chooses from the run's measured profile and network."""

    algorithms: list[str] = option(None, "comma-separated entries NAME or NAME:KEY=VALUE[:KEY=VALUE...] "
                                   "(per-entry algorithm options, e.g. powersgd:matrix_approximation_rank=1,"
                                   "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16)",
                                   flag="--algorithms",
                                   default_factory=lambda: ["allreduce", "fp16", "powersgd", "covap"])
    seeds: list[int] = option(None, "seeds of the --to-accuracy and --to-quality runs (each algorithm trains once "
                         "per seed from that seed's model and data order; the report gives the median and the spread); "
                         "default: --seed", flag="--seeds", default_factory=list)
    hosts: int = option(2, "emulated hosts, one rank each", low=1, high=64)
    bandwidth_mbit: Optional[float] = option(None, "link rate (None: loopback, not shaped)", low=0.1,
                                             high=100_000.0, units="Mbit/s", cli=False)
    steps: int = option(20, "timed iterations per algorithm per round", low=1, high=100_000)
    warmup: int = option(5, "untimed iterations per algorithm per round", low=0, high=10_000)
    rounds: int = option(3, "interleaved rounds (A B C A B C ...)", low=1, high=1000)
    batch_size: Optional[int] = option(None, "samples per step per rank; default: the workload's recipe", low=1,
                                       high=65_536)
    lr: Optional[float] = option(None, "learning rate: constant in the timed and --to-accuracy runs, the one-cycle "
                                 "peak in --to-quality runs; default: the workload's recipe", low=0.0, high=10.0,
                                 low_open=True)
    to_accuracy: Optional[float] = option(None, "also train each algorithm until this test accuracy (0-1) and "
                                          "report the time", low=0.0, high=1.0, low_open=True)
    eval_every: int = option(50, "steps between the evaluations of --to-accuracy and --to-quality", low=1, high=100_000)
    max_accuracy_steps: int = option(2000, "give up on --to-accuracy after this many steps", low=1,
                                     high=10_000_000)
    to_quality: bool = option(False, "also train each entry for the recipe's whole budget once per seed and report "
                              "its final quality and the time to the quality target (MLPerf-style; see "
                              "--quality-target)")
    quality_target: Optional[float] = option(None, "absolute --to-quality target: test accuracy in (0, 1], or bits "
                                             "per character (lower is better) on the kjv workloads; default: the "
                                             "allreduce entry's mean final quality minus 0.5 points (accuracy) or "
                                             "plus 0.5 % (bits per character)", low=0.0, low_open=True)
    epochs: Optional[int] = option(None, "--to-quality budget in epochs; default: the workload's recipe", low=1,
                                   high=10_000)
    train_samples: Optional[int] = option(None, "--to-quality: train on the first N training samples only; "
                                          "default: the workload's recipe (all for fashion-mnist)", low=1)
    auto_probe: str = option("copies", "how the entry auto measures: 'copies' (a start-up probe on copies of the "
                             "model; gradsync.profiler.auto) or 'online' (on the job's own first steps: "
                             "gradsync.profiler.online; the hooks that work on any DDP bucket layout)",
                             choices=["copies", "online"])
    timeout: float = option(300.0, "process-group timeout", low=1.0, high=86_400.0, units="s")
    options: dict = option(None, "algorithm options", cli=False, default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        recipe = get_workload(self.workload, self.model).recipe
        for key in ("lr", "batch_size", "epochs", "train_samples"):
            if getattr(self, key) is None:
                setattr(self, key, getattr(recipe, key))
        if self.to_quality and self.to_accuracy is not None:
            raise ValueError("to_accuracy and to_quality are exclusive: give --to-accuracy (a fixed target) or "
                             "--to-quality (the recipe's budget, target from dense), not both")
        if self.quality_target is not None and not self.to_quality:
            raise ValueError("quality_target needs to_quality (--to-quality)")
        if self.quality_target is not None and self.higher_is_better() and self.quality_target > 1:
            raise ValueError(f"quality_target must be a test accuracy in (0, 1] for {self.workload}; "
                             f"got {self.quality_target}")
        if not self.algorithms:
            raise ValueError("algorithms must name at least one algorithm")
        self.algorithms = [a.strip() for a in self.algorithms]
        for a in self.algorithms:
            if a != AUTO:
                parse_entry(a)
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError(f"algorithms must not repeat an entry, got {self.algorithms}")
        seeds = []
        for s in self.seeds:
            try:
                seeds.append(int(s))
            except (TypeError, ValueError):
                raise ValueError(f"seeds must be integers in [0, 2**63 - 1], got {s!r}") from None
            if not 0 <= seeds[-1] < 2**63:
                raise ValueError(f"seeds must be integers in [0, 2**63 - 1], got {s!r}")
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must not repeat, got {seeds}")
        self.seeds = seeds
        accepted = {k for spec in REGISTRY.values() for k in spec.options.keys()}
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise ValueError(f"options {', '.join(unknown)} are taken by no algorithm; known: {', '.join(sorted(accepted))}")
        for a in self.algorithms:
            if a != AUTO:
                self.algorithm_options(a)
        if self.to_quality and self.quality_target is None and self.dense_entry() is None:
            raise ValueError("to_quality needs an allreduce entry in algorithms (its final quality sets the "
                             "target) or an explicit quality_target (--quality-target)")

    def dense_entry(self) -> Optional[str]:
        """The ``allreduce`` entry of ``algorithms`` (the dense reference of ``--to-quality``), or None."""
        return next((a for a in self.algorithms if a != AUTO and parse_entry(a)[0] == "allreduce"), None)

    def higher_is_better(self) -> bool:
        """Whether the workload's quality is test accuracy (higher is better) rather than bits per
        character (lower is better)."""
        return get_workload(self.workload, self.model).metric == "test accuracy"

    def algorithm_options(self, entry: str) -> Any:
        """The options dataclass of entry ``entry`` (an algorithm name, or ``NAME:KEY=VALUE...``): the
        items of ``options`` its algorithm accepts, overridden by the entry's own. An entry that fixes
        its own ``ratio`` keeps K fixed (``adapt_every`` 0) unless it sets ``adapt_every`` too."""
        name, own = parse_entry(entry)
        keys = REGISTRY[name].options.keys()
        merged = {**{k: v for k, v in self.options.items() if k in keys}, **own}
        if own.get("ratio", AUTO) != AUTO and "adapt_every" in keys and "adapt_every" not in own:
            merged["adapt_every"] = 0
        return make_options(name, merged)

    def accuracy_seeds(self) -> list[int]:
        """The seeds of the time-to-accuracy runs: ``seeds``, or ``[seed]`` when none were given."""
        return list(self.seeds) or [self.seed]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        return cls(**json.loads(text))


