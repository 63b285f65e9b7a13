"""Alpha-beta cost model and trace-driven simulator (gradsync.sim)."""

from __future__ import annotations

import json
import math

import pytest

from gradsync.compressors.covap_shards import CovapPlan

from gradsync.sim import (
    AlgorithmPlan,
    BucketPlan,
    CommStep,
    CovapSimPlan,
    DeARPlan,
    DensePlan,
    FP16Plan,
    Network,
    PeriodicPlan,
    PowerSGDPlan,
    TopKPlan,
    allgather_time,
    allreduce_time,
    collective_time,
    fit_alpha_beta,
    load_profile,
    make_plan,
    plot_scaling,
    reduce_scatter_time,
    simulate,
    sparse_allgather_time,
    sweep,
    synthetic_profile,
)

NET = Network(1.0, 1e-4)  # beta = 8e-9 s/B


# ------------------------------------------------------------------ cost model
def test_network_alpha_beta():
    assert NET.beta == pytest.approx(8e-9)
    assert NET.alpha == 1e-4
    assert Network.from_mbit(100).beta == pytest.approx(8e-8)
    n = Network.from_alpha_beta(2e-5, 8e-10)
    assert n.bandwidth_gbps == pytest.approx(10.0) and n.latency_s == 2e-5


def test_cost_formulas_hand_computed():
    # 2*3*1e-4 + 2*3/4 * 1e6 * 8e-9 = 6e-4 + 0.012
    assert allreduce_time(1e6, 4, NET) == pytest.approx(0.0126)
    # 3*1e-4 + 3/4 * 1e6 * 8e-9
    assert reduce_scatter_time(1e6, 4, NET) == pytest.approx(0.0063)
    assert allgather_time(1e6, 4, NET) == pytest.approx(0.0063)
    # 7*1e-4 + 7 * 1e5 * 8e-9
    assert sparse_allgather_time(1e5, 8, NET) == pytest.approx(0.0063)
    assert collective_time("allreduce", 1e6, 4, NET) == allreduce_time(1e6, 4, NET)
    # all-reduce = reduce-scatter + all-gather
    assert allreduce_time(3e6, 16, NET) == pytest.approx(
        reduce_scatter_time(3e6, 16, NET) + allgather_time(3e6, 16, NET))
    for f in (allreduce_time, reduce_scatter_time, allgather_time, sparse_allgather_time):
        assert f(1e9, 1, NET) == 0.0


def test_fit_alpha_beta_recovers_parameters():
    sizes = [1e4, 1e5, 1e6, 4e6]
    p = 4
    times = [2 * (p - 1) * 3e-4 + 2 * (p - 1) / p * s * 8e-8 for s in sizes]
    a, b = fit_alpha_beta(sizes, times, p)
    assert a == pytest.approx(3e-4, rel=1e-6) and b == pytest.approx(8e-8, rel=1e-6)
    # noise-free data through the origin: alpha clamps to >= 0
    a0, b0 = fit_alpha_beta([1e6, 2e6], [0.0075, 0.015], 2)
    assert a0 >= 0 and b0 == pytest.approx(7.5e-9, rel=1e-3)


@pytest.mark.parametrize("call", [
    lambda: Network(0.0),
    lambda: Network(-1.0),
    lambda: Network(float("nan")),
    lambda: Network(1.0, -1e-3),
    lambda: allreduce_time(1e6, 0, NET),
    lambda: allreduce_time(-1, 2, NET),
    lambda: allreduce_time(1e6, 2, "fast"),
    lambda: collective_time("broadcast", 1e6, 2, NET),
    lambda: fit_alpha_beta([1e6, 1e6], [0.1, 0.1], 2),
    lambda: fit_alpha_beta([1e6, 2e6], [0.1], 2),
    lambda: fit_alpha_beta([1e6, 2e6], [0.1, 0.2], 1),
    lambda: fit_alpha_beta([1e6, 2e6], [0.2, 0.1], 2),
])
def test_cost_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


