"""DeAR in real training jobs: clipping, GradScaler, frozen / eval-mode parts, no_sync, bf16, misuse,
dear-covap resume. Every test compares against DDP + the same optimizer on real Gloo ranks."""

from __future__ import annotations

import io
import math

import pytest
import torch
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.algorithms.dear import DeAR
from gradsync.algorithms.dear import CovapGradFilter

ONE_MODULE_MB = 1e-6  # every module in its own fusion group
SHARED_MB = 550 / 2**20  # groups [fc1] [bn, fc2, unused] [extra, head]: eval-mode BN shares a group


class Net(nn.Module):
    """frozen (requires_grad=False) -> fc1 -> bn (eval mode, trainable affine) -> fc2 -> [extra on
    rank 0 only] -> head; ``unused`` never runs. With ``full=False``: no ``unused``, no ``extra``, and
    (in :func:`_pair`) everything trainable and in training mode."""

    def __init__(self, full: bool = True):
        super().__init__()
        self.frozen = nn.Linear(11, 12)
        self.fc1 = nn.Linear(12, 13)
        self.bn = nn.BatchNorm1d(13)
        self.fc2 = nn.Linear(13, 7)
        self.unused = nn.Linear(3, 3) if full else None
        self.extra = nn.Linear(7, 7) if full else None
        self.head = nn.Linear(7, 3)
        self.use_extra = False

    def forward(self, x):
        x = torch.tanh(self.fc1(self.frozen(x)))
        x = torch.relu(self.fc2(self.bn(x)))
        if self.use_extra:
            x = self.extra(x)
        return self.head(x)


def _pair(rank, dtype=torch.float32, frozen_parts=False, seed=0):
    """Two identical models (rank 0's state; other ranks start perturbed so the broadcast matters)."""
    torch.manual_seed(seed)
    base = Net(full=frozen_parts).to(dtype)
    with torch.no_grad():
        base.bn.running_mean.uniform_(-0.5, 0.5)
        base.bn.running_var.uniform_(0.5, 1.5)
        if rank != 0:
            for p in base.parameters():
                p.add_(1.0)
    models = []
    for _ in range(2):
        m = Net(full=frozen_parts).to(dtype)
        m.load_state_dict(base.state_dict())
        if frozen_parts:
            m.frozen.requires_grad_(False)
            m.bn.eval()  # frozen statistics, trainable affine parameters
            m.use_extra = rank == 0
        models.append(m)
    return models


