"""Configuration of a ``gradsync train`` run, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..validation import check_choice, check_float, check_int


@dataclass
class TrainConfig:
    """All settings of a training run.

    Raises:
        ValueError: from :meth:`validate` (called on construction), naming the argument and range.
    """

    algorithm: str = "allreduce"
    workload: str = "fashion-mnist"
    workers: int = 2
    threads: int = 1
    epochs: int | None = None      # None: the workload's default (fashion-mnist 4, kjv-lstm 1)
    batch_size: int | None = None  # per worker; None: the workload's default (64, 32)
    lr: float | None = None        # peak of the one-cycle schedule; None: the workload's (0.1, 2.0)
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    max_steps: int | None = None  # stop after this many optimizer steps in total
    ratio: int | str = 3          # COVAP compression ratio K, or "auto"
    density: float = 0.01         # kept fraction for top-k, random-k, DGC, RedSync
    error_feedback: bool = True   # error feedback for the compressors of the compressor library
    compressor: str = "topk"      # GraVAC's sparsifier
    search_interval: int | None = None  # GraVAC steps between search boundaries; None: a quarter epoch
    gain_floor: float = 0.75      # GraVAC epsilon: least compression gain a compressor may have
    plateau_tolerance: float = 0.05  # GraVAC omega: relative gap of the two best throughputs to stop
    levels: int = 127             # QSGD quantisation levels
    powersgd_rank: int = 2        # PowerSGD matrix approximation rank
    bucket_cap_mb: float = 0.1    # DDP bucket size (MB)
    fusion_mb: float | str = 25.0  # DeAR tensor-fusion threshold (MB) or "auto"
    data_dir: str | None = None
    train_samples: int | None = None  # use only the first N training samples (quick experiments)
    checkpoint: str | None = None  # directory: DIR/epoch{E}/rank{r}.pt after every epoch
    checkpoint_every: int | None = None  # also DIR/step{S} every this many steps (needs checkpoint)
    resume: str | None = None      # a checkpoint directory, or "latest" (newest complete under checkpoint)
    out: str | None = None
    timeout: float = 120.0        # seconds before a collective with a dead peer raises
    backend: str = "auto"         # gloo, nccl, or auto (nccl when CUDA is available under torchrun)
    compute_steps: int = 3        # steps timed without communication
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        from ..algorithms import DEAR_ALGORITHMS, REGISTRY
        from ..workloads import WORKLOADS

        check_choice("algorithm", self.algorithm, sorted([*REGISTRY, *DEAR_ALGORITHMS]))
        check_choice("workload", self.workload, sorted(WORKLOADS))
        for key, value in WORKLOADS[self.workload].defaults.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        check_int("workers", self.workers, 1, 64)
        check_int("threads", self.threads, 1, 256)
        check_int("epochs", self.epochs, 1, 10_000)
        check_int("batch_size", self.batch_size, 1, 65_536)
        check_float("lr", self.lr, 0.0, 10.0, low_inclusive=False)
        check_float("momentum", self.momentum, 0.0, 1.0, high_inclusive=False)
        check_float("weight_decay", self.weight_decay, 0.0, 1.0)
        check_int("seed", self.seed, 0, 2**63 - 1)
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps, 1)
        if self.ratio != "auto":
            self.ratio = check_int("ratio", self.ratio, 1, 32)
        check_float("density", self.density, 0.0, 1.0, low_inclusive=False)
        check_choice("compressor", self.compressor, ["topk", "dgc", "redsync", "randomk"])
        check_int("levels", self.levels, 1, 32767)
        check_float("gain_floor", self.gain_floor, 0.0, None, low_inclusive=False)
        check_float("plateau_tolerance", self.plateau_tolerance, 0.0, None)
        if self.search_interval is not None:
            check_int("search_interval", self.search_interval, 1)
        check_int("powersgd_rank", self.powersgd_rank, 1, 64)
        if self.fusion_mb != "auto":
            self.fusion_mb = check_float("fusion_mb", self.fusion_mb, 0.0, 1e6, low_inclusive=False)
        check_float("bucket_cap_mb", self.bucket_cap_mb, 0.0, 1024.0, low_inclusive=False)
        check_float("timeout", self.timeout, 1.0, 86_400.0)
        check_choice("backend", self.backend, ["auto", "gloo", "nccl"])
        check_int("compute_steps", self.compute_steps, 1, 100)
        if self.train_samples is not None:
            check_int("train_samples", self.train_samples, 1)
        if self.checkpoint_every is not None:
            check_int("checkpoint_every", self.checkpoint_every, 1)
            if not self.checkpoint:
                raise ValueError("checkpoint_every needs checkpoint (--checkpoint DIR) to say where to write")
        if self.resume == "latest" and not self.checkpoint:
            raise ValueError("resume 'latest' needs checkpoint (--checkpoint DIR) to say where to look")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def agreement_fields(self) -> dict[str, Any]:
        """Fields that must be equal on every rank (everything but paths and UI)."""
        d = self.to_dict()
        for k in ("data_dir", "out", "progress", "checkpoint", "resume"):
            d.pop(k)
        return d
