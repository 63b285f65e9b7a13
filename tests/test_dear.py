"""DeAR wrapper and fusion tuner: equality with DDP + the same optimizer on real Gloo ranks."""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms.dear import DeAR
from gradsync.tuning import FusionTuner

TINY_MB = 200 / 2**20  # ~200 bytes: several fusion groups on the small models below


class MLP(nn.Module):
    def __init__(self, bn: bool = False, unused: bool = False, extra: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(11, 13)
        self.bn = nn.BatchNorm1d(13) if bn else None
        self.fc2 = nn.Linear(13, 7)
        self.unused = nn.Linear(3, 3) if unused else None  # never called: globally unused
        self.extra = nn.Linear(7, 7) if extra else None  # called on rank 0 only
        self.use_extra = False
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        x = self.fc1(x)
        if self.bn is not None:
            x = self.bn(x)
        x = self.fc2(torch.relu(x))
        if self.extra is not None and self.use_extra:
            x = self.extra(x)
        return self.head(torch.relu(x))


def _make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01, weight_decay=1e-4)
    if name == "adamw-groups":  # two param groups with different settings
        ps = list(params)
        return torch.optim.AdamW([{"params": ps[:2], "lr": 0.02}, {"params": ps[2:]}], lr=0.005)
    raise AssertionError(name)


