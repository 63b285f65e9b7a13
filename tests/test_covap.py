"""COVAP and the dense baselines on real 2-rank Gloo groups.

Tolerances: the ``allreduce`` hook must match DDP bitwise; COVAP with K=1 must match dense
all-reduce within rtol=1e-6/atol=1e-7 (float32 sums in a different grouping).
"""

import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from small_mlp import backward_step, batch, flat_grad, make_model
from gradsync.algorithms import AllReduceState, CovapPlan, CovapState, allreduce_hook, covap_hook
from gradsync.comm.agreement import ConfigMismatchError, check_config_agreement


def grads_per_step(rank, world, algorithm, steps, ratio=1, lam0=None, dense_from=0):
    """Flat gradients after each of ``steps`` backward passes (no optimizer step, so the
    gradients depend only on the data and the hook)."""
    model = DDP(make_model(), bucket_cap_mb=0.01)
    state = None
    if algorithm == "allreduce":
        state = AllReduceState()
        model.register_comm_hook(state, allreduce_hook)
    elif algorithm == "covap":
        state = CovapState(ratio=ratio, lam0=lam0, ramp_steps=10, dense_from=dense_from)
        model.register_comm_hook(state, covap_hook)
    out = []
    for step in range(steps):
        backward_step(model, rank, step)
        out.append(flat_grad(model.module).clone())
    return out, (state.stats() if state else None)


def test_allreduce_hook_is_bitwise_ddp():
    ref = run_ranks(grads_per_step, 2, "ddp", 4)
    got = run_ranks(grads_per_step, 2, "allreduce", 4)
    for r in range(2):
        for a, b in zip(ref[r][0], got[r][0]):
            assert torch.equal(a, b)
    stats = got[0][1]
    n_bytes = 4 * sum(p.numel() for p in make_model().parameters()) * 4  # 4 steps of float32 gradients
    assert stats["payload_bytes"] == stats["dense_payload_bytes"] == n_bytes
    assert stats["wire_bytes"] == stats["dense_wire_bytes"] == n_bytes  # ring all-reduce, 2 ranks: 2 (P-1)/P = 1
    assert stats["compression_ratio"] == 1.0


