"""Training workloads: a real dataset plus a model sized for this kind of machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import fashion_mnist
from .resnet import ResNetFMNIST


@dataclass(frozen=True)
class Workload:
    """A dataset loader and model factory.

    ``load(data_dir)`` returns ``(train_x, train_y, test_x, test_y)`` tensors; ``make_model()`` a
    fresh ``nn.Module``; ``augment(x)`` a batch transform applied in training only.
    """

    name: str
    load: Callable[[str | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    make_model: Callable[[], nn.Module]
    augment: Callable[[torch.Tensor], torch.Tensor]


def _load_fmnist(data_dir: str | None):
    return (*fashion_mnist.load(data_dir, "train"), *fashion_mnist.load(data_dir, "test"))


def _random_flip(x: torch.Tensor) -> torch.Tensor:
    """Horizontal flip of a random half of the batch ``[B, C, H, W]``."""
    flip = torch.rand(x.shape[0], device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(3), x)


WORKLOADS: dict[str, Workload] = {
    "fashion-mnist": Workload("fashion-mnist", _load_fmnist, lambda: ResNetFMNIST(16, (1, 1, 1)), _random_flip),
}


def get_workload(name: str) -> Workload:
    """Raises ValueError listing the known workloads."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    return WORKLOADS[name]
