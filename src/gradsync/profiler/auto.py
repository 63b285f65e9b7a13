"""``--algorithm auto``: the setting with the least predicted time to quality, measured on the job.

Every rank runs the same steps (collectives), on its own batches, and ends with the same choice:

1. **compute profile** (:func:`~gradsync.profiler.profile.record_profile`: forward, backward and
   optimizer times, DDP's buckets and when each is ready) and the dense all-reduce time of those
   buckets on the real network (:func:`~gradsync.profiler.ccr.measure_ccr`), both MAX over ranks; the
   network as the link rate at which the ring model gives that time (:func:`effective_bandwidth_mbit`); the
   all-reduce is repeated at most :data:`CCR_PROBE_SHARE` of the probe's budget (:data:`CCR_BUDGET_S` at most).
   Below a CCR of :data:`~gradsync.profiler.advise.LOW_CCR` auto keeps DDP and measures nothing more.
   Each lossy hook's own computation per step (compression, error feedback, decompression) is timed
   without communication (:func:`~gradsync.profiler.probe.compression_seconds`) and added to its
   simulated iteration: PowerSGD's can exceed the model's forward and backward pass;
2. **quality**: every lossy communication-hook candidate the simulator predicts at least
   :data:`~gradsync.profiler.advise.MIN_GAIN` x faster per iteration than DDP (but those of
   :data:`NOT_PROBED`) that could still be short-listed (:func:`_next_stage`: the costliest waits for
   the others' errors, and is measured only if it still could) is measured on the job's own gradients
   (:class:`~gradsync.profiler.probe.QualityProbe`: its relative error against the dense aggregate,
   estimated from a sample of each gradient tensor;
   the 16-bit casts without communication, :func:`~gradsync.profiler.probe.cast_errors`), which the
   quality model (:mod:`gradsync.profiler.quality_model`) turns into predicted extra steps. No table of
   other models' runs is read;
3. **short-list and time**: the :data:`SHORTLIST` candidates with the least predicted time to quality
   (simulated iteration x (1 + extra steps)) are timed on the real network in a race
   (:func:`~gradsync.profiler.probe.time_candidates`, on the quality probe's copy where they run on
   DDP's buckets): each at least :data:`~gradsync.profiler.probe.RACE_MIN_STEPS` steps, then one
   clearly slower to quality than the best stops, until one is left or the rest are within
   :data:`~gradsync.profiler.probe.RACE_TIE` (at most :data:`~gradsync.profiler.probe.TIMED_STEPS`);
   DDP with them only where it is a contender (:data:`DDP_CONTENDER`), else its
   iteration is simulated from the measured all-reduce time (step 1), which spares the probe its most
   expensive steps on a slow network;
4. the choice (:func:`gradsync.profiler.advise.advise` over the timed candidates and DDP): the least
   iteration time x (1 + predicted extra steps), unless it gains less than ``MIN_GAIN`` over DDP. Where
   nothing was timed (a budget too small), only DDP and the 16-bit casts may be chosen: a setting whose
   quality had to be metered is chosen only on its timed iteration.

The probe trains copies of the model; its cost is start-up time, reported in the advice's notes.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import max_over_ranks
from ..options import AUTO
from ..sim.profile import Profile
from ..validation import check_int
from .advise import CASTS, LOW_CCR, Advice, advise, candidates, is_hook, worth_measuring
from .ccr import measure_ccr
from .probe import (QUALITY_STEPS, RACE_MIN_STEPS, REFERENCE_FRACTION, START_STEPS, TIMED_STEPS, QualityProbe,
                    cast_errors, compression_seconds, probe_batches, quality_proxy, time_candidates)
from .profile import ccr_at, record_profile
from .quality_model import unwrap_optimizer

__all__ = ["AUTO", "CCR_BUDGET_S", "CCR_PROBE_SHARE", "DDP_CONTENDER", "PROBE_SHARE", "SHORTLIST", "AutoDecision",
           "agreed_profile", "decide", "effective_bandwidth_mbit", "measure_start", "optimizer_factory", "probe_batches", "register_auto", "resolve_auto"]

_REFERENCE_MBIT = 1000.0


def agreed_profile(prof: Profile, allreduce_s: float, group: Any = None) -> tuple[Profile, float]:
    """Collective: ``prof`` with its times (forward, backward, optimizer, every bucket's ready time;
    seconds) and ``allreduce_s`` (this rank's dense all-reduce time, seconds) replaced by their MAX
    over the ranks of ``group`` (one all-reduce), so every rank holds the same numbers."""
    v = max_over_ranks([allreduce_s, prof.forward_s, prof.backward_s, prof.optimizer_s,
                        *(b.ready_s for b in prof.buckets)], group)
    buckets = tuple(dataclasses.replace(b, ready_s=r) for b, r in zip(prof.buckets, v[4:]))
    return dataclasses.replace(prof, forward_s=v[1], backward_s=v[2], optimizer_s=v[3], buckets=buckets), v[0]


def effective_bandwidth_mbit(prof: Profile, world_size: int, allreduce_s: float) -> float:
    """The link rate (Mbit/s) at which the ring all-reduce model (no latency) moves ``prof``'s buckets
    in ``allreduce_s`` seconds: the measured network as one number.

    Raises:
        ValueError: if ``allreduce_s`` <= 0.
    """
    if not allreduce_s > 0:
        raise ValueError(f"allreduce_s must be > 0 seconds; got {allreduce_s}")
    modelled = ccr_at(prof, world_size, _REFERENCE_MBIT) * prof.backward_s
    return _REFERENCE_MBIT * modelled / allreduce_s


#: Candidates timed on the real network after the quality probe.
SHORTLIST = 3
#: DDP is timed with the short-list when its simulated time to quality is within this factor of the best
#: candidate's (else simulated only: on a slow link its steps are the probe's most expensive, and the
#: choice does not hinge on them). Without it, on the ResNet-8 at 40 Mbit/s (CCR 1.3) the candidates'
#: probe timings (fp16 111.7 ms) met DDP's simulated 105 ms and auto kept DDP, 24 % behind PowerSGD r=8.
DDP_CONTENDER = 2.0
#: Share of the job's predicted time auto may spend measuring where the job's length is known (``job_steps``):
#: the job's time is predicted as it would run without lossy compression (its steps x the least simulated
#: iteration of DDP and the allowed 16-bit casts, which need no quality measurement), and each quality stage and
#: the timing race are cut to what the rest of the budget is predicted to pay for (:func:`decide`). On a job of
#: hours it never binds; on a 468-step MLP-Mixer at 4 hosts the probe was 9-30 s of a 54-230 s job. (The least
#: simulated iteration of every setting instead, PowerSGD r=1's, left the Mixer's 2-host job at 5 Mbit/s a 3.6 s
#: budget: only r=1 was measured and fp16 ran it at 2.2x the best setting's time.)
PROBE_SHARE = 0.05
#: Seconds of timed dense all-reduces auto's CCR measurement may spend after its warm-up (at least one
#: repetition): on 2 hosts at 5 Mbit/s one dense all-reduce of a 0.16 M-parameter model takes ~1 s.
CCR_BUDGET_S = 2.0
#: Share of the probe's budget (:data:`PROBE_SHARE`, judged from the first dense all-reduce) its CCR
#: measurement may spend, up to :data:`CCR_BUDGET_S`: the first all-reduce is always timed. At 2 and 4 hosts at
#: 15 Mbit/s the MobileNetV2's 1-epoch job (budget 4.2-5.2 s) spent 1.7-2.0 s on 5 repetitions of ~0.35 s, and
#: at 4 hosts no lossy setting's quality could be paid for after it.
CCR_PROBE_SHARE = 0.1
#: Algorithms auto does not probe: every model measured put their error far above the quality model's
#: limit (COVAP K=2-6 with fp16 shards 0.59-0.95, top-k 0.01 0.60-1.01 on the ResNet-8, its 3-rank and
#: wide forms, the character LSTM, the ViT and the GRU), while metering them costs the probe 1/K of a dense
#: all-reduce each per step (1.45 for K=2..6): on the ViT at 5 Mbit/s the probe took 71 s with them.
#: ``gradsync doctor`` still measures them.
NOT_PROBED = ("covap", "topk")


@dataclass(frozen=True)
class AutoDecision:
    """What :func:`decide` measured and chose: the chosen ``entry``, the :class:`Advice`, the
    ``errors`` (``{entry: relative error}``) and ``iterations`` (``{entry: seconds}``) measured,
    ``probe_seconds``, the wall-clock cost of those measurements on this rank, ``phases``, that
    cost by step of the module docstring (seconds: ``profile``, ``ccr``, ``quality``, ``timing``; a
    step not taken is absent), and the gradient ``noise`` and optimizer ``family`` the errors were judged
    against (None where no lossy setting was metered), and ``timed_steps`` (``{entry: steps}``, fewer for
    an entry the timing race dropped), and the probe's ``budget_s`` (seconds, :data:`PROBE_SHARE` of the job's
    predicted time; None where the job's length is not known), and ``compression`` (``{entry: seconds}``
    each hook computed per step, :func:`~gradsync.profiler.probe.compression_seconds`)."""

    entry: str
    advice: Advice
    errors: dict
    iterations: dict
    probe_seconds: float
    phases: dict = dataclasses.field(default_factory=dict)
    noise: float | None = None
    family: str | None = None
    timed_steps: dict = dataclasses.field(default_factory=dict)
    budget_s: float | None = None
    compression: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures for metrics.json."""
        return {"auto_choice": self.entry, "auto_reason": self.advice.reason, "auto_ccr": self.advice.ccr,
                "auto_errors": self.errors, "auto_noise": self.noise,
                "auto_optimizer_family": self.family, "auto_iterations_s": self.iterations,
                "auto_timed_steps": self.timed_steps, "auto_probe_budget_s": self.budget_s,
                "auto_compression_s": self.compression,
                "auto_probe_seconds": self.probe_seconds, "auto_probe_phases_s": self.phases}

    def describe_phases(self) -> str:
        """``"profile 0.4 s, ccr 2.1 s, quality 3.0 s, timing 1.9 s"``: :attr:`phases` for a log line, and the
        budget where there was one (``"; budget 4.2 s"``)."""
        text = ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
        return text if self.budget_s is None else f"{text}; budget {self.budget_s:.1f} s"


