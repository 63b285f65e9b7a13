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
    appear in several entries with different options (see :func:`parse_entry`)."""

    algorithms: list[str] = option(None, "comma-separated entries NAME or NAME:KEY=VALUE[:KEY=VALUE...] "
                                   "(per-entry algorithm options, e.g. powersgd:matrix_approximation_rank=1,"
                                   "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16)",
                                   flag="--algorithms",
                                   default_factory=lambda: ["allreduce", "fp16", "powersgd", "covap"])
    seeds: list[int] = option(None, "seeds of the --to-accuracy runs (each algorithm trains once per seed from "
                         "that seed's model and data order; the report gives the median and the spread); "
                         "default: --seed", flag="--seeds", default_factory=list)
    hosts: int = option(2, "emulated hosts, one rank each", low=1, high=64)
    bandwidth_mbit: Optional[float] = option(None, "link rate (None: loopback, not shaped)", low=0.1,
                                             high=100_000.0, units="Mbit/s", cli=False)
    steps: int = option(20, "timed iterations per algorithm per round", low=1, high=100_000)
    warmup: int = option(5, "untimed iterations per algorithm per round", low=0, high=10_000)
    rounds: int = option(3, "interleaved rounds (A B C A B C ...)", low=1, high=1000)
    batch_size: int = option(64, "samples per step per rank", low=1, high=65_536)
    lr: Optional[float] = option(None, "constant learning rate; default: the workload's", low=0.0, high=10.0,
                                 low_open=True)
    to_accuracy: Optional[float] = option(None, "also train each algorithm until this test accuracy (0-1) and "
                                          "report the time", low=0.0, high=1.0, low_open=True)
    eval_every: int = option(50, "steps between time-to-accuracy evaluations", low=1, high=100_000)
    max_accuracy_steps: int = option(2000, "give up on --to-accuracy after this many steps", low=1,
                                     high=10_000_000)
    timeout: float = option(300.0, "process-group timeout", low=1.0, high=86_400.0, units="s")
    options: dict = option(None, "algorithm options", cli=False, default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lr is None:
            self.lr = get_workload(self.workload, self.model).defaults["lr"]
        if not self.algorithms:
            raise ValueError("algorithms must name at least one algorithm")
        self.algorithms = [a.strip() for a in self.algorithms]
        for a in self.algorithms:
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
            self.algorithm_options(a)

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