def test_error_message_names_argument():
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        Network(0)
    with pytest.raises(ValueError, match="world_size"):
        allreduce_time(10, 0, NET)


# ------------------------------------------------------------------ simulator
def test_full_overlap_iteration_equals_compute():
    # 10 buckets of 4 kB, ready every 9 ms; each all-reduce takes ~3 us at 10 Gbit/s
    prof = synthetic_profile([1000] * 10, 0.02, 0.1, 0.005,
                             ready_s=[0.009 * (i + 1) for i in range(10)])
    r = simulate(prof, DensePlan(), 8, Network(10.0))
    assert r.iteration_s == pytest.approx(0.125)
    assert r.compute_s == pytest.approx(0.125)
    assert r.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    assert r.scaling_efficiency == pytest.approx(1.0)
    assert r.comm_s > 0


def test_no_overlap_iteration_is_compute_plus_comm():
    # 3 buckets of 1 MB all ready at the end of backward; P=2 at 1 Gbit/s: 8 ms each
    prof = synthetic_profile([250_000] * 3, 0.01, 0.03, 0.002, ready_s=[0.03] * 3)
    r = simulate(prof, "dense", 2, Network(1.0))
    assert r.iteration_s == pytest.approx(0.042 + 0.024)
    assert r.exposed_comm_s == pytest.approx(0.024)
    assert r.scaling_efficiency == pytest.approx(0.042 / 0.066)
    assert r.payload_bytes == pytest.approx(3e6)
    assert r.wire_bytes == pytest.approx(3e6)  # 2(P-1)/P * n per rank


def test_fifo_partial_overlap():
    # comm 8 ms each: bucket 0 runs 10-18 ms, bucket 1 waits for it: 18-26 ms; backward ends 20 ms
    prof = synthetic_profile([250_000] * 2, 0.0, 0.02, 0.0, ready_s=[0.010, 0.012])
    r = simulate(prof, DensePlan(), 2, Network(1.0))
    assert r.iteration_s == pytest.approx(0.026)
    assert r.exposed_comm_s == pytest.approx(0.006)


def test_world_size_one_has_no_comm():
    prof = synthetic_profile([10**6] * 4, 0.01, 0.03, 0.001)
    for plan in ("dense", "fp16", "covap:3", "topk:0.01", "powersgd:2", "dear"):
        assert simulate(prof, plan, 1, NET).iteration_s == pytest.approx(0.041)


def test_fp16_halves_bytes_and_charges_cast():
    prof = synthetic_profile([250_000] * 3, 0.01, 0.03, 0.002, ready_s=[0.03] * 3)
    r = simulate(prof, FP16Plan(cast_s_per_element=1e-9), 2, Network(1.0))
    assert r.payload_bytes == pytest.approx(1.5e6)
    assert r.compression_s == pytest.approx(750_000 * 1e-9)
    assert r.iteration_s == pytest.approx(0.042 + 0.012 + 750_000e-9)


def test_covap_shard_counts_hand_computed():
    # median 100: t = floor(n/100 - 0.3) -> 0,0,0,2,9 -> c = 1,1,1,3,min(10,4)
    assert CovapPlan.build([100, 100, 100, 250, 1000], 4).shards == (1, 1, 1, 3, 4)
    assert CovapPlan.build([100, 100, 100, 250, 1000], 1).shards == (1,) * 5


def test_covap_step_selection():
    prof = synthetic_profile([100, 100, 100, 250, 1000], 0.0, 0.01)
    plans = CovapSimPlan(4).bucket_plans(prof, 2, step=0)
    # global ids: b0 0, b1 1, b2 2, b3 3..5, b4 6..9; step 0 sends G in {0, 4, 8}
    sent = [bp.steps[0].nbytes / 4 if bp.steps else 0 for bp in plans]
    assert sent == [100, 0, 0, math.ceil((250 - 1) / 3), math.ceil((1000 - 2) / 4)]