def _batches(rank, steps, n=8):
    g = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    return [(torch.randn(n, 11, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def _compare(rank, world_size, opt_name, fusion_mb, steps, kw):
    """Train a DDP copy and a DeAR copy side by side; return max parameter / output differences."""
    kw = dict(kw)
    model_kw = kw.pop("model_kw", {})
    sched = kw.pop("scheduler", False)
    regroup_at = kw.pop("regroup_at", None)
    torch.manual_seed(0)
    base = MLP(**model_kw)
    if rank != 0:  # both wrappers must broadcast rank 0's initial state
        with torch.no_grad():
            for p in base.parameters():
                p.add_(1.0)
    ref = MLP(**model_kw)
    ref.load_state_dict(base.state_dict())
    mod = MLP(**model_kw)
    mod.load_state_dict(base.state_dict())
    for m in (ref, mod):
        m.use_extra = rank == 0
    ddp = DDP(ref, find_unused_parameters=bool(model_kw))
    opt_ref = _make_opt(opt_name, ref.parameters())
    opt = _make_opt(opt_name, mod.parameters())
    dear = DeAR(mod, opt, fusion_mb=fusion_mb, **kw)
    scheds = []
    if sched:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_ref, opt)]
    loss_fn = nn.CrossEntropyLoss()
    groups_seen = {dear.num_groups}
    dear_seconds = 0.0  # wall time of DeAR's part of the steps
    for t, (x, y) in enumerate(_batches(rank, steps)):
        opt_ref.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt_ref.step()
        t0 = time.perf_counter()
        dear.zero_grad()
        loss_fn(dear(x), y).backward()
        dear.step()
        dear_seconds += time.perf_counter() - t0
        for s in scheds:
            s.step()
        if regroup_at is not None and t in regroup_at:
            dear.set_fusion_mb(regroup_at[t])
        groups_seen.add(dear.num_groups)
    t0 = time.perf_counter()
    dear.flush()
    dear_seconds += time.perf_counter() - t0
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), mod.parameters()))
    scale = max(a.abs().max().item() for a in ref.parameters())
    bufdiff = max(((a.float() - b.float()).abs().max().item() for a, b in zip(ref.buffers(), mod.buffers())),
                  default=0.0)
    # evaluation after flush(): same outputs and accuracy as DDP
    xt, yt = _batches(99, 1, n=64)[0]
    ref.eval()
    mod.eval()
    with torch.no_grad():
        out_ref, out = ref(xt), mod(xt)
    acc_ref = (out_ref.argmax(1) == yt).float().mean().item()
    acc = (out.argmax(1) == yt).float().mean().item()
    # parameters identical across ranks
    flat = torch.cat([p.detach().reshape(-1) for p in mod.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    spread = max((g - flat).abs().max().item() for g in gathered)
    return {
        "diff": diff, "scale": scale, "bufdiff": bufdiff, "outdiff": (out - out_ref).abs().max().item(),
        "acc": acc, "acc_ref": acc_ref, "spread": spread, "stats": dear.stats(),
        "groups_seen": sorted(groups_seen), "lr": opt.param_groups[0]["lr"],
        "lr_ref": opt_ref.param_groups[0]["lr"], "dear_seconds": dear_seconds,
    }


def _check(results, tol=2e-5):
    for r in results:
        assert r["diff"] <= tol * max(1.0, r["scale"]), r
        assert r["outdiff"] <= 1e-4, r
        assert r["bufdiff"] <= 1e-4, r
        assert r["acc"] == r["acc_ref"]
        assert r["spread"] == 0.0
        assert r["lr"] == r["lr_ref"]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_matches_ddp(world_size, opt_name):
    # SGD runs with a StepLR scheduler on the user's optimizer (halving the LR every step)
    kw = {"scheduler": opt_name == "sgd"}
    res = run_ranks(_compare, world_size, opt_name, TINY_MB, 5, kw, timeout=90, pg_timeout=20)
    _check(res)
    st = res[0]["stats"]
    assert st["iteration"] == 5 and st["num_groups"] == 3  # fc1 | fc2 | head: one module per group
    assert st["collectives"] == 2 * 5 * st["num_groups"]  # one reduce-scatter + one all-gather each
    assert st["payload_bytes"] > st["dense_payload_bytes"] > 0
    # reduce-scatter + all-gather of the padded buffer: a ring all-reduce's traffic, plus flags/padding
    assert st["wire_bytes"] > st["dense_wire_bytes"] > 0
    assert st["compression_ratio"] > 0.8
    # blocked time is part of DeAR's own wall time (a late rank's is checked in test_wait_seconds_...)
    assert 0 < st["rs_wait_seconds"] + st["ag_wait_seconds"] < res[0]["dear_seconds"]
    assert st["buffer_broadcast_seconds"] == 0.0  # no buffers
    if opt_name == "sgd":
        assert res[0]["lr"] == pytest.approx(0.05 * 0.5**5)


def test_one_group_param_groups_and_lr_scheduler():
    res = run_ranks(_compare, 3, "adamw-groups", 25.0, 4, {"scheduler": True}, timeout=90, pg_timeout=20)
    _check(res)
    assert res[0]["stats"]["num_groups"] == 1
    assert res[0]["lr"] == pytest.approx(0.02 * 0.5**4)


def test_unused_parameters():
    # ``unused`` never runs on any rank (DDP leaves its grad None); ``extra`` runs on rank 0 only;
    # all all-gathers launched at step() (max_allgathers)
    kw = {"model_kw": {"unused": True, "extra": True}, "max_allgathers": 100}
    res = run_ranks(_compare, 3, "sgd", TINY_MB, 4, kw, timeout=90, pg_timeout=20)
    _check(res)


@pytest.mark.parametrize("max_allgathers", ["auto", 1])  # Gloo's auto: every all-gather at step()
def test_batchnorm_buffers(max_allgathers):
    kw = {"model_kw": {"bn": True}, "max_allgathers": max_allgathers}
    res = run_ranks(_compare, 2, "sgd", TINY_MB, 4, kw, timeout=90, pg_timeout=20)
    _check(res)
    assert 0 < res[0]["stats"]["buffer_broadcast_seconds"] < res[0]["dear_seconds"]


def _buffers_at_forward(rank, world_size):
    """DeAR on a BatchNorm model; between step() and the next training forward, every rank runs a
    no-grad training-mode forward that changes its buffers (differently on each rank) before steps 2
    and 4, followed by ``sync_buffers()`` before step 4, and every rank loads the same state dict
    before step 3. Return, per training forward, rank 0's buffers just before it, rank 0's buffers
    at the previous step() and the buffers the forward starts from."""
    torch.manual_seed(0)
    mod = MLP(bn=True)
    dear = DeAR(mod, torch.optim.SGD(mod.parameters(), lr=0.05), fusion_mb=TINY_MB)
    seen = []
    mod.bn.register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()))
    out = []
    at_step = mod.bn.running_mean.clone()
    dist.broadcast(at_step, src=0)
    for t, (x, y) in enumerate(_batches(rank, 5)):
        if t in (2, 4):
            with torch.no_grad():
                mod(x * (rank + 2.0))  # training mode: updates the running statistics locally
        if t == 4:
            dear.sync_buffers()
        if t == 3:  # every rank loads a checkpoint whose statistics differ from step()'s broadcast
            state = {k: v + 1.0 if k.endswith("running_mean") else v for k, v in mod.state_dict().items()}
            dist.broadcast(state["bn.running_mean"], src=0)
            mod.load_state_dict(state)
        rank0 = mod.bn.running_mean.clone()
        dist.broadcast(rank0, src=0)
        seen.clear()
        dear.zero_grad()
        nn.CrossEntropyLoss()(dear(x), y).backward()
        out.append((rank0.tolist(), at_step.tolist(), seen[-1].tolist()))
        dear.step()
        at_step = mod.bn.running_mean.clone()
        dist.broadcast(at_step, src=0)
    dear.flush()
    return out


