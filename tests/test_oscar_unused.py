"""OSCAR and count-sketch hooks beside DDP's own collectives (``find_unused_parameters=True``).

Their reductions run on a background thread; DDP all-reduces its unused-parameter map from the
autograd thread while that work is in flight. On one shared process group the two interleave
differently on different ranks (Gloo: "Received data size doesn't match expected size"); the hooks'
background work has its own process group.
"""

import pickle

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily; import once before fork
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.algorithms.oscar import ALGORITHMS

ALGOS = (
    ("oscar-sw", dict(sketch_ratio=0.1, start_iter=1)),
    ("oscar-asc", dict(sketch_ratio=0.1, start_iter=1)),
    ("countsketch", dict(sketch_ratio=0.1, start_iter=1)),
)


class _WithUnused(nn.Module):
    """Three layers and a head that ``forward`` never uses (a genuinely unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.unused = nn.Linear(64, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _make(unused: bool) -> nn.Module:
    torch.manual_seed(0)
    if unused:
        return _WithUnused()
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train_all(rank, world_size, steps):
    """Every algorithm, with and without an unused parameter, on one process group; returns
    ``{(algo, unused): (params, losses, compressed_iterations, pickled state)}``."""
    out = {}
    for algo, kwargs in ALGOS:
        for unused in (False, True):
            model = DDP(_make(unused), bucket_cap_mb=0.01, find_unused_parameters=True)
            cls, hook = ALGORITHMS[algo]
            state = cls(**kwargs)
            model.register_comm_hook(state, hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            g = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(steps):
                x = torch.randn(32, 20, generator=g)
                y = torch.randint(0, 4, (32,), generator=g)
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            assert state.comm_group is not None  # the worker runs on its own group, not the default one
            blob = pickle.dumps(state)  # the private process group is dropped when pickling
            again = pickle.loads(blob)
            assert again.process_group is None
            out[(algo, unused)] = (params, losses, state.compressed_iterations, len(blob))
    dist.barrier()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_background_hooks_train_with_find_unused_parameters(world_size):
    steps = 5
    res = run_ranks(_train_all, world_size, steps, timeout=240, pg_timeout=60)
    init_unused = _make(True).unused.weight.detach().reshape(-1)
    for algo, _ in ALGOS:
        for unused in (False, True):
            params0, losses0, compressed, _ = res[0][(algo, unused)]
            assert compressed == steps - 1, (algo, unused)  # start_iter=1: every later step compressed
            assert all(loss == loss for loss in losses0), (algo, unused)  # no NaN
            for r in range(1, world_size):
                # replicas stay bitwise identical
                assert torch.equal(res[r][(algo, unused)][0], params0), (algo, unused, r)
            if unused:
                # the unused head is the last parameter: weight (7 x 64) then bias (7); never updated
                w = params0[-(7 * 64 + 7):-7]
                assert torch.equal(w, init_unused), algo


def _train_subgroup(rank, world_size, steps):
    """DDP over the subgroup {0, 1} of a 3-rank job: the reduction runs in the hook body (a private
    group would need rank 2 to take part) and stays in step with DDP's collectives."""
    sub = dist.new_group(ranks=[0, 1])
    out = None
    if rank < 2:
        model = DDP(_make(True), bucket_cap_mb=0.01, find_unused_parameters=True, process_group=sub)
        cls, hook = ALGORITHMS["oscar-asc"]
        state = cls(sub, sketch_ratio=0.1, start_iter=1)
        model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(torch.randn(16, 20, generator=g)),
                                               torch.randint(0, 4, (16,), generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert state.comm_group is sub  # no private group for a strict subgroup
        out = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state.compressed_iterations)
    dist.barrier()
    return out


def test_strict_subgroup_runs_in_hook_body():
    res = run_ranks(_train_subgroup, 3, 4, timeout=180, pg_timeout=60)
    assert res[2] is None
    assert torch.equal(res[0][0], res[1][0]) and res[0][1] == 3
