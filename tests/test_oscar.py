"""OSCAR hooks (reconstructed): quantisation, zero-mask split, sketch, ASC ring; count-sketch baseline."""

import math
import pickle

import pytest
import torch
import torch._dynamo  # DDP imports it lazily (~6 s); importing it before fork saves that per run
import torch.distributed as dist
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.algorithms.oscar import (
    ALGORITHMS,
    CountSketchState,
    OscarASCState,
    OscarState,
    OscarSWState,
    countsketch_hook,
    oscar_hook,
    split_by_mask,
    stochastic_round,
    wire_dtype,
)


def _vec(rank, it, n, sparse=False):
    g = torch.Generator().manual_seed(31 * it + 1000 * rank + 5)
    x = torch.randn(n, generator=g)
    if sparse:
        keep = torch.zeros(n, dtype=torch.bool)
        keep[torch.randperm(n, generator=torch.Generator().manual_seed(it))[:20]] = True
        x = torch.where(keep, x * 10, torch.zeros(()))
    return x


# -- pure helpers -------------------------------------------------------------------------------
def test_split_by_mask_degenerate_and_partition():
    a, b = split_by_mask(torch.zeros(10, dtype=torch.bool))
    assert a.numel() == 0 and torch.equal(b, torch.arange(10))
    a, b = split_by_mask(torch.ones(10, dtype=torch.bool))
    assert b.numel() == 0 and torch.equal(a, torch.arange(10))
    m = torch.rand(100, generator=torch.Generator().manual_seed(0)) < 0.3
    a, b = split_by_mask(m)
    assert torch.equal(torch.cat([a, b]).sort().values, torch.arange(100))
    assert bool(m[a].all()) and not bool(m[b].any())
    with pytest.raises(ValueError, match="mask"):
        split_by_mask(torch.zeros(10))


def test_stochastic_round_unbiased_and_bounded():
    g = torch.Generator().manual_seed(0)
    y = torch.full((200_000,), 0.3)
    q = stochastic_round(y, g)
    assert q.dtype == torch.int32 and set(q.unique().tolist()) <= {0, 1}
    assert abs(float(q.float().mean()) - 0.3) < 0.01
    y = torch.linspace(-127, 127, 1001)
    q = stochastic_round(y, g)
    assert int(q.min()) >= -127 and int(q.max()) <= 127 and float((q - y).abs().max()) < 1


# -- distributed reduce (no DDP) ---------------------------------------------------------------
def _reduce_many(rank, world_size, kwargs, iters, n, sparse, preset_mask):
    st = OscarState(**kwargs)
    st.iteration = 10
    outs, conserved, xs = [], [], []
    for it in range(iters):
        x = _vec(rank, it, n, sparse)
        if preset_mask is not None and it == 0:
            # "zero": every coordinate aggregated to 0 last step (all probable zeros); "one": none did
            st.zero_mask[0] = torch.full((n,), preset_mask == "zero", dtype=torch.bool)
        e_before = st.error.get(0, torch.zeros(n)).clone()
        out = st.reduce(x, 0)
        # mass conservation: sum_r (x_r + e_before_r) = P * out + sum_r e_after_r
        lhs = x + e_before - st.error[0]
        dist.all_reduce(lhs)
        conserved.append(float((lhs - world_size * out).abs().max()))
        ref = x.clone()
        dist.all_reduce(ref)
        outs.append(out)
        xs.append(ref / world_size)
    return outs, xs, conserved, st.stats(), pickle.dumps(st)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sw_and_asc_agree_and_conserve_mass(world_size):
    base = dict(levels=15, sketch=True, sketch_ratio=0.2, seed=3)
    sw = run_ranks(_reduce_many, world_size, dict(base, mode="sw"), 5, 2000, False, None, timeout=90)
    asc = run_ranks(_reduce_many, world_size, dict(base, mode="asc"), 5, 2000, False, None, timeout=90)
    eq = run_ranks(_reduce_many, world_size, dict(base, mode="asc", chunking="equal"), 5, 2000, False, None,
                   timeout=90)
    for r in range(world_size):
        for a, b, c in zip(sw[r][0], asc[r][0], eq[r][0]):
            assert torch.equal(a, b) and torch.equal(a, c)  # the coded ring sums ints exactly
        for res in (sw, asc, eq):
            assert max(res[r][2]) < 1e-4  # error feedback conserves mass
        # identical result on every rank
        assert all(torch.equal(sw[r][0][i], sw[0][0][i]) for i in range(5))
    s = asc[0][3]
    assert s["wire_bytes"] > 0 and s["encode_seconds"] > 0 and s["ring_balance"] >= 1.0
    # coding cost: every compressed call codes 2 (P - 1) hops of part B on this rank
    assert 0 < s["coded_hops"] <= 5 * 2 * (world_size - 1)
    assert s["coding_seconds"] == pytest.approx(s["encode_seconds"] + s["decode_seconds"])
    assert s["coding_seconds_per_hop"] * s["coded_hops"] == pytest.approx(s["coding_seconds"])
    assert s["coding_ns_per_element"] * s["coded_elements"] == pytest.approx(s["coding_seconds"] * 1e9)
    assert 0 < s["coded_bytes"] <= s["wire_bytes"]
    assert 0 < s["coded_bits_per_element"] < 8  # int8 would be 8 bits; ASC codes fewer
    assert sw[0][3]["coded_hops"] == 0 and sw[0][3]["coding_seconds"] == 0
    assert 0 < s["probable_zero_fraction"] < 1
    assert s["sketch_unrecovered_fraction"] >= 0


