"""The probe (gradsync.profiler.probe) on 2 real Gloo ranks: the relative error of each setting against
dense all-reduce on the same gradients (exact settings 0, fp16 near 0, PowerSGD's error falling with its
rank), identical on every rank; the meter with a primary hook trains exactly as that hook alone; timed
candidates report positive times, identical on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distributed import run_ranks
from gradsync.profiler.probe import RACE_MIN_STEPS, TIMED_STEPS


def _job(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(8)]
    return model, batches


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


ENTRIES = ["allreduce", "fp16", "powersgd-overlap:matrix_approximation_rank=1",
           "powersgd-overlap:matrix_approximation_rank=4", "powersgd:matrix_approximation_rank=4",
           "covap:ratio=2:cast=fp16", "topk:density=0.1"]


def _quality(rank, world):
    from gradsync.profiler.probe import _ProbeCopy, cast_errors, measure_quality, time_candidates

    model, batches = _job(rank)
    before = [p.detach().clone() for p in model.parameters()]
    errors = measure_quality(model, batches, F.cross_entropy, _optimizer, ENTRIES, bucket_cap_mb=0.005).errors
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # a copy was probed
    timed = time_candidates(model, batches, F.cross_entropy, _optimizer, ["allreduce", "fp16"], bucket_cap_mb=0.005)
    # fp16 a thousand times the steps to quality: dropped from the race as soon as any entry may be
    raced = time_candidates(model, batches, F.cross_entropy, _optimizer, ["allreduce", "fp16"], bucket_cap_mb=0.005,
                            factors={"allreduce": 1.0, "fp16": 1000.0})
    casts = cast_errors(model, batches[0], F.cross_entropy, ["fp16", "bf16"])
    # a copy's start step rebuilds DDP's buckets without training; the candidate compresses from its first step
    copy = _ProbeCopy(model, ["powersgd-overlap:matrix_approximation_rank=1"], batches, F.cross_entropy, _optimizer,
                      0.005, None, 0, 0)
    untrained = all(torch.equal(a, b) for a, b in zip(copy.local.parameters(), model.parameters()))
    state = copy.meter.hooks[0][0]
    started = state.stats()["wire_bytes"]
    copy.train(1)
    first = state.stats()
    copy.close()
    timed = {e: (p.iteration_s, p.wire_bytes_per_step, p.timed_steps, raced[e].timed_steps) for e, p in timed.items()}
    return (errors, timed, casts,
            (len(copy.meter.hooks), untrained, started, first["wire_bytes"], first["dense_wire_bytes"]))


def test_errors_against_dense_are_exact_for_exact_settings_and_the_same_on_every_rank():
    (e0, t0, c0, s0), (e1, t1, c1, s1) = run_ranks(_quality, 2, timeout=180)
    assert e0 == e1 and t0 == t1 and c0 == c1  # every rank decides alike
    hooks, untrained, started, wire, dense = s0
    assert untrained, "the start step only rebuilt DDP's buckets: the copy is still the job's model"
    assert hooks == 1 and started == 0, "the start step ran the rebuild-only hook, not the candidate, and dropped it"
    assert 0 < wire < dense / 4, "no dense start iterations: the candidate compressed its first step"
    # the casts' error without communication: 11 and 8 significant bits; the metered fp16 error is as small
    assert 0 < c0["fp16"] < c0["bf16"] < 1e-2 and e0["fp16"] < 10 * c0["fp16"]
    assert e0["allreduce"] < 1e-6  # the same arithmetic as the reference (summation order aside)
    assert 0 < e0["fp16"] < 1e-3  # one rounding to 11 significant bits
    r1, r4 = e0["powersgd-overlap:matrix_approximation_rank=1"], e0["powersgd-overlap:matrix_approximation_rank=4"]
    assert 0.05 < r4 < r1 < 2  # a higher rank keeps more of the gradient
    assert e0["powersgd:matrix_approximation_rank=4"] == r4  # torch's PowerSGD is measured as the overlapped one
    assert 0.1 < e0["covap:ratio=2:cast=fp16"] < 2 and 0.1 < e0["topk:density=0.1"] < 2
    assert all(s > 0 for s, *_ in t0.values())
    assert t0["fp16"][1] == t0["allreduce"][1] / 2  # half the wire bytes of the dense all-reduce
    assert t0["fp16"][2] == t0["allreduce"][2] == TIMED_STEPS  # no factors: no race
    assert t0["fp16"][3] == t0["allreduce"][3] == RACE_MIN_STEPS  # the race ended when fp16 was dropped


def test_a_race_drops_an_entry_clearly_slower_to_quality_and_stops_on_a_tie():
    from gradsync.profiler.probe import RACE_TIE, race

    # 2 x noise intervals: b's [1.21, 1.31] lies above a's [0.95, 1.05]; c's [0.93, 1.30] overlaps it
    assert race({"a": 1.0, "b": 1.26, "c": 1.1}, {"a": 0.025, "b": 0.02, "c": 0.09}) == (["a", "c"], False)
    assert race({"a": 1.0, "b": 1.26}, {"a": 0.025, "b": 0.02}) == (["a"], True)
    # overlapping, but all within the tie: more steps would choose between settings at most RACE_TIE apart
    near = 1 + RACE_TIE / 4
    assert race({"a": 1.0, "b": near}, {"a": 0.005, "b": 0.005}) == (["a", "b"], True)
    assert race({"a": 1.0, "b": near}, {"a": 0.05, "b": 0.05}) == (["a", "b"], False)  # too noisy to call a tie
    assert race({"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}) == (["a", "b"], True)


def _primary(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.algorithms import build_hook
    from gradsync.profiler.probe import QualityMeter, metered_hook

    out = []
    for metered in (False, True):
        model, batches = _job(rank)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
        state, hook = build_hook("powersgd-overlap", model=model, matrix_approximation_rank=2)
        meter = QualityMeter([(state, hook)], primary=0)
        if metered:
            ddp.register_comm_hook(meter, metered_hook)
        else:
            ddp.register_comm_hook(state, hook)
        opt = _optimizer(ddp.parameters())
        for i, (x, y) in enumerate(batches):
            meter.on = i % 2 == 1
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        out.append(([p.detach().clone() for p in model.parameters()], meter.sums()))
    return out


def test_a_metered_primary_hook_trains_exactly_as_the_hook_alone():
    for (plain, _), (metered, sums) in run_ranks(_primary, 2, timeout=180):
        assert all(torch.equal(a, b) for a, b in zip(plain, metered))
        assert sums[0, 0] > 0 and sums[0, 1] > 0  # measured on the odd steps


def _script(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    import gradsync

    model, batches = _job(rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state, decision = gradsync.register_auto(ddp, opt, batches, F.cross_entropy)
    for x, y in batches[:3]:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return decision.entry, decision.advice.reason, state.stats()["wire_bytes"] > 0, ddp.gradsync_state is state


def test_register_auto_in_a_script_chooses_alike_on_every_rank_and_trains():
    from gradsync.algorithms import REGISTRY, parse_entry

    (e0, why, sent, same), (e1, _, _, _) = run_ranks(_script, 2, timeout=180)
    # the choice depends on this machine's load (loopback all-reduce vs backward): only what holds for any
    spec = REGISTRY[parse_entry(e0)[0]]
    assert e0 == e1 and spec.make_hook is not None and not spec.single_bucket  # a hook for the script's buckets
    assert why.startswith("CCR ") and sent and same


def _sampled(rank, world):
    from gradsync.profiler.probe import measure_quality

    model, batches = _job(rank)
    entries = ["allreduce", "fp16", "powersgd-overlap:matrix_approximation_rank=1"]
    return [measure_quality(model, batches, F.cross_entropy, _optimizer, entries, bucket_cap_mb=0.005,
                            reference_fraction=f) for f in (1.0, 0.25)]


def test_a_sampled_reference_estimates_the_error_and_copies_precede_the_primary():
    (full, sampled), (full1, sampled1) = run_ranks(_sampled, 2, timeout=180)
    assert full == full1 and sampled == sampled1
    assert abs(sampled.noise - full.noise) < 0.15 * full.noise
    full, sampled = full.errors, sampled.errors
    for errors in (full, sampled):
        assert errors["allreduce"] < 1e-6
        # the metered hooks' copies are taken before the primary (allreduce) all-reduces the bucket in place
        assert 0 < errors["fp16"] < 1e-3
    r1 = "powersgd-overlap:matrix_approximation_rank=1"
    # a quarter of every tensor's elements, 8 steps of a 4.4 k-parameter model: within 15 %
    assert abs(sampled[r1] - full[r1]) < 0.15 * full[r1]


def test_the_meter_refuses_a_sample_without_a_primary_and_fractions_outside_0_1():
    import pytest

    from gradsync.profiler.probe import QualityMeter

    with pytest.raises(ValueError, match="primary"):
        QualityMeter([], primary=None, sample_fraction=0.5)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="sample_fraction"):
            QualityMeter([], primary=0, sample_fraction=bad)


def test_optimizer_factory_rebuilds_the_jobs_optimizer_adamw_included():
    # torch's AdamW keeps decoupled_weight_decay in its defaults but does not take it: register_auto's
    # type(opt)(params, **opt.defaults) raised TypeError for every AdamW job
    from gradsync.profiler.auto import optimizer_factory

    model = torch.nn.Linear(3, 2)
    for opt in (torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05),
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)):
        copy = optimizer_factory(opt)(torch.nn.Linear(3, 2).parameters())
        assert type(copy) is type(opt)
        keys = ("lr", "weight_decay")
        assert {k: copy.defaults[k] for k in keys} == {k: opt.defaults[k] for k in keys}


def _copies(rank, world):
    from gradsync.comm.agreement import replicas_agree
    from gradsync.profiler.probe import _ddp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    same = replicas_agree(model)
    with torch.no_grad():
        if rank == 1:
            model[1].running_mean[0] += 1e-7  # a buffer, one element, the last bits
    differ = replicas_agree(model)
    _ddp(model, None, 25.0)  # differing replicas: DDP still broadcasts rank 0's state
    return same, differ, replicas_agree(model), model[1].running_mean.tolist()


def test_a_probe_copy_skips_ddps_broadcast_only_where_every_rank_holds_the_same_state():
    (same, differ, after, mean0), (same1, differ1, after1, mean1) = run_ranks(_copies, 2, timeout=120)
    assert same and same1, "equal replicas agree on every rank"
    assert not differ and not differ1, "one element of one buffer on one rank is a disagreement, on every rank"
    assert after and after1 and mean0 == mean1 == [0.0, 0.0, 0.0], "the differing copy got rank 0's state"


def _staged(rank, world):
    from gradsync.profiler.probe import QualityProbe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 4))
    _, batches = _job(rank)
    r1, r2, r4 = (f"powersgd-overlap:matrix_approximation_rank={r}" for r in (1, 2, 4))
    together = QualityProbe(model, batches, F.cross_entropy, _optimizer, [r1, r2, r4], 0.005)
    staged = QualityProbe(model, batches, F.cross_entropy, _optimizer, [r1, r4], 0.005)
    staged.measure([r2, "powersgd:matrix_approximation_rank=2"])
    together.close(), staged.close()
    assert together.noise == staged.noise and together.family == "sgd"  # the optimizer's family, read from it
    adam = QualityProbe(model, batches, F.cross_entropy, lambda p: torch.optim.AdamW(p, lr=1e-3), [r1], 0.005)
    adam.close()
    assert adam.family == "adaptive" and adam.errors[r1] == together.errors[r1]  # the error does not depend on it
    return together.errors, staged.errors


def _direct_noise(model, batches, world, train):
    """The gradient noise over the probe's measured steps (the job's first batches) from each rank's own gradient
    and the all-reduced average; with ``train`` a copy of ``model`` steps on that average after each."""
    import copy

    import torch.distributed as dist

    from gradsync.profiler.probe import QUALITY_STEPS

    local = copy.deepcopy(model)
    opt = _optimizer(local.parameters())
    sums = torch.zeros(2, dtype=torch.float64)
    for x, y in batches[:QUALITY_STEPS]:
        opt.zero_grad()
        F.cross_entropy(local(x), y).backward()
        g = torch.cat([p.grad.flatten() for p in local.parameters()]).double()
        d = g.clone()
        dist.all_reduce(d)
        d /= world
        sums += torch.stack([(g - d).pow(2).sum(), d.pow(2).sum()])
        if train:
            offset = 0
            for p in local.parameters():
                p.grad.copy_(d[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            opt.step()
    dist.all_reduce(sums)
    return float((sums[0] / sums[1]).sqrt())


def _noise(rank, world):
    from gradsync.profiler.probe import measure_quality

    model, batches = _job(rank)
    measured = measure_quality(model, batches, F.cross_entropy, _optimizer, ["fp16"], bucket_cap_mb=0.005,
                               reference_fraction=1.0)
    return measured.noise, _direct_noise(model, batches, world, train=False)


def _training_noise(rank, world):
    from gradsync.profiler.probe import measure_quality

    model, batches = _job(rank)
    before = [p.detach().clone() for p in model.parameters()]
    entries = ["allreduce", "fp16", "powersgd-overlap:matrix_approximation_rank=4"]
    measured = measure_quality(model, batches, F.cross_entropy, _optimizer, entries, bucket_cap_mb=0.005,
                               reference_fraction=1.0, training_base="fp16")
    frozen = measure_quality(model, batches, F.cross_entropy, _optimizer, entries, bucket_cap_mb=0.005,
                             reference_fraction=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # a copy trained
    return measured, frozen, _direct_noise(model, batches, world, train=True)


def test_errors_measured_while_the_copy_trains_on_a_base_setting():
    """``training_base``: the copy steps its optimizer on fp16's aggregate while every entry is metered beside it
    (what a probe riding on a job's first steps sees): the noise is that of a model trained on the dense
    average (fp16 rounding apart), not the frozen model's; exact and near-exact entries stay near 0."""
    (measured, frozen, direct), (measured1, frozen1, direct1) = run_ranks(_training_noise, 2, timeout=180)
    assert measured == measured1 and frozen == frozen1 and direct == direct1  # every rank alike
    # (here the frozen model's noise lies 1.1 % off; fp16's rounding moves the trained one by ~4e-8)
    assert abs(measured.noise - direct) < 1e-5 * direct and abs(frozen.noise - measured.noise) > 5e-3 * direct
    assert measured.errors["allreduce"] < 1e-6 and 0 < measured.errors["fp16"] < 1e-3
    assert 0.05 < measured.errors["powersgd-overlap:matrix_approximation_rank=4"] < 2


def test_the_gradient_noise_is_one_ranks_gradient_against_the_dense_average():
    """The unit of the quality model: sqrt(mean over ranks of sum ||g_i - d||^2 / sum ||d||^2) over the
    measured steps, computed here from each rank's own gradients and their all-reduced average."""
    (noise, direct), (noise1, direct1) = run_ranks(_noise, 2, timeout=180)
    assert noise == noise1 and direct == direct1
    assert 0.05 < noise < 2 and abs(noise - direct) < 1e-6 * direct


def test_an_entry_measured_later_has_the_error_it_has_measured_with_the_others():
    """The probe's copy does not train while it measures, the reference samples the same positions and
    dropout draws the same masks at every measurement: auto can measure a costly candidate only when
    the cheaper ones' errors leave it a chance, and get the number measuring all at once gives."""
    (together, staged), (together1, staged1) = run_ranks(_staged, 2, timeout=180)
    assert together == staged and together == together1 and staged == staged1
    assert 0 < together["powersgd-overlap:matrix_approximation_rank=4"] < together[
        "powersgd-overlap:matrix_approximation_rank=1"]


def _compression(rank, world):
    import torch.distributed as dist

    from gradsync.profiler.probe import compression_seconds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    before = [p.detach().clone() for p in model.parameters()]
    g = torch.Generator().manual_seed(10 + rank)
    batch = (torch.randn(16, 256, generator=g), torch.randint(0, 4, (16,), generator=g))
    entries = ["fp16", "powersgd-overlap:matrix_approximation_rank=4", "powersgd:matrix_approximation_rank=4"]
    # 0.3 MB buckets: several, so torch's PowerSGD (one bucket on Gloo) is timed on them joined
    # the least of 3 calls: one call times each hook once, and a step stalled by the machine (4 ms for the
    # fp16 cast under a loaded suite) would order them by the stall
    calls = [compression_seconds(model, batch, F.cross_entropy, _optimizer, entries, 0.3) for _ in range(3)]
    seconds = {e: min(c[e] for c in calls) for e in calls[0]}
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    after = torch.ones(1)
    dist.all_reduce(after)  # the job's group still works: the rank's own group is gone
    return seconds, unchanged, float(after), compression_seconds(model, batch, F.cross_entropy, _optimizer, [], 0.3)


def test_compression_is_each_hooks_own_computation_timed_alike_on_every_rank():
    """probe.compression_seconds: each hook on copies of one backward's buckets, in a group of the rank
    alone; the least of its timed runs, MAX over the ranks. PowerSGD's matrix products, orthogonalisation
    and error feedback on two 256x256 layers cost more than the fp16 cast of the same gradients."""
    (s0, unchanged, after, none), (s1, *_) = run_ranks(_compression, 2, timeout=180)
    assert s0 == s1 and unchanged and after == 2.0 and none == {}
    assert list(s0) == ["fp16", "powersgd-overlap:matrix_approximation_rank=4", "powersgd:matrix_approximation_rank=4"]
    assert all(0 < v < 1 for v in s0.values())
    assert s0["powersgd-overlap:matrix_approximation_rank=4"] > s0["fp16"]
    assert s0["powersgd:matrix_approximation_rank=4"] > s0["fp16"]
