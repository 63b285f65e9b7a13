"""``auto`` decided on the job's own steps (gradsync.profiler.online) on 2 real Gloo ranks: while it meters,
the job trains exactly as the base hook alone; the errors are measured and the same on every rank; the race,
on a step clock the test drives, chooses the setting with the least time to quality on every rank; the probe
costs only its steps' excess; a checkpoint resumes the choice, or measures again before it."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distributed import run_ranks
from test_probe import _job, _optimizer  # the same 2-rank MLP job and SGD
from gradsync.profiler.probe import QUALITY_STEPS, RACE_MIN_STEPS, START_STEPS, TIMED_STEPS
from gradsync.profiler.quality_model import FITTED_TRAINING

R1, R4 = "powersgd-overlap:matrix_approximation_rank=1", "powersgd-overlap:matrix_approximation_rank=4"
T4 = "powersgd:matrix_approximation_rank=4"  # torch's, raced on the job's buckets joined into one
#: the test's step times by entry, in units of DDP's simulated iteration: PowerSGD r=4 the fastest (torch's
#: the fastest of all where it is raced)
STEP_S = {"allreduce": 1.0, "fp16": 0.6, R1: 0.45, R4: 0.3, T4: 0.2}
#: a quality model whose limits let this MLP's r=4 and r=1 reach (the fitted slopes)
LENIENT = dataclasses.replace(FITTED_TRAINING, limits={"sgd": 2.0, "adaptive": 2.0})


class _StepClock:
    """The hook's clock: the test advances it by the step time of the entry each step ran."""

    def __init__(self, unit=1.0):
        self.t, self.unit = 0.0, unit

    def __call__(self) -> float:
        return self.t


def _plan(model, batches, **changes):
    from gradsync.profiler.online import plan_online

    from gradsync.profiler.probe import cast_errors

    plan = plan_online(model, batches, F.cross_entropy, _optimizer, "mlp", 16, 0.005)
    # a slow network, so compression pays: the plan's CCR as a 2 Mbit/s link would give it (on loopback the plan
    # may measure nothing: its casts' errors are measured here)
    # the mechanics, not the fitted limits, are under test: r=4 on this MLP (0.6 of its noise) is above the SGD limit
    changes = {"joined": (), "base": "fp16", "metered": (R1, R4), "quality": LENIENT, **changes}
    return dataclasses.replace(plan, bandwidth_mbit=2.0,
                               errors=cast_errors(model, batches[0], F.cross_entropy, ["fp16", "bf16"]), **changes)


class _Job:
    """The job's DDP with the online hook, trained a few steps at a time."""

    def __init__(self, state, model, batches):
        from gradsync.profiler.online import online_auto_hook

        self.state, self.batches, self.step = state, batches, 0
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
        self.ddp.register_comm_hook(state, online_auto_hook)
        self.opt = _optimizer(self.ddp.parameters())

    def train(self, steps, clock=None):
        ran = []
        for _ in range(steps):
            x, y = self.batches[self.step % len(self.batches)]
            self.step += 1
            self.opt.zero_grad(set_to_none=True)
            F.cross_entropy(self.ddp(x), y).backward()
            self.opt.step()
            ran.append(self.state.current)
            if clock is not None:
                clock.t += STEP_S[self.state.current] * clock.unit
        return ran


