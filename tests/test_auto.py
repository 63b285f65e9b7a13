"""``--algorithm auto`` (gradsync.profiler.auto): the choice from a measured profile, all-reduce time and
each setting's error on the job (the quality model); train's use of it end to end on 2 Gloo ranks
(loopback: CCR far below 0.5, so dense all-reduce)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
import shutil

import pytest
import torch

from gradsync.profiler.advise import advise
from gradsync.profiler.auto import effective_bandwidth_mbit
from gradsync.profiler.quality_model import (FAMILIES, FITTED, RISK, QualityModel, QualityPoint, cross_validate,
                                            error_to_noise, seeds_missing_risk,
                                            fit, optimizer_family)
from gradsync.profiler.profile import ccr_at
from gradsync.sim import synthetic_profile
from gradsync.train.config import TrainConfig
from cli_runner import run_cli

#: 8 buckets of 20k fp32 elements, 30 ms backward (see tests/test_doctor.py)
PROFILE = synthetic_profile([20_000] * 8, 0.010, 0.030, 0.002)


def test_effective_bandwidth_reproduces_the_measured_all_reduce_time():
    bw = effective_bandwidth_mbit(PROFILE, 4, 0.25)
    assert ccr_at(PROFILE, 4, bw) * PROFILE.backward_s == pytest.approx(0.25)
    with pytest.raises(ValueError, match="allreduce_s"):
        effective_bandwidth_mbit(PROFILE, 2, 0.0)


def test_auto_weighs_iteration_time_with_extra_steps_predicted_from_the_measured_error():
    model = QualityModel({"sgd": 0.8, "adaptive": 0.5}, {"sgd": 0.2, "adaptive": 1.0})
    slow_bw = effective_bandwidth_mbit(PROFILE, 2, 0.30)  # a dense all-reduce of 10x the backward pass
    errors = {"fp16": 0.0003, "powersgd:matrix_approximation_rank=4": 0.3, "powersgd:matrix_approximation_rank=1": 0.8}
    a = advise(PROFILE, 2, slow_bw, errors=errors, model=model, noise=0.5, family="sgd")
    assert a.ccr == pytest.approx(10.0) and a.choice.entry == "powersgd:matrix_approximation_rank=4"
    r4 = next(r for r in a.predictions if r.entry == "powersgd:matrix_approximation_rank=4")
    assert r4.extra_steps == pytest.approx(0.2 * 0.6 ** 2) and "error 0.30 = 0.60 x noise" in r4.cost
    assert r4.time_to_quality_s == pytest.approx(r4.iteration_s * (1 + 0.2 * 0.36))
    # r=1 is faster per iteration but its error, 1.6 x the noise, is above the limit: predicted to miss
    k4 = next(r for r in a.predictions if r.entry == "powersgd:matrix_approximation_rank=1")
    assert k4.iteration_s < r4.iteration_s and k4.time_to_quality_s == float("inf") and "miss" in k4.cost
    assert not next(r for r in a.predictions if r.entry == "bf16").measured  # no error measured: not chosen
    # an adaptive optimizer (the stricter family): r=4's 0.6 x noise is above its 0.5; so when the family is unknown
    for family in ("adaptive", None):
        strict = advise(PROFILE, 2, slow_bw, errors=errors, model=model, noise=0.5, family=family)
        assert strict.choice.entry == "fp16" and any("optimizer family adaptive" in n for n in strict.notes)
    sgd = advise(PROFILE, 2, slow_bw, errors=errors, model=model, noise=0.5, family="sgd")
    assert sgd.choice.entry == "powersgd:matrix_approximation_rank=4" and "> 0.80" in next(
        r.cost for r in sgd.predictions if r.entry == "powersgd:matrix_approximation_rank=1")
    with pytest.raises(ValueError, match="family must be one of sgd, adaptive"):
        advise(PROFILE, 2, slow_bw, errors=errors, model=model, noise=0.5, family="lbfgs")
    # quieter gradients (noise 0.2): r=4's 0.3 is 1.5 x the noise and misses; fp16 (error 0.0003) is left
    assert advise(PROFILE, 2, slow_bw, errors=errors, model=model, noise=0.2, family="sgd").choice.entry == "fp16"
    # at 5 ranks the same noise of one rank's gradient means half as much in the average: r=4 misses there too
    assert advise(PROFILE, 5, slow_bw, errors=errors, model=model, noise=0.5, family="sgd").predictions[0].entry != (
        "powersgd:matrix_approximation_rank=4")
    # errors without the noise: only the casts count (their rounding), the rest is not measured
    blind = advise(PROFILE, 2, slow_bw, errors=errors, model=model)
    assert blind.choice.entry == "fp16" and not next(r for r in blind.predictions if "rank=4" in r.entry).measured
    # nothing measured: DeAR (DDP's arithmetic) is the only alternative, too little faster
    bare = advise(PROFILE, 2, slow_bw, model=model)
    assert bare.choice.entry == "allreduce" and "alternative, DeAR" in bare.reason
    none = advise(PROFILE, 2, slow_bw, model=model, allowed=lambda e: e != "dear")
    assert none.choice.entry == "allreduce" and "no other setting is predicted to reach" in none.reason
    # a fast network: dense all-reduce; measured iteration times replace the simulated ones
    assert advise(PROFILE, 2, 1e5, errors=errors, model=model).choice.entry == "allreduce"
    timed = advise(PROFILE, 2, slow_bw, errors=errors, model=model, allowed=lambda e: e == "fp16",
                   iterations={"allreduce": 0.5, "fp16": 0.2})
    assert {r.entry for r in timed.predictions} == {"allreduce", "fp16"}
    assert timed.choice.entry == "fp16" and timed.choice.timed and timed.choice.iteration_s == 0.2
    assert timed.choice.speedup == pytest.approx(2.5) and "measured 2.50x" in timed.reason


def test_a_cast_timed_beside_ddp_needs_no_margin_but_a_predicted_or_lossy_one_does():
    """MIN_GAIN (1.10) covers the simulator's error: a lossless cast timed on the same steps as DDP is chosen
    when faster at all; predicted, or lossy (its extra steps are a prediction), it still needs the margin."""
    slow_bw = effective_bandwidth_mbit(PROFILE, 2, 0.30)
    fp16 = lambda e: e == "fp16"  # noqa: E731
    close = advise(PROFILE, 2, slow_bw, errors={"fp16": 0.0003}, allowed=fp16, iterations={"allreduce": 0.206, "fp16": 0.2})
    assert close.choice.entry == "fp16", close.reason
    slower = advise(PROFILE, 2, slow_bw, errors={"fp16": 0.0003}, allowed=fp16, iterations={"allreduce": 0.2, "fp16": 0.206})
    assert slower.choice.entry == "allreduce" and "timed beside DDP" in slower.reason
    ddp_s = next(r.iteration_s for r in advise(PROFILE, 2, slow_bw).predictions if r.entry == "allreduce")
    untimed_ddp = advise(PROFILE, 2, slow_bw, errors={"fp16": 0.0003}, allowed=fp16, iterations={"fp16": ddp_s / 1.05})
    assert untimed_ddp.choice.entry == "allreduce", "DDP simulated: the simulator's error still needs the margin"
    r4 = "powersgd:matrix_approximation_rank=4"
    lossy = advise(PROFILE, 2, slow_bw, errors={r4: 0.1}, noise=0.5, family="sgd", allowed=lambda e: e == r4,
                   iterations={"allreduce": 0.206, r4: 0.2})
    assert lossy.choice.entry == "allreduce" and "within the predictions' ~10 % error" in lossy.reason


def test_quality_model_fit_and_cross_validation():
    inf = float("inf")
    # noise 1 at 2 ranks: the ratio is the error; "c" has quiet gradients (0.1 of noise), "d" 5 ranks; "e" and "f"
    # train with AdamW, the adaptive family, fitted apart. Each point's 5 seeds all reached or all missed.
    points = [QualityPoint(0.0, 1.0, 2, 0.0, "a"), QualityPoint(0.2, 1.0, 2, 0.02, "a"),
              QualityPoint(0.55, 1.0, 2, inf, "a"), QualityPoint(0.3, 1.0, 2, 0.03, "b"),
              QualityPoint(0.7, 1.0, 2, inf, "b"), QualityPoint(0.06, 0.1, 2, inf, "c"),
              QualityPoint(0.1, 1.0, 5, 0.01, "d"),
              QualityPoint(0.1, 1.0, 2, 0.05, "e", "adamw"), QualityPoint(0.3, 1.0, 2, inf, "e", "adamw"),
              QualityPoint(0.12, 1.0, 2, 0.1, "f", "AdamW"), QualityPoint(0.25, 1.0, 2, inf, "f", "adamw")]
    points = [replace(p, seeds_missed=(p.extra == inf,) * 5) for p in points]
    assert points[5].ratio == pytest.approx(0.6) and points[6].ratio == pytest.approx(0.2)
    m = fit(points)
    # separable outcomes (every miss above every reach): the prior keeps the slope finite; the limit, where the
    # chance of 2 or more misses in 5 seeds reaches RISK, lies below the smallest miss, at most a little above the
    # largest reach (0.3 for SGD): with few seeds the model is unsure, and unsure is stricter
    assert 0.2 < m.limit("sgd") < 0.55 and m.limit("adaptive") < 0.25 and m.limit() == m.limit("adaptive")
    for family in FAMILIES:
        assert seeds_missing_risk(m.miss_probability(m.limit(family), family)) == pytest.approx(RISK, abs=1e-6)
    reached = [(0.02, 0.2), (0.03, 0.3), (0.01, 0.2)]
    assert m.slopes["sgd"] == pytest.approx(sum(x * r * r for x, r in reached) / sum(r ** 4 for _, r in reached))
    sgd = m.slopes["sgd"]
    assert m.extra_steps(0.56, 1.0, 2, "sgd") == inf and m.extra_steps(0.2, 1.0, 2, "sgd") == pytest.approx(sgd * 0.04)
    assert m.extra_steps(0.2, 0.4, 2, "sgd") == inf and m.extra_steps(0.1, 1.0, 5, "sgd") == pytest.approx(sgd * 0.04)
    assert m.extra_steps(0.26, 1.0, 2, "adaptive") == inf and m.extra_steps(0.26, 1.0, 2) == inf
    cv = cross_validate(points)
    # held out, no miss is called a reach; three reaches are called misses (the speed a stricter limit costs)
    assert cv["points"] == 11 and cv["workloads"] == 6 and cv["misclassified"] == 3 and cv["accepted_missed"] == 0
    assert sorted(p.workload for p in cv["wrong"]) == ["b", "e", "f"]
    # "c" at noise 1 is a miss at 0.06, below every reach: held out, the others' fit calls it a reach
    quiet = cross_validate([replace(p, noise=1.0) if p.workload == "c" else p for p in points])
    assert quiet["accepted_missed"] == 1
    with pytest.raises(ValueError, match="error"):
        m.extra_steps(-0.1, 1.0, 2, "sgd")
    with pytest.raises(ValueError, match="family must be one of"):
        m.extra_steps(0.1, 1.0, 2, "lbfgs")
    with pytest.raises(ValueError, match="world_size"):
        error_to_noise(0.1, 1.0, 1)
    assert error_to_noise(0.0, 0.0, 2) == 0 and error_to_noise(0.1, 0.0, 2) == inf
    with pytest.raises(ValueError, match="points"):
        fit([])
    # a family without points gets the fit of all points
    only_sgd = fit(points[:7])
    assert only_sgd.limits["adaptive"] == pytest.approx(only_sgd.limits["sgd"])
    assert set(FITTED.limits) == set(FAMILIES) and all(0 < v < 10 for v in FITTED.limits.values())
    assert all(v >= 0 for v in FITTED.slopes.values()) and "leave-one-workload-out" in FITTED.cv
    assert QualityModel({"sgd": 0.5}, {"sgd": 0.1}).miss_probability(0.3, "sgd") is None


def test_quality_model_per_seed_risk():
    """The acceptance is per seed: a setting misses when more than 1 of 5 seeds miss; the limit is where the fitted
    per-seed miss probability makes that as likely as RISK."""
    assert seeds_missing_risk(0.0) == 0 and seeds_missing_risk(1.0) == pytest.approx(1.0)
    assert seeds_missing_risk(0.5) == pytest.approx(26 / 32) and seeds_missing_risk(0.5, 3, 0) == pytest.approx(7 / 8)
    for bad in (dict(p=-0.1), dict(p=1.5), dict(p=0.1, seeds=0), dict(p=0.1, seeds=5, tolerated=6)):
        with pytest.raises(ValueError):
            seeds_missing_risk(**bad)
    point = QualityPoint(0.5, 1.0, 2, 0.0, "a", seeds_missed=(True, False, False, False, False))
    assert point.outcomes == point.seeds_missed and not point.missed
    assert replace(point, seeds_missed=(True, True, False, False, False)).missed
    assert replace(point, seeds_missed=(True, False, False)).missed  # 1 of 3 is 1.7 of 5
    assert QualityPoint(0.5, 1.0, 2, float("inf"), "a").outcomes == (True,)
    # outcomes drawn from a known per-seed model sigmoid(-4 + 4 r): the fit recovers it and puts the limit where
    # the risk of 2 or more misses in 5 seeds reaches RISK
    gen = torch.Generator().manual_seed(0)
    points = []
    for i, r in enumerate(torch.linspace(0.0, 2.0, 41).tolist()):
        drawn = torch.rand(200, generator=gen) < torch.sigmoid(torch.tensor(-4.0 + 4.0 * r))
        points.append(QualityPoint(r, 1.0, 2, 0.0, f"w{i % 4}", seeds_missed=tuple(drawn.tolist())))
    m = fit(points)
    assert m.miss["sgd"] == pytest.approx((-4.0, 4.0), abs=0.3)
    p_star = 0.1127  # seeds_missing_risk(p_star) = 0.10
    assert seeds_missing_risk(p_star) == pytest.approx(RISK, abs=1e-3)
    assert m.limit("sgd") == pytest.approx((math.log(p_star / (1 - p_star)) + 4.0) / 4.0, abs=0.06)
    # no rise of the misses with the ratio: above the risk everywhere (limit 0) or nowhere (1.25 x the largest ratio)
    flat = [QualityPoint(r, 1.0, 2, 0.0, "a", seeds_missed=(False,) * 99 + (True,)) for r in (0.1, 0.5, 1.0)]
    assert fit(flat).limit("sgd") == pytest.approx(1.25)
    lossy = [replace(p, seeds_missed=(True, False)) for p in flat]
    assert fit(lossy).limit("sgd") == 0.0


def test_optimizer_family():
    p = [torch.nn.Parameter(torch.zeros(2))]
    for opt in (torch.optim.Adam(p), torch.optim.AdamW(p), torch.optim.RMSprop(p), torch.optim.Adagrad(p), "adamw",
                "Lion", "adaptive"):
        assert optimizer_family(opt) == "adaptive", opt
    for opt in (torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd", "LARS"):
        assert optimizer_family(opt) == "sgd", opt

    class Wrapper:  # Accelerate's and Lightning's wrappers hold the optimizer as .optimizer
        optimizer = torch.optim.AdamW(p)

    assert optimizer_family(Wrapper()) == "adaptive"


def test_no_file_under_src_holds_the_grids_rows():
    import pathlib

    import gradsync

    root = pathlib.Path(gradsync.__file__).parent
    assert not (root / "profiler" / "accuracy_costs.py").exists()
    data = json.loads((pathlib.Path(__file__).parents[1] / "benchmarks" / "data" / "accuracy_costs.json").read_text())
    assert data["rows"] and all("source" in r and r["steps"] > 0 for r in data["rows"])


def test_train_auto_refuses_options():
    with pytest.raises(ValueError, match="ratio"):
        TrainConfig(algorithm="auto", options={"ratio": 2})


def test_train_auto_measures_chooses_and_resumes_with_its_choice(tmp_path):
    common = ["train", "--algorithm", "auto", "--train-samples", "1024", "--eval-samples", "200", "--no-progress",
              "--workers", "2"]
    ckpt = tmp_path / "ckpt"
    first = run_cli([*common, "--max-steps", "6", "--checkpoint", ckpt, "--checkpoint-every", "3",
                     "--out", tmp_path / "first"], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    s = json.loads((tmp_path / "first" / "metrics.json").read_text())["summary"]
    # loopback: the all-reduce is far faster than the backward pass
    assert s["algorithm"] == "auto" and s["auto_choice"] == "allreduce" and s["auto_ccr"] < 0.5
    assert s["auto_reason"].startswith("CCR ") and "auto chose" in first.stdout and s["auto_probe_seconds"] > 0
    # below LOW_CCR nothing but the profile and the dense all-reduce is measured; the phases add up
    phases = s["auto_probe_phases_s"]
    assert set(phases) == {"profile", "ccr"} and 0 < sum(phases.values()) <= s["auto_probe_seconds"], phases
    # resumed with auto: the recorded choice, no new measurement; steps 7-9 as a resume that names the choice
    shutil.copytree(ckpt, tmp_path / "ckpt-named")
    resumed = run_cli([*common, "--max-steps", "9", "--checkpoint", ckpt, "--resume", "latest",
                       "--out", tmp_path / "resumed"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    r = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert r["summary"]["auto_choice"] == "allreduce" and "resumed from" in r["summary"]["auto_reason"]
    named = run_cli([*common[:2], "allreduce", *common[3:], "--max-steps", "9", "--checkpoint", tmp_path / "ckpt-named",
                     "--resume", "latest", "--out", tmp_path / "named"], timeout=300)
    assert named.returncode == 0, named.stderr[-3000:]
    n = json.loads((tmp_path / "named" / "metrics.json").read_text())
    losses = {int(i["step"]): i["loss"] for i in r["iterations"]}
    assert sorted(losses) == list(range(1, 10))
    assert [losses[k] for k in (7, 8, 9)] == [i["loss"] for i in n["iterations"] if i["step"] > 6]
    first_losses = json.loads((tmp_path / "first" / "metrics.json").read_text())["iterations"]
    assert [losses[k] for k in range(1, 7)] == [i["loss"] for i in first_losses]


def _decide_at(rank, world, allreduce_times, job_steps=None):
    import torch
    import torch.nn.functional as F

    from gradsync.profiler.auto import decide

    out = []
    for allreduce_s in allreduce_times:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        g = torch.Generator().manual_seed(10 + rank)
        batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(8)]
        d = decide(PROFILE, allreduce_s, model, batches, F.cross_entropy,
                   lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 0.005, job_steps=job_steps)
        out.append((sorted(d.iterations), d.entry, sorted(d.phases), sorted(d.errors), d.budget_s))
    return out


def test_ddp_is_timed_beside_the_short_list_only_where_it_is_a_contender():
    from distributed import run_ranks

    # CCR 1.5 (45 ms of dense all-reduce against 30 ms of backward): DDP's simulated time to quality is
    # within 2x of the best candidate's, so it is timed on the probe's copy with them;
    # CCR 50: DDP is far behind; its iteration stays simulated (no dense steps on a slow link)
    ranks = run_ranks(_decide_at, 2, [0.045, 1.5], timeout=180)
    assert ranks[0] == ranks[1], "every rank measures and chooses alike"
    (near, _, near_phases, _, budget), (far, _, far_phases, _, _) = ranks[0]
    assert budget is None  # the job's length not given: no budget
    assert "allreduce" in near and len(near) >= 2
    assert far and "allreduce" not in far
    assert near_phases == far_phases == ["compression", "quality", "timing"]


def test_a_short_job_bounds_what_auto_measures_alike_on_every_rank():
    """PROBE_SHARE of a 10-step job (about 20 ms) pays for no quality stage (9 steps of 42 ms compute): auto
    chooses from the simulation and the casts' error; a million steps pay for all of it."""
    from distributed import run_ranks
    from gradsync.profiler.auto import PROBE_SHARE

    short = run_ranks(_decide_at, 2, [0.045], 10, timeout=180)
    assert short[0] == short[1]
    timed, entry, phases, measured, budget = short[0][0]
    assert budget == pytest.approx(PROBE_SHARE * 10 * 0.042, rel=0.2)
    assert timed == [] and set(measured) <= {"fp16", "bf16"} and "timing" not in phases
    assert entry in ("fp16", "bf16", "allreduce")
    timed, _, phases, measured, budget = run_ranks(_decide_at, 2, [0.045], 10 ** 6, timeout=180)[0][0]
    assert "allreduce" in timed and len(timed) >= 2 and "timing" in phases and len(measured) > 2 and budget > 1e3


