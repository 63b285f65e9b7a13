"""Test-set evaluation shared by every rank (loss and accuracy all-reduced)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
              group=None, batch: int = 1000) -> tuple[float, float]:
    """Test loss (mean cross-entropy) and accuracy in [0, 1] over the whole set; each rank takes
    every world-th sample and the sums are all-reduced."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    xs, ys = x[rank::world], y[rank::world]
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for i in range(0, xs.shape[0], batch):
            xb, yb = xs[i:i + batch].to(device), ys[i:i + batch].to(device)
            out = model(xb)
            sums[0] += F.cross_entropy(out, yb, reduction="sum").item()
            sums[1] += (out.argmax(1) == yb).sum().item()
            sums[2] += yb.numel()
    model.train(was_training)
    dist.all_reduce(sums, group=group)
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])
