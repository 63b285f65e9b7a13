"""Wire bytes (what a rank puts on the network) are counted per collective kind and are comparable
across algorithms: checked on real 2- and 3-rank Gloo groups against the ring formulas, computed here
from the model's gradient size alone.

Formulas (P ranks; Patarasuk & Yuan, JPDC 2009): ring all-reduce of n bytes sends 2 (P-1)/P * n per
rank; all-gather of a contribution of m bytes sends (P-1) * m; reduce-scatter of n bytes and the
all-gather of its n/P-byte shards send (P-1)/P * n each; point-to-point rings: the bytes sent.
"""

import math

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.comm.collectives import WIRE_KINDS, wire_bytes

STEPS = 8
K = 4  # COVAP ratio
DENSITY = 0.05  # top-k density
KEYS = ("wire_bytes", "payload_bytes", "dense_wire_bytes")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))


N = sum(p.numel() for p in make_model().parameters())  # 2762 fp32 gradient elements: one DDP bucket
N_PARAMS = len(list(make_model().parameters()))


def ring_allreduce(nbytes: float, p: int) -> float:
    return 2 * (p - 1) / p * nbytes


def _batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]


def _per_step(stats_fn, step_fn, rank):
    steps = []
    for x, y in _batches(rank):
        before = stats_fn()
        step_fn(x, y)
        after = stats_fn()
        steps.append({k: after[k] - before[k] for k in KEYS + ("coded_bytes",) if k in after})
    return {"steps": steps, "stats": stats_fn()}


def _hook_run(rank, state, hook):
    model = make_model()
    ddp = DDP(model)  # 11 KB of gradients: one bucket
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    out = _per_step(state.stats, step, rank)
    if hasattr(state, "close"):
        state.close()
    return out


def _dear_run(rank):
    from gradsync.algorithms.dear import DeAR

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dear = DeAR(model, opt, fusion_mb=25.0)  # one fusion group

    def step(x, y):
        dear.zero_grad()
        nn.functional.cross_entropy(dear(x), y).backward()
        dear.step()  # launches this step's all-gather (counted here)

    out = _per_step(dear.stats, step, rank)
    dear.flush()
    return out


def _all_algorithms(rank, world):
    from gradsync.algorithms import build_hook
    from gradsync.algorithms.compressed import CompressedState, compressed_hook
    from gradsync.algorithms.oscar.splitting import OscarASCState, OscarSWState, oscar_hook

    out = {}
    for name, opts in (("allreduce", {}), ("fp16", {}), ("covap", {"ratio": K})):
        out[name] = _hook_run(rank, *build_hook(name, model=None, **opts))
    out["topk"] = _hook_run(rank, CompressedState("topk", density=DENSITY, error_feedback=True, start_iter=0),
                            compressed_hook)
    # sketch=False: part B is the whole bucket, so the sizes do not depend on the data
    out["oscar-sw"] = _hook_run(rank, OscarSWState(sketch=False), oscar_hook)
    out["oscar-asc"] = _hook_run(rank, OscarASCState(sketch=False), oscar_hook)
    out["dear"] = _dear_run(rank)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    p = request.param
    return p, run_ranks(_all_algorithms, p, timeout=300, pg_timeout=60)


def _check_steps(res, expected_wire, expected_payload, p):
    dense = ring_allreduce(4 * N, p)
    for t, s in enumerate(res["steps"]):
        assert s["dense_wire_bytes"] == pytest.approx(dense, rel=1e-12), t
        assert s["wire_bytes"] == pytest.approx(expected_wire(t), rel=1e-12, abs=1e-9), t
        assert s["payload_bytes"] == expected_payload(t), t
    st = res["stats"]
    assert st["wire_bytes"] == pytest.approx(sum(expected_wire(t) for t in range(STEPS)), rel=1e-12)
    assert st["dense_wire_bytes"] == pytest.approx(STEPS * dense, rel=1e-12)
    assert st["payload_bytes"] == sum(expected_payload(t) for t in range(STEPS))
    assert st["dense_payload_bytes"] == STEPS * 4 * N
    assert st["compression_ratio"] == pytest.approx(st["dense_wire_bytes"] / st["wire_bytes"], rel=1e-12)


def test_every_rank_reports_the_same_wire_bytes(runs):
    p, results = runs
    for name in results[0]:
        if name == "oscar-asc":  # entropy-coded hops differ between ranks
            continue
        for r in results[1:]:
            assert r[name]["stats"]["wire_bytes"] == results[0][name]["stats"]["wire_bytes"], name


def test_allreduce_and_fp16(runs):
    p, results = runs
    res = results[0]
    _check_steps(res["allreduce"], lambda t: ring_allreduce(4 * N, p), lambda t: 4 * N, p)
    assert res["allreduce"]["stats"]["compression_ratio"] == pytest.approx(1.0, rel=1e-12)
    _check_steps(res["fp16"], lambda t: ring_allreduce(2 * N, p), lambda t: 2 * N, p)
    assert res["fp16"]["stats"]["compression_ratio"] == pytest.approx(2.0, rel=1e-12)


def test_covap_sends_the_whole_bucket_every_kth_iteration(runs):
    # one bucket => one shard (c = 1), sent at iterations t with t % K == 0 (COVAP §3 round robin);
    # iterations 0 and 1 are the dense warm-up (start_iter = 2). Every compressed iteration's last
    # bucket also all-reduces the float32 finite vote (FiniteGuard): one more element of the sent
    # shard, or a 4-byte all-reduce of its own when the bucket is dropped.
    p, results = runs
    sent = [t < 2 or t % K == 0 for t in range(STEPS)]
    payload = [4 * N if t < 2 else (4 * N if sent[t] else 0) + 4 for t in range(STEPS)]
    res = results[0]["covap"]
    _check_steps(res, lambda t: ring_allreduce(payload[t], p), lambda t: payload[t], p)
    assert res["stats"]["compression_ratio"] == pytest.approx(STEPS * 4 * N / sum(payload), rel=1e-12)
    assert res["stats"]["buckets_skipped"] == STEPS - sum(sent)