def test_fp16_and_int32_wire_paths_are_exact():
    assert wire_dtype(127) == torch.int8 and wire_dtype(2048) == torch.float16 and wire_dtype(2049) == torch.int32
    for levels in (1000, 3000):  # P * L = 2000 -> float16 on the wire; 6000 -> int32
        base = dict(levels=levels, sketch=True, sketch_ratio=0.3, seed=4)
        sw = run_ranks(_reduce_many, 2, dict(base, mode="sw"), 3, 1500, False, None, timeout=60)
        asc = run_ranks(_reduce_many, 2, dict(base, mode="asc"), 3, 1500, False, None, timeout=60)
        for r in range(2):
            assert all(torch.equal(a, b) for a, b in zip(sw[r][0], asc[r][0]))


def test_nearest_rounding_and_hash_cache_options():
    base = dict(levels=15, sketch=True, sketch_ratio=0.2, seed=3, rounding="nearest")
    a = run_ranks(_reduce_many, 2, base, 4, 1200, False, None, timeout=60)
    b = run_ranks(_reduce_many, 2, dict(base, cache_hashes=False), 4, 1200, False, None, timeout=60)
    for r in range(2):
        assert all(torch.equal(x, y) for x, y in zip(a[r][0], b[r][0]))
        assert max(a[r][2]) < 1e-4


def _cs_reduce(rank, world_size, n, variant="fetchsgd"):
    st = CountSketchState(sketch_ratio=0.5, heavy_fraction=0.05, variant=variant)
    x = torch.zeros(n)
    hot = torch.tensor([3, 500, 4000, 7777])
    x[hot] = torch.tensor([1.0, -2.0, 3.0, 4.0]) * (rank + 1)
    out = st.reduce(x, 0)
    ref = x.clone()
    dist.all_reduce(ref)
    return out, ref / world_size, pickle.loads(pickle.dumps(st)).state_dict()["accumulators"][0]


def test_countsketch_recovers_planted_sparse_mean_and_drains_accumulator():
    for variant in ("fetchsgd", "local_ef"):
        for out, ref, acc in run_ranks(_cs_reduce, 2, 10_000, variant, timeout=60):
            assert torch.allclose(out, ref, atol=1e-5)
            assert float(acc.abs().max()) < 1e-5


def _cs_local_ef_conserves(rank, world_size, n, iters):
    st = CountSketchState(sketch_ratio=0.05, heavy_fraction=0.2, variant="local_ef")
    worst = 0.0
    for it in range(iters):
        x = _vec(rank, it, n)
        before = st.accumulators.get(0, torch.zeros(n)).clone()
        out = st.reduce(x, 0)
        lhs = x + before - st.accumulators[0]
        dist.all_reduce(lhs)
        worst = max(worst, float((lhs - world_size * out).abs().max()))
    return worst, int((out != 0).sum())


