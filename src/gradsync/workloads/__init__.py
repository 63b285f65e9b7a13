"""Training workloads: a real dataset plus a model sized for this kind of machine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import fashion_mnist
from .resnet import ResNetFMNIST


@dataclass(frozen=True)
class Workload:
    """A dataset loader and model factory.

    ``load(data_dir)`` returns ``(train_x, train_y, test_x, test_y)`` tensors; ``make_model()`` a
    fresh ``nn.Module`` whose output works with ``F.cross_entropy(out, y)`` (class dimension 1);
    ``augment(x)`` a batch transform applied in training only; ``defaults`` the training settings
    (``lr``, ``batch_size``, ``epochs``) used where the user gives none; ``extra_metrics(test_loss,
    test_acc)`` workload-specific figures for the summary.
    """

    name: str
    load: Callable[[str | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    make_model: Callable[[], nn.Module]
    augment: Callable[[torch.Tensor], torch.Tensor]
    defaults: dict[str, Any] = field(default_factory=dict)
    extra_metrics: Callable[[float, float], dict[str, float]] = lambda loss, acc: {}


def _load_fmnist(data_dir: str | None):
    return (*fashion_mnist.load(data_dir, "train"), *fashion_mnist.load(data_dir, "test"))


def _random_flip(x: torch.Tensor) -> torch.Tensor:
    """Horizontal flip of a random half of the batch ``[B, C, H, W]``."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


def _load_kjv(data_dir: str | None):
    from . import kjv

    return kjv.load(data_dir)[:4]


def _kjv_model() -> nn.Module:
    from . import kjv
    from .charlstm import CharLSTM

    return CharLSTM(len(kjv.KJV_VOCAB), channels_first=True)


WORKLOADS: dict[str, Workload] = {
    "fashion-mnist": Workload("fashion-mnist", _load_fmnist, lambda: ResNetFMNIST(16, (1, 1, 1)), _random_flip,
                              {"lr": 0.1, "batch_size": 64, "epochs": 4}),
    # Character-level LSTM language model on the King James Bible (GraVAC's LSTM workload);
    # test loss is nats per character, "accuracy" next-character accuracy.
    "kjv-lstm": Workload("kjv-lstm", _load_kjv, _kjv_model, lambda x: x,
                         {"lr": 2.0, "batch_size": 32, "epochs": 1},
                         lambda loss, acc: {"bits_per_char": loss / math.log(2)}),
}


def get_workload(name: str) -> Workload:
    """Raises ValueError listing the known workloads."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return WORKLOADS[name]
