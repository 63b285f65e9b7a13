"""Compressors: round trips, unbiasedness, argument checks, and the communicators on real Gloo ranks."""

import math

import pytest
import torch

from distributed import run_ranks
from gradsync.comm.sparse import allgather_payload, communicate
from gradsync.compressors import (
    COMPRESSORS,
    DGCCompressor,
    QSGDCompressor,
    RandomKCompressor,
    RedSyncCompressor,
    SignSGDCompressor,
    TopKCompressor,
    available_compressors,
    make_compressor,
)

SPARSE = ["topk", "randomk", "dgc", "redsync"]


def _x(n=20000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _kwargs(name, density=0.01):
    return {"density": density} if name in SPARSE else {}


def _selected(c, payload, ctx):
    if isinstance(c, RandomKCompressor):
        return ctx.extra["indices"].long()
    return payload[1].long()


def test_registry_names_and_unknown_name():
    assert {"none", "fp16", "bf16", "topk", "randomk", "dgc", "redsync", "qsgd", "signsgd"} <= set(available_compressors())
    for name in ["none", "fp16", "bf16", "topk", "randomk", "dgc", "redsync", "qsgd", "signsgd"]:
        c = make_compressor(name, **_kwargs(name))
        assert COMPRESSORS[name] is type(c) and c.name == name
        assert c.aggregation in ("allreduce", "allgather")
        assert make_compressor(**c.config()).config() == c.config()  # config() rebuilds it
    with pytest.raises(ValueError, match="compressor must be one of"):
        make_compressor("nope")


@pytest.mark.parametrize("name", SPARSE)
def test_sparsifiers_keep_exactly_the_selected_entries(name):
    x = _x()
    c = make_compressor(name, density=0.01)
    payload, ctx = c.compress(x, step=5, key=2)
    idx = _selected(c, payload, ctx)
    y = c.decompress(payload, ctx)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert idx.unique().numel() == idx.numel() == ctx.selected
    assert torch.equal(y[idx], x[idx])
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[idx] = False
    assert torch.count_nonzero(y[mask]) == 0
    # aggregate of several payloads = sum of decompressions
    p2, ctx2 = c.compress(_x(seed=1), step=5, key=2)
    assert torch.allclose(c.aggregate([payload, p2], ctx), y + c.decompress(p2, ctx2))


def test_topk_selects_largest_magnitudes():
    x = _x()
    c = TopKCompressor(density=0.01)
    payload, ctx = c.compress(x)
    assert ctx.selected == 200 and ctx.density == pytest.approx(0.01)
    idx = payload[1].long()
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[idx] = False
    assert x[idx].abs().min() >= x[rest].abs().max()
    # per-call density override (GraVAC)
    assert c.compress(x, density=0.001)[1].selected == 20


def test_randomk_indices_shared_by_seed_step_key():
    x = _x()
    a = RandomKCompressor(density=0.05, seed=3)
    i1 = a.compress(x, step=7, key=1, rank=0)[1].extra["indices"]
    i2 = a.compress(_x(seed=9), step=7, key=1, rank=1)[1].extra["indices"]
    assert torch.equal(i1, i2)  # same on every rank
    assert not torch.equal(i1, a.compress(x, step=8, key=1)[1].extra["indices"])
    assert not torch.equal(i1, a.compress(x, step=7, key=2)[1].extra["indices"])


@pytest.mark.parametrize("name", ["dgc", "redsync"])
def test_threshold_sparsifiers_select_a_magnitude_threshold(name):
    x = _x(100000)
    c = make_compressor(name, density=0.01)
    payload, ctx = c.compress(x, step=1)
    idx = payload[1].long()
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[idx] = False
    assert x[idx].abs().min() >= x[rest].abs().max()
    if name == "dgc":
        assert 0.7 * 1000 <= ctx.selected <= 1.3 * 1000
    else:  # binary search stops within [k, 2k) or when the interval is narrow
        assert 1 <= ctx.selected <= 0.1 * x.numel()


def test_dgc_density_warmup_schedule():
    c = DGCCompressor(density=0.001, warmup_steps=10)
    assert [c.density_at(s) for s in (0, 9, 10, 20, 30, 40, 1000)] == pytest.approx(
        [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    )
    x = _x(100000)
    d0 = c.compress(x, step=0)[1].density
    d4 = c.compress(x, step=45)[1].density
    assert 0.15 < d0 < 0.35 and d4 < 0.002
    assert DGCCompressor(density=0.01).density_at(0) == 0.01


def test_redsync_all_equal_input_keeps_max():
    x = torch.ones(100)
    payload, ctx = RedSyncCompressor(density=0.1).compress(x)
    assert ctx.selected == 100


def test_qsgd_unbiased_and_on_lattice():
    n, s, trials = 64, 4, 4000
    x = _x(n, seed=3)
    c = QSGDCompressor(levels=s, seed=1)
    acc = torch.zeros(n, dtype=torch.float64)
    norm = float(x.norm())
    for t in range(trials):
        payload, ctx = c.compress(x, step=t)
        assert payload[0].dtype == torch.int8 and int(payload[0].abs().max()) <= s
        y = c.decompress(payload, ctx)
        # every coordinate is sign(x) * l * norm / s with l in {floor, floor+1}
        lvl = (y.abs() / norm * s).double()
        assert torch.allclose(lvl, lvl.round(), atol=1e-4)
        acc += y.double()
    mean = acc / trials
    # Bernoulli rounding: per-coordinate std <= (norm / s) / 2; the mean of T draws has std <= that / sqrt(T).
    sigma = norm / s / 2 / math.sqrt(trials)
    assert float((mean - x.double()).abs().max()) < 5 * sigma
    # independent rounding across ranks, reproducible for the same (step, key, rank)
    assert torch.equal(c.compress(x, step=1, rank=0)[0][0], c.compress(x, step=1, rank=0)[0][0])
    assert not torch.equal(c.compress(x, step=1, rank=0)[0][0], c.compress(x, step=1, rank=1)[0][0])
    assert QSGDCompressor(levels=1000).compress(x)[0][0].dtype == torch.int16
    zero = torch.zeros(10)
    assert torch.equal(c.decompress(*c.compress(zero)), zero)


@pytest.mark.parametrize("n", [1, 8, 13, 1000])
def test_signsgd_scaled_sign(n):
    x = _x(n, seed=n)
    x[0] = 0.0
    c = SignSGDCompressor()
    payload, ctx = c.compress(x)
    assert payload[0].dtype == torch.uint8 and payload[0].numel() == math.ceil(n / 8)
    sign = torch.where(x >= 0, 1.0, -1.0)
    assert torch.allclose(c.decompress(payload, ctx), x.abs().mean() * sign)


def test_casts_and_identity():
    x = _x(1000)
    for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = make_compressor(name)
        payload, ctx = c.compress(x)
        assert payload[0].dtype == dt
        assert torch.equal(c.decompress(payload, ctx), x.to(dt).float())
    c = make_compressor("none")
    assert torch.equal(c.decompress(*c.compress(x)), x)


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("topk", {"density": 0.0}, "density"),
        ("topk", {"density": 1.5}, "density"),
        ("randomk", {"density": "a"}, "density"),
        ("dgc", {"density": 0.01, "sample_ratio": 0}, "sample_ratio"),
        ("dgc", {"density": 0.01, "warmup_steps": -1}, "warmup_steps"),
        ("redsync", {"density": 0.01, "min_interval": 0}, "min_interval"),
        ("qsgd", {"levels": 0}, "levels"),
        ("qsgd", {"levels": 2.5}, "levels"),
        ("topk", {"density": 0.1, "seed": -1}, "seed"),
    ],
)
def test_bad_arguments_raise(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_compressor(name, **kwargs)


def test_bad_inputs_and_checkpoint_mismatch():
    from gradsync.compressors import CastCompressor

    with pytest.raises(ValueError, match="dtype"):
        CastCompressor(torch.float64)
    c = TopKCompressor(density=0.1)
    with pytest.raises(ValueError, match="1-D torch.float32"):
        c.compress(torch.randn(3, 3))
    with pytest.raises(ValueError, match="1-D torch.float32"):
        c.compress(torch.randn(3, dtype=torch.float64))
    c.load_state_dict(TopKCompressor(density=0.1).state_dict())
    with pytest.raises(ValueError, match="does not match"):
        c.load_state_dict(TopKCompressor(density=0.2).state_dict())


# -- communicators on real Gloo ranks -----------------------------------------------------------
def _rank_vector(rank, n=3000):
    return torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))