def test_covap_k1_equals_dense():
    prof = synthetic_profile([300_000, 50_000, 2_000_000, 80_000, 700_000], 0.01, 0.05, 0.002)
    for ws in (2, 16):
        assert simulate(prof, CovapSimPlan(1), ws, NET) == simulate(prof, DensePlan(), ws, NET)


def test_covap_k4_sends_quarter_of_bytes():
    prof = synthetic_profile([300_000, 50_000, 2_000_000, 80_000, 700_000, 1_500_000],
                             0.01, 0.05, 0.002)
    dense = simulate(prof, DensePlan(), 8, NET)
    cov = simulate(prof, CovapSimPlan(4), 8, NET)
    assert cov.payload_bytes == pytest.approx(dense.payload_bytes / 4, rel=1e-9)
    assert cov.comm_s < dense.comm_s
    assert cov.iteration_s <= dense.iteration_s


def test_topk_sparse_allgather_bytes():
    prof = synthetic_profile([1000], 0.0, 0.01, ready_s=[0.01])
    r = simulate(prof, TopKPlan(0.01), 4, NET)
    # k=10: values 40 B and indices 40 B per rank; each all-gather 3*alpha + 3*40*beta
    expect = 2 * (3e-4 + 3 * 40 * 8e-9)
    assert r.iteration_s == pytest.approx(0.01 + expect)
    assert r.payload_bytes == 80


def test_powersgd_bytes_with_and_without_shapes():
    prof = load_profile({
        "schema": "gradsync-profile/1", "model": "m", "batch_size": 8, "dtype_bytes": 4,
        "forward_s": 0.0, "backward_s": 0.01, "optimizer_s": 0.0,
        "buckets": [{"index": 0, "numel": 64 * 576 + 64, "ready_s": 0.01,
                     "shapes": [[64, 64, 3, 3], [64]]}],
    })
    steps = PowerSGDPlan(4).bucket_plans(prof, 2, 0)[0].steps
    assert [s.nbytes for s in steps] == [64 * 4, 64 * 4 * 4, 576 * 4 * 4]
    # powersgd-overlap: the uncompressed tensors (float32) travel with P
    steps = PowerSGDPlan(4, fused=True).bucket_plans(prof, 2, 0)[0].steps
    assert [s.nbytes for s in steps] == [64 * 4 + 64 * 4 * 4, 576 * 4 * 4]
    sq = synthetic_profile([10**6], 0.0, 0.01)
    steps = PowerSGDPlan(2).bucket_plans(sq, 2, 0)[0].steps
    assert [s.nbytes for s in steps] == [1000 * 2 * 4, 1000 * 2 * 4]
    # a tiny bucket is not worth compressing: one uncompressed all-reduce
    tiny = synthetic_profile([16], 0.0, 0.01)
    steps = PowerSGDPlan(4).bucket_plans(tiny, 2, 0)[0].steps
    assert [s.nbytes for s in steps] == [64]
    r = simulate(sq, PowerSGDPlan(2, flops_per_s=1e12), 2, NET)
    assert r.compression_s == pytest.approx((6 * 1e6 * 2 + 2 * 2000 * 4) / 1e12)


class _TwoPhase(AlgorithmPlan):
    """Per bucket a 1 MB all-reduce at its ready time, then a 0.5 MB one in ``phase``."""

    def __init__(self, phase):
        self.phase = phase

    def bucket_plans(self, profile, world_size, step):
        return [BucketPlan((CommStep("allreduce", 1e6), CommStep("allreduce", 5e5, self.phase)))
                for _ in profile.buckets]


