"""ASC adaptive stepwise coding (OSCAR, reconstructed) on the coded ring, plus its baselines."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from gradsync.coding.asc import (
    ASCRingCoder,
    StaticTableCoder,
    decode_with_counts,
    encode_with_counts,
    measure_ring_coding,
    raw_bytes,
    zlib_size,
    zstd_size,
)
from gradsync.comm.ring import balanced_bounds, equal_bounds, ring_all_reduce_coded


def _drifting(rank, it, n, levels):
    """Laplace-like ints whose width and mean drift with the iteration; rank-specific noise."""
    g = torch.Generator().manual_seed(7919 * it + rank)
    width = 1.0 + 6.0 * (0.5 + 0.5 * np.sin(it / 3.0))
    u = torch.rand(n, generator=g) - 0.5
    lap = -width * torch.sign(u) * torch.log1p(-2 * u.abs())
    shift = int(3 * np.cos(it / 5.0))
    x = torch.round(lap).to(torch.int64) + shift
    x[torch.rand(n, generator=g) < 0.3] = 0  # zeros as in quantised gradients
    if it % 7 == 3:
        x[:] = 0  # a constant message
    return x.clamp_(-levels, levels)


def _asc_ring(rank, world_size, n, iters, levels, chunking):
    coder = ASCRingCoder(world_size, world_size * levels)
    ok = True
    totals = []
    for it in range(iters):
        x = _drifting(rank, it, n, levels)
        ref = x.clone()
        dist.all_reduce(ref)
        if chunking == "balanced" and it > 0:
            bounds = balanced_bounds(torch.rand(n, generator=torch.Generator().manual_seed(it)), world_size)
        else:
            bounds = equal_bounds(n, world_size)
        y, st = ring_all_reduce_coded(x.clone(), bounds, coder.encode, coder.decode)
        ok = ok and torch.equal(y, ref)
        coder.end_iteration(y)
        totals.append(st.total_bytes)
    return ok, totals, coder.send_counts.copy(), coder.recv_counts.copy()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_asc_ring_decodes_exactly_over_drifting_steps(world_size):
    n, iters, levels = 3000, 20, 40
    res = run_ranks(_asc_ring, world_size, n, iters, levels, "balanced", timeout=90)
    for ok, totals, _, _ in res:
        assert ok
        # adapted models beat the first (uniform) iteration on the same data family
        assert min(totals[1:]) < totals[0]
    # rank r's send models equal rank r+1's receive models: no table ever sent
    for r in range(world_size):
        assert np.array_equal(res[r][2], res[(r + 1) % world_size][3])


def test_encode_decode_roundtrip_and_edge_cases():
    K = 127
    counts = np.zeros(2 * K + 1)
    g = torch.Generator().manual_seed(0)
    for it in range(10):
        v = torch.randint(-K, K + 1, (5000,), generator=g) // (it + 1)
        p = encode_with_counts(v, counts, K)
        assert p.dtype == torch.uint8 and (p.numel() - 8) % 4 == 0
        assert torch.equal(decode_with_counts(p, v.numel(), counts, K), v)
        counts += np.bincount(v.numpy() + K, minlength=2 * K + 1)
    # constant message: header only
    p = encode_with_counts(torch.full((100,), -3), counts, K)
    assert p.numel() == 8
    assert torch.equal(decode_with_counts(p, 100, counts, K), torch.full((100,), -3))
    # empty message
    p = encode_with_counts(torch.zeros(0, dtype=torch.int64), counts, K)
    assert decode_with_counts(p, 0, counts, K).numel() == 0
    # extreme values
    v = torch.tensor([-K, K, 0, K, -K])
    assert torch.equal(decode_with_counts(encode_with_counts(v, counts, K), 5, counts, K), v)


def test_adapted_model_compresses_near_entropy():
    K = 64
    g = torch.Generator().manual_seed(1)
    u = torch.rand(100_000, generator=g) - 0.5
    v = torch.round(-2.0 * torch.sign(u) * torch.log1p(-2 * u.abs())).clamp(-K, K).to(torch.int64)
    counts = np.bincount(v.numpy() + K, minlength=2 * K + 1).astype(float)
    p = counts[counts > 0] / counts.sum()
    entropy_bytes = -(p * np.log2(p)).sum() * v.numel() / 8
    coded = encode_with_counts(v, counts, K).numel()
    assert coded < 1.02 * entropy_bytes + 16
    assert coded < len(raw_bytes(v, K)) / 2


def test_baselines():
    v = torch.randint(-3, 4, (10_000,))
    assert len(raw_bytes(v, 127)) == 10_000
    assert len(raw_bytes(v, 128)) == 20_000
    assert 0 < zlib_size(v, 127) < 10_000
    z = zstd_size(v, 127)
    assert 0 < z < 10_000
    st = StaticTableCoder(127)
    first = st.size("k", v)
    assert st.table_bytes == 8 + 2 * 7
    assert st.size("k", v) == first  # same table reused, not resent
    assert st.table_bytes == 8 + 2 * 7


def test_measure_ring_coding_runs_and_asc_beats_raw():
    P, n, levels = 3, 4000, 31
    iters = [[_drifting(r, it, n, levels) for r in range(P)] for it in range(6)]
    bounds = [equal_bounds(n, P)] * 6
    m = measure_ring_coding(iters, bounds, P * levels)
    assert m["asc"] < m["raw"]
    assert m["static"] > 0 and m["zlib"] > 0
    assert m["per_step_max_mean"] >= 1.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        ASCRingCoder(0, 10)
    with pytest.raises(ValueError, match="max_abs"):
        ASCRingCoder(2, 0)
    with pytest.raises(ValueError, match="alpha"):
        ASCRingCoder(2, 10, alpha=0.0)
    with pytest.raises(ValueError, match="decay"):
        ASCRingCoder(2, 10, decay=1.0)
    with pytest.raises(ValueError, match="values"):
        encode_with_counts(torch.tensor([11]), np.zeros(21), 10)
    with pytest.raises(ValueError, match="payload"):
        decode_with_counts(torch.zeros(5, dtype=torch.uint8), 3, np.zeros(21), 10)
    with pytest.raises(ValueError, match="max_abs"):
        StaticTableCoder(0)


def _reference_update(row, values, K, decay=0.5):
    """The model update as specified: ``decay * counts + histogram over [-K, K]``."""
    h = np.bincount(np.asarray(values, dtype=np.int64) + K, minlength=2 * K + 1).astype(np.float64)
    return decay * row + h if decay > 0 else h


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, "numpy"])
def test_batched_coder_roundtrip_random_skewed_and_edge_inputs(dtype):
    K = 126
    g = torch.Generator().manual_seed(5)
    counts = np.bincount(torch.randint(-5, 6, (1000,), generator=g).numpy() + K, minlength=2 * K + 1).astype(float)
    u = torch.rand(20_000, generator=g) - 0.5
    skewed = torch.round(-1.5 * torch.sign(u) * torch.log1p(-2 * u.abs())).clamp(-K, K).to(torch.int64)
    skewed[torch.rand(20_000, generator=g) < 0.6] = 0
    cases = [
        torch.randint(-K, K + 1, (20_000,), generator=g),  # uniform over the whole alphabet
        skewed,  # zero-heavy Laplace, as quantised gradients
        torch.tensor([K] * 50 + [-K]),  # values the model gives almost no mass
        torch.zeros(0, dtype=torch.int64),  # empty
        torch.tensor([17]),  # a single element
        torch.full((999,), -4),  # a single symbol repeated (header only)
        torch.tensor([3, 4]),  # two symbols, one element each
    ]
    for v in cases:
        x = v.to(dtype) if dtype != "numpy" else v.numpy().astype(np.int16)
        p = encode_with_counts(x, counts, K)
        assert p.dtype == torch.uint8 and (p.numel() - 8) % 4 == 0
        if v.numel() == 0 or int(v.min()) == int(v.max()):
            assert p.numel() == 8
        back = decode_with_counts(p, v.numel(), counts, K)
        assert back.dtype == torch.int64 and torch.equal(back, v)


def test_ring_coder_models_adapt_identically_on_both_ends_and_as_specified():
    K, P = 60, 3
    send, recv = ASCRingCoder(P, K), ASCRingCoder(P, K)
    ref_send = np.zeros((P - 1, 2 * K + 1))
    ref_ag = np.zeros(2 * K + 1)
    g = torch.Generator().manual_seed(11)
    for it in range(6):
        for step in range(P - 1):
            width = 1 + it + step
            v = (torch.randn(4000, generator=g) * width).round().clamp(-K, K).to(torch.int32)
            if it == 2 and step == 0:
                v[:] = -7  # a constant message: its count goes to value -7
            if it == 4 and step == 1:
                v = v[:1]  # a single element
            payload = send.encode("rs", step, 0, v)
            out = recv.decode("rs", step, 0, payload, v.numel())
            assert out.dtype == torch.int32 and torch.equal(out, v)
            ref_send[step] = _reference_update(ref_send[step], v.numpy(), K)
        # no table is sent: the receiver's models equal the sender's, and equal the specified update
        assert np.array_equal(send.send_counts, recv.recv_counts)
        assert np.array_equal(send.send_counts, ref_send)
        full = (torch.randn(5000, generator=g) * 3).round().clamp(-K, K).to(torch.int32)
        payload = send.encode("ag", 0, 0, full)
        assert torch.equal(recv.decode("ag", 0, 0, payload, full.numel()), full)
        for c in (send, recv):
            c.end_iteration(full)
        ref_ag = _reference_update(ref_ag, full.numpy(), K)
        assert np.array_equal(send.ag_counts, ref_ag) and np.array_equal(recv.ag_counts, ref_ag)
    zero_decay = ASCRingCoder(P, K, decay=0.0)
    zero_decay.encode("rs", 0, 0, torch.tensor([1, 2, 2]))
    zero_decay.encode("rs", 0, 0, torch.tensor([5, 5]))
    assert zero_decay.send_counts[0].sum() == 2 and zero_decay.send_counts[0][5 + K] == 2


def test_each_message_is_one_constriction_call(monkeypatch):
    """The coder makes one encode and one decode call per message, whatever its length (no loop per
    symbol)."""
    import constriction

    calls = {"encode_reverse": 0, "decode": 0}
    real = constriction.stream.stack.AnsCoder

    class Counting:
        def __init__(self, *a, **k):
            self._c = real(*a, **k)

        def encode_reverse(self, *a, **k):
            calls["encode_reverse"] += 1
            return self._c.encode_reverse(*a, **k)

        def decode(self, *a, **k):
            calls["decode"] += 1
            return self._c.decode(*a, **k)

        def get_compressed(self):
            return self._c.get_compressed()

    monkeypatch.setattr(constriction.stream.stack, "AnsCoder", Counting)
    K = 100
    counts = np.ones(2 * K + 1)
    for m in (2, 1000, 100_000):
        v = torch.randint(-K, K + 1, (m,), generator=torch.Generator().manual_seed(m))
        v[0], v[1] = -K, K
        before = dict(calls)
        assert torch.equal(decode_with_counts(encode_with_counts(v, counts, K), m, counts, K), v)
        assert calls["encode_reverse"] - before["encode_reverse"] == 1
        assert calls["decode"] - before["decode"] == 1


def _ring_stats(rank, world_size, n):
    coder = ASCRingCoder(world_size, world_size * 10)
    x = torch.randint(-10, 11, (n,), generator=torch.Generator().manual_seed(rank)).to(torch.int32)
    bounds = equal_bounds(n, world_size)
    _, st = ring_all_reduce_coded(x, bounds, coder.encode, coder.decode)
    return st.hops, st.rs_numel, st.ag_numel, st.encoded_numel, st.decoded_numel, st.total_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_stats_count_hops_and_elements(world_size):
    n = 1001
    size = [b - a for a, b in zip(equal_bounds(n, world_size), equal_bounds(n, world_size)[1:])]
    for r, (hops, rs_numel, ag_numel, enc, dec, nbytes) in enumerate(run_ranks(_ring_stats, world_size, n,
                                                                               timeout=60)):
        assert hops == 2 * (world_size - 1)
        assert rs_numel == [size[(r - s) % world_size] for s in range(world_size - 1)]
        assert ag_numel == [size[(r + 1 - s) % world_size] for s in range(world_size - 1)]
        own = size[(r + 1) % world_size]
        assert enc == sum(rs_numel) + own  # the all-gather chunk is encoded once, then forwarded
        received_rs = sum(size[(r - s - 1) % world_size] for s in range(world_size - 1))
        received_ag = sum(size[(r - s) % world_size] for s in range(world_size - 1))
        assert dec == received_rs + received_ag
        assert nbytes > 0
