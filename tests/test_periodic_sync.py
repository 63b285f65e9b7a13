"""``local-sgd`` and ``diloco`` (issue 33) on real 2-rank Gloo groups on 127.0.0.1: what they compute
(H = 1 against DDP and against each other), when the ranks agree (right after each sync only), the bytes
they count, their option checks, and a ``gradsync train`` run resumed mid-period that repeats the
uninterrupted run's steps bitwise."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from gradsync.algorithms import REGISTRY, BuildContext, build, make_options
from gradsync.comm.collectives import wire_bytes
from gradsync.workloads import fashion_mnist

#: parameters of H = 1 local SGD (or DiLoCo with outer lr 1, no momentum) against DDP after 4 plain SGD
#: steps: equal up to float32 rounding of a different summation order (params averaged instead of
#: gradients), measured 4.5e-8; allowed 1e-6
ATOL = 1e-6


def _model(norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if norm:  # BatchNorm running statistics: buffers the sync must average too
        return nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 10))
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def _build(name: str, model: nn.Module, lr: float = 0.1, momentum: float = 0.0, **options):
    ctx = BuildContext(model=model, make_optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=momentum))
    return build(name, ctx, options)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in (*module.parameters(), *module.buffers())])


def _h1_against_ddp(rank, world, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        x, y = _batch(rank, s)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    out = {"ddp": _flat(model)}
    for name, options in (("local-sgd", {"period": 1}),
                          ("diloco", {"period": 1, "outer_lr": 1.0, "outer_momentum": 0.0})):
        dp = _build(name, _model(), **options)
        for s in range(steps):
            dp.train_step(*_batch(rank, s), F.cross_entropy)
        out[name] = _flat(dp.module)
        dp.close()
    return out


def test_period_1_equals_ddp_and_diloco_with_outer_lr_1_equals_averaging():
    for r in run_ranks(_h1_against_ddp, 2, 4, timeout=120):
        assert (r["ddp"] - r["local-sgd"]).abs().max() <= ATOL, "local-sgd H=1 is not DDP's plain SGD"
        # diloco, outer lr 1, no momentum, H = 1: theta - mean(theta - theta_i) = the plain average
        assert (r["diloco"] - r["local-sgd"]).abs().max() <= ATOL, "diloco (1, 0, H=1) is not plain averaging"
        assert (r["diloco"] - r["ddp"]).abs().max() <= ATOL


def _period_4(rank, world, steps):
    out = {}
    for name, options in (("local-sgd", {"period": 4}), ("diloco", {"period": 4})):
        dp = _build(name, _model(norm=True), momentum=0.9, **options)
        same, wire, synced = [], [], []
        last = dp.stats()["wire_bytes"]
        for s in range(steps):
            dp.train_step(*_batch(rank, s), F.cross_entropy)
            flat = _flat(dp.module)
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)  # the test's own collective, not the algorithm's
            same.append(all(torch.equal(every[0], other) for other in every[1:]))
            now = dp.stats()
            wire.append(now["wire_bytes"] - last)
            last = now["wire_bytes"]
        out[name] = {"same": same, "wire": wire, "stats": dp.stats(), "numel": dp.bucket_numels()[0],
                     "state": dp.state_dict()}
        dp.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_period_4_ranks_differ_between_syncs_agree_after_each_and_count_the_bytes(world):
    steps = 9
    results = run_ranks(_period_4, world, steps, timeout=120)
    model = _model(norm=True)
    n = sum(t.numel() for t in (*model.parameters(), *model.buffers()) if t.is_floating_point())
    grads = sum(p.numel() for p in model.parameters()) * 4
    for rank, r in enumerate(results):
        for name in ("local-sgd", "diloco"):
            got = r[name]
            syncs = [(s + 1) % 4 == 0 for s in range(steps)]
            # identical parameters and BatchNorm statistics right after each sync (steps 4, 8), different between
            assert got["same"] == syncs, (name, rank, got["same"])
            assert got["numel"] == n
            per_sync = wire_bytes("allreduce", 4 * n, world)  # 2 (P-1)/P x n float32 bytes
            assert got["wire"] == [per_sync if s else 0.0 for s in syncs], (name, got["wire"])
            st = got["stats"]
            assert st["syncs"] == 2 and st["iteration"] == steps and st["collectives"] == 2
            assert st["dense_wire_bytes"] == pytest.approx(steps * wire_bytes("allreduce", grads, world))
            assert st["compression_ratio"] > 4 * grads / (4 * n) - 1e-9
            assert got["state"]["step"] == steps
        assert set(r["diloco"]["state"]) >= {"anchor", "outer_optimizer", "step"}
        # diloco's outer Nesterov momentum: a buffer per parameter after its first outer step
        assert all("momentum_buffer" in v for v in r["diloco"]["state"]["outer_optimizer"]["state"].values())


@pytest.mark.parametrize("name, options, match", [
    ("local-sgd", {"period": 0}, r"local-sgd\.period must be an integer in \[1, 1000000\], got 0"),
    ("diloco", {"period": 2.5}, r"diloco\.period must be an integer in \[1, 1000000\]"),
    ("diloco", {"outer_lr": 0.0}, r"diloco\.outer_lr must be in \(0\.0, 10\.0\], got 0\.0"),
    ("diloco", {"outer_momentum": 1.0}, r"diloco\.outer_momentum must be in \[0\.0, 1\.0\), got 1\.0"),
    ("local-sgd", {"outer_lr": 0.7}, r"algorithm 'local-sgd' does not take option\(s\) outer_lr; allowed: period"),
])
def test_bad_options_name_the_option_and_its_range(name, options, match):
    with pytest.raises(ValueError, match=match):
        make_options(name, options)


def test_both_are_registered_wrappers_not_hooks():
    from gradsync.algorithms import build_hook

    for name in ("local-sgd", "diloco"):
        assert REGISTRY[name].make_hook is None
        with pytest.raises(ValueError, match="gradsync.wrap"):
            build_hook(name)


# ------------------------------------------------------------------------------- gradsync train, resumed
def _train(rank, world, root, resume):
    """``gradsync train``'s rank function (:func:`gradsync.train.loop.run`): diloco, H = 4, 9 steps,
    checkpoints every 3 steps; or the run resumed from its step-6 checkpoint (between the syncs at steps
    4 and 8: every rank's own model, the synced copy and the outer momentum must come back)."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import run

    cfg = TrainConfig(algorithm="diloco", options={"period": 4}, train_samples=640, batch_size=16, max_steps=9,
                      eval_samples=64, compute_steps=1, progress=False,
                      checkpoint=None if resume else f"{root}/ckpt", checkpoint_every=None if resume else 3,
                      resume=f"{root}/ckpt/step6" if resume else None)
    with contextlib.redirect_stdout(io.StringIO()):
        res = run(cfg)
    if res is None:
        return None
    return {"losses": {i["step"]: i["loss"] for i in res["iterations"]},
            "wire": {i["step"]: i["wire_bytes"] for i in res["iterations"]},
            "test_loss": res["summary"]["test_loss"]}


@pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_gradsync_train_diloco_resumed_mid_period_repeats_steps_7_to_9(tmp_path):
    full = run_ranks(_train, 2, str(tmp_path), False, timeout=120, pg_timeout=60)[0]
    part = run_ranks(_train, 2, str(tmp_path), True, timeout=120, pg_timeout=60)[0]
    assert sorted(part["losses"]) == list(range(1, 10))
    assert [part["losses"][s] for s in (7, 8, 9)] == [full["losses"][s] for s in (7, 8, 9)]
    assert part["test_loss"] == full["test_loss"]  # rank 0's model after step 9 (one sync after the resume)
    assert [full["wire"][s] > 0 for s in range(1, 10)] == [s % 4 == 0 for s in range(1, 10)]
    assert part["wire"][8] == full["wire"][8] > 0