def _next_stage(pending: Sequence[str], errors: dict, noise: float | None, family: str | None, simulated: Advice,
                prof: Profile, world: int, bandwidth: float, allowed: Callable[[str], bool],
                shortlist: int, overheads: dict | None = None) -> list[str]:
    """The ``pending`` entries to measure next: those that could still enter the short-list, but the
    costliest of them waits for the others' errors where metering it costs more than a stage of its own
    (its simulated communication per step, iteration minus compute, above one step's compute: on a slow
    network; on a fast one a second stage's forward and backward passes cost more than its bytes). An
    entry's predicted time to quality is at least its simulated iteration (no extra steps), so one at or above the ``shortlist``-th best
    predicted time to quality of the measured hooks cannot be short-listed. The errors do not depend on
    what is measured together (:meth:`QualityProbe.measure`), so the short-list is the one measuring
    every entry would give, without metering what cannot matter: PowerSGD r=16 carries about half of the
    candidates' bytes (the GRU at 5 Mbit/s: r=1..16 send 31 units of r=1's per step, r=16 16 of them)."""
    if not pending:
        return []
    ranked = advise(prof, world, bandwidth, errors=errors, allowed=allowed, noise=noise, family=family,
                    overheads=overheads).predictions
    known = sorted(r.time_to_quality_s for r in ranked
                   if r.entry != "allreduce" and r.measured and is_hook(r.entry) and r.time_to_quality_s is not None)
    bound = known[shortlist - 1] if len(known) >= shortlist else math.inf
    iteration = {r.entry: r.iteration_s for r in simulated.predictions}
    lowest: dict[str, float] = {}  # per quality proxy (torch's PowerSGD and the overlapped one share one)
    for e in pending:
        if iteration[e] < bound:
            lowest[quality_proxy(e)] = min(lowest.get(quality_proxy(e), math.inf), iteration[e])
    costliest = max(lowest, key=lambda p: (lowest[p], p), default=None)
    if len(lowest) > 1 and lowest[costliest] - prof.compute_s > prof.compute_s:
        del lowest[costliest]
    return [e for e in pending if quality_proxy(e) in lowest]