def test_covap_k1_equals_dense():
    ref = run_ranks(grads_per_step, 2, "ddp", 6)
    got = run_ranks(grads_per_step, 2, "covap", 6, 1)
    for r in range(2):
        for a, b in zip(ref[r][0], got[r][0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert got[0][1]["buckets_skipped"] == 0


def test_covap_schedule_sends_each_element_once_every_k_steps():
    k, start = 3, 2
    res = run_ranks(grads_per_step, 2, "covap", start + 3 * k, k)
    (g0, stats0), (g1, _) = res
    assert stats0["shards"], "the plan was built"
    assert max(stats0["shards"]) > 1, "the test model should have a bucket split into shards"
    for step in range(start, start + 3 * k):
        assert torch.equal(g0[step], g1[step]), "both ranks apply the same averaged gradient"
    for window in range(start, start + 2 * k + 1):
        sent = torch.stack([g0[s] != 0 for s in range(window, window + k)]).sum(0)
        assert torch.all(sent == 1), f"every element sent exactly once in steps {window}..{window + k - 1}"
    assert stats0["buckets_skipped"] > 0
    assert stats0["compression_ratio"] > 1.5


def test_plan_median_rule_and_round_robin():
    plan = CovapPlan.build([100, 100, 1000, 50, 400], ratio=4)
    # median 100: t = floor(n/100 - 0.3) -> 0, 0, 9, -1, 3 -> c = 1, 1, min(10,4)=4, 1, 4
    assert plan.shards == (1, 1, 4, 1, 4)
    assert plan.offsets == (0, 1, 2, 6, 7)
    for t in range(8):
        for b in range(5):
            s = plan.selected_shard(b, t)
            hits = [s2 for s2 in range(plan.shards[b]) if (plan.offsets[b] + s2 + t) % 4 == 0]
            assert (s is None and not hits) or hits == [s]
    mean = sum(plan.sent_fraction(t) for t in range(4)) / 4
    assert mean == pytest.approx(0.25, abs=0.02)
    assert CovapPlan.build([10, 10, 10], 1).shards == (1, 1, 1)


def ef_mass(rank, world, steps):
    model = DDP(make_model(), bucket_cap_mb=0.01)
    state = CovapState(ratio=4, lam0=1.0, ramp_steps=1)
    raw = torch.zeros((), dtype=torch.float64)

    def hook(st, bucket):
        nonlocal raw
        raw += bucket.buffer().double().sum()
        return covap_hook(st, bucket)

    model.register_comm_hook(state, hook)
    applied = torch.zeros((), dtype=torch.float64)
    for step in range(steps):
        backward_step(model, rank, step)
        applied += flat_grad(model.module).double().sum()
    totals = torch.stack([raw, state.filter.memory.total()])
    dist.all_reduce(totals)
    return float(applied), float(totals[0] / world), float(totals[1] / world)


def test_error_feedback_conserves_gradient_mass():
    for applied, mean_raw, mean_residual in run_ranks(ef_mass, 2, 11):
        # sum of applied (averaged) updates + mean residual == mean of the summed local gradients,
        # up to float32 rounding of the per-step arithmetic
        assert applied + mean_residual == pytest.approx(mean_raw, rel=1e-6, abs=1e-6)
        assert abs(mean_residual) > 0  # something is still held back


def mismatch(rank, world):
    state = CovapState(ratio=3 + rank)
    t0 = time.monotonic()
    try:
        check_config_agreement(state.config())
    except ConfigMismatchError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_config_mismatch_raises_on_every_rank_quickly():
    for message, seconds in run_ranks(mismatch, 2, timeout=30):
        assert message is not None
        assert "'ratio'" in message and "rank 0 = 3" in message and "rank 1 = 4" in message
        assert seconds < 5


def test_dense_tail_flushes_the_residual_and_then_equals_dense():
    """K=3 until iteration 7, K=1 from there: iteration 7 sends every element, the residuals held
    included (its gradient sum over both ranks exceeds dense's by what was unsent), and from
    iteration 8 on the gradients are dense all-reduce's (rtol 1e-6, atol 1e-7)."""
    steps, dense_from = 10, 7
    ref = run_ranks(grads_per_step, 2, "ddp", steps)
    got = run_ranks(grads_per_step, 2, "covap", steps, 3, None, dense_from)
    k3 = run_ranks(grads_per_step, 2, "covap", dense_from, 3)
    for r in range(2):
        for step in range(dense_from):  # identical to the run without a tail up to the switch
            assert torch.equal(got[r][0][step], k3[r][0][step])
        assert torch.all(got[r][0][dense_from] != 0), "the switch iteration sends every element"
        assert not torch.allclose(got[r][0][dense_from], ref[r][0][dense_from]), "it carries the flushed residual"
        for step in range(dense_from + 1, steps):
            torch.testing.assert_close(got[r][0][step], ref[r][0][step], rtol=1e-6, atol=1e-7)
    stats = got[0][1]
    assert stats["covap_k"] == 1 and stats["buckets_skipped"] == k3[0][1]["buckets_skipped"]


@pytest.mark.parametrize("kwargs, name", [
    ({"dense_from": 1}, "dense_from"), ({"dense_from": -1}, "dense_from"),
    ({"ratio": 0}, "ratio"), ({"ratio": 33}, "ratio"), ({"ratio": 2.5}, "ratio"),
    ({"start_iter": 1}, "start_iter"), ({"lam0": 1.5}, "lam0"), ({"ramp_steps": 0}, "ramp_steps"),
])
def test_bad_arguments_raise_value_error(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CovapState(**kwargs)


def test_plan_rejects_bad_layout():
    with pytest.raises(ValueError, match="numels"):
        CovapPlan.build([], 2)
    with pytest.raises(ValueError, match="ratio"):
        CovapPlan.build([10], 0)


def test_state_dict_and_pickle_round_trip():
    st = CovapState(ratio=4)
    st.iteration = 7
    st.layouts = {0: ((10,),), 1: ((30,),)}
    st.filter.memory.store(0, torch.arange(10.0))
    clone = CovapState(ratio=2)
    clone.load_state_dict(st.state_dict())
    assert clone.ratio == 4 and clone.iteration == 7 and clone.layouts == {0: ((10,),), 1: ((30,),)}
    assert torch.equal(clone.filter.memory.residuals[0], torch.arange(10.0))
    restored = pickle.loads(pickle.dumps(st))
    assert restored.iteration == 7 and torch.equal(restored.filter.memory.residuals[0], torch.arange(10.0))


def _steps(ddp, opt, rank, steps, state, per_step=None):
    for step in steps:
        before = state.stats()["payload_bytes"]
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if per_step is not None:
            per_step.append(state.stats()["payload_bytes"] - before)


def _covap_ddp(module, state=None):
    ddp = DDP(module, bucket_cap_mb=0.001)
    state = state or CovapState(ratio=4, model=module)
    ddp.register_comm_hook(state, covap_hook)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.05)


def restore_into_fresh_ddp(rank, world, steps_before, steps_after, saved_dtype=None):
    """Train, save the COVAP state, restore it into a fresh DDP (buckets not rebuilt yet) and go on;
    compare with the same run uninterrupted. ``saved_dtype``: the saved residuals are converted to
    it first (a stand-in for a checkpoint restored on another device than the buckets')."""
    torch.manual_seed(0)
    reference = make_model()
    ddp, state, opt = _covap_ddp(reference)
    _steps(ddp, opt, rank, range(steps_before + steps_after), state)

    torch.manual_seed(0)
    module = make_model()
    ddp, state, opt = _covap_ddp(module)
    _steps(ddp, opt, rank, range(steps_before), state)
    saved = state.state_dict()
    if saved_dtype is not None:
        memory = saved["filter"]["memory"]
        memory["residuals"] = {k: v.to(saved_dtype) for k, v in memory["residuals"].items()}
    restored = CovapState(ratio=4, model=module)
    restored.load_state_dict(saved)
    fresh, restored, opt = _covap_ddp(module, restored)
    per_step: list[int] = []
    _steps(fresh, opt, rank, range(steps_before, steps_before + 1), restored, per_step)
    kinds = {(str(e.device), e.dtype) for e in restored.filter.memory.residuals.values()}
    _steps(fresh, opt, rank, range(steps_before + 1, steps_before + steps_after), restored, per_step)
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (reference, module)]
    dense = sum(p.numel() for p in module.parameters()) * 4
    return (per_step, dense, flat[0], flat[1], float(state.filter.memory.total()), restored.iteration,
            restored.remapped_buckets, kinds)


def test_restored_state_continues_the_uninterrupted_run():
    """A CovapState restored into a fresh DDP used to crash the first backward ('bucket layout
    changed'). Now the iteration before DDP's bucket rebuild finds every parameter by name in the
    recorded layout, so the resumed run equals the uninterrupted one (bitwise at 2 ranks)."""
    r0, r1 = run_ranks(restore_into_fresh_ddp, 2, 5, 4, timeout=120)
    per_step, dense, reference, resumed, residual_mass, iteration, remapped, _ = r0
    assert remapped > 0, "the fresh DDP's first layout differs from the recorded one"
    assert residual_mass != 0.0, "residuals were saved"
    assert all(b < dense / 2 for b in per_step), f"compressed from the first step: {per_step} vs dense {dense}"
    assert iteration == 9
    assert torch.equal(resumed, reference), f"max diff {(resumed - reference).abs().max()}"
    assert torch.equal(resumed, r1[3]), "replicas identical"


def test_restored_residuals_move_to_the_buckets_device_and_dtype():
    """A checkpoint restored with ``map_location="cpu"`` holds CPU residuals; the buckets compressed
    through the recorded layout (before DDP's rebuild) used them in place, so CUDA buckets crashed.
    No second device here: float64 residuals stand in for "not the bucket's device/dtype" (the same
    ``.to(device, float32)`` moves both); after the first resumed step every residual is float32 on
    the bucket's device and the run still equals the uninterrupted one bitwise."""
    r0, r1 = run_ranks(restore_into_fresh_ddp, 2, 5, 3, torch.float64, timeout=120)
    for r in (r0, r1):
        reference, resumed, remapped, kinds = r[2], r[3], r[6], r[7]
        assert remapped > 0
        assert kinds == {("cpu", torch.float32)}, kinds
        assert torch.equal(resumed, reference), f"max diff {(resumed - reference).abs().max()}"