def _online(rank, world):
    from gradsync.algorithms import build_hook
    from gradsync.profiler.online import OnlineAutoState

    model, batches = _job(rank)
    plan = _plan(model, batches)
    clock = _StepClock(next(r.iteration_s for r in plan.advice().predictions if r.entry == "allreduce"))
    state = OnlineAutoState(plan, model, clock=clock)
    metered_until = START_STEPS + QUALITY_STEPS
    job = _Job(state, model, batches)
    ran = job.train(metered_until, clock)
    after_meter = [p.detach().clone() for p in model.parameters()]
    # the same job with its hooks alone: the base for the start step, then the first metered entry (r=4)
    ref, _ = _job(rank)
    base, r4 = build_hook("fp16"), build_hook("powersgd-overlap", model=ref, matrix_approximation_rank=4)
    step = [0]

    def switched(_, bucket):
        state_, hook = base if step[0] < START_STEPS else r4
        if bucket.is_last():
            step[0] += 1
        return hook(state_, bucket)

    ddp = DistributedDataParallel(ref, bucket_cap_mb=0.005)
    ddp.register_comm_hook(None, switched)
    opt = _optimizer(ddp.parameters())
    for i in range(metered_until):
        if i == START_STEPS:
            r4[0].skip_start()  # it joins after DDP's bucket rebuild, as the online state's does
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    same = all(torch.equal(a, b) for a, b in zip(after_meter, ref.parameters()))
    plain_wire = base[0].stats()["wire_bytes"] + r4[0].stats()["wire_bytes"]
    wire_metered = state.stats()["wire_bytes"]
    ran += job.train(TIMED_STEPS * 4 + 4, clock)
    checkpoint = state.state_dict()
    resumed = OnlineAutoState(plan, model, clock=_StepClock())
    resumed.load_state_dict(checkpoint)
    early = OnlineAutoState(plan, model, clock=_StepClock())
    early.iteration = 5
    early.load_state_dict(early.state_dict())
    return {"same": same, "ran": ran, "choice": state.choice, "errors": state.errors, "noise": state.noise,
            "medians": state.medians, "stages": state.stages, "phase": state.phase, "plain_wire": plain_wire, "wire_metered": wire_metered,
            "excess": state.probe_excess_seconds(STEP_S[state.choice] * clock.unit), "unit": clock.unit, "timed": state.step_seconds,
            "resumed": (resumed.phase, resumed.choice, resumed.current, resumed.iteration),
            "early": (early.phase, early.choice, early.current, early.start)}


def test_online_auto_meters_on_the_job_then_races_and_every_rank_chooses_alike():
    r0, r1 = run_ranks(_online, 2, timeout=240)
    assert r0["choice"] == r1["choice"] and r0["errors"] == r1["errors"] and r0["medians"] == r1["medians"]
    assert r0["ran"] == r1["ran"], "every rank ran the same hook at every step"
    assert r0["same"] and r1["same"], "while metered, a candidate trains the job exactly as its hook alone"
    assert r0["wire_metered"] > r0["plain_wire"], "the metered steps' reference traffic is counted"
    ran = r0["ran"]
    # every rank is metered on the same steps (a rank's error falls as the job trains), the highest training the job
    assert r0["stages"] == [[R4, R1]]
    metered = START_STEPS + QUALITY_STEPS
    assert ran[:metered] == ["fp16"] * START_STEPS + [R4] * QUALITY_STEPS
    errors = r0["errors"]
    assert 0 < errors["fp16"] < 1e-3 and 0.05 < errors[R4] < errors[R1] < 2  # a higher rank keeps more
    assert r0["noise"] > 0
    raced = set(r0["medians"])
    assert len(raced) >= 2 and R4 in raced, raced
    for e in raced:  # the medians are the clock's step times: one period between first buckets per step
        assert abs(r0["medians"][e] - STEP_S[e] * r0["unit"]) < 1e-9, (e, r0["medians"][e])
    race = ran[metered:]
    first_rounds = race[:RACE_MIN_STEPS * len(raced)]
    assert all(first_rounds.count(e) == RACE_MIN_STEPS for e in raced), first_rounds
    assert r0["phase"] == "settled" and r0["choice"] == R4 and ran[-1] == R4
    # the probe's cost: its timed steps beyond the choice's step time
    assert abs(r0["excess"] - sum(s - STEP_S[R4] * r0["unit"] for _, s in r0["timed"])) < 1e-9 and r0["excess"] > 0
    assert r0["resumed"][:3] == ("settled", R4, R4)
    assert r0["early"] == ("start", None, "fp16", 5), "a checkpoint before the decision measures again from it"


def _joined(rank, world):
    from gradsync.profiler.online import OnlineAutoState

    model, batches = _job(rank)
    plan = _plan(model, batches, joined=(T4,))
    clock = _StepClock(next(r.iteration_s for r in plan.advice().predictions if r.entry == "allreduce"))
    state = OnlineAutoState(plan, model, clock=clock)
    ran = _Job(state, model, batches).train(START_STEPS + 2 * QUALITY_STEPS + 4 * TIMED_STEPS + 4, clock)
    return state.stages, state.medians, state.choice, ran, [float(p.sum()) for p in model.parameters()]


