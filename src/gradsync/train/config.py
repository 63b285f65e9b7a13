"""Configuration of a ``gradsync train`` run: typed fields, validated once on construction, from which
the command-line flags are generated (:func:`gradsync.options.add_arguments`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..algorithms import REGISTRY, make_options
from ..options import AUTO, Options, option
from ..workloads import WORKLOADS, get_workload


@dataclass
class SharedConfig(Options):
    """Settings shared by ``gradsync train`` and ``gradsync bench``."""

    workload: str = option("fashion-mnist", "training workload (model + real dataset)", choices=sorted(WORKLOADS))
    model: Optional[str] = option(None, "architecture for the workload (fashion-mnist: resnet8 or a torchvision "
                                  "classification model such as resnet18, resnet50, mobilenet_v3_small); "
                                  "default: the workload's")
    threads: int = option(1, "torch threads per rank", low=1, high=256)
    seed: int = option(0, "seed of the model, the data order and every algorithm's randomness", low=0,
                       high=2**63 - 1)
    bucket_cap_mb: float = option(0.1, "DDP bucket size", low=0.0, high=1024.0, low_open=True, units="MB")
    data_dir: Optional[str] = option(None, "directory with the dataset files (default: where the Debian "
                                     "packages install them)")
    eval_samples: Optional[int] = option(None, "evaluate on the first N test samples (default: the full test set; "
                                         "fewer is faster and noisier)", low=1)


@dataclass
class TrainConfig(SharedConfig):
    """All settings of a training run; ``options`` holds the algorithm's options (validated by its
    options dataclass; after construction it lists every option with its effective value).

    Raises:
        ValueError: on construction, naming the field (or the algorithm and its allowed options) and
            the allowed range.
    """

    algorithm: str = option("allreduce", "gradient-synchronisation algorithm; auto: the setting with the least "
                            "predicted time to quality on the measured network (gradsync.profiler.auto)",
                            choices=sorted([*REGISTRY, AUTO]))
    auto_probe: str = option("copies", "how --algorithm auto measures: copies (a start-up probe on copies of the model, "
                             "gradsync.profiler.auto) or online (on the job's own first steps, gradsync.profiler.online;"
                             " among the hooks that work on any DDP bucket layout)", choices=["copies", "online"])
    auto_recheck_every: int = option(0, "with --auto-probe online: re-measure a lossy choice's error every this many "
                                     "steps and escalate it (PowerSGD rank x2, fp16, DDP) where it exceeds the quality "
                                     "model's limit (gradsync.profiler.online, phase 5); 0: never", low=0,
                                     high=1_000_000, units="iterations")
    bucket_cap_mb: Union[float, str] = option(AUTO, "DDP bucket size; auto: the model's gradient size / 16, "
                                              "clamped to [0.01, 25] (at least 8 buckets, so compression can "
                                              "overlap with the backward pass)", low=0.0, high=1024.0,
                                              low_open=True, units="MB")
    workers: int = option(2, "local ranks on 127.0.0.1 (ignored under torchrun, which sets the world size)",
                          low=1, high=64)
    epochs: Optional[int] = option(None, "epochs; default: the workload's recipe", low=1, high=10_000)
    batch_size: Optional[int] = option(None, "samples per step per rank; default: the workload's recipe", low=1,
                                       high=65_536)
    lr: Optional[float] = option(None, "peak learning rate of the one-cycle schedule; default: the workload's recipe",
                                 low=0.0, high=10.0, low_open=True)
    warmup_fraction: Optional[float] = option(None, "fraction of the steps spent warming the one-cycle schedule up "
                                              "to --lr; default: the workload's recipe", low=0.0, high=1.0,
                                              low_open=True, high_open=True)
    momentum: Optional[float] = option(None, "SGD (Nesterov) momentum; default: the workload's recipe", low=0.0,
                                       high=1.0, high_open=True)
    weight_decay: Optional[float] = option(None, "weight decay; default: the workload's recipe", low=0.0,
                                           high=1.0)
    amp: str = option("off", "mixed precision: autocast the forward pass to bf16, or to fp16 with "
                      "torch.amp.GradScaler loss scaling (steps with inf/nan gradients are skipped on every rank)",
                      choices=["off", "bf16", "fp16"])
    clip_grad_norm: Optional[float] = option(None, "clip the averaged gradients to this global 2-norm "
                                             "(torch.nn.utils.clip_grad_norm_ after the reduction; DeAR: its "
                                             "exact global norm over the reduced shards)", low=0.0, high=1e9,
                                             low_open=True)
    max_steps: Optional[int] = option(None, "stop after this many optimizer steps in total", low=1)
    train_samples: Optional[int] = option(None, "train on the first N training samples only", low=1)
    checkpoint: Optional[str] = option(None, "directory; after every epoch (and every --checkpoint-every steps) "
                                       "each rank writes DIR/epochE or DIR/stepS/rankR.pt (model, optimizer, "
                                       "scheduler, error-feedback residuals, controller state), then a manifest")
    checkpoint_every: Optional[int] = option(None, "also checkpoint every N optimizer steps (needs --checkpoint)",
                                             low=1, units="steps")
    resume: Optional[str] = option(None, "continue from a checkpoint directory, or 'latest': the newest complete "
                                   "checkpoint under --checkpoint")
    out: Optional[str] = option(None, "write metrics.json and curves.png here")
    timeout: float = option(120.0, "seconds before a collective waiting on a dead peer fails", low=1.0,
                            high=86_400.0, units="s")
    backend: str = option("auto", "process-group backend (auto: NCCL under torchrun when LOCAL_RANK names a CUDA "
                          "device, for local ranks with one CUDA device per rank; else Gloo, always on --hosts)",
                          choices=["auto", "gloo", "nccl"])
    compute_steps: int = option(3, "steps timed without communication (compute-only reference)", low=1, high=100)
    progress: bool = option(True, "show a progress bar on rank 0")
    options: dict = option(None, "the algorithm's options", cli=False, default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, value in get_workload(self.workload, self.model).defaults.items():
            if getattr(self, key, value) is None:
                setattr(self, key, value)
        if self.checkpoint_every is not None and not self.checkpoint:
            raise ValueError("checkpoint_every needs checkpoint (--checkpoint DIR) to say where to write")
        if self.resume == "latest" and not self.checkpoint:
            raise ValueError("resume 'latest' needs checkpoint (--checkpoint DIR) to say where to look")
        if self.auto_probe != "copies" and self.algorithm != AUTO:
            raise ValueError(f"auto_probe {self.auto_probe!r} needs algorithm 'auto'; got algorithm {self.algorithm!r}")
        if self.auto_recheck_every and self.auto_probe != "online":
            raise ValueError(f"auto_recheck_every {self.auto_recheck_every} needs auto_probe 'online' (and algorithm "
                             f"'auto'); got auto_probe {self.auto_probe!r}")
        if self.algorithm == AUTO:
            if self.options:
                raise ValueError(f"options {', '.join(sorted(self.options))} cannot be given with algorithm 'auto', "
                                 f"which chooses the algorithm and its options; name an algorithm to set them")
        else:
            self.options = make_options(self.algorithm, self.options).to_dict()

    def to_dict(self) -> dict[str, Any]:
        return dict(super().to_dict())

    def agreement_fields(self) -> dict[str, Any]:
        """Fields that must be equal on every rank (everything but paths and UI)."""
        d = self.to_dict()
        for k in ("data_dir", "out", "progress", "checkpoint", "resume"):
            d.pop(k)
        return d