def _short_list(ranked: Sequence, shortlist: int, errors: dict) -> list[str]:
    """The first ``shortlist`` measured hooks of ``ranked`` (least predicted time to quality first) that
    could reach the target, one per simulator plan (bytes and schedule): of fp16 and bf16, which move the
    same bytes, the one with the smaller error in ``errors`` (their measured compression times differ by
    less than their noise on a CPU: 0.6-2.3 ms, and Gloo sums bf16 slower, which only timing shows)."""
    plans = {e: (type(plan), vars(plan)) for e, _, plan in candidates()}
    short: list[str] = []
    for r in ranked:
        if r.entry == "allreduce" or not (r.measured and is_hook(r.entry) and math.isfinite(r.time_to_quality_s)):
            continue
        twin = next((i for i, s in enumerate(short) if r.entry in plans and plans.get(s) == plans[r.entry]), None)
        if twin is None:
            if len(short) < shortlist:
                short.append(r.entry)
        elif errors.get(r.entry, math.inf) < errors.get(short[twin], math.inf):
            short[twin] = r.entry
    return short


def decide(prof: Profile, allreduce_s: float, model: torch.nn.Module,
           batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable, make_optimizer: Callable,
           bucket_cap_mb: float, allowed: Callable[[str], bool] = lambda entry: True,
           group: Any = None, seed: int = 0, shortlist: int = SHORTLIST, job_steps: int | None = None,
           spent_s: float = 0.0) -> AutoDecision:
    """Collective: steps 2-4 of the module docstring, given the agreed profile ``prof`` and dense
    all-reduce time ``allreduce_s`` (seconds; :func:`agreed_profile`).

    Args:
        model: the job's model (copied by the probes, not changed).
        batches: this rank's probe batches (:func:`probe_batches`).
        allowed: which ``--algorithms`` entries may be chosen.
        shortlist: candidates timed on the network besides DDP (>= 1).
        job_steps: the job's optimizer steps, or None (unknown: no budget). Known, the probe spends at
            most :data:`PROBE_SHARE` of the job's predicted time, ``spent_s`` (seconds already spent on
            measuring, the same on every rank) included: a quality stage is measured only with the
            entries whose predicted cost (:func:`_stage_seconds`, and 3 timed rounds of the stage's fastest
            entry beside the fastest lossless setting) fits, costliest dropped first, and the
            race times the candidates the rest pays :data:`~gradsync.profiler.probe.RACE_MIN_STEPS`
            rounds for (simulated iterations; the least promising dropped first, but DDP where it is a
            contender: it is timed with the last candidate or neither is; a median of fewer steps decides by
            noise), up to the rounds it pays for; without one, the choice is DDP's or a 16-bit cast's.

    Raises:
        ValueError: for ``allreduce_s`` <= 0, a world size < 2, ``shortlist`` < 1 or ``job_steps`` < 1.
    """
    shortlist = check_int("shortlist", shortlist, 1, 100)
    if job_steps is not None:
        job_steps = check_int("job_steps", job_steps, 1, 10 ** 12)
    world = dist.get_world_size(group)
    t0 = time.perf_counter()
    bandwidth = effective_bandwidth_mbit(prof, world, allreduce_s)
    simulated = advise(prof, world, bandwidth, allowed=allowed)
    budget = math.inf if job_steps is None else _probe_budget(simulated, allowed, job_steps)

    def left() -> float:  # seconds of the budget left, agreed (the ranks' clocks differ)
        return budget - max_over_ranks([spent_s + time.perf_counter() - t0], group)[0] if job_steps else math.inf

    errors: dict[str, float] = {}
    noise: float | None = None
    family: str | None = None
    iterations: dict[str, float] = {}
    timed_steps: dict[str, int] = {}
    phases: dict[str, float] = {}
    overheads: dict[str, float] = {}
    if simulated.ccr >= LOW_CCR and left() > 0:
        hooks = [e for e in worth_measuring(simulated, skip=NOT_PROBED) if allowed(e)]
        # torch's PowerSGD as its quality proxy, gradsync's (the same products and orthogonalisation, per
        # bucket: 1.0-1.3x torch's one-bucket time on the MLP): half the hooks to time
        proxies = compression_seconds(model, batches[0], loss_fn, make_optimizer,
                                      list(dict.fromkeys(quality_proxy(e) for e in hooks)), bucket_cap_mb,
                                      process_group=group, seed=seed)
        overheads = {e: proxies[quality_proxy(e)] for e in hooks}
        phases["compression"] = time.perf_counter() - t0
        simulated = advise(prof, world, bandwidth, allowed=allowed, overheads=overheads)
    sim_iteration = {r.entry: r.iteration_s for r in simulated.predictions}
    lossless = min(sim_iteration[e] for e in sim_iteration if e == "allreduce" or (e in CASTS and allowed(e)))
    if simulated.ccr >= LOW_CCR:
        casts, metered = split_candidates(simulated, allowed)
        if casts:
            errors.update(cast_errors(model, batches[0], loss_fn, casts, process_group=group))
        probe = None
        unaffordable: set[str] = set()
        while stage := _next_stage([e for e in metered if e not in errors and e not in unaffordable], errors, noise,
                                   family, simulated, prof, world, bandwidth, allowed, shortlist, overheads):
            room = left()
            while stage and _stage_seconds(stage, sim_iteration, prof, probe is None) + RACE_MIN_STEPS * (
                    lossless + min(sim_iteration[e] for e in stage)) > room:  # and a race it could win
                costliest = max((quality_proxy(e) for e in stage), key=lambda p: (sim_iteration.get(p, 0.0), p))
                unaffordable.update(e for e in stage if quality_proxy(e) == costliest)
                stage = [e for e in stage if e not in unaffordable]
            if not stage:
                continue
            if probe is None:
                probe = QualityProbe(model, batches, loss_fn, make_optimizer, stage, bucket_cap_mb,
                                     process_group=group, seed=seed)
            errors.update(probe.measure(stage))
            noise, family = probe.noise, probe.family
        phases["quality"] = time.perf_counter() - t0 - phases.get("compression", 0.0)
        ranked = advise(prof, world, bandwidth, errors=errors, allowed=allowed, noise=noise,
                        family=family, overheads=overheads).predictions
        short = _short_list(ranked, shortlist, errors)
        ddp = next(r for r in ranked if r.entry == "allreduce")
        if short and ddp.time_to_quality_s <= DDP_CONTENDER * min(r.time_to_quality_s for r in ranked
                                                                  if r.entry in short):
            short.append("allreduce")  # a contender: timed beside the others, on the same copy
        rounds = TIMED_STEPS
        if short and job_steps:
            short, rounds = _affordable_race(short, sim_iteration, {r.entry: r.time_to_quality_s for r in ranked},
                                             left())
        if short:
            t1 = time.perf_counter()
            factor = {r.entry: r.time_to_quality_s / r.iteration_s for r in ranked if r.entry in short}
            timed = time_candidates(model, batches, loss_fn, make_optimizer, short, bucket_cap_mb, steps=rounds,
                                    process_group=group, seed=seed, probe=probe, factors=factor,
                                    min_steps=min(RACE_MIN_STEPS, rounds))
            iterations = {e: p.iteration_s for e, p in timed.items()}
            timed_steps = {e: p.timed_steps for e, p in timed.items()}
            phases["timing"] = time.perf_counter() - t1
        if probe is not None:
            probe.close()
    spent = time.perf_counter() - t0
    if iterations:
        advice = advise(prof, world, bandwidth, errors=errors, iterations=iterations, noise=noise, family=family,
                        allowed=lambda e: e in iterations or e == "allreduce", probe_seconds=spent)
    else:  # a metered setting is chosen only once timed: its simulated iteration was 4.5x off on the MLP
        cast = _untimed_cast(errors, allowed)
        advice = advise(prof, world, bandwidth, errors=errors, allowed=lambda e: e == cast,
                        noise=noise, family=family, probe_seconds=spent, overheads=overheads)
    return AutoDecision(advice.choice.entry, advice, errors, iterations, spent, phases, noise, family, timed_steps,
                        None if job_steps is None else budget, overheads)