def test_online_auto_races_torchs_powersgd_on_the_jobs_buckets_joined_into_one():
    """A DDP of several buckets (0.005 MB) cannot run torch's PowerSGD bucket by bucket on Gloo; the online
    probe races it on the buckets joined into one, with its overlapped twin's measured error (never metered
    itself), and chooses it where its steps are the fastest; every rank alike."""
    (stages, medians, choice, ran, params), other = run_ranks(_joined, 2, timeout=240)
    assert (stages, medians, choice, ran, params) == other
    assert all(T4 not in stage for stage in stages)
    assert T4 in medians and R4 in medians, medians
    assert choice == T4 and ran[-1] == T4 and ran.count(T4) > RACE_MIN_STEPS


def _no_budget(rank, world):
    from gradsync.profiler.online import OnlineAutoState

    model, batches = _job(rank)
    state = OnlineAutoState(_plan(model, batches, budget_s=0.0), model, clock=_StepClock())
    ran = _Job(state, model, batches).train(START_STEPS + QUALITY_STEPS + 2, _StepClock())
    return state.phase, state.choice, ran


def test_without_budget_for_a_race_the_job_stays_on_the_base():
    (p0, c0, ran0), (p1, c1, ran1) = run_ranks(_no_budget, 2, timeout=180)
    assert (p0, c0) == (p1, c1) == ("settled", "fp16") and ran0 == ran1 == ["fp16"] * len(ran0)



def _script(rank, world):
    import gradsync

    model, batches = _job(rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.005)
    opt = _optimizer(ddp.parameters())
    state, decision = gradsync.register_auto(ddp, opt, batches, F.cross_entropy, online=True)
    # one metered stage, then at most TIMED_STEPS rounds of 4 entries, and one more step: the race's last verdict is
    # taken at the first bucket after its last round
    for i in range(START_STEPS + QUALITY_STEPS + 4 * TIMED_STEPS + 1):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return state.phase, state.choice, decision, state.stats()["wire_bytes"] > 0, ddp.gradsync_state is state


def test_register_auto_online_in_a_script_settles_alike_on_every_rank():
    (p0, c0, d0, sent, same), (p1, c1, _, _, _) = run_ranks(_script, 2, timeout=180)
    # the choice depends on this machine's load (loopback all-reduce vs backward): only what holds for any
    assert p0 == p1 == "settled" and c0 == c1 and c0 is not None and d0 is None and sent and same