def _repetitions(rank, world, budget_s):
    import time

    import torch

    from gradsync.profiler.ccr import _median_seconds

    calls = []

    def run():  # rank 1's first call is the slow one: the MAX over ranks sets every rank's count alike
        time.sleep(0.1 * rank if not calls else 0.0)
        calls.append(1)

    if budget_s == "2.5 first calls":  # a callable budget, given the first call's time (MAX over ranks)
        budget_s = lambda first_s: 2.5 * first_s  # noqa: E731
    _median_seconds(run, None, 5, torch.device("cpu"), budget_s)
    return len(calls)


def test_the_ccr_budget_cuts_repetitions_alike_on_every_rank():
    from distributed import run_ranks

    assert run_ranks(_repetitions, 2, None, timeout=60) == [5, 5]  # 5, the first included (the warm-up: 1 element)
    assert run_ranks(_repetitions, 2, 0.29, timeout=60) == [2, 2]  # 0.29 s / 0.10-0.14 s of rank 1's first call: 2
    assert run_ranks(_repetitions, 2, 1e-6, timeout=60) == [1, 1]  # at least one: the first call
    assert run_ranks(_repetitions, 2, "2.5 first calls", timeout=60) == [2, 2]


def test_where_nothing_was_timed_the_cast_with_the_smaller_measured_error_is_the_one_allowed():
    """auto._untimed_cast: fp16 and bf16 move the same bytes; chosen by their noisy compression times, auto
    ran a 4-host job with bf16 at 8x fp16's error."""
    from gradsync.profiler.auto import _untimed_cast

    assert _untimed_cast({"bf16": 0.0017, "fp16": 0.0002}, lambda e: True) == "fp16"
    assert _untimed_cast({"bf16": 0.0001, "fp16": 0.0002}, lambda e: True) == "bf16"
    assert _untimed_cast({}, lambda e: True) == "fp16"  # none measured (below the CCR worth measuring)
    assert _untimed_cast({"bf16": 0.0017, "fp16": 0.0002}, lambda e: e != "fp16") == "bf16"
    assert _untimed_cast({}, lambda e: e == "allreduce") is None