def test_a_hook_that_waits_for_the_previous_bucket_stalls_backward():
    # 2 ranks at 1 Gbit/s: 8 ms and 4 ms; buckets ready at 10 and 12 ms of a 20 ms backward
    prof = synthetic_profile([100, 100], 0.0, 0.02, ready_s=[0.010, 0.012])
    net = Network(1.0)
    # FIFO at ready time: P0 10-18, Q0 18-22, P1 22-30, Q1 30-34
    assert simulate(prof, _TwoPhase("backward"), 2, net).iteration_s == pytest.approx(0.034)
    # bucket 1's hook waits for P0 until 18 ms (6 ms stall), launches Q0 18-22 and P1 22-30; the last
    # hook, at 12 + 6 ms, waits for P1 until 30 (12 ms more), launches Q1 30-34; backward ends 20 + 18
    r = simulate(prof, _TwoPhase("next_hook"), 2, net)
    assert r.iteration_s == pytest.approx(0.038)
    assert r.payload_bytes == pytest.approx(3e6)
    # powersgd-overlap's plan launches its Q by the next hook
    shaped = load_profile({
        "schema": "gradsync-profile/1", "model": "m", "batch_size": 8, "dtype_bytes": 4,
        "forward_s": 0.0, "backward_s": 0.01, "optimizer_s": 0.0,
        "buckets": [{"index": 0, "numel": 64 * 576, "ready_s": 0.01, "shapes": [[64, 64, 3, 3]]}]})
    assert [s.phase for s in PowerSGDPlan(4, fused=True).bucket_plans(shaped, 2, 0)[0].steps] == \
        ["backward", "next_hook"]
    assert [s.phase for s in PowerSGDPlan(4).bucket_plans(shaped, 2, 0)[0].steps] == ["backward", "backward"]
    with pytest.raises(ValueError, match="phase must be one of backward, forward, next_hook"):
        CommStep("allreduce", 1.0, "later")


def test_dear_forward_overlap_single_bucket():
    # one 1 MB bucket, P=2, 1 Gbit/s: all-gather 4 ms before forward, reduce-scatter 4 ms after
    prof = synthetic_profile([250_000], 0.01, 0.03, 0.002, ready_s=[0.03])
    r = simulate(prof, DeARPlan(), 2, Network(1.0))
    assert r.iteration_s == pytest.approx(0.042 + 0.008)
    # many buckets: DeAR hides all-gathers under forward, so it beats dense here
    prof = synthetic_profile([250_000] * 8, 0.04, 0.04, 0.0)
    assert simulate(prof, "dear", 2, Network(1.0)).iteration_s < \
        simulate(prof, "dense", 2, Network(1.0)).iteration_s


def test_periodic_plan_mean_iteration_is_compute_plus_one_allreduce_per_period():
    # buckets ready during backward: a per-step all-reduce would overlap, the periodic sync must not
    prof = synthetic_profile([300_000, 50_000, 2_000_000, 80_000, 700_000], 0.01, 0.05, 0.002,
                             ready_s=[0.01, 0.02, 0.03, 0.035, 0.04])
    n = prof.total_numel
    for plan, net in ((PeriodicPlan(16), NET), (PeriodicPlan(4), NET),
                      (PeriodicPlan(16, fragments=4), Network(1.0)),  # no latency: F fragments = one sync
                      (PeriodicPlan(16, fragments=4, bytes_per_element=2), Network(1.0))):
        r = simulate(prof, plan, 8, net)
        one_sync = allreduce_time(n * plan.bytes_per_element, 8, net)
        assert r.iteration_s == pytest.approx(prof.compute_s + one_sync / plan.period, rel=0.01), plan.name
        assert r.payload_bytes == pytest.approx(n * plan.bytes_per_element / plan.period, rel=1e-12)
        assert r.exposed_comm_s == pytest.approx(one_sync / plan.period, rel=0.01)
    # one fragment per sync step, H/F steps apart; nothing at the other steps
    sent = [sum(s.nbytes for bp in PeriodicPlan(8, fragments=4).bucket_plans(prof, 2, t) for s in bp.steps)
            for t in range(8)]
    assert [b > 0 for b in sent] == [False, True] * 4 and sum(sent) == 4 * n
    assert make_plan("periodic:64").period == 64 and make_plan("periodic").period == 16


