"""The small MLP and the per-rank batches the COVAP tests train (test helper)."""

import torch
from torch import nn


def make_model() -> nn.Module:
    """A 4-layer MLP, 20 inputs, 10 classes, seeded so every rank starts from the same weights."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 96), nn.Tanh(),
                         nn.Linear(96, 32), nn.Tanh(), nn.Linear(32, 10))


def batch(rank: int, step: int):
    """16 samples of ``rank``'s data at ``step``: inputs ``(16, 20)`` float32, labels ``(16,)`` int64."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, concatenated (1-D)."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def backward_step(model: nn.Module, rank: int, step: int) -> None:
    """Clear ``model``'s gradients and run forward and backward on :func:`batch` ``(rank, step)``."""
    model.zero_grad(set_to_none=True)
    x, y = batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