def test_the_costliest_candidate_is_measured_only_where_it_could_still_be_short_listed():
    """auto._next_stage: PowerSGD r=16 (half the candidates' bytes at a high CCR) waits for the cheaper
    ranks' errors where metering it costs more than a stage's compute, and is not metered where three
    cheaper measured hooks already beat its iteration; on a fast network it is metered with them."""
    from gradsync.profiler.auto import _next_stage, worth_measuring, NOT_PROBED
    from gradsync.profiler.advise import CASTS

    fast_bw = effective_bandwidth_mbit(PROFILE, 2, 0.06)  # r=16's communication well below a step's compute
    fast = advise(PROFILE, 2, fast_bw)
    metered = [e for e in worth_measuring(fast, skip=NOT_PROBED) if e not in CASTS]
    assert any(e.endswith("rank=16") for e in metered), metered
    assert _next_stage(metered, {}, None, None, fast, PROFILE, 2, fast_bw, lambda e: True, 3) == metered

    slow_bw = effective_bandwidth_mbit(PROFILE, 2, 0.60)
    simulated = advise(PROFILE, 2, slow_bw)
    metered = [e for e in worth_measuring(simulated, skip=NOT_PROBED) if e not in CASTS]
    r16 = [e for e in metered if e.endswith("rank=16")]
    assert r16, metered
    casts = {"fp16": 0.0003, "bf16": 0.002}
    first = _next_stage(metered, casts, None, None, simulated, PROFILE, 2, slow_bw, lambda e: True, 3)
    assert first and not set(r16) & set(first) and set(first) == set(metered) - set(r16)
    low = {e: 0.1 for e in first}  # every cheaper rank passes: r=16 cannot enter the short-list
    assert _next_stage(r16, {**casts, **low}, 0.5, "sgd", simulated, PROFILE, 2, slow_bw, lambda e: True, 3) == []
    high = {e: 5.0 for e in first}  # every cheaper rank misses: r=16 is measured after all
    assert _next_stage(r16, {**casts, **high}, 0.5, "sgd", simulated, PROFILE, 2, slow_bw, lambda e: True, 3) == r16


