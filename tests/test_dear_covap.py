"""COVAP's filter inside DeAR (dear-covap) on real 2- and 3-rank Gloo groups."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms.dear import DeAR
from gradsync.algorithms.dear import CovapGradFilter


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # uneven layer sizes so the median rule shards the big groups
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 200), nn.Tanh(), nn.Linear(200, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def deltas(rank, world, ratio, steps, use_ddp=False, cast=None):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if use_ddp:
        net, step = DDP(model), opt.step
        stats = None
    else:
        filt = CovapGradFilter(ratio, cast=cast)
        dear = DeAR(model, opt, fusion_mb=1e-6, grad_filter=filt)  # one module per fusion group
        filt.bind(dear)
        net, step = dear, dear.step
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        if not use_ddp:
            dear.zero_grad()
        else:
            opt.zero_grad()
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        nn.functional.cross_entropy(net(x), y).backward()
        step()
        if not use_ddp:
            dear.flush()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before)
    if not use_ddp:
        stats = dear.stats()
        stats["shards"] = list(filt.plan.shards)
    return out, stats


def test_dear_covap_k1_matches_ddp():
    ref = run_ranks(deltas, 3, 1, 4, True)
    got = run_ranks(deltas, 3, 1, 4)
    for r in range(3):
        for a, b in zip(ref[r][0], got[r][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dear_covap_sends_each_element_once_every_k_steps_and_fewer_bytes():
    k = 3
    (d0, s0), (d1, _) = run_ranks(deltas, 2, k, 3 * k)
    _, dense_stats = run_ranks(deltas, 2, 1, 3 * k)[0]
    assert max(s0["shards"]) > 1, "a group is split into strided shards"
    for a, b in zip(d0, d1):
        assert torch.equal(a, b)
    for w in range(0, 2 * k + 1):
        sent = torch.stack([d0[s] != 0 for s in range(w, w + k)]).sum(0)
        assert torch.all(sent == 1), f"steps {w}..{w + k - 1}"
    assert s0["buckets_skipped"] > 0
    assert s0["wire_bytes"] < 0.5 * dense_stats["wire_bytes"]
    assert s0["payload_bytes"] < 0.5 * dense_stats["payload_bytes"]


def test_dear_covap_cast_fp16_sends_half_the_bytes_and_tracks_fp32():
    k = 3
    f32, s32 = run_ranks(deltas, 2, k, 3 * k)[0]
    f16, s16 = run_ranks(deltas, 2, k, 3 * k, False, "fp16")[0]
    assert s16["collectives"] == s32["collectives"]
    # values and used flags in 2 bytes instead of 4 (the padding to a multiple of P aside)
    assert 0.45 * s32["wire_bytes"] <= s16["wire_bytes"] <= 0.55 * s32["wire_bytes"]
    # fp16 rounding (relative 2**-11) of each sent value; the error stays in the residual
    for a, b in zip(f32, f16):
        assert not torch.any((b != 0) & (a == 0))  # same schedule (a tiny value may round to 0 in fp16)
        torch.testing.assert_close(b, a, rtol=5e-3, atol=1e-4)


def test_dear_covap_cast_option_sets_the_wire_dtype_and_rejects_bad_values():
    assert CovapGradFilter(2, cast="fp16").wire_dtype == torch.float16  # what ratio=auto times the CCR in
    assert CovapGradFilter(2).wire_dtype is None
    assert CovapGradFilter(2, cast="bf16").config()["cast"] == "bf16"
    with pytest.raises(ValueError, match="cast must be one of fp16, bf16"):
        CovapGradFilter(2, cast="fp8")


def _residuals_after_step_0(rank, world, path, scaled):
    """dear-covap (K=2) after one step on fp32 data, built through ``path`` (``"wrap"``:
    ``gradsync.wrap(..., scaler=)``; ``"train"``: ``build`` + ``train_step`` as ``gradsync train``
    runs them), with a GradScaler at 2**16 (``scaled``) or without loss scaling. Returns the
    error-feedback residuals."""
    import gradsync
    from gradsync.algorithms import BuildContext, Precision, build

    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaled else None
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    if path == "wrap":
        dear = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "dear-covap", scaler=scaler,
                             ratio=2, fusion_mb=1e-6)
        dear.zero_grad()
        loss = nn.functional.cross_entropy(dear(x), y)
        (scaler.scale(loss) if scaled else loss).backward()
        dear.step(scaler)
    else:
        ctx = BuildContext(model=model, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), scaler=scaler)
        dp = build("dear-covap", ctx, {"ratio": 2, "fusion_mb": 1e-6})
        dp.train_step(x, y, nn.functional.cross_entropy, Precision(scaler=scaler))
        dear = dp.wrapper
    assert dear.grad_scaler is scaler
    res = dear.grad_filter.state_dict()["memory"]["residuals"]
    return {k: v.clone() for k, v in res.items()}


@pytest.mark.parametrize("path", ["wrap", "train"])
def test_dear_covap_residuals_are_unscaled_with_a_grad_scaler(path):
    # the scaler is known from construction: the filter sees unscaled gradients from step 0 (before,
    # the synchroniser built DeAR without it and step 0's residual stayed 65,536 times too large)
    scaled = run_ranks(_residuals_after_step_0, 2, path, True)
    plain = run_ranks(_residuals_after_step_0, 2, path, False)
    for a, b in zip(scaled, plain):
        assert a.keys() == b.keys() and len(a) > 0
        assert any(v.abs().max() > 0 for v in b.values())
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-9)


def _scaler_errors(rank, world):
    """The two misuses: another GradScaler than the one given at construction, and a scaler given
    only to step() after dear-covap's filter stored residuals from loss-scaled gradients."""
    msgs = []
    for late in (False, True):
        model = make_model()
        built_with = None if late else torch.amp.GradScaler("cpu", init_scale=2.0**16)
        filt = CovapGradFilter(2)
        dear = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.1), fusion_mb=1e-6, grad_filter=filt,
                    grad_scaler=built_with)
        filt.bind(dear)
        other = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        loss = nn.functional.cross_entropy(dear(torch.randn(6, 8)), torch.randint(0, 4, (6,)))
        other.scale(loss).backward()
        with pytest.raises(ValueError) as err:
            dear.step(other)
        msgs.append(str(err.value))
    return msgs


def test_dear_covap_refuses_a_different_or_late_grad_scaler():
    for other, late in run_ranks(_scaler_errors, 2):
        assert "different GradScaler" in other
        assert "loss-scaled units" in late and "grad_scaler=scaler" in late


def _cast_overflow(rank, world):
    """dear-covap K=1, fp16 cast: every gradient element is 40,000 on every rank (fp16 max 65,504);
    summed before dividing it overflows, divided first it is the exact average."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    filt = CovapGradFilter(1, cast="fp16")
    dear = DeAR(model, torch.optim.SGD(model.parameters(), lr=1.0), fusion_mb=0.01, grad_filter=filt)
    filt.bind(dear)
    deltas = []
    for _ in range(3):
        before = model.weight.detach().clone()
        dear.zero_grad()
        (dear(torch.ones(1, 8)).sum() * 40000.0).backward()
        dear.step()
        dear.flush()
        deltas.append(before - model.weight.detach())
    return deltas


def test_dear_covap_cast_divides_before_the_sum():
    for deltas in run_ranks(_cast_overflow, 2, timeout=120):
        for t, d in enumerate(deltas):
            assert torch.allclose(d, torch.full((4, 8), 40000.0), rtol=1e-6), f"step {t}: {d.flatten()[:4]}"