def test_buffers_broadcast_in_step_are_rank_0s_at_the_next_forward():
    # step() broadcasts rank 0's buffers for the next training forward. A no-grad forward in between
    # (t == 2) is overridden by them (no forward broadcasts: the collectives cannot depend on which
    # forwards a rank ran), unless sync_buffers() was called (t == 4); a state dict loaded on every
    # rank (t == 3) is kept
    for res in run_ranks(_buffers_at_forward, 2, timeout=90, pg_timeout=20):
        for t, (rank0, at_step, start) in enumerate(res):
            assert start == (at_step if t == 2 else rank0), t
        assert res[2][0] != res[2][1]  # the no-grad forward changed rank 0's statistics


def test_regroup_mid_run():
    res = run_ranks(_compare, 2, "adam", TINY_MB, 6, {"regroup_at": {1: 25.0, 3: 1e-6}},
                    timeout=90, pg_timeout=20)
    _check(res)
    assert res[0]["groups_seen"] == [1, 3]


def test_auto_fusion_tuning_keeps_results():
    kw = {"tune_trials": 3, "tune_window": 2, "tune_warmup": 1}
    res = run_ranks(_compare, 2, "sgd", "auto", 9, kw, timeout=90, pg_timeout=20)
    _check(res)
    tuning = [r["stats"]["tuning"] for r in res]
    assert tuning[0] == tuning[1]  # same history and decision on every rank
    assert tuning[0]["done"] and len(tuning[0]["trials"]) == 3
    assert tuning[0]["trials"][0]["fusion_mb"] == 25.0
    best = min(tuning[0]["trials"], key=lambda r: r["seconds"])["fusion_mb"]
    assert tuning[0]["best_mb"] == best == res[0]["stats"]["fusion_mb"]
    assert all(1.0 <= t["fusion_mb"] <= 256.0 for t in tuning[0]["trials"])


def _filter_run(rank, world_size, mode):
    torch.manual_seed(0)
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def filt(flat, step, group):
        calls.append((step, group, flat.numel()))
        if mode == "skip":
            return False
        if group == 0:
            return flat * 0.0  # a replacement tensor
        flat.zero_()  # or in place
        return None

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # a process group other than the default one (same ranks): DeAR derives its two groups from it
    pg = dist.new_group(list(range(world_size))) if mode == "scale" else None
    dear = DeAR(model, opt, process_group=pg, fusion_mb=TINY_MB, grad_filter=filt)
    for x, y in _batches(rank, 3):
        dear.zero_grad()
        nn.functional.cross_entropy(dear(x), y).backward()
        dear.step()
    dear.flush()
    moved = max((a - b).abs().max().item() for a, b in zip(before, model.parameters()))
    return {"calls": calls, "moved": moved, "stats": dear.stats()}


@pytest.mark.parametrize("mode", ["skip", "scale"])
def test_grad_filter_hook(mode):
    res = run_ranks(_filter_run, 2, mode, timeout=60, pg_timeout=20)
    r = res[0]
    assert res[0]["calls"] == res[1]["calls"]
    # called for every group and step, in descending group order, with the group's flat gradient
    assert [(s, g) for s, g, _ in r["calls"]] == [(s, g) for s in range(3) for g in (2, 1, 0)]
    assert r["calls"][0][2] == 7 * 3 + 3  # head: weight 3x7 + bias 3
    assert r["moved"] == 0.0  # zero (or no) gradient with plain SGD: parameters unchanged
    if mode == "skip":
        assert r["stats"]["collectives"] == 0 and r["stats"]["buckets_skipped"] == 9
    else:
        assert r["stats"]["collectives"] == 18


