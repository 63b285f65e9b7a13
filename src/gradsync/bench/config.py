"""Settings of a ``gradsync bench`` run (validated on construction)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..validation import check_choice, check_float, check_int


@dataclass
class BenchConfig:
    """Raises ValueError (from :meth:`validate`) naming the argument and allowed range."""

    algorithms: list[str] = field(default_factory=lambda: ["allreduce", "fp16", "powersgd", "covap"])
    hosts: int = 2
    bandwidth_mbit: float | None = None   # None: loopback, not shaped
    steps: int = 20                       # timed iterations per algorithm per round
    warmup: int = 5                       # untimed iterations per algorithm per round
    rounds: int = 3                       # A B C A B C ... rounds
    workload: str = "fashion-mnist"
    batch_size: int = 64
    threads: int = 1
    lr: float = 0.05
    seed: int = 0
    bucket_cap_mb: float = 0.1
    fusion_mb: float | str = 25.0
    ratio: int | str = "auto"
    density: float = 0.01
    error_feedback: bool = True
    compressor: str = "topk"
    levels: int = 127
    powersgd_rank: int = 2
    search_interval: int | None = None
    gain_floor: float = 0.75
    plateau_tolerance: float = 0.05
    to_accuracy: float | None = None      # also train each algorithm until this test accuracy
    eval_every: int = 50                  # steps between evaluations in the time-to-accuracy phase
    max_accuracy_steps: int = 2000
    timeout: float = 300.0
    data_dir: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from ..algorithms import DEAR_ALGORITHMS, REGISTRY
        from ..workloads import WORKLOADS

        if isinstance(self.algorithms, str):
            self.algorithms = [a.strip() for a in self.algorithms.split(",") if a.strip()]
        if not self.algorithms:
            raise ValueError("algorithms must name at least one algorithm")
        for a in self.algorithms:
            check_choice("algorithms", a, sorted([*REGISTRY, *DEAR_ALGORITHMS]))
        if len(set(self.algorithms)) != len(self.algorithms):
            raise ValueError(f"algorithms must not repeat a name, got {self.algorithms}")
        check_int("hosts", self.hosts, 1, 64)
        if self.bandwidth_mbit is not None:
            check_float("bandwidth", self.bandwidth_mbit, 0.1, 100_000.0)
        check_int("steps", self.steps, 1, 100_000)
        check_int("warmup", self.warmup, 0, 10_000)
        check_int("rounds", self.rounds, 1, 1000)
        check_choice("workload", self.workload, sorted(WORKLOADS))
        check_int("batch_size", self.batch_size, 1, 65_536)
        check_int("threads", self.threads, 1, 256)
        check_float("lr", self.lr, 0.0, 10.0, low_inclusive=False)
        check_float("bucket_cap_mb", self.bucket_cap_mb, 0.0, 1024.0, low_inclusive=False)
        if self.fusion_mb != "auto":
            self.fusion_mb = check_float("fusion_mb", self.fusion_mb, 0.0, 1e6, low_inclusive=False)
        if self.ratio != "auto":
            self.ratio = check_int("ratio", self.ratio, 1, 32)
        check_float("density", self.density, 0.0, 1.0, low_inclusive=False)
        check_choice("compressor", self.compressor, ["topk", "dgc", "redsync", "randomk"])
        check_int("levels", self.levels, 1, 32767)
        check_int("powersgd_rank", self.powersgd_rank, 1, 64)
        if self.search_interval is not None:
            check_int("search_interval", self.search_interval, 1)
        check_float("gain_floor", self.gain_floor, 0.0, None, low_inclusive=False)
        check_float("plateau_tolerance", self.plateau_tolerance, 0.0, None)
        if self.to_accuracy is not None:
            check_float("to_accuracy", self.to_accuracy, 0.0, 1.0, low_inclusive=False)
        check_int("eval_every", self.eval_every, 1, 100_000)
        check_int("max_accuracy_steps", self.max_accuracy_steps, 1, 10_000_000)
        check_float("timeout", self.timeout, 1.0, 86_400.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "BenchConfig":
        return cls(**json.loads(text))

    def algorithm_options(self) -> dict[str, Any]:
        """Keyword options for :class:`~gradsync.train.parallel.DataParallel`."""
        return {"ratio": self.ratio, "density": self.density, "compressor": self.compressor,
                "error_feedback": self.error_feedback, "search_interval": self.search_interval,
                "gain_floor": self.gain_floor, "plateau_tolerance": self.plateau_tolerance,
                "levels": self.levels, "rank": self.powersgd_rank, "seed": self.seed,
                "batch_size": self.batch_size}