def test_topk_all_gather_counts_every_other_ranks_block(runs):
    p, results = runs
    k = math.ceil(DENSITY * N)
    m = k * (4 + 4)  # float32 values + int32 indices, one padded block per rank (fixed size: no sizes gather)
    vote = ring_allreduce(4, p)  # the last bucket's 1-element float32 finite vote (FiniteGuard)
    res = results[0]["topk"]
    _check_steps(res, lambda t: (p - 1) * m + vote, lambda t: m + 4, p)
    assert res["stats"]["compression_ratio"] == pytest.approx(ring_allreduce(4 * N, p) / ((p - 1) * m + vote),
                                                              rel=1e-12)
    assert res["stats"]["last_step"]["wire_bytes"] == pytest.approx((p - 1) * m + vote, rel=1e-12)
    assert res["stats"]["last_step"]["dense_wire_bytes"] == pytest.approx(ring_allreduce(4 * N, p), rel=1e-12)


def test_dear_moves_the_traffic_of_an_all_reduce(runs):
    # reduce-scatter of the padded group buffer (gradients | one used flag per parameter | zeros up to
    # a multiple of P) and all-gather of its 1/P shard: (P-1)/P of the buffer each, like a ring
    # all-reduce of it; the ratio is 1 up to the flags and padding
    p, results = runs
    padded = -(-(N + N_PARAMS) // p) * p
    res = results[0]["dear"]
    assert res["stats"]["num_groups"] == 1
    _check_steps(res, lambda t: (p - 1) / p * 4 * padded + (p - 1) * 4 * padded // p,
                 lambda t: 4 * padded + 4 * padded // p, p)
    assert res["stats"]["compression_ratio"] == pytest.approx(N / padded, rel=1e-12)
    assert res["stats"]["compression_ratio"] == pytest.approx(1.0, abs=3e-3)
    assert res["stats"]["compression_ratio"] == pytest.approx(
        results[0]["allreduce"]["stats"]["compression_ratio"], abs=3e-3)


def test_oscar_sw_int8_all_reduce(runs):
    # after the 2 dense warm-up iterations: one float32 scale all-reduce (4 bytes) and one int8
    # all-reduce of the whole bucket (P * levels <= 127)
    p, results = runs
    res = results[0]["oscar-sw"]
    _check_steps(res, lambda t: ring_allreduce(4 * N if t < 2 else 4 + N, p), lambda t: 4 * N if t < 2 else 4 + N, p)
    assert res["stats"]["wire_bytes_per_step"] == pytest.approx(ring_allreduce(4 + N, p), rel=1e-12)


def test_oscar_asc_ring_counts_the_bytes_sent(runs):
    # the ASC ring is point-to-point: its wire bytes are the hops as sent (RingStats, 8-byte length
    # headers included), plus the scale all-reduce
    p, results = runs
    for r in results:
        res = r["oscar-asc"]
        for t, s in enumerate(res["steps"]):
            if t < 2:
                assert s["wire_bytes"] == pytest.approx(ring_allreduce(4 * N, p), rel=1e-12)
                continue
            ring = s["coded_bytes"]
            assert ring >= 2 * (p - 1) * 8  # at least the headers of 2 (P-1) hops
            assert s["wire_bytes"] == pytest.approx(ring_allreduce(4, p) + ring, rel=1e-12)
            assert s["payload_bytes"] == 4 + ring
            assert s["wire_bytes"] < ring_allreduce(N, p)  # coded below the int8 all-reduce


def test_stats_keys():
    from gradsync.algorithms.base import HookState

    st = HookState().stats()
    assert {"wire_bytes", "dense_wire_bytes", "payload_bytes", "dense_payload_bytes",
            "compression_ratio"} <= set(st)
    assert "bytes_sent" not in st and "dense_bytes" not in st


@pytest.mark.parametrize("kind, payload, p, expected", [
    ("allreduce", 1200, 3, 1600.0), ("allreduce", 1000, 1, 0.0), ("allgather", 100, 4, 300.0),
    ("reduce_scatter", 1200, 4, 900.0), ("broadcast", 1200, 4, 900.0), ("p2p", 77, 3, 77.0),
    ("allgather", 100, 1, 0.0),
])
def test_wire_bytes_formulas(kind, payload, p, expected):
    assert wire_bytes(kind, payload, p) == pytest.approx(expected, rel=1e-15)


def test_sharded_all_gather_equals_reduce_scatter():
    for p in (2, 3, 4, 8):
        n = 4 * 12 * p
        assert wire_bytes("allgather", n // p, p) == pytest.approx(wire_bytes("reduce_scatter", n, p))
        assert (wire_bytes("allgather", n // p, p) + wire_bytes("reduce_scatter", n, p)
                == pytest.approx(wire_bytes("allreduce", n, p)))


@pytest.mark.parametrize("args, match", [
    (("gather", 10, 2), "kind must be one of " + ", ".join(WIRE_KINDS)),
    (("allreduce", -1, 2), "payload_bytes must be >= 0"),
    (("allreduce", 10, 0), "world_size must be an int >= 1"),
    (("allreduce", 10, 2.5), "world_size must be an int >= 1"),
])
def test_wire_bytes_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        wire_bytes(*args)