def split_candidates(simulated: Advice, allowed: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """``(casts, metered)``: the ``allowed`` settings worth measuring in ``simulated``
    (:func:`~gradsync.profiler.advise.worth_measuring`, but :data:`NOT_PROBED`), split into the 16-bit casts
    (their error needs no communication) and the rest (metered on the job's gradients)."""
    worth = [e for e in worth_measuring(simulated, skip=NOT_PROBED) if allowed(e)]
    return [e for e in worth if e in CASTS], [e for e in worth if e not in CASTS]


def _probe_budget(simulated: Advice, allowed: Callable[[str], bool], job_steps: int) -> float:
    """Seconds auto may spend measuring: :data:`PROBE_SHARE` of ``job_steps`` at the least ``simulated``
    iteration of DDP and the ``allowed`` 16-bit casts (the job as it would run without lossy compression)."""
    return PROBE_SHARE * job_steps * min(r.iteration_s for r in simulated.predictions
                                         if r.entry == "allreduce" or (r.entry in CASTS and allowed(r.entry)))


def _untimed_cast(errors: dict, allowed: Callable[[str], bool]) -> str | None:
    """The 16-bit cast auto may choose where nothing was timed: of the ``allowed`` ones, the least
    measured relative error in ``errors`` (fp16 first where none was measured). fp16 and bf16 move the
    same bytes, and their compression times differ by noise: chosen by those, auto ran the MobileNetV2
    at 4 hosts with bf16 (error 0.0017) where fp16's was 0.0002."""
    return min((e for e in CASTS if allowed(e)), key=lambda e: (errors.get(e, math.inf), CASTS.index(e)),
               default=None)


def _affordable_race(short: Sequence[str], sim_iteration: dict, predicted: dict,
                     room: float) -> tuple[list[str], int]:
    """``(entries, rounds)``: the entries of ``short`` that ``room`` (seconds) pays
    :data:`~gradsync.profiler.probe.RACE_MIN_STEPS` timed rounds for (each round one step of each, its
    ``sim_iteration``, seconds), and the rounds it pays (at most :data:`~gradsync.profiler.probe.TIMED_STEPS`).
    The least promising (greatest ``predicted`` time to quality) is dropped first, but DDP (``allreduce``),
    where it is a contender, is timed with the last candidate or neither is: a timed candidate against DDP's
    simulated iteration is no comparison (the Mixer at 40 Mbit/s kept DDP, 53 % behind fp16). ``([], 0)``
    where nothing is paid for."""
    short = list(short)
    while short and room < RACE_MIN_STEPS * sum(sim_iteration[e] for e in short):
        others = [e for e in short if e != "allreduce"]
        if len(others) > 1 or "allreduce" not in short:
            short.remove(max(others, key=lambda e: (predicted[e], e)))
        else:
            short = []
    return (short, min(TIMED_STEPS, int(room / sum(sim_iteration[e] for e in short)))) if short else ([], 0)


def _stage_seconds(stage: Sequence[str], sim_iteration: dict, prof: Profile, first: bool) -> float:
    """Predicted seconds of a quality stage (:meth:`QualityProbe.measure`): its :data:`QUALITY_STEPS` metered
    steps (and the probe copy's :data:`START_STEPS` for the ``first``), each a forward, a backward and the
    stage's hooks: every measured proxy's simulated communication and compression (iteration minus compute; the
    proxy's, which the meter runs: torch's PowerSGD is measured as the overlapped one) and the
    reference's (:data:`REFERENCE_FRACTION` of DDP's)."""
    compute = prof.compute_s
    comm = {quality_proxy(e): max(0.0, sim_iteration.get(quality_proxy(e), sim_iteration[e]) - compute)
            for e in stage}
    reference = REFERENCE_FRACTION * max(0.0, sim_iteration["allreduce"] - compute)
    steps = QUALITY_STEPS + (START_STEPS if first else 0)
    return steps * (compute + sum(comm.values()) + reference)


def resolve_auto(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], workload: str,
                 batch_size: int, bucket_cap_mb: float, allowed: Callable[[str], bool] = lambda entry: True,
                 group: Any = None, seed: int = 0, job_steps: int | None = None) -> AutoDecision:
    """Collective (every rank, same arguments but its own batches): measure and choose (the module
    docstring's steps 1-4).

    Args:
        model: the model to train (copies are profiled and probed; ``model`` is not changed).
        batches: this rank's probe batches (:func:`probe_batches`; at least one).
        loss_fn, make_optimizer: as in training.
        workload, batch_size, bucket_cap_mb: the profile's labels and DDP's bucket size (MB).
        allowed: which ``--algorithms`` entries may be chosen.
        seed: the job's seed (PowerSGD's initial factors in the probes).
        job_steps: the job's optimizer steps where known: measuring then spends at most
            :data:`PROBE_SHARE` of its predicted time, the profile and the CCR measurement included
            (:func:`decide`); None: no budget.

    Returns:
        :class:`AutoDecision`: ``entry`` is the chosen ``gradsync bench --algorithms`` entry (e.g.
        ``powersgd:matrix_approximation_rank=8``); ``advice`` has every prediction and the reason.

    Raises:
        ValueError: for an empty ``batches`` or a world size < 2.
    """
    if not batches:
        raise ValueError("batches must hold at least one (inputs, targets) batch")
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"world size must be >= 2 for algorithm 'auto' (nothing to synchronise); got {world}")
    t0 = time.perf_counter()
    prof, allreduce_s, phases = measure_start(model, batches, loss_fn, make_optimizer, workload, batch_size,
                                              bucket_cap_mb, allowed, group, job_steps)
    t2 = time.perf_counter()
    decision = decide(prof, allreduce_s, model, batches, loss_fn, make_optimizer, bucket_cap_mb,
                      allowed=allowed, group=group, seed=seed, job_steps=job_steps, spent_s=t2 - t0)
    phases = {**phases, **decision.phases}
    return dataclasses.replace(decision, probe_seconds=time.perf_counter() - t0, phases=phases)