def _batches(rank, steps, n=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    return [(torch.randn(n, 11, generator=g).to(dtype), torch.randint(0, 3, (n,), generator=g))
            for _ in range(steps)]


def _max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _scale(m):
    return max(p.detach().double().abs().max().item() for p in m.parameters())


def _spread(model, world_size):
    """Max difference of the parameters across ranks (0.0 = identical)."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return max((g - flat).abs().max().item() for g in gathered)


# ------------------------------------------------------------------ clipping
def _clip_run(rank, world_size, steps):
    out = {}
    data = _batches(rank, steps)
    for norm_type in (2.0, math.inf):
        ref, mod = _pair(rank)
        ddp = DDP(ref)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
        dear = DeAR(mod, torch.optim.SGD(mod.parameters(), lr=0.5, momentum=0.9), fusion_mb=ONE_MODULE_MB)
        norms_ref, norms = [], []
        for x, y in data:
            opt_ref.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type).item())
            opt_ref.step()
            dear.zero_grad()
            nn.functional.cross_entropy(dear(x), y).backward()
            norms.append(dear.clip_grad_norm_(0.05, norm_type).item())
            dear.step()
        dear.flush()
        out[str(norm_type)] = {"diff": _max_diff(ref, mod), "scale": _scale(ref), "norms_ref": norms_ref,
                               "norms": norms, "spread": _spread(mod, world_size)}
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_matches_ddp(world_size):
    res = run_ranks(_clip_run, world_size, 5, timeout=180, pg_timeout=60)
    for r in res:
        for nt, v in r.items():
            assert min(v["norms_ref"]) > 0.05, "clipping must be active at every step"
            # same global norm as torch on DDP's averaged gradients (float32, summation order differs)
            for a, b in zip(v["norms_ref"], v["norms"]):
                assert b == pytest.approx(a, rel=1e-5), nt
            assert v["diff"] <= 2e-5 * max(1.0, v["scale"]), (nt, v["diff"])
            assert v["spread"] == 0.0


# ------------------------------------------------------------------ GradScaler
def _scaler_run(rank, world_size, steps, inf_step, mode):
    ref, mod = _pair(rank)
    ddp = DDP(ref)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = torch.optim.Adam(mod.parameters(), lr=0.01)
    kw = {"init_scale": 2.0**10, "growth_interval": 2}
    s_ref, s = torch.amp.GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    dear = DeAR(mod, opt, fusion_mb=ONE_MODULE_MB, grad_scaler=s if mode == "ctor+clip" else None)
    clip = mode == "ctor+clip"
    scales_ref, scales, norms_ref, norms = [], [], [], []
    for t, (x, y) in enumerate(_batches(rank, steps)):
        bad = t == inf_step and rank == world_size - 1  # inf on one rank only
        opt_ref.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ddp(x), y)
        if bad:
            loss = loss * math.inf
        s_ref.scale(loss).backward()
        if clip:
            s_ref.unscale_(opt_ref)
            norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        s_ref.step(opt_ref)
        s_ref.update()
        scales_ref.append(s_ref.get_scale())

        dear.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(dear(x), y)
        if bad:
            loss = loss * math.inf
        s.scale(loss).backward()
        if clip:
            norms.append(dear.clip_grad_norm_(0.05).item())
        dear.step(s)
        scales.append(s.get_scale())
    dear.flush()
    return {"diff": _max_diff(ref, mod), "scale": _scale(ref), "scales_ref": scales_ref, "scales": scales,
            "norms_ref": norms_ref, "norms": norms, "skipped": dear.stats()["steps_skipped"],
            "spread": _spread(mod, world_size), "finite": all(bool(torch.isfinite(p).all()) for p in mod.parameters())}


@pytest.mark.parametrize("world_size,mode", [(2, "step"), (3, "step"), (3, "ctor+clip")])
def test_grad_scaler_matches_ddp_with_inf_on_one_rank(world_size, mode):
    res = run_ranks(_scaler_run, world_size, 6, 3, mode, timeout=180, pg_timeout=60)
    for r in res:
        # growth every 2 good steps, backoff at the inf step, identical to scaler.step + update on DDP
        assert r["scales"] == r["scales_ref"], r
        assert r["scales_ref"] == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0]
        assert r["skipped"] == 1 and r["finite"] and r["spread"] == 0.0
        assert r["diff"] <= 2e-5 * max(1.0, r["scale"]), r["diff"]
        for a, b in zip(r["norms_ref"], r["norms"]):
            assert (math.isfinite(a) == math.isfinite(b)) and (not math.isfinite(a) or b == pytest.approx(a, rel=1e-5))


# ------------------------------------------------------------------ frozen, eval-mode, unused, no_sync
def _frozen_run(rank, world_size, fusion_mb, steps):
    ref, mod = _pair(rank, frozen_parts=True)
    ddp = DDP(ref, find_unused_parameters=True)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    dear = DeAR(mod, opt, fusion_mb=fusion_mb, max_allgathers=2)
    frozen_before = [p.detach().clone() for p in mod.frozen.parameters()]
    data = _batches(rank, 2 * steps)
    for t in range(steps):
        micro = data[2 * t: 2 * t + 2] if t % 2 == 0 else data[2 * t: 2 * t + 1]  # accumulate every 2nd step
        opt_ref.zero_grad()
        with ddp.no_sync():
            for x, y in micro[:-1]:
                nn.functional.cross_entropy(ddp(x), y).backward()
        nn.functional.cross_entropy(ddp(micro[-1][0]), micro[-1][1]).backward()
        opt_ref.step()
        dear.zero_grad()
        with dear.no_sync():
            for x, y in micro[:-1]:
                nn.functional.cross_entropy(dear(x), y).backward()
        nn.functional.cross_entropy(dear(micro[-1][0]), micro[-1][1]).backward()
        dear.step()
    dear.flush()
    return {
        "diff": _max_diff(ref, mod), "scale": _scale(ref), "groups": dear.num_groups,
        "frozen_moved": max((a - b).abs().max().item() for a, b in zip(frozen_before, mod.frozen.parameters())),
        "unused_grad": mod.unused.weight.grad is None,
        "bn_moved": (mod.bn.weight.detach() - torch.ones(13)).abs().max().item(),
        "spread": _spread(mod, world_size),
    }


@pytest.mark.parametrize("fusion_mb,groups", [(ONE_MODULE_MB, 6), (SHARED_MB, 3)])
def test_frozen_eval_unused_and_no_sync_match_ddp(fusion_mb, groups):
    res = run_ranks(_frozen_run, 3, fusion_mb, 5, timeout=180, pg_timeout=60)
    for r in res:
        assert r["groups"] == groups
        assert r["diff"] <= 2e-5 * max(1.0, r["scale"]), r
        assert r["frozen_moved"] == 0.0 and r["unused_grad"] and r["spread"] == 0.0
        assert r["bn_moved"] > 0.0, "the eval-mode BatchNorm's affine parameters are trained"


# ------------------------------------------------------------------ bf16 parameters
def _bf16_run(rank, world_size, steps):
    ref, mod = _pair(rank, dtype=torch.bfloat16)
    ddp = DDP(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dear = DeAR(mod, torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9), fusion_mb=ONE_MODULE_MB)
    norms_ref, norms = [], []
    for x, y in _batches(rank, steps, dtype=torch.bfloat16):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ddp(x).float(), y).backward()
        norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        opt_ref.step()
        dear.zero_grad()
        nn.functional.cross_entropy(dear(x).float(), y).backward()
        norms.append(dear.clip_grad_norm_(0.5).item())
        dear.step()
    dear.flush()
    st = dear.stats()
    numel = sum(p.numel() for p in mod.parameters() if p.requires_grad)
    return {"diff": _max_diff(ref, mod), "scale": _scale(ref), "norms_ref": norms_ref, "norms": norms,
            "dtypes": {str(p.dtype) for p in mod.parameters()}, "dense_bytes": st["dense_payload_bytes"],
            "numel": numel, "spread": _spread(mod, world_size)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_parameters_match_ddp(world_size):
    steps = 4
    res = run_ranks(_bf16_run, world_size, steps, timeout=180, pg_timeout=60)
    for r in res:
        assert r["dtypes"] == {"torch.bfloat16"} and r["spread"] == 0.0
        assert r["dense_bytes"] == 2 * r["numel"] * steps  # communicated in bf16, 2 bytes per element
        # bf16 has an 8-bit mantissa: allow 2 ulps of the largest parameter (2 ** -7 relative)
        tol = 2 * 2.0**-7 * max(1.0, r["scale"])
        assert r["diff"] <= tol, (r["diff"], tol)
        for a, b in zip(r["norms_ref"], r["norms"]):  # torch's norm is rounded to bf16, ours is float32
            assert b == pytest.approx(a, rel=2.0**-7)


# ------------------------------------------------------------------ misuse raises
def _misuse_run(rank, world_size):
    _, mod = _pair(rank)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    dear = DeAR(mod, opt, fusion_mb=ONE_MODULE_MB)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step after DeAR
    scaler = torch.amp.GradScaler("cpu")
    errors = {}
    x, y = _batches(rank, 1)[0]

    def expect(name, fn):
        try:
            fn()
        except RuntimeError as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    nn.functional.cross_entropy(dear(x), y).backward()
    expect("clip", lambda: torch.nn.utils.clip_grad_norm_(mod.parameters(), 1.0))
    expect("clip_value", lambda: torch.nn.utils.clip_grad_value_(mod.parameters(), 1.0))
    expect("opt_step", lambda: opt.step())
    expect("scaler_step", lambda: (scaler.scale(torch.ones(())), scaler.step(opt)))
    expect("second_backward", lambda: nn.functional.cross_entropy(dear(x), y).backward())
    meta_ok = mod.fc1.weight.grad is not None and mod.fc1.weight.grad.shape == mod.fc1.weight.shape
    opt.zero_grad(set_to_none=False)  # zeroing placeholders is allowed (the gradients are DeAR's)
    dear.step()  # the first backward's gradients, unaffected by the failed calls above
    sched.step()
    nn.functional.cross_entropy(dear(x), y).backward()  # applies the update in the forward
    dear.step()
    dear.remove_hooks()
    before = mod.head.weight.detach().clone()
    opt.step()  # plain optimizer again (gradients are None after DeAR, so nothing moves)
    mod.zero_grad()
    nn.functional.cross_entropy(mod(x), y).backward()
    opt.step()
    moved = (mod.head.weight - before).abs().max().item()
    return {"errors": errors, "meta_ok": meta_ok, "moved": moved, "lr": opt.param_groups[0]["lr"]}


def test_plain_torch_calls_on_dear_model_raise():
    res = run_ranks(_misuse_run, 2, timeout=120, pg_timeout=60)
    for r in res:
        e = r["errors"]
        assert all(v is not None for v in e.values()), e
        assert "DeAR.clip_grad_norm_" in e["clip"] and "DeAR.clip_grad_norm_" in e["clip_value"]
        assert "DeAR.step" in e["opt_step"] and "DeAR.step(scaler)" in e["scaler_step"]
        assert "no_sync" in e["second_backward"]
        assert r["meta_ok"] and r["moved"] > 0 and r["lr"] == pytest.approx(0.05)


def _bad_args(rank, world_size):
    _, mod = _pair(rank)
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    msgs = []
    with pytest.raises(ValueError) as e:
        DeAR(mod, opt, grad_scaler="scaler")
    msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:
        DeAR(mod, opt, reduce_scatter="tree")
    msgs.append(str(e.value))
    dear = DeAR(mod, opt, fusion_mb=ONE_MODULE_MB)
    x, y = _batches(rank, 1)[0]
    nn.functional.cross_entropy(dear(x), y).backward()
    for kw in ({"max_norm": -1.0}, {"max_norm": math.nan}, {"max_norm": 1.0, "norm_type": 0.0},
               {"max_norm": 1.0, "norm_type": -2.0}):
        with pytest.raises(ValueError) as e:
            dear.clip_grad_norm_(**kw)
        msgs.append(str(e.value))
    with pytest.raises(ValueError) as e:
        dear.step(scaler=3)
    msgs.append(str(e.value))
    dear.step()
    return msgs


def test_bad_arguments_name_the_argument():
    msgs = run_ranks(_bad_args, 2, timeout=120, pg_timeout=60)[0]
    assert "grad_scaler" in msgs[0] and "reduce_scatter" in msgs[1]
    assert "max_norm" in msgs[2] and "max_norm" in msgs[3]
    assert "norm_type" in msgs[4] and "norm_type" in msgs[5] and "scaler" in msgs[6]


# ------------------------------------------------------------------ dear-covap resume
def _covap_resume_run(rank, world_size, steps, cut, keep_filter_state):
    data = _batches(rank, steps)

    def build():
        _, m = _pair(0)
        o = torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
        f = CovapGradFilter(3)
        d = DeAR(m, o, fusion_mb=ONE_MODULE_MB, grad_filter=f)
        f.bind(d)
        return m, d

    def train(d, batches):
        for x, y in batches:
            d.zero_grad()
            nn.functional.cross_entropy(d(x), y).backward()
            d.step()

    m1, d1 = build()
    train(d1, data)
    d1.flush()
    _, d2 = build()
    train(d2, data[:cut])
    buf = io.BytesIO()
    torch.save(d2.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    if not keep_filter_state:
        state["dear"]["grad_filter"] = None
    m3, d3 = build()
    d3.load_state_dict(state)
    train(d3, data[cut:])
    d3.flush()
    return {"equal": all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters())),
            "diff": _max_diff(m1, m3)}


def test_dear_covap_resume_continues_exactly():
    res = run_ranks(_covap_resume_run, 2, 7, 4, True, timeout=180, pg_timeout=60)
    assert all(r["equal"] for r in res), res
    # without the filter's residuals the resumed run diverges: the saved state is what makes it exact
    res = run_ranks(_covap_resume_run, 2, 7, 4, False, timeout=180, pg_timeout=60)
    assert all(r["diff"] > 1e-6 for r in res), res


# ------------------------------------------------------------------ checkpoints hold the model once
def _dear_checkpoint_sizes(rank, world_size, root):
    import os

    import torch.nn.functional as F
    from every_algorithm import batches, build_small

    from gradsync.train import checkpoint as C
    from gradsync.train.config import TrainConfig

    out = {}
    data = batches(rank, 6)
    for name in ("dear", "dear-covap"):
        cfg = TrainConfig(algorithm=name, resume=f"{root}/{name}")
        torch.manual_seed(1)
        dp = build_small(name)
        sched = torch.optim.lr_scheduler.StepLR(dp.optimizer, 10)
        for x, y in data[:3]:
            dp.train_step(x, y, F.cross_entropy)
        C.save_training_checkpoint(cfg.resume, cfg, dp, sched, epoch=0, epoch_step=3, step=3, train_seconds=0.0,
                                   iterations=[], epochs=[])
        saved = C.load_checkpoint(cfg.resume, rank, world_size)
        buf = io.BytesIO()
        torch.save(dp.wrapper.state_dict(), buf)  # what the algorithm entry held before: model and optimizer again
        buf.seek(0)
        old_format = torch.load(buf, weights_only=True)
        full = [dp.train_step(x, y, F.cross_entropy).item() for x, y in data[3:]]
        dp.close()
        resumed = {}
        for fmt, algo in (("new", saved["algorithm"]), ("old", old_format)):
            torch.manual_seed(99)
            dp = build_small(name)
            sched = torch.optim.lr_scheduler.StepLR(dp.optimizer, 10)
            C.restore_training(cfg, dp, sched) if fmt == "new" else dp.load_state_dict(algo)
            resumed[fmt] = [dp.train_step(x, y, F.cross_entropy).item() for x, y in data[3:]]
            dp.close()
        out[name] = {"keys": sorted(saved["algorithm"]), "full": full, "resumed": resumed,
                     "bytes": os.path.getsize(C.checkpoint_file(cfg.resume, rank)),
                     "model_bytes": sum(t.numel() * t.element_size() for t in saved["model"].values())}
    return out


def test_dear_checkpoints_hold_the_model_and_optimizer_once_and_old_ones_still_load(tmp_path):
    """Before, the algorithm entry of a DeAR checkpoint was DeAR's whole state_dict: the model and
    the optimizer a second time beside the checkpoint's own copies (about twice the bytes)."""
    res = run_ranks(_dear_checkpoint_sizes, 2, str(tmp_path), timeout=120, pg_timeout=60)
    for r in res:
        for name, v in r.items():
            assert v["keys"] == ["dear"], (name, v["keys"])
            # model + momentum (+ dear-covap's residuals) once: less than one more model's bytes on top,
            # where the second copy of model and momentum added two
            copies = 2 if name == "dear" else 3
            assert v["bytes"] < (copies + 1) * v["model_bytes"], (name, v["bytes"], v["model_bytes"])
            assert v["resumed"] == {"new": v["full"], "old": v["full"]}, name