def _communicate_all(rank, world_size):
    import torch.distributed as dist

    out = {}
    for name in ["none", "fp16", "bf16", "topk", "randomk", "dgc", "redsync", "qsgd", "signsgd"]:
        # rank-dependent density so variable-size payloads differ in size between ranks; top-k
        # declares fixed_size (same k everywhere), so it gets one density
        kw = {"density": 0.01 * (rank + 1)} if name in ("dgc", "redsync") else _kwargs(name, 0.05)
        c = make_compressor(name, **kw)
        x = _rank_vector(rank)
        payload, ctx = c.compress(x, step=3, key=0, rank=rank)
        sizes = []
        got = communicate(c, payload, ctx, counter=lambda *t, kind=None: sizes.append(sum(a.numel() for a in t))).wait()
        out[name] = (got, c.decompress(payload, ctx), ctx.selected, sizes)
    # raw all-gather of mixed-dtype payloads with unequal sizes
    k = rank + 1
    payload = (torch.arange(k, dtype=torch.float32) + rank, torch.full((2 * k,), rank, dtype=torch.int16))
    out["raw"] = allgather_payload(payload).wait()
    dist.barrier()
    return out


def test_communicators_aggregate_correctly_on_3_ranks():
    res = run_ranks(_communicate_all, 3, timeout=90)
    for name in res[0]:
        if name == "raw":
            continue
        local = [r[name][1] for r in res]
        expected = sum(local) / 3
        for r in range(3):
            got = res[r][name][0]
            tol = 1e-2 if name in ("fp16", "bf16") else 1e-6
            assert torch.allclose(got, expected, atol=tol), name
    # sizes really differed for the sparse ones
    assert len({r["dgc"][2] for r in res}) == 3 and len({r["redsync"][2] for r in res}) == 3
    # fixed-size payloads skip the sizes all-gather: one collective; variable ones need two
    assert len(res[0]["topk"][3]) == 1 and len(res[0]["dgc"][3]) == 2
    for r in range(3):
        gathered = res[r]["raw"]
        for src in range(3):
            vals, ints = gathered[src]
            assert torch.equal(vals, torch.arange(src + 1, dtype=torch.float32) + src)
            assert ints.dtype == torch.int16 and torch.equal(ints, torch.full((2 * (src + 1),), src, dtype=torch.int16))