def test_countsketch_local_ef_conserves_mass():
    for worst, nnz in run_ranks(_cs_local_ef_conserves, 2, 5000, 4, timeout=60):
        assert worst < 1e-4 and 0 < nnz <= 10


def test_default_levels_fit_int8():
    st = OscarState()
    assert st.levels is None
    assert st.resolved_levels(2) == 63 and st.resolved_levels(4) == 31 and st.resolved_levels(200) == 1


def test_all_zero_mask_sketches_everything_and_recovers_sparse_sum():
    res = run_ranks(_reduce_many, 2, dict(levels=127, sketch=True, sketch_ratio=0.5, seed=1), 1, 3000, True,
                    "zero", timeout=60)
    for outs, xs, conserved, stats, _ in res:
        assert stats["probable_zero_fraction"] == 1.0
        assert stats["sketch_unrecovered_fraction"] == 0.0
        # all non-zeros recovered exactly: only quantisation error remains (< one step)
        step = max(float(_vec(r, 0, 3000, True).abs().max()) for r in range(2)) / 127
        assert float((outs[0] - xs[0]).abs().max()) <= step
        assert max(conserved) < 1e-4


def test_all_nonzero_mask_equals_sketch_off():
    on = run_ranks(_reduce_many, 2, dict(levels=31, sketch=True, seed=2), 1, 1000, False, "one", timeout=60)
    off = run_ranks(_reduce_many, 2, dict(levels=31, sketch=False, seed=2), 1, 1000, False, None, timeout=60)
    for r in range(2):
        assert on[r][3]["probable_zero_fraction"] == 0.0
        assert torch.equal(on[r][0][0], off[r][0][0])


def test_high_levels_no_sketch_close_to_dense():
    for mode in ("sw", "asc"):
        levels = 32767 if mode == "sw" else 4095
        res = run_ranks(_reduce_many, 2, dict(mode=mode, levels=levels, sketch=False), 3, 1000, False, None,
                        timeout=60)
        for outs, xs, conserved, _, _ in res:
            for o, x in zip(outs, xs):
                # per element |error| < quantisation step (+ carried EF of one step)
                assert float((o - x).abs().max()) < 2 * 8.0 / levels


# -- real DDP ---------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _ddp_train(rank, world_size, algo, kwargs, steps):
    model = DDP(_model(), bucket_cap_mb=0.01)
    if algo is not None:
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
    stats = state.stats() if algo is not None else {}
    sd = pickle.loads(pickle.dumps(state.state_dict())) if algo is not None else None
    return params, losses, stats, sd


def test_ddp_hooks_run_and_keep_ranks_in_sync():
    steps = 6
    dense = run_ranks(_ddp_train, 2, None, {}, steps, timeout=90)
    for algo, kw in (
        ("oscar-sw", dict(sketch_ratio=0.1)),
        ("oscar-asc", dict(sketch_ratio=0.1, global_balance=True)),
        ("countsketch", dict(sketch_ratio=0.1)),
    ):
        res = run_ranks(_ddp_train, 2, algo, kw, steps, timeout=90)
        assert torch.equal(res[0][0], res[1][0]), algo  # identical parameters on every rank
        stats = res[0][2]
        assert stats["iteration"] == steps and stats["wire_bytes"] > 0, algo
        assert all(math.isfinite(v) for v in res[0][1]), algo  # no NaN
        assert res[0][3]["iteration"] == steps
        if algo == "oscar-asc":
            assert stats["ring_balance_global"] >= 1.0
        # compressed runs move away from dense, but not wildly
        assert float((res[0][0] - dense[0][0]).abs().max()) < 0.5, algo