def _resume_run(rank, world_size):
    """Uninterrupted vs. saved after 3 steps and resumed on a BatchNorm model: each rank's state dict
    holds its own running statistics (updated by its last forward), as a per-rank checkpoint does."""
    loss_fn = nn.CrossEntropyLoss()
    data = _batches(rank, 6)

    def build():
        torch.manual_seed(0)
        m = MLP(bn=True)
        m.starts = []  # running mean at the start of each training forward
        m.bn.register_forward_pre_hook(lambda mod, a: m.starts.append(mod.running_mean.clone()))
        o = torch.optim.Adam(m.parameters(), lr=0.01)
        return m, o, DeAR(m, o, fusion_mb=TINY_MB)

    def train(dear, batches):
        for x, y in batches:
            dear.zero_grad()
            loss_fn(dear(x), y).backward()
            dear.step()

    m1, _, d1 = build()
    train(d1, data)
    d1.flush()
    m2, _, d2 = build()
    train(d2, data[:3])
    sd = d2.state_dict()
    m3, _, d3 = build()
    d3.load_state_dict(sd)
    train(d3, data[3:])
    d3.flush()
    return max((a.float() - b.float()).abs().max().item()
               for a, b in zip([*m1.parameters(), *m1.buffers(), *m1.starts[3:]],
                               [*m3.parameters(), *m3.buffers(), *m3.starts]))


def test_state_dict_resume():
    assert max(run_ranks(_resume_run, 2, timeout=60, pg_timeout=20)) <= 1e-6


def _bad_args(rank, world_size):
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    errors = []
    for kwargs in ({"fusion_mb": 0}, {"fusion_mb": -1.0}, {"fusion_mb": "fast"}, {"fusion_mb": float("nan")},
                   {"tune_trials": 0}, {"tune_window": 1}, {"grad_filter": 3}, {"max_allgathers": 0}):
        with pytest.raises(ValueError) as e:
            DeAR(model, opt, **kwargs)
        errors.append(str(e.value))
    with pytest.raises(ValueError):
        DeAR(model, torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError):
        DeAR(model, torch.optim.SGD(MLP().parameters(), lr=0.1))
    with pytest.raises(ValueError):
        DeAR("model", opt)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError):  # no trainable parameter
        DeAR(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))
    dear = DeAR(model, opt, fusion_mb=TINY_MB)
    with pytest.raises(ValueError):
        dear.set_fusion_mb(0)
    x, y = _batches(rank, 1)[0]
    nn.functional.cross_entropy(dear(x), y).backward()
    with pytest.raises(RuntimeError):  # second backward before step(): no gradient accumulation
        nn.functional.cross_entropy(dear(x), y).backward()
    return errors


def test_bad_arguments():
    errors = run_ranks(_bad_args, 2, timeout=60, pg_timeout=20)[0]
    assert "fusion_mb" in errors[0] and "tune_trials" in errors[4] and "tune_window" in errors[5]


def test_requires_initialised_process_group():
    m = MLP()
    with pytest.raises(RuntimeError):
        DeAR(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_tuner_finds_minimum_and_validates():
    tuner = FusionTuner(initial_mb=25.0, trials=8, window=3, warmup=2, seed=1)
    now, regroups = 0.0, 0
    for _ in range(100):
        now += 0.1 + 0.01 * abs(math.log2(tuner.current_mb) - 2.0)  # fastest at 4 MB
        if tuner.observe(now) is not None:
            regroups += 1
    rep = tuner.report()
    assert rep["done"] and len(rep["trials"]) == 8 and regroups >= 2
    assert rep["best_mb"] == min(rep["trials"], key=lambda r: r["seconds"])["fusion_mb"]
    assert rep["trials"][0]["seconds"] == pytest.approx(0.1 + 0.01 * abs(math.log2(25.0) - 2.0))
    restored = FusionTuner()
    restored.load_state_dict(tuner.state_dict())
    assert restored.report() == rep
    for kwargs in ({"initial_mb": 0.5}, {"low_mb": 0}, {"high_mb": 0.5}, {"trials": 0}, {"window": 1},
                   {"xi": -1}, {"warmup": -1}):
        with pytest.raises(ValueError):
            FusionTuner(**kwargs)


def _rank0_forward(rank, world_size, mode, max_allgathers):
    """DDP and DeAR side by side on a BatchNorm model; after every step() rank 0 alone runs an extra
    forward before the next training forward (a logging forward): ``"eval"`` (eval mode, no grad),
    ``"train"`` (training mode under no_grad: updates rank 0's running statistics) or
    ``"train-grad"`` (training mode with grad enabled, no backward: DeAR applies the pending update
    on rank 0 first). DDP's extra forward runs on ``ddp.module``. Returns the losses, the parameters
    and buffers after the last update, and rank 0's buffers at each of DeAR's ``step()``."""
    torch.manual_seed(0)
    base = MLP(bn=True)
    ref, mod = MLP(bn=True), MLP(bn=True)
    ref.load_state_dict(base.state_dict())
    mod.load_state_dict(base.state_dict())
    ddp = DDP(ref)
    opt_ref = _make_opt("sgd", ref.parameters())
    dear = DeAR(mod, _make_opt("sgd", mod.parameters()), fusion_mb=TINY_MB, max_allgathers=max_allgathers)
    seen = []
    mod.bn.register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()) if m.training else None)
    loss_fn = nn.CrossEntropyLoss()
    out = {"losses_ref": [], "losses": [], "at_step": [], "at_forward": []}
    for t, (x, y) in enumerate(_batches(rank, 5)):
        opt_ref.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt_ref.step()
        out["losses_ref"].append(loss.item())
        seen.clear()
        dear.zero_grad()
        loss = loss_fn(dear(x), y)
        loss.backward()
        out["at_forward"].append(seen[0].tolist())
        dear.step()
        rank0 = mod.bn.running_mean.clone()
        dist.broadcast(rank0, src=0)
        out["at_step"].append(rank0.tolist())
        out["losses"].append(loss.item())
        if rank == 0:
            for m in (ref, mod):
                if mode == "eval":
                    m.eval()
                with contextlib.nullcontext() if mode == "train-grad" else torch.no_grad():
                    m(x * 3.0).sum()
                m.train()
    dear.flush()
    out["params"] = [p.detach().clone() for p in mod.parameters()]
    out["params_ref"] = [p.detach().clone() for p in ref.parameters()]
    out["buffers"] = [b.clone() for b in mod.buffers()]
    out["buffers_ref"] = [b.clone() for b in ref.buffers()]
    return out