def test_an_overlapped_sync_is_charged_only_what_the_next_iterations_cannot_hide():
    prof = synthetic_profile([300_000, 700_000], 0.01, 0.03, 0.002, ready_s=[0.01, 0.03])
    per_sync = lambda net, period: allreduce_time(prof.total_numel * 4 / 4, 2, net)  # noqa: E731 (one fragment)
    compute = prof.compute_s
    for net, eta in ((Network(1.0), 1.0), (Network.from_mbit(5), 1.0), (Network.from_mbit(5), 0.5)):
        blocking = simulate(prof, PeriodicPlan(16, fragments=4), 2, net, eta).iteration_s
        hidden = simulate(prof, PeriodicPlan(16, fragments=4, overlap=3), 2, net, eta).iteration_s
        exposed = max(0.0, per_sync(net, 16) - eta * 3 * compute)
        assert hidden == pytest.approx(compute + 4 * exposed / 16, rel=1e-9)
        assert blocking == pytest.approx(compute + 4 * per_sync(net, 16) / 16, rel=1e-9)
    # at 1 Gbit/s a fragment's all-reduce (8 ms) hides under 3 iterations (126 ms): compute only
    assert simulate(prof, PeriodicPlan(16, fragments=4, overlap=3), 2, Network(1.0)).iteration_s == \
        pytest.approx(compute)
    assert "tau=3" in PeriodicPlan(16, fragments=4, overlap=3).name


def test_make_plan_specs():
    assert make_plan("dense").name == "dense"
    assert make_plan("allreduce").name == "dense"
    assert make_plan("covap:4").k == 4
    assert make_plan("covap").k == 3
    assert make_plan("topk:0.05").density == 0.05
    assert make_plan("powersgd:2").rank == 2
    assert isinstance(make_plan("dear"), DeARPlan)


@pytest.mark.parametrize("call", [
    lambda: make_plan("nope"),
    lambda: make_plan("covap:x"),
    lambda: make_plan("covap:0"),
    lambda: make_plan("fp16:3"),
    lambda: make_plan(""),
    lambda: CovapSimPlan(0),
    lambda: TopKPlan(0.0),
    lambda: TopKPlan(1.5),
    lambda: PowerSGDPlan(0),
    lambda: FP16Plan(-1.0),
    lambda: PeriodicPlan(0),
    lambda: PeriodicPlan(4, fragments=5),
    lambda: PeriodicPlan(4, bytes_per_element=0),
    lambda: PeriodicPlan(16, fragments=4, overlap=4),
    lambda: CommStep("allreduce", 8.0, "backward", 1),
    lambda: CovapPlan.build([], 2),
    lambda: simulate(synthetic_profile([10], 0, 1), "dense", 0, NET),
    lambda: simulate(synthetic_profile([10], 0, 1), "dense", 2, 1.0),
    lambda: simulate(synthetic_profile([10], 0, 1), 42, 2, NET),
    lambda: sweep(synthetic_profile([10], 0, 1), [], [2], [1.0]),
    lambda: plot_scaling([], "/tmp/x.png"),
])
def test_sim_bad_arguments(call):
    with pytest.raises(ValueError):
        call()


# ------------------------------------------------------------------ profile JSON
GOOD = {
    "schema": "gradsync-profile/1", "model": "resnet18-fmnist", "batch_size": 64,
    "dtype_bytes": 4, "forward_s": 0.010, "backward_s": 0.030, "optimizer_s": 0.002,
    "buckets": [{"index": 0, "numel": 123456, "ready_s": 0.012},
                {"index": 1, "numel": 654321, "ready_s": 0.030}],
    "device": "cpu",
}


def test_profile_round_trip(tmp_path):
    prof = load_profile(GOOD)
    path = tmp_path / "p.json"
    text = prof.to_json(path)
    assert json.loads(text)["schema"] == "gradsync-profile/1"
    again = load_profile(path)
    assert again == prof
    assert again.meta == {"device": "cpu"}
    assert again.total_bytes == (123456 + 654321) * 4
    assert load_profile(json.loads(text)) == prof


