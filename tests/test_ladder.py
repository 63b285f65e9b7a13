"""The ``ladder`` algorithm (gradsync.algorithms.ladder) on 2 real Gloo ranks: without a switch it trains
exactly as its first rung alone (the meter only watches); above the error limit every rank escalates at
the same iteration, rung by rung, until a rung's error is below it; the switches and the rung
survive a weights-only checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks


def _job(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    g = torch.Generator().manual_seed(10 + rank)
    return model, [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(12)]


def _train(rank, world, name, options):
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.algorithms import build_hook

    model, batches = _job(rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    state, hook = build_hook(name, model=model, **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    rungs = []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        rungs.append(state.observe_step(0.0, 16).get("ladder_rung"))
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh, _ = build_hook(name, model=model, **options)
    fresh.load_state_dict(saved)
    return ([p.detach().clone() for p in model.parameters()], rungs, state.stats(),
            getattr(state, "switches", None),
            {**fresh.stats(), "sampled": (state.meter.sampled_buckets, fresh.meter.sampled_buckets),
             "config": state.config()} if name == "ladder" else None)


def test_without_a_switch_the_ladder_trains_as_its_first_rung():
    start = {"start": "powersgd-overlap/matrix_approximation_rank=2", "check_every": 3, "max_error_to_noise": 100.0}
    ladder = run_ranks(_train, 2, "ladder", start, timeout=180)
    plain = run_ranks(_train, 2, "powersgd-overlap", {"matrix_approximation_rank": 2}, timeout=180)
    for (lp, rungs, stats, switches, _), (pp, _, pstats, _, _) in zip(ladder, plain):
        assert all(torch.equal(a, b) for a, b in zip(lp, pp)) and switches == [] and set(rungs) == {0.0}
        # the checks' dense all-reduces (iterations 3, 6, 9) and decisions are counted on top of the rung's bytes
        assert stats["wire_bytes"] > pstats["wire_bytes"] and stats["rung"] == "powersgd-overlap:matrix_approximation_rank=2"


def test_above_the_limit_every_rank_escalates_alike_and_the_state_round_trips():
    out = run_ranks(_train, 2, "ladder", {"start": "powersgd-overlap/matrix_approximation_rank=4", "check_every": 2,
                                          "max_error_to_noise": 0.01}, timeout=180)
    (_, rungs0, stats0, switches0, fresh0), (_, rungs1, _, switches1, _) = out
    assert rungs0 == rungs1 and switches0 == switches1
    # r=4 -> 8 -> 16, where no tensor of this small model is 2x smaller as rank-16 factors: sent whole, the
    # error is ~0 and the ladder stays (a new rung's first 2 iterations are PowerSGD's dense start: a check
    # there measures 0, so a switch follows only the check after)
    assert [s["to"] for s in switches0] == ["powersgd-overlap:matrix_approximation_rank=8",
                                            "powersgd-overlap:matrix_approximation_rank=16"]
    assert [s["iteration"] for s in switches0] == [3, 7]
    assert all(s["ratio"] > 0.01 and s["ratio"] == pytest.approx(s["error"] / s["noise"]) for s in switches0)
    assert stats0["switches"] == 2
    assert rungs0 == sorted(rungs0) and rungs0[-1] == 2.0
    assert fresh0["rung"] == stats0["rung"] and fresh0["switches"] == 2  # the rung and its history survive
    # the checks compare a sixteenth of the elements; the sample's position survives too (a resumed run compares
    # the same elements as an uninterrupted one)
    assert fresh0["config"]["reference_fraction"] == 1 / 16 and fresh0["sampled"][0] > 0
    assert fresh0["sampled"][0] == fresh0["sampled"][1]


def test_bad_options():
    from gradsync.algorithms import build_hook
    from gradsync.algorithms.ladder import DEFAULT_MAX_ERROR_TO_NOISE, rungs
    from gradsync.profiler.quality_model import FITTED

    assert DEFAULT_MAX_ERROR_TO_NOISE == FITTED.limit()
    assert rungs("powersgd-overlap:matrix_approximation_rank=8") == [
        "powersgd-overlap:matrix_approximation_rank=8", "powersgd-overlap:matrix_approximation_rank=16", "fp16",
        "allreduce"]
    with pytest.raises(ValueError, match="powersgd-overlap"):
        rungs("powersgd/matrix_approximation_rank=4")
    with pytest.raises(ValueError, match="check_every"):
        build_hook("ladder", check_every=0)


def test_a_window_measures_consecutive_steps_and_decides_once_after_them():
    # check_every 4, window 3: iterations 4-6 and 8-10 are measured, each window decided once after its last step
    out = run_ranks(_train, 2, "ladder", {"start": "powersgd-overlap/matrix_approximation_rank=4", "check_every": 4,
                                          "window": 3, "max_error_to_noise": 0.01}, timeout=180)
    (_, rungs0, _, switches0, fresh0), (_, rungs1, _, switches1, _) = out
    assert rungs0 == rungs1 and switches0 == switches1 and fresh0["config"]["window"] == 3
    # the first window (4-6) is decided at 7's first bucket: r=4 -> 8; r=8's window 8-10 starts in PowerSGD's dense
    # start (error 0 on its first 2 steps) but its third step compresses: decided at 11, -> 16
    assert [(s["iteration"], s["to"]) for s in switches0] == [(7, "powersgd-overlap:matrix_approximation_rank=8"),
                                                             (11, "powersgd-overlap:matrix_approximation_rank=16")]
    from gradsync.algorithms.ladder import LadderState

    state = LadderState("powersgd-overlap:matrix_approximation_rank=4", check_every=10, window=3)
    assert [i for i in range(35) if state.checks(i)] == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    with pytest.raises(ValueError, match="window"):
        LadderState("powersgd-overlap:matrix_approximation_rank=4", check_every=4, window=5)
    from gradsync.algorithms import build_hook

    with pytest.raises(ValueError, match="ladder.window must be an integer in \\[1, check_every=4\\]"):
        build_hook("ladder", check_every=4, window=5)