@pytest.mark.parametrize("world_size,mode,max_allgathers", [
    (2, "eval", "auto"), (3, "eval", 1), (2, "train", 1), (3, "train", "auto"), (3, "train-grad", "auto")])
def test_forward_on_rank_0_only_between_steps_does_not_hang(world_size, mode, max_allgathers):
    # the buffer broadcast is issued in step() only, so a forward that one rank runs between step()
    # and the next training forward changes no rank's collective sequence (it hung before: rank 0
    # broadcast at its next forward while the others started their reduce-scatters)
    res = run_ranks(_rank0_forward, world_size, mode, max_allgathers, timeout=150, pg_timeout=30)
    for r in res:
        # training-mode BatchNorm normalises with batch statistics: same losses as DDP
        assert r["losses"] == pytest.approx(r["losses_ref"], rel=1e-6, abs=1e-6)
        for a, b in zip(r["params"], r["params_ref"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
        # every training forward starts from rank 0's buffers as of step() (t >= 1), on every rank
        assert r["at_forward"][1:] == r["at_step"][:-1]
        if mode == "eval":  # the eval forward changes no buffer: the same buffers as DDP
            for a, b in zip(r["buffers"], r["buffers_ref"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


LATE = 0.4  # s


def _late_rank(rank, world_size):
    """Rank 1 is LATE seconds late for its backward at t == 1, its step() at t == 2 and its forward
    at t == 3; rank 0's blocked times must show it in the reduce-scatter wait, the buffer broadcast
    and the all-gather wait (max_allgathers=1: group 1's all-gather starts in the forward)."""
    torch.manual_seed(0)
    mod = MLP(bn=True)
    dear = DeAR(mod, torch.optim.SGD(mod.parameters(), lr=0.05), fusion_mb=TINY_MB, max_allgathers=1)
    t0 = time.perf_counter()
    for t, (x, y) in enumerate(_batches(rank, 5)):
        late = rank == 1 and t in (1, 2, 3)
        dear.zero_grad()
        if late and t == 3:
            time.sleep(LATE)
        loss = nn.CrossEntropyLoss()(dear(x), y)
        if late and t == 1:
            time.sleep(LATE)
        loss.backward()
        if late and t == 2:
            time.sleep(LATE)
        dear.step()
    dear.flush()
    return {"wall": time.perf_counter() - t0, "groups": dear.num_groups, **dear.stats()}


def test_wait_seconds_measure_a_late_rank():
    r = run_ranks(_late_rank, 2, timeout=90, pg_timeout=20)[0]
    assert r["groups"] >= 2
    keys = ("rs_wait_seconds", "buffer_broadcast_seconds", "ag_wait_seconds")
    for key in keys:
        assert 0.8 * LATE <= r[key] < r["wall"], (key, r)
    assert sum(r[k] for k in keys) < r["wall"]