def test_the_short_list_times_one_of_two_settings_with_the_same_bytes_and_schedule():
    """bf16 moves fp16's bytes on fp16's schedule: with both measured, only one is timed, the one with the
    smaller error even where the other's measured cast time ranks it first, and the third place goes to
    the next setting."""
    from gradsync.profiler.auto import _short_list

    bw = effective_bandwidth_mbit(PROFILE, 2, 0.30)
    r8, o8 = "powersgd:matrix_approximation_rank=8", "powersgd-overlap:matrix_approximation_rank=8"
    errors = {"fp16": 0.0003, "bf16": 0.002, r8: 0.05, o8: 0.05}
    for overheads in ({}, {"fp16": 0.002, "bf16": 0.001}):
        ranked = advise(PROFILE, 2, bw, errors=errors, noise=0.5, family="sgd", overheads=overheads).predictions
        short = _short_list(ranked, 3, errors)
        assert len(short) == 3 and "fp16" in short and "bf16" not in short and {r8, o8} <= set(short)
    swapped = _short_list(ranked, 3, {**errors, "bf16": 0.0001})
    assert "bf16" in swapped and "fp16" not in swapped


def test_a_frameworks_step_count_is_a_budget_only_when_finite_and_positive():
    from gradsync.integrations.auto import known_steps

    assert known_steps(468) == 468 and known_steps(468.0) == 468
    assert known_steps(float("inf")) is None and known_steps(-1) is None and known_steps(0) is None
    assert known_steps(None) is None and known_steps("many") is None


