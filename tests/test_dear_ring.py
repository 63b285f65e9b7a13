"""DeAR's reduce-scatter on a point-to-point ring (Gloo): same layout as reduce_scatter_tensor, and
DeAR's losses equal DDP's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.algorithms.dear import DeAR
from gradsync.algorithms.dear import CovapGradFilter
from gradsync.comm.collectives import reduce_scatter_flat
from gradsync.comm.ring import ring_reduce_scatter_tensor


def _ring_unit(rank, world_size):
    out = {}
    for n in (0, 1, 5, 37):
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(-1000, 1000, (world_size * n,), generator=g, dtype=torch.int64)
        ref = torch.empty(n, dtype=torch.int64)
        reduce_scatter_flat(ref, x.clone())
        got = torch.full((n,), -7, dtype=torch.int64)
        ring_reduce_scatter_tensor(got, x.clone())
        out[n] = torch.equal(ref, got)
    errors = 0
    for bad in ((torch.zeros(3), torch.zeros(3 * world_size + 1)), (torch.zeros(3), torch.zeros(3 * world_size,
                                                                                                 dtype=torch.int64))):
        try:
            ring_reduce_scatter_tensor(*bad)
        except ValueError:
            errors += 1
    return out, errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_reduce_scatter_tensor_equals_native(world_size):
    for out, errors in run_ranks(_ring_unit, world_size, timeout=90, pg_timeout=60):
        assert all(out.values()), out  # integer sums: exact
        assert errors == 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _losses(rank, world_size, mode, steps):
    """Per-step losses and final parameters of DDP (mode "ddp") or DeAR with the given reduce-scatter."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if mode == "ddp":
        net, step = DDP(model), opt.step
    else:
        rs, _, filt = mode.partition("+")
        f = CovapGradFilter(1) if filt == "covap1" else None
        dear = DeAR(model, opt, fusion_mb=1e-3, reduce_scatter=rs, grad_filter=f)
        if f is not None:
            f.bind(dear)
        net, step = dear, dear.step
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        opt.zero_grad() if mode == "ddp" else dear.zero_grad()
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        step()
        losses.append(loss.item())
    if mode != "ddp":
        dear.flush()
        impl = dear.stats()["reduce_scatter"]
        dear.remove_hooks()
    else:
        impl = "ddp"
    # everyone's losses, so rank 0 can compare the mean loss
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return {"losses": (t / world_size).tolist(), "params": [p.detach().clone() for p in model.parameters()],
            "impl": impl}


@pytest.mark.parametrize("world_size", [2, 3])
def test_dear_ring_losses_equal_ddp(world_size):
    steps = 6
    ddp = run_ranks(_losses, world_size, "ddp", steps, timeout=120, pg_timeout=60)[0]
    for mode in ("auto", "native", "ring+covap1"):
        got = run_ranks(_losses, world_size, mode, steps, timeout=120, pg_timeout=60)[0]
        assert got["impl"] == ("native" if mode == "native" else "ring")
        if world_size == 2:  # a + b and (a + b) / 2 == a / 2 + b / 2: bitwise equal to DDP
            assert got["losses"] == ddp["losses"], mode
            assert all(torch.equal(a, b) for a, b in zip(got["params"], ddp["params"])), mode
        else:  # three-term sums in another order: float32 rounding only
            assert got["losses"] == pytest.approx(ddp["losses"], rel=1e-6, abs=1e-6), mode
            for a, b in zip(got["params"], ddp["params"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _extra_forward(rank, world_size, mode, steps):
    """A grad-enabled forward between backward and step() (e.g. logging) with BatchNorm buffers: the
    buffer broadcast must not interleave with ring reduce-scatters still running on the worker."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dear = DeAR(model, opt, fusion_mb=1e-3, reduce_scatter=mode)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        dear.zero_grad()
        x, y = torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = nn.functional.cross_entropy(dear(x), y)
        loss.backward()
        dear(x)  # extra training-mode forward before step()
        dear.step()
        losses.append(loss.item())
    dear.flush()
    return losses, [b.clone() for b in model.buffers()]


def test_ring_with_forward_before_step_matches_native():
    ring = run_ranks(_extra_forward, 2, "ring", 4, timeout=120, pg_timeout=60)
    native = run_ranks(_extra_forward, 2, "native", 4, timeout=120, pg_timeout=60)
    for (l1, b1), (l2, b2) in zip(ring, native):
        assert l1 == l2
        assert all(torch.equal(a, b) for a, b in zip(b1, b2))