def measure_start(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                  make_optimizer: Callable, workload: str, batch_size: int, bucket_cap_mb: float,
                  allowed: Callable[[str], bool], group: Any, job_steps: int | None) -> tuple[Profile, float, dict]:
    """Collective: step 1 of the module docstring: ``(prof, allreduce_s, phases)``, the compute profile of a
    copy of ``model`` (3 iterations) and the dense all-reduce time of its buckets (seconds), both MAX over
    the ranks, and what each took (seconds: ``profile``, ``ccr``). The all-reduce is repeated within
    :data:`CCR_PROBE_SHARE` of the probe's budget where ``job_steps`` is known, else :data:`CCR_BUDGET_S`."""
    world = dist.get_world_size(group)
    t0 = time.perf_counter()
    it = iter(list(batches) * 8)
    prof = record_profile(copy.deepcopy(model), lambda: next(it), loss_fn, make_optimizer, workload, batch_size,
                          bucket_cap_mb, iterations=3)
    t1 = time.perf_counter()
    prof, _ = agreed_profile(prof, 0.0, group)  # agreed before the CCR budget is judged from it

    def ccr_budget(first_s: float) -> float:
        if job_steps is None:
            return CCR_BUDGET_S
        simulated = advise(prof, world, effective_bandwidth_mbit(prof, world, first_s), allowed=allowed)
        return min(CCR_BUDGET_S, CCR_PROBE_SHARE * _probe_budget(simulated, allowed, job_steps))

    ccr = measure_ccr([b.numel for b in prof.buckets], prof.backward_s, group=group, budget_s=ccr_budget)
    prof, allreduce_s = agreed_profile(prof, ccr.allreduce_s, group)
    return prof, allreduce_s, {"profile": t1 - t0, "ccr": time.perf_counter() - t1}


