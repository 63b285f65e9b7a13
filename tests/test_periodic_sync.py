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


# ------------------------------------------------------------------- diloco's defaults pinned bitwise
def _reference_diloco(rank, world, steps):
    """diloco at its default options against a plain re-implementation of DiLoCo's outer step as it was
    before fragments and outer_dtype existed (Nesterov SGD on the mean of the flat float32 outer
    gradients and buffers, divided by P before one all-reduce): parameters and losses must be bitwise
    equal at every step."""
    dp = _build("diloco", _model(norm=True), momentum=0.9, period=4)
    model = _model(norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    anchor = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    equal = []
    for s in range(steps):
        x, y = _batch(rank, s)
        got = dp.train_step(x, y, F.cross_entropy)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if (s + 1) % 4 == 0:
            with torch.no_grad():
                flat = torch.cat([(a - p).reshape(-1) for a, p in zip(anchor, params)]
                                 + [b.reshape(-1) for b in buffers])
                flat /= world
                dist.all_reduce(flat)
                offset = 0
                for a in anchor:
                    a.grad = flat[offset:offset + a.numel()].view_as(a).clone()
                    offset += a.numel()
                outer.step()
                for a, p in zip(anchor, params):
                    p.copy_(a)
                for b in buffers:
                    b.copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()
        equal.append(torch.equal(got, loss.detach()) and torch.equal(_flat(dp.module), _flat(model)))
    dp.close()
    return equal


def test_diloco_defaults_equal_a_plain_reimplementation_bitwise():
    # fragments=1, outer_dtype=fp32 must not move a bit from DiLoCo before Streaming DiLoCo was added
    for r in run_ranks(_reference_diloco, 2, 9, timeout=120):
        assert r == [True] * 9, r


# ---------------------------------------------------------------------------------- Streaming DiLoCo
def test_fragment_partition_and_schedule():
    from gradsync.comm.fragments import fragment_at, fragment_bounds, fragment_offsets

    assert fragment_bounds([640, 32, 320, 10], 1) == [(0, 4)]
    # 1002 elements: the cut nearest 501 is after the first tensor (640), not after none (0)
    assert fragment_bounds([640, 32, 320, 10], 2) == [(0, 1), (1, 4)]
    assert fragment_bounds([10, 10, 10, 10], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # a huge first tensor cannot leave the others' fragments empty
    assert fragment_bounds([1000, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    assert fragment_offsets(16, 4) == [4, 8, 12, 16]
    assert fragment_offsets(4, 1) == [4]
    # every fragment once per period, the last at the multiples of the period
    assert [fragment_at(t, 4, 2) for t in range(1, 9)] == [None, 0, None, 1, None, 0, None, 1]
    assert [fragment_at(t, 4, 1) for t in range(1, 9)] == [None, None, None, 0] * 2
    with pytest.raises(ValueError, match="fragments"):
        fragment_bounds([3, 4], 3)


def _fragments(rank, world, steps, options):
    """diloco with ``options`` on the plain MLP (4 trainable tensors, no buffers): after each step, per
    fragment, whether the ranks hold bitwise identical parameters of it, and the wire bytes of the step."""
    dp = _build("diloco", _model(), momentum=0.9, **options)
    bounds = dp.algorithm.bounds
    same, wire, mixed = [], [], []
    algo, outer_step = dp.algorithm, dp.algorithm._outer_step

    def checked_outer_step(f, averaged):  # the parameters after an outer step: alpha x local + (1-alpha) x copy
        lo, hi = bounds[f]
        local = [p.detach().clone() for p in algo.params[lo:hi]]
        outer_step(f, averaged)
        mixed.append(all(torch.equal(p, torch.lerp(a, q, options.get("overlap_mix", 0.0)))
                         for p, a, q in zip(algo.params[lo:hi], algo.anchor[lo:hi], local)))

    algo._outer_step = checked_outer_step
    last = 0.0
    for s in range(steps):
        dp.train_step(*_batch(rank, s), F.cross_entropy)
        row = []
        for lo, hi in bounds:
            flat = torch.cat([p.detach().reshape(-1) for p in dp.algorithm.params[lo:hi]])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            row.append(all(torch.equal(every[0], other) for other in every[1:]))
        same.append(row)
        now = dp.stats()["wire_bytes"]
        wire.append(now - last)
        last = now
    out = {"same": same, "wire": wire, "bounds": bounds, "stats": dp.stats(), "mixed": mixed}
    dp.close()
    try:  # refused before any collective: more fragments than trainable tensors (4)
        _build("diloco", _model(), period=8, fragments=5)
    except ValueError as exc:
        out["too_many"] = str(exc)
    return out


def test_streaming_fragments_agree_after_their_own_sync_and_send_one_full_sync_per_period():
    steps = 8
    r0, r1 = run_ranks(_fragments, 2, steps, {"period": 4, "fragments": 2}, timeout=120)
    full = run_ranks(_fragments, 2, steps, {"period": 4}, timeout=120)[0]
    half = run_ranks(_fragments, 2, steps, {"period": 4, "fragments": 2, "outer_dtype": "fp16"}, timeout=120)[0]
    late = run_ranks(_fragments, 2, steps, {"period": 4, "fragments": 2, "overlap": 1}, timeout=120)[0]
    mix = run_ranks(_fragments, 2, steps, {"period": 4, "fragments": 2, "overlap": 1, "overlap_mix": 0.25},
                    timeout=120)[0]
    assert r0["bounds"] == [(0, 1), (1, 4)]
    assert r0["too_many"] == ("diloco.fragments must be an integer in [1, min(period, trainable parameter tensors) "
                              "= 4], got 5")
    # fragment 0 syncs after steps 2 and 6, fragment 1 after 4 and 8: a fragment's parameters agree
    # right after its own sync (and stay different from the step after, until the next one)
    expected = [[s % 4 == 2, s % 4 == 0] for s in range(1, steps + 1)]
    assert r0["same"] == expected, r0["same"]
    assert r1["same"] == r0["same"]
    assert [w > 0 for w in r0["wire"]] == [s % 2 == 0 for s in range(1, steps + 1)]
    # the fragments partition the parameters: one period of fragment syncs sends one full sync's bytes
    assert sum(r0["wire"][:4]) == sum(full["wire"][:4]) == full["wire"][3] > 0
    assert r0["stats"]["syncs"] == 4 and full["stats"]["syncs"] == 2
    # fp16 outer gradients: half the counted bytes (no buffers in this model)
    assert half["wire"] == [w / 2 for w in r0["wire"]]
    # overlap 1: issued (and counted) at the same steps, applied one step later: the ranks agree then
    assert late["wire"] == r0["wire"]
    assert late["same"] == [[s % 4 == 3, s % 4 == 1 and s > 1] for s in range(1, steps + 1)], late["same"]
    # overlap_mix 0.25: each fragment's parameters become 0.25 local + 0.75 synced copy (ranks differ after)
    assert mix["mixed"] == [True] * 3 and late["mixed"] == [True] * 3 and r0["mixed"] == [True] * 4
    assert not any(any(row) for row in mix["same"])


@pytest.mark.parametrize("name, options, match", [
    ("local-sgd", {"period": 0}, r"local-sgd\.period must be an integer in \[1, 1000000\], got 0"),
    ("diloco", {"period": 2.5}, r"diloco\.period must be an integer in \[1, 1000000\]"),
    ("diloco", {"outer_lr": 0.0}, r"diloco\.outer_lr must be in \(0\.0, 10\.0\], got 0\.0"),
    ("diloco", {"outer_momentum": 1.0}, r"diloco\.outer_momentum must be in \[0\.0, 1\.0\), got 1\.0"),
    ("diloco", {"fragments": 0}, r"diloco\.fragments must be an integer in \[1, 1000000\], got 0"),
    ("diloco", {"period": 4, "fragments": 5}, r"diloco\.fragments must be an integer in \[1, period=4\], got 5"),
    ("diloco", {"outer_dtype": "fp8"}, r"diloco\.outer_dtype must be one of fp32, fp16, bf16; got 'fp8'"),
    ("diloco", {"period": 4, "fragments": 2, "overlap": 2},
     r"diloco\.overlap must be an integer in \[0, period // fragments - 1 = 1\], got 2"),
    ("diloco", {"overlap_mix": 1.5}, r"diloco\.overlap_mix must be in \[0\.0, 1\.0\], got 1\.5"),
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
def _train(rank, world, root, resume, options):
    """``gradsync train``'s rank function (:func:`gradsync.train.loop.run`): diloco with ``options`` (H =
    4), 9 steps, checkpoints every 3 steps; or the run resumed from its step-6 checkpoint (between the
    syncs at steps 4 and 8: every rank's own model, the synced copy and the outer momentum must come
    back; with 2 fragments, right after fragment 0's sync and before fragment 1's)."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import run

    cfg = TrainConfig(algorithm="diloco", options=options, train_samples=640, batch_size=16, max_steps=9,
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
@pytest.mark.parametrize("options, every", [({"period": 4}, 4),
                                            # Streaming DiLoCo with bf16 outer gradients, each fragment's
                                            # all-reduce applied a step late: a sync issued every 2 steps, one
                                            # in flight at the step-6 checkpoint
                                            ({"period": 4, "fragments": 2, "outer_dtype": "bf16", "overlap": 1},
                                             2)])
def test_gradsync_train_diloco_resumed_mid_period_repeats_steps_7_to_9(tmp_path, options, every):
    full = run_ranks(_train, 2, str(tmp_path), False, options, timeout=120, pg_timeout=60)[0]
    part = run_ranks(_train, 2, str(tmp_path), True, options, timeout=120, pg_timeout=60)[0]
    assert sorted(part["losses"]) == list(range(1, 10))
    assert [part["losses"][s] for s in (7, 8, 9)] == [full["losses"][s] for s in (7, 8, 9)]
    assert part["test_loss"] == full["test_loss"]  # rank 0's model after step 9 (one sync after the resume)
    assert [full["wire"][s] > 0 for s in range(1, 10)] == [s % every == 0 for s in range(1, 10)]
    assert part["wire"][8] == full["wire"][8] > 0