def test_a_budgeted_race_drops_the_least_promising_first_and_times_ddp_with_the_last_candidate_or_not_at_all():
    """auto._affordable_race: 3 rounds of every raced entry must fit the room; DDP, a contender, is never
    left alone nor dropped while a candidate is timed (a timed candidate against DDP's simulated iteration
    kept DDP 53 % behind on the Mixer)."""
    from gradsync.profiler.auto import _affordable_race

    sim = {"fp16": 0.10, "powersgd:matrix_approximation_rank=4": 0.05, "powersgd:matrix_approximation_rank=8": 0.06,
           "allreduce": 0.20}
    ttq = {"fp16": 0.10, "powersgd:matrix_approximation_rank=4": 0.08, "powersgd:matrix_approximation_rank=8": 0.07,
           "allreduce": 0.20}
    every = list(sim)
    assert _affordable_race(every, sim, ttq, 100.0) == (every, 8)  # at most 8 rounds
    short, rounds = _affordable_race(every, sim, ttq, 3 * 0.31 + 1e-9)  # all but fp16 (the least promising)
    assert short == ["powersgd:matrix_approximation_rank=4", "powersgd:matrix_approximation_rank=8", "allreduce"]
    assert rounds == 3
    short, rounds = _affordable_race(every, sim, ttq, 3 * 0.26 + 1e-9)  # r=8 and DDP: DDP kept with the last
    assert short == ["powersgd:matrix_approximation_rank=8", "allreduce"] and rounds == 3
    assert _affordable_race(every, sim, ttq, 3 * 0.26 - 1e-3) == ([], 0)  # not DDP alone, not r=8 alone
    lone = ["powersgd:matrix_approximation_rank=8", "powersgd:matrix_approximation_rank=4"]
    assert _affordable_race(lone, sim, ttq, 0.20) == (["powersgd:matrix_approximation_rank=8"], 3)
    assert _affordable_race(lone, sim, ttq, 0.17) == ([], 0)  # fewer than 3 rounds decide by noise


def test_the_fitted_constants_are_the_fit_of_the_committed_data():
    """FITTED (errors on a frozen copy) and FITTED_TRAINING (errors while the copy trains on fp16) are what
    benchmarks/fit_quality_model.py fits to the committed data files, to the 3 decimals they are written with."""
    import pathlib
    import sys

    from gradsync.profiler.quality_model import FITTED_TRAINING

    data = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(data))
    try:
        import fit_quality_model
    finally:
        sys.path.remove(str(data))
    for suffix, model in (("", FITTED), ("_training", FITTED_TRAINING)):
        got = fit(fit_quality_model.fit_points(
            str(data / "data" / "accuracy_costs.json"), str(data / "data" / f"probe_errors{suffix}.json"),
            [(str(data / "data" / "accuracy_costs_held_out.json"),
              str(data / "data" / f"probe_errors_held_out{suffix}.json"))]))
        assert got.limits == pytest.approx(model.limits, abs=5e-4), suffix
        assert got.slopes == pytest.approx(model.slopes, abs=5e-4), suffix
        for family in model.miss:
            assert got.miss[family] == pytest.approx(model.miss[family], abs=5e-4), suffix
