"""Test-set evaluation shared by every rank (loss and accuracy all-reduced)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


#: Samples per forward pass of :func:`evaluate` on a CPU: activations that stay in cache. One thread, 600 test
#: samples, in batches of 1000 against 64: the ResNet-8 0.52 s against 0.27 s, the character LSTM 3.1 s against
#: 2.8 s, the transformer 6.9 s against 5.0 s, the MobileNetV2 equal (0.11 s).
CPU_EVAL_BATCH = 64
#: Samples per forward pass of :func:`evaluate` on an accelerator.
DEVICE_EVAL_BATCH = 1000


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             group=None, batch: int | None = None) -> tuple[float, float]:
    """Test loss (mean cross-entropy) and accuracy in [0, 1] over the whole set; each rank takes
    every world-th sample and the sums are all-reduced. ``batch``: samples per forward pass (default
    :data:`CPU_EVAL_BATCH` on a CPU ``device``, else :data:`DEVICE_EVAL_BATCH`)."""
    if batch is None:
        batch = CPU_EVAL_BATCH if torch.device(device).type == "cpu" else DEVICE_EVAL_BATCH
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