def optimizer_factory(optimizer: Any) -> Callable[[Any], torch.optim.Optimizer]:
    """``make_optimizer`` of a job's optimizer for :func:`resolve_auto`: framework wrappers
    (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``) are unwrapped;
    ``make_optimizer(params)`` builds the same class with its ``defaults`` (those its constructor
    takes).

    Raises:
        ValueError: if ``optimizer`` is no ``torch.optim.Optimizer`` (nor wraps one).
    """
    optimizer = unwrap_optimizer(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"algorithm 'auto' needs the job's torch.optim.Optimizer; got {type(optimizer).__name__}")
    cls, defaults = type(optimizer), dict(optimizer.defaults)
    accepted = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        # torch's AdamW keeps Adam's ``decoupled_weight_decay`` in its defaults but does not take it
        defaults = {k: v for k, v in defaults.items() if k in accepted}

    def make_optimizer(params: Any) -> torch.optim.Optimizer:
        return cls(params, **defaults)

    return make_optimizer


def script_job(ddp: Any, optimizer: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
               ) -> tuple[Callable[[Any], torch.optim.Optimizer], int, float]:
    """``(make_optimizer, batch_size, bucket_cap_mb)`` of a script's ``DistributedDataParallel`` for auto:
    :func:`optimizer_factory` of its optimizer, the first batch's leading dimension (1 without batches) and
    DDP's bucket size (MB).

    Raises:
        ValueError: for a ``ddp`` that is no ``DistributedDataParallel`` or a non-optimizer.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp, DistributedDataParallel):
        raise ValueError(f"ddp must be a torch DistributedDataParallel, got {type(ddp).__name__}")
    return (optimizer_factory(optimizer), int(batches[0][0].shape[0]) if batches else 1,
            ddp.bucket_bytes_cap / 2 ** 20)


def register_auto(ddp: Any, optimizer: torch.optim.Optimizer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  job_steps: int | None = None) -> tuple[Any, AutoDecision]:
    """Collective: ``--algorithm auto`` for a script's own ``DistributedDataParallel``: measure on copies
    of ``ddp.module`` (:func:`resolve_auto`), then register the chosen communication hook on ``ddp``.
    Call it on every rank after building ``ddp`` and ``optimizer`` and before training::

        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        state, decision = gradsync.register_auto(ddp, opt, [next(batches) for _ in range(8)], F.cross_entropy)

    Args:
        ddp: a ``DistributedDataParallel`` without a communication hook (its process group and bucket
            size are used).
        optimizer: the job's optimizer; copies (same class and defaults) train the probes.
        batches: this rank's ``(inputs, targets)`` batches on the model's device, different on every
            rank as in training (8 are measured: :data:`~gradsync.profiler.probe.QUALITY_STEPS`).
        loss_fn: ``loss_fn(ddp(inputs), targets) -> 0-d tensor``.
        job_steps: the script's optimizer steps, where known: measuring then spends at most
            :data:`PROBE_SHARE` of the job's predicted time (:func:`decide`); None: no budget.

    Returns:
        ``(state, decision)``: the registered hook's state (``stats()``, ``state_dict()`` for
        checkpoints; also ``ddp.gradsync_state``) and the :class:`AutoDecision` (``entry``,
        ``advice.reason``, what was measured and what it cost).

    Raises:
        ValueError: for a ``ddp`` that is no ``DistributedDataParallel``, empty ``batches`` or a world
            size < 2.
    """
    from ..algorithms import build_hook, parse_entry

    make_optimizer, batch_size, bucket_cap_mb = script_job(ddp, optimizer, batches)
    decision = resolve_auto(ddp.module, list(batches), loss_fn, make_optimizer, "script", batch_size, bucket_cap_mb,
                            allowed=lambda e: is_hook(e, any_buckets=True), group=ddp.process_group,
                            job_steps=job_steps)
    name, options = parse_entry(decision.entry)
    state, hook = build_hook(name, process_group=ddp.process_group, model=ddp.module, **options)
    ddp.register_comm_hook(state, hook)
    ddp.gradsync_state = state
    return state, decision
