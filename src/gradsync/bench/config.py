"""Settings of a ``gradsync bench`` run: typed fields validated once on construction, from which the
command-line flags are generated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from ..algorithms import REGISTRY, make_options
from ..options import option
from ..train.config import SharedConfig
from ..workloads import get_workload


@dataclass
class BenchConfig(SharedConfig):
    """Raises ValueError on construction naming the field and the allowed range. ``options`` holds
    algorithm options; each algorithm takes the ones it accepts, and a key no registered algorithm
    accepts is an error."""

    algorithms: list[str] = option(None, "comma-separated algorithm names", flag="--algorithms",
                                   default_factory=lambda: ["allreduce", "fp16", "powersgd", "covap"])
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
        for a in self.algorithms:
            if a not in REGISTRY:
                raise ValueError(f"algorithms must be among {', '.join(sorted(REGISTRY))}; got {a!r}")
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError(f"algorithms must not repeat a name, got {self.algorithms}")
        accepted = {k for spec in REGISTRY.values() for k in spec.options.keys()}
        unknown = sorted(set(self.options) - accepted)
        if unknown:
            raise ValueError(f"options {', '.join(unknown)} are taken by no algorithm; known: {', '.join(sorted(accepted))}")
        for a in self.algorithms:
            self.algorithm_options(a)

    def algorithm_options(self, name: str) -> Any:
        """The options dataclass of algorithm ``name``: the entries of ``options`` it accepts."""
        keys = REGISTRY[name].options.keys()
        return make_options(name, {k: v for k, v in self.options.items() if k in keys})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        return cls(**json.loads(text))
