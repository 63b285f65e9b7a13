"""``--algorithm auto`` (gradsync.profiler.auto): the choice from a measured profile and all-reduce time,
only among settings whose accuracy cost was measured for the job's optimizer family; train's and
bench's use of it end to end on 2 Gloo ranks (loopback: CCR far below 0.5, so dense all-reduce)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from gradsync.profiler.accuracy_costs import AccuracyCost
from gradsync.profiler.advise import advise
from gradsync.profiler.auto import choose, effective_bandwidth_mbit
from gradsync.profiler.profile import ccr_at
from gradsync.sim import synthetic_profile
from gradsync.train.config import TrainConfig
from cli_runner import run_cli

#: 8 buckets of 20k fp32 elements, 30 ms backward (see tests/test_doctor.py)
PROFILE = synthetic_profile([20_000] * 8, 0.010, 0.030, 0.002)


def _cost(entry, steps, optimizer="sgd"):
    return AccuracyCost(entry, steps, 200, 2, 5, "synthetic", "dense - 0.5", "test", optimizer)


def test_effective_bandwidth_reproduces_the_measured_all_reduce_time():
    bw = effective_bandwidth_mbit(PROFILE, 4, 0.25)
    assert ccr_at(PROFILE, 4, bw) * PROFILE.backward_s == pytest.approx(0.25)
    with pytest.raises(ValueError, match="allreduce_s"):
        effective_bandwidth_mbit(PROFILE, 2, 0.0)


def test_auto_weighs_iteration_time_with_measured_extra_steps_of_the_optimizer_family():
    costs = [_cost("fp16", 200), _cost("powersgd:matrix_approximation_rank=4", 200),
             _cost("covap:ratio=4:cast=fp16", 400), _cost("powersgd:matrix_approximation_rank=4", 200, "adamw")]
    slow = 0.30  # a dense all-reduce of 10x the backward pass
    a = choose(PROFILE, 2, slow, "sgd", costs)
    assert a.ccr == pytest.approx(10.0) and a.choice.entry == "powersgd:matrix_approximation_rank=4"
    # covap K=4 is faster per iteration here but needs twice the steps; unmeasured settings never win
    ranked = [r.entry for r in a.predictions if r.measured]
    assert ranked.index("powersgd:matrix_approximation_rank=4") < ranked.index("covap:ratio=4:cast=fp16")
    assert not next(r for r in a.predictions if r.entry == "bf16").measured  # a cast is not assumed lossless
    # the same network with AdamW: only the AdamW measurement counts
    assert choose(PROFILE, 2, slow, "adamw", costs).choice.entry == "powersgd:matrix_approximation_rank=4"
    # no AdamW measurement: DeAR (same arithmetic as DDP) is the only alternative, too little faster
    dear_only = choose(PROFILE, 2, slow, "adamw", costs[:3])
    assert dear_only.choice.entry == "allreduce" and "alternative, DeAR" in dear_only.reason
    none = choose(PROFILE, 2, slow, "adamw", costs[:3], allowed=lambda e: e != "dear")
    assert none.choice.entry == "allreduce" and "no other setting has a measured accuracy cost" in none.reason
    # a fast network: dense all-reduce; a restricted candidate list: the best allowed one
    assert choose(PROFILE, 2, 0.003, "sgd", costs).choice.entry == "allreduce"
    only_fp16 = choose(PROFILE, 2, slow, "sgd", costs, allowed=lambda e: e == "fp16")
    assert only_fp16.choice.entry == "fp16" and {r.entry for r in only_fp16.predictions} == {"allreduce", "fp16"}


def test_auto_offers_a_measured_dense_tail_scaled_to_the_job_budget():
    from gradsync.profiler.advise import tail_candidates

    tail = AccuracyCost("powersgd:matrix_approximation_rank=4:dense_from=150", 210, 200, 2, 5, "synthetic",
                        "dense - 0.5", "test", budget_steps=250)
    costs = [_cost("fp16", 200), AccuracyCost("powersgd:matrix_approximation_rank=4", 250, 200, 2, 5, "synthetic",
                                              "dense - 0.5", "test", not_reached=True), tail]
    slow = 0.30
    # without a budget the tail is no candidate: plain PowerSGD missed the target, so fp16
    assert choose(PROFILE, 2, slow, "sgd", costs).choice.entry == "fp16"
    a = choose(PROFILE, 2, slow, "sgd", costs, budget_steps=500)
    entry = "powersgd:matrix_approximation_rank=4:dense_from=300"  # 150 of 250 -> 300 of 500
    assert a.choice.entry == entry and "dense tail from 300" in a.choice.label
    c = a.choice
    fp16 = next(r for r in a.predictions if r.entry == "fp16")
    # 150 steps at PowerSGD's iteration, 60 at the fp16 hook's on PowerSGD's one bucket, over dense's 200
    assert c.time_to_quality_s == pytest.approx((150 * c.iteration_s + 60 * c.tail_iteration_s) / 200)
    assert c.iteration_s < fp16.iteration_s <= c.tail_iteration_s and c.time_to_quality_s < fp16.time_to_quality_s
    assert "fp16 hook" in c.cost and c.extra_steps == pytest.approx(0.05)
    # the tail counts: at fp16's step count and with a tail from the first step it would lose to fp16
    early = dataclasses.replace(tail, entry="powersgd:matrix_approximation_rank=4:dense_from=2", steps=200)
    assert choose(PROFILE, 2, slow, "sgd", [costs[0], early], budget_steps=250).choice.entry == "fp16"
    # a tail that missed the target, or one not allowed, is never chosen
    missed = dataclasses.replace(tail, not_reached=True)
    assert choose(PROFILE, 2, slow, "sgd", [costs[0], missed], budget_steps=500).choice.entry == "fp16"
    assert choose(PROFILE, 2, slow, "sgd", costs, budget_steps=500,
                  allowed=lambda e: "dense_from" not in e).choice.entry == "fp16"
    assert [t[0] for t in tail_candidates(costs, 10)] == ["powersgd:matrix_approximation_rank=4:dense_from=6"]
    with pytest.raises(ValueError, match="budget_steps"):
        tail_candidates(costs, 0)


def test_a_models_own_accuracy_costs_replace_another_models():
    """PowerSGD r=4's cost measured on one model does not carry to another: a job whose model has rows
    is advised from those alone; one without any from every row."""
    from gradsync.profiler.accuracy_costs import MEASURED_COSTS, rows_for_model

    small = [dataclasses.replace(_cost("fp16", 200), model="w:small"),
             dataclasses.replace(_cost("powersgd:matrix_approximation_rank=4", 200), model="w:small")]
    wide = [dataclasses.replace(_cost("fp16", 200), model="w:wide"),
            dataclasses.replace(_cost("powersgd:matrix_approximation_rank=4", 250), model="w:wide", not_reached=True)]
    costs = small + wide
    assert rows_for_model(costs, "w:wide") == wide and rows_for_model(costs, "w:other") == costs
    assert rows_for_model(costs, None) == costs
    slow = 0.30
    assert choose(PROFILE, 2, slow, "sgd", costs, model_key="w:small").choice.entry == \
        "powersgd:matrix_approximation_rank=4"
    wide_pick = choose(PROFILE, 2, slow, "sgd", costs, model_key="w:wide")
    assert wide_pick.choice.entry == "fp16"
    r4 = next(r for r in wide_pick.predictions if r.entry == "powersgd:matrix_approximation_rank=4")
    assert r4.cost.startswith("missed the target")
    # the published rows: the wider ResNet-8 has its own, and its r=4 rows missed the target there
    own = rows_for_model(MEASURED_COSTS, "fashion-mnist:resnet8-w32")
    assert own and all(c.model == "fashion-mnist:resnet8-w32" for c in own)
    assert {c.entry for c in own if c.not_reached} == {"powersgd:matrix_approximation_rank=4",
                                                       "powersgd:matrix_approximation_rank=4:dense_from=700"}
    # the keys train and bench (Workload.key) and doctor (its --model) pass
    from gradsync.profiler.profile import workload_key
    from gradsync.workloads import get_workload

    assert get_workload("fashion-mnist", "resnet8-w32").key == workload_key("fashion-mnist:resnet8-w32") == \
        "fashion-mnist:resnet8-w32"
    assert workload_key("fashion-mnist") == "fashion-mnist:resnet8" and workload_key("resnet18") is None


def test_the_rows_of_the_nearest_world_size_advise_alone():
    """A cost does not carry across world sizes either: a 3-rank job is advised from the 3-rank rows
    alone (a setting measured only at 2 ranks is then not measured), a 4-rank job from the nearest."""
    from gradsync.profiler.accuracy_costs import MEASURED_COSTS, rows_for_world_size

    two = [_cost("fp16", 200), _cost("powersgd:matrix_approximation_rank=4", 200)]
    three = [dataclasses.replace(_cost("fp16", 200), world_size=3),
             dataclasses.replace(_cost("powersgd:matrix_approximation_rank=4", 300), world_size=3, not_reached=True)]
    costs = two + three
    assert rows_for_world_size(costs, 2) == two and rows_for_world_size(costs, 3) == three
    assert rows_for_world_size(costs, 8) == three and rows_for_world_size([], 3) == []
    slow = 0.30
    assert choose(PROFILE, 2, slow, "sgd", costs).choice.entry == "powersgd:matrix_approximation_rank=4"
    pick = choose(PROFILE, 3, slow, "sgd", costs)
    assert pick.choice.entry == "fp16" and "3 ranks" in pick.reason
    # the published rows: at 3 ranks bf16 (measured at 2 only) is not measured, and the overlapped tail is
    # offered from its 3-rank row (467 of 624), which missed the target
    a = advise(PROFILE, 3, 20, budget_steps=624, optimizer="sgd", model_key="fashion-mnist:resnet8",
               assume_casts=False)
    assert {p.entry for p in a.predictions if p.cost == "not measured"} >= {"bf16"}
    tail = next(p for p in a.predictions if p.entry == "powersgd-overlap:matrix_approximation_rank=4:dense_from=467")
    assert tail.cost.startswith("missed the target") and "3 ranks" in tail.cost
    assert all(c.world_size == 3 for c in rows_for_world_size(MEASURED_COSTS, 3))


@pytest.mark.parametrize("kwargs, name", [
    ({"algorithm": "auto", "options": {"ratio": 2}}, "ratio"),
    ({"algorithm": "auto", "resume": "runs/x"}, "resume"),
])
def test_train_auto_refuses_options_and_resume(kwargs, name):
    with pytest.raises(ValueError, match=name):
        TrainConfig(**kwargs)


def test_train_auto_measures_chooses_and_names_the_choice(tmp_path):
    proc = run_cli(["train", "--algorithm", "auto", "--max-steps", "3", "--train-samples", "1024",
                    "--eval-samples", "200", "--no-progress", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    # loopback: the all-reduce is far faster than the backward pass
    assert s["algorithm"] == "auto" and s["auto_choice"] == "allreduce" and s["auto_ccr"] < 0.5
    assert s["auto_reason"].startswith("CCR ") and "auto chose" in proc.stdout
