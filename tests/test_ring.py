"""Ring reduce-scatter / all-gather over batch_isend_irecv with uneven chunks, dense and coded."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from gradsync.comm.ring import (
    balanced_bounds,
    chunk_imbalance,
    equal_bounds,
    owned_chunk,
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_coded,
    ring_reduce_scatter,
)


def _uneven_bounds(n, p, pattern):
    if pattern == "equal":
        return equal_bounds(n, p)
    if pattern == "zeros":  # empty chunks at the start and in the middle, the rest uneven
        return {2: [0, 0, n], 3: [0, n // 3, n // 3, n], 4: [0, 0, n // 3, n // 3, n]}[p]
    if pattern == "all_in_one":  # every element in the last chunk
        return [0] * p + [n]
    g = torch.Generator().manual_seed(p)
    cuts = sorted(torch.randint(0, n + 1, (p - 1,), generator=g).tolist())
    return [0] + cuts + [n]


def _dense_case(rank, world_size, n, pattern, dtype):
    g = torch.Generator().manual_seed(10 + rank)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g).to(dtype)
    else:
        x = torch.randint(-100, 100, (n,), generator=g).to(dtype)
    ref = x.clone()
    dist.all_reduce(ref)
    bounds = _uneven_bounds(n, world_size, pattern)
    y = x.clone()
    ring_all_reduce(y, bounds)
    # reduce-scatter alone: owned chunk is fully reduced
    z = x.clone()
    ring_reduce_scatter(z, bounds)
    c = owned_chunk(rank, world_size)
    own_ok = torch.allclose(z[bounds[c]:bounds[c + 1]].double(), ref[bounds[c]:bounds[c + 1]].double(), atol=1e-4)
    ring_all_gather(z, bounds)
    return (
        bounds,
        torch.allclose(y.double(), ref.double(), atol=1e-4),
        own_ok,
        torch.equal(y, z),
    )


def _dense_cases(rank, world_size, n, cases):
    """:func:`_dense_case` for each ``(pattern, dtype)`` of ``cases`` in one process group."""
    return [_dense_case(rank, world_size, n, pattern, dtype) for pattern, dtype in cases]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_matches_all_reduce_uneven_and_empty_chunks(world_size):
    cases = [(pattern, dtype) for pattern in ("equal", "random", "zeros", "all_in_one")
             for dtype in (torch.float32, torch.int32)]
    per_rank = run_ranks(_dense_cases, world_size, 1001, cases, timeout=60)
    for i, (pattern, dtype) in enumerate(cases):
        res = [r[i] for r in per_rank]
        for bounds, same, own_ok, rs_ag in res:
            assert same and own_ok and rs_ag, (world_size, pattern, dtype, bounds)
        if pattern in ("zeros", "all_in_one"):
            b = res[0][0]
            assert any(b[j] == b[j + 1] for j in range(world_size)), b


def _coded_case(rank, world_size, n, steps):
    """Coded ring with a trivial 'codec' (int16 bytes, with a per-step XOR so the callbacks matter)."""
    log = []

    def encode(phase, step, chunk, values):
        b = values.to(torch.int16).numpy().tobytes()
        key = (step * 7 + chunk + (3 if phase == "ag" else 0)) % 251
        return torch.frombuffer(bytearray(x ^ key for x in b), dtype=torch.uint8)

    def decode(phase, step, chunk, payload, numel):
        key = (step * 7 + chunk + (3 if phase == "ag" else 0)) % 251
        raw = bytearray(x ^ key for x in payload.numpy().tobytes())
        log.append((phase, step, chunk, numel))
        return torch.frombuffer(raw, dtype=torch.int16).to(torch.int64) if numel else torch.zeros(0, dtype=torch.int64)

    ok = True
    sizes = []
    for it in range(steps):
        g = torch.Generator().manual_seed(1000 * it + rank)
        x = torch.randint(-50, 50, (n,), generator=g, dtype=torch.int32)
        ref = x.clone()
        dist.all_reduce(ref)
        bounds = _uneven_bounds(n, world_size, ["random", "zeros", "equal", "all_in_one"][it % 4])
        y, st = ring_all_reduce_coded(x.clone(), bounds, encode, decode)
        ok = ok and torch.equal(y, ref)
        sizes.append((st.rs_bytes, st.ag_bytes))
    return ok, sizes


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_coded_ring_matches_all_reduce(world_size):
    res = run_ranks(_coded_case, world_size, 333, 4, timeout=60)
    for ok, sizes in res:
        assert ok
        for rs, ag in sizes:
            assert len(rs) == world_size - 1 and len(ag) == world_size - 1
            assert all(b == 0 or b >= 8 for b in rs + ag)


def test_balanced_bounds_quantiles():
    costs = torch.tensor([1.0] * 10 + [9.0] * 10)  # total 100
    b = balanced_bounds(costs, 4)
    assert b[0] == 0 and b[-1] == 20 and b == sorted(b)
    sums = [float(costs[b[i]:b[i + 1]].sum()) for i in range(4)]
    assert chunk_imbalance(sums) < 1.3
    eq = equal_bounds(20, 4)
    eq_sums = [float(costs[eq[i]:eq[i + 1]].sum()) for i in range(4)]
    assert chunk_imbalance(eq_sums) > chunk_imbalance(sums)
    # degenerate inputs
    assert balanced_bounds(torch.zeros(7), 3) == equal_bounds(7, 3)
    assert balanced_bounds(torch.zeros(0), 3) == [0, 0, 0, 0]
    assert balanced_bounds(torch.tensor([5.0]), 3)[-1] == 1
    one_hot = torch.zeros(100)
    one_hot[50] = 1.0
    b = balanced_bounds(one_hot, 4)
    assert b[0] == 0 and b[-1] == 100 and b == sorted(b)
    assert balanced_bounds(torch.rand(50), 1) == [0, 50]
    assert equal_bounds(10, 3) == [0, 4, 7, 10]
    assert equal_bounds(2, 4) == [0, 1, 2, 2, 2]


def test_balanced_bounds_random_costs_are_balanced():
    g = torch.Generator().manual_seed(0)
    costs = torch.rand(10_000, generator=g) ** 4 * 10
    costs[:2000] *= 20
    b = balanced_bounds(costs, 4)
    sums = [float(costs[b[i]:b[i + 1]].sum()) for i in range(4)]
    assert chunk_imbalance(sums) < 1.01


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        equal_bounds(10, 0)
    with pytest.raises(ValueError, match="numel"):
        equal_bounds(-1, 2)
    with pytest.raises(ValueError, match="costs"):
        balanced_bounds(torch.tensor([1.0, -1.0]), 2)
    with pytest.raises(ValueError, match="costs"):
        balanced_bounds(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="costs"):
        balanced_bounds(torch.ones(2, 2), 2)
    with pytest.raises(ValueError, match="world_size"):
        balanced_bounds(torch.ones(3), 0)
    assert chunk_imbalance([]) == 1.0 and chunk_imbalance([0, 0]) == 1.0


def _bad_bounds(rank, world_size):
    errs = []
    for call in (
        lambda: ring_all_reduce(torch.ones(10), [0, 5, 9]),
        lambda: ring_all_reduce(torch.ones(10), [0, 6, 5, 10][: world_size + 1]),
        lambda: ring_all_reduce(torch.ones(2, 5), [0, 5, 10]),
        lambda: ring_all_reduce_coded(torch.ones(10), [0, 5, 10], None, None),
    ):
        try:
            call()
            errs.append(None)
        except ValueError as e:
            errs.append(str(e))
    return errs


def test_bad_bounds_raise_before_communicating():
    for errs in run_ranks(_bad_bounds, 2, timeout=60):
        assert all(e is not None for e in errs), errs