def test_train_online_auto_writes_its_decision_and_resumes_it(tmp_path):
    import json

    from cli_runner import run_cli

    ckpt, args = tmp_path / "ckpt", ["train", "--algorithm", "auto", "--auto-probe", "online", "--workers", "2",
                                     "--train-samples", "512", "--eval-samples", "500", "--no-progress",
                                     "--compute-steps", "1"]
    first = run_cli([*args, "--max-steps", "3", "--checkpoint", str(ckpt), "--out", str(tmp_path / "a")], timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((tmp_path / "a" / "metrics.json").read_text())["summary"]
    # on loopback (CCR far below 0.5) nothing lossy can pay off: DDP from the first step, nothing metered
    assert summary["algorithm"] == "auto" and summary["auto_choice"] == "allreduce" and summary["auto_stages"] == []
    assert summary["auto_setup_seconds"] > 0 and "auto (online): base allreduce, metering nothing" in first.stdout
    resumed = run_cli([*args, "--max-steps", "5", "--checkpoint", str(ckpt), "--resume", "latest", "--out",
                       str(tmp_path / "b")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = json.loads((tmp_path / "b" / "metrics.json").read_text())["summary"]
    assert again["steps"] == 5 and again["auto_choice"] == "allreduce"
    not_auto = run_cli(["train", "--algorithm", "fp16", "--auto-probe", "online"], timeout=60)
    assert not_auto.returncode != 0 and "auto_probe 'online' needs algorithm 'auto'" in not_auto.stderr


def test_only_lossy_settings_clearly_faster_than_the_fastest_lossless_one_are_metered():
    from gradsync.profiler.online import faster_than_lossless

    sim = {"allreduce": 0.147, "fp16": 0.124, R1: 0.117, R4: 0.100}
    assert faster_than_lossless([R1, R4], sim, ["fp16"]) == [R4]  # r=4 1.24x fp16; r=1 only 1.06x
    assert faster_than_lossless([R1, R4], sim, []) == [R1, R4]  # against DDP alone both are (1.26x, 1.47x)


def _lossless_race(rank, world):
    from gradsync.profiler.online import OnlineAutoState

    model, batches = _job(rank)
    plan = _plan(model, batches, base="allreduce", metered=(), lossless_race=True)
    clock = _StepClock(next(r.iteration_s for r in plan.advice().predictions if r.entry == "allreduce"))
    state = OnlineAutoState(plan, model, clock=clock)
    ran = _Job(state, model, batches).train(START_STEPS + 2 * TIMED_STEPS + 2, clock)
    return state.choice, state.stages, sorted(state.medians), ran


def test_a_cast_within_the_simulators_error_of_ddp_is_raced_beside_it_and_the_faster_chosen():
    (choice, stages, raced, ran), other = run_ranks(_lossless_race, 2, timeout=180)
    assert (choice, stages, raced, ran) == other
    assert stages == [] and raced == ["allreduce", "fp16"] and choice == "fp16", (stages, raced, choice)
    assert ran[:START_STEPS] == ["allreduce"] * START_STEPS and ran[-1] == "fp16"


R8 = "powersgd-overlap:matrix_approximation_rank=8"


def _rechecked(rank, world):
    from gradsync.profiler.online import OnlineAutoState

    model, batches = _job(rank)
    plan = _plan(model, batches, recheck_every=12)
    clock = _StepClock(next(r.iteration_s for r in plan.advice().predictions if r.entry == "allreduce"))
    state = OnlineAutoState(plan, model, clock=clock)
    job = _Job(state, model, batches)
    while state.phase != "settled":
        job.train(1, clock)
    settled_at, ladder = state.iteration, state.ladder
    wire = state.stats()["wire_bytes"]
    # windows of QUALITY_STEPS steps from every multiple of 12 of the job's iterations, each decided after its last
    # step; under the lenient limit r=4 (about 0.6 of the noise) passes the next two
    first = -(-(settled_at + 1) // 12) * 12
    job.train(first + 12 + QUALITY_STEPS + 1 - state.iteration)
    lenient = (list(ladder.switches), state.current, state.stats()["wire_bytes"] > wire)
    ladder.max_error_to_noise = 0.01  # the test's stand-in for a quality that degraded
    ran = job.train(12)
    checkpoint = state.state_dict()
    resumed = OnlineAutoState(plan, model, clock=_StepClock())
    resumed.load_state_dict(checkpoint)
    return {"choice": state.choice, "strict_window": first + 24, "lenient": lenient, "ran": ran,
            "switches": state.ladder.switches, "stats": {k: state.stats()[k] for k in ("auto_rung", "auto_switches")},
            "summary": state.summary()["auto_switches"], "window": ladder.window, "every": ladder.check_every,
            "resumed": (resumed.current, resumed.ladder.current, len(resumed.ladder.switches), resumed.ladder.check_every)}


def test_a_settled_lossy_choice_is_rechecked_and_escalates_alike_on_every_rank():
    r0, r1 = run_ranks(_rechecked, 2, timeout=240)
    assert r0["switches"] == r1["switches"] and r0["ran"] == r1["ran"]
    assert r0["choice"] == R4 and (r0["every"], r0["window"]) == (12, QUALITY_STEPS)
    # the settled r=4 keeps its own state under the ladder; its checks cost reference traffic but pass the limit
    assert r0["lenient"] == ([], R4, True)
    # the next window, past the limit: r=4 hands over to r=8 at the first bucket after it
    [switch] = r0["switches"]
    assert switch["from"] == R4 and switch["to"] == R8 and switch["ratio"] > 0.01
    assert switch["iteration"] == r0["strict_window"] + QUALITY_STEPS
    assert r0["ran"][-1] == R8 and r0["stats"] == {"auto_rung": R8, "auto_switches": 1} and r0["summary"] == [switch]
    assert r0["resumed"] == (R8, R8, 1, 12), "a checkpoint resumes the rung, its history and the re-check period"


def test_recheck_needs_the_online_probe():
    import pytest

    from gradsync.train.config import TrainConfig

    with pytest.raises(ValueError, match="auto_recheck_every 50 needs auto_probe 'online'"):
        TrainConfig(algorithm="auto", auto_recheck_every=50)
    with pytest.raises(ValueError, match="auto_recheck_every"):
        TrainConfig(algorithm="auto", auto_probe="online", auto_recheck_every=-1)
