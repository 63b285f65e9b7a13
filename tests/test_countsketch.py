"""Count sketch (Charikar et al. 2002): linearity across ranks, heavy hitters, hashing, errors."""

import pickle

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from gradsync.compressors.countsketch import MERSENNE_P, CountSketch, HashCache, sketch_cols


def _allreduced_sketch(rank, world_size, n, rows, cols):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g)
    sk = CountSketch(rows, cols).accumulate(x)
    dist.all_reduce(sk.table)
    return x, sk.table


def test_allreduced_sketch_equals_sketch_of_sum():
    n, rows, cols = 5000, 5, 301
    res = run_ranks(_allreduced_sketch, 2, n, rows, cols, timeout=60)
    total = res[0][0] + res[1][0]
    direct = CountSketch(rows, cols, dtype=torch.float64).accumulate(total.double()).table
    for _, table in res:
        assert torch.allclose(table.double(), direct, atol=1e-4)
    assert torch.equal(res[0][1], res[1][1])


def test_linearity_in_process_exact_for_ints():
    a = torch.randint(-50, 50, (2000,))
    b = torch.randint(-50, 50, (2000,))
    s = CountSketch(3, 64).accumulate(a) + CountSketch(3, 64).accumulate(b)
    assert torch.equal(s.table, CountSketch(3, 64).accumulate(a + b).table)


def test_planted_heavy_hitters_recovered_exactly():
    n = 100_000
    idx = torch.tensor([7, 1234, 50_000, 77_777, 99_999])
    vals = torch.tensor([40.0, -25.0, 13.0, -8.0, 100.0])
    x = torch.zeros(n)
    x[idx] = vals
    # Exact recovery needs few false positives: with h hot items, a cold coordinate collides with a
    # hot one in a row with probability ~h/cols, so cols >> h and an odd number of rows.
    for rows in (5, 7):
        sk = CountSketch(rows, 2000).accumulate(x)
        got_idx, got_vals = sk.heavy_hitters(torch.arange(n), k=5)
        assert torch.equal(got_idx, idx)
        assert torch.equal(got_vals, vals)
        t_idx, _ = sk.heavy_hitters(torch.arange(n), threshold=1.0)
        assert torch.equal(t_idx, idx)


def test_heavy_hitters_over_noise_and_subset_coordinates():
    g = torch.Generator().manual_seed(0)
    n = 20_000
    x = 0.01 * torch.randn(n, generator=g)
    hot = torch.randperm(n, generator=g)[:10].sort().values
    x[hot] = 50.0
    sk = CountSketch(5, 2000).accumulate(x)
    got, est = sk.heavy_hitters(torch.arange(n), k=10)
    assert torch.equal(got, hot)
    assert torch.allclose(est, torch.full((10,), 50.0), atol=0.5)
    # sparse accumulate at explicit coordinates equals dense accumulate
    sk2 = CountSketch(5, 400).accumulate(x[hot], hot)
    y = torch.zeros(n)
    y[hot] = x[hot]
    assert torch.allclose(sk2.table, CountSketch(5, 400).accumulate(y).table)
    assert sk.l2_estimate() > 0


def test_hashes_shared_and_well_formed():
    a, b = CountSketch(4, 97, seed=3), CountSketch(4, 97, seed=3)
    idx = torch.arange(0, 10_000)
    ha, sa = a.hashes(idx)
    hb, sb = b.hashes(idx)
    assert torch.equal(ha, hb) and torch.equal(sa, sb)
    assert int(ha.min()) >= 0 and int(ha.max()) < 97
    assert set(sa.unique().tolist()) == {-1.0, 1.0}
    # every column used, signs roughly balanced
    assert ha[0].bincount(minlength=97).min() > 50
    assert abs(float(sa.mean())) < 0.05
    hc, _ = CountSketch(4, 97, seed=4).hashes(idx)
    assert not torch.equal(ha, hc)
    big = torch.tensor([MERSENNE_P - 1])
    a.hashes(big)  # the largest coordinate is fine


def test_state_dict_and_pickle_roundtrip():
    sk = CountSketch(3, 50).accumulate(torch.randn(300))
    sk2 = CountSketch.from_state_dict(sk.state_dict())
    assert torch.equal(sk.table, sk2.table)
    sk3 = pickle.loads(pickle.dumps(sk))
    idx = torch.arange(300)
    assert torch.equal(sk.estimate(idx), sk3.estimate(idx))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rows"):
        CountSketch(0, 10)
    with pytest.raises(ValueError, match="cols"):
        CountSketch(3, 0)
    with pytest.raises(ValueError, match="seed"):
        CountSketch(3, 10, seed=-1)
    with pytest.raises(ValueError, match="dtype"):
        CountSketch(3, 10, dtype=torch.int32)
    sk = CountSketch(3, 10)
    with pytest.raises(ValueError, match="indices"):
        sk.hashes(torch.tensor([-1]))
    with pytest.raises(ValueError, match="indices"):
        sk.hashes(torch.tensor([MERSENNE_P]))
    with pytest.raises(ValueError, match="length"):
        sk.accumulate(torch.ones(3), torch.arange(4))
    with pytest.raises(ValueError, match="k"):
        sk.heavy_hitters(torch.arange(5), k=-1)
    with pytest.raises(ValueError, match="threshold"):
        sk.heavy_hitters(torch.arange(5), threshold=-0.1)
    with pytest.raises(ValueError, match="ratio"):
        sketch_cols(100, 0.0, 3)
    with pytest.raises(ValueError, match="combined"):
        CountSketch(3, 10) + CountSketch(3, 11)
    assert sketch_cols(1000, 0.05, 5) == 10


def test_hash_cache_matches_direct_hashes():
    cache = HashCache()
    idx = torch.tensor([0, 5, 999, 123])
    for cols in (17, 64):  # one cached entry serves sketches of any width
        sk = CountSketch(5, cols, seed=9)
        b1, s1 = cache.hashes(sk, "bucket0", 1000, idx)
        b2, s2 = sk.hashes(idx)
        assert torch.equal(b1, b2) and torch.equal(s1, s2)
        full = cache.hashes(sk, "bucket0", 1000)
        x = torch.randn(1000)
        assert torch.equal(CountSketch(5, cols, seed=9).accumulate(x, hashed=full).table,
                           CountSketch(5, cols, seed=9).accumulate(x).table)
    b3, _ = cache.hashes(CountSketch(5, 17, seed=10), "bucket0", 1000, idx)  # new seed: recomputed
    assert torch.equal(b3, CountSketch(5, 17, seed=10).hashes(idx)[0])
    cache.clear()