def test_ddp_high_levels_no_sketch_matches_dense():
    steps = 5
    dense = run_ranks(_ddp_train, 2, None, {}, steps, timeout=90)
    for algo, kw in (("oscar-sw", dict(levels=32767, sketch=False)), ("oscar-asc", dict(levels=4095, sketch=False))):
        res = run_ranks(_ddp_train, 2, algo, kw, steps, timeout=90)
        diff = float((res[0][0] - dense[0][0]).abs().max())
        # tolerance: 5 SGD steps (lr .05, momentum .9) of quantisation noise < 2 * max|g| / levels
        assert diff < 2e-3 if algo == "oscar-asc" else diff < 2e-4, (algo, diff)


# -- state ----------------------------------------------------------------------------------
def test_state_dict_roundtrip_continues_identically():
    res = run_ranks(_resume, 2, timeout=60)
    for a, b in res:
        assert torch.equal(a, b)


def _resume(rank, world_size):
    st = OscarASCState(levels=15, sketch_ratio=0.2)
    st.iteration = 5
    for it in range(3):
        st.reduce(_vec(rank, it, 500), 0)
    saved = pickle.loads(pickle.dumps(st.state_dict()))
    cont = st.reduce(_vec(rank, 9, 500), 0)
    st2 = OscarASCState(levels=15, sketch_ratio=0.2)
    st2.load_state_dict(saved)
    again = st2.reduce(_vec(rank, 9, 500), 0)
    pickle.loads(pickle.dumps(st2))  # the state object itself pickles
    return cont, again


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        OscarState(mode="hw")
    with pytest.raises(ValueError, match="levels"):
        OscarState(levels=0)
    with pytest.raises(ValueError, match="levels"):
        OscarState(levels=40000)
    with pytest.raises(ValueError, match="sketch_ratio"):
        OscarState(sketch_ratio=0.0)
    with pytest.raises(ValueError, match="sketch_rows"):
        OscarState(sketch_rows=0)
    with pytest.raises(ValueError, match="heavy_fraction"):
        OscarState(heavy_fraction=1.5)
    with pytest.raises(ValueError, match="rounding"):
        OscarState(rounding="floor")
    with pytest.raises(ValueError, match="cache_hashes"):
        OscarState(cache_hashes="yes")
    with pytest.raises(ValueError, match="sketch_basis"):
        OscarState(sketch_basis="all")
    with pytest.raises(ValueError, match="chunking"):
        OscarState(chunking="random")
    with pytest.raises(ValueError, match="asc_decay"):
        OscarState(asc_decay=1.0)
    with pytest.raises(ValueError, match="start_iter"):
        OscarState(start_iter=-1)
    with pytest.raises(ValueError, match="sketch"):
        OscarState(sketch="yes")
    with pytest.raises(ValueError, match="mode"):
        OscarSWState(mode="asc")
    with pytest.raises(ValueError, match="sketch_ratio"):
        CountSketchState(sketch_ratio=2.0)
    with pytest.raises(ValueError, match="heavy_fraction"):
        CountSketchState(heavy_fraction=0)
    with pytest.raises(ValueError, match="variant"):
        CountSketchState(variant="sketchy")
    assert set(ALGORITHMS) == {"oscar-sw", "oscar-asc", "countsketch"}
    assert ALGORITHMS["oscar-asc"] == (OscarASCState, oscar_hook)
    assert ALGORITHMS["countsketch"] == (CountSketchState, countsketch_hook)


def _ddp_train_sync(rank, world_size, algo, kwargs, steps):
    cls = ALGORITHMS[algo][0]
    saved = cls.overlap
    cls.overlap = False  # run the reduction in the hook body instead of the bucket worker
    try:
        return _ddp_train(rank, world_size, algo, kwargs, steps)
    finally:
        cls.overlap = saved


def test_bucket_worker_gives_the_same_result_as_the_hook_body():
    # the worker thread only moves the reduction off the autograd thread; the order of the
    # collectives and every value must be the same
    for algo in ("oscar-asc", "countsketch"):
        overlapped = run_ranks(_ddp_train, 2, algo, dict(sketch_ratio=0.1), 5, timeout=90)
        sync = run_ranks(_ddp_train_sync, 2, algo, dict(sketch_ratio=0.1), 5, timeout=90)
        for r in range(2):
            assert torch.equal(overlapped[r][0], sync[r][0]), algo
            assert overlapped[r][1] == sync[r][1], algo