def _bad(**changes):
    d = json.loads(json.dumps(GOOD))
    for k, v in changes.items():
        if v is None:
            d.pop(k)
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("data,match", [
    (_bad(schema="gradsync-profile/2"), "schema"),
    (_bad(forward_s=None), "forward_s"),
    (_bad(batch_size=0), "batch_size"),
    (_bad(backward_s=-1.0), "backward_s"),
    (_bad(buckets=[]), "buckets"),
    (_bad(buckets=[{"index": 0, "numel": 10, "ready_s": 0.5}]), r"buckets\[0\].ready_s"),
    (_bad(buckets=[{"index": 0, "numel": 0, "ready_s": 0.01}]), r"buckets\[0\].numel"),
    (_bad(buckets=[{"index": 0, "numel": 5, "ready_s": 0.01},
                   {"index": 0, "numel": 5, "ready_s": 0.02}]), "duplicated"),
    (_bad(buckets=[{"index": 0, "numel": 5, "ready_s": 0.01, "shapes": [[2, 2]]}]), "shapes"),
    (_bad(buckets=[{"index": 0, "numel": 5}]), "ready_s"),
    (_bad(model=""), "model"),
])
def test_bad_profile_raises(data, match):
    with pytest.raises(ValueError, match=match):
        load_profile(data)


def test_ready_slightly_after_backward_is_clamped():
    d = _bad(buckets=[{"index": 0, "numel": 10, "ready_s": 0.0305}])
    assert load_profile(d).buckets[0].ready_s == 0.030


def test_bad_profile_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(p)
    with pytest.raises(ValueError):
        load_profile(42)


# ------------------------------------------------------------------ sweep and plot
def test_sweep_rows_and_plot(tmp_path):
    prof = synthetic_profile([2_000_000, 500_000, 3_000_000, 1_000_000], 0.02, 0.06, 0.005)
    plans = ["dense", "fp16", "covap:4", "topk:0.01", "powersgd:4"]
    rows = sweep(prof, plans, [2, 8, 64], [1.0, 10.0], latency_s=2e-5)
    assert len(rows) == 5 * 3 * 2
    for r in rows:
        assert 0 < r["scaling_efficiency"] <= 1
        if r["algorithm"] == "dense":
            assert r["speedup"] == 1.0
    # dense efficiency falls with world size at fixed bandwidth and rises with bandwidth
    eff = {(r["algorithm"], r["world_size"], r["bandwidth_gbps"]): r["scaling_efficiency"]
           for r in rows}
    assert eff[("dense", 64, 1.0)] < eff[("dense", 2, 1.0)]
    assert eff[("dense", 8, 10.0)] > eff[("dense", 8, 1.0)]
    out = plot_scaling(rows, tmp_path / "scaling.png", title="synthetic")
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_overlap_efficiency_stretches_only_the_overlapped_part():
    # one 4,000-byte bucket ready 0.2 s into a 1 s backward; its all-reduce costs 0.6 s at full rate
    prof = synthetic_profile([1000], forward_s=0.0, backward_s=1.0, ready_s=[0.2])
    net = Network.from_alpha_beta(0.0, 1.5e-4)
    assert allreduce_time(4000, 2, net) == pytest.approx(0.6)
    # full overlap: ends at 0.8 s, hidden under the 1 s backward
    assert simulate(prof, "dense", 2, net).iteration_s == pytest.approx(1.0)
    # at half rate the 0.8 s of overlap carries 0.4 s of work; the other 0.2 s runs after backward
    assert simulate(prof, "dense", 2, net, overlap_efficiency=0.5).iteration_s == pytest.approx(1.2)
    with pytest.raises(ValueError, match="overlap_efficiency"):
        simulate(prof, "dense", 2, net, overlap_efficiency=0.0)
