"""``--algorithm auto`` decided on the job's own first steps: the probe's steps train the job.

The start-up probe (:mod:`gradsync.profiler.auto`) measures on private copies of the model, so every
second it spends is start-up time: on a 1-epoch MobileNetV2-style job at 2 hosts x 15 Mbit/s it was
5.4 s of a 38.1 s job, more than issue 31's 10 % bar by itself. Here only the cheap part runs before
training (:func:`plan_online`: the compute profile, the dense all-reduce and the 16-bit casts' error, as in
:func:`~gradsync.profiler.auto.resolve_auto`), and the rest, each lossy hook's computation included, rides on
the job's own DDP steps (:class:`OnlineAutoState`, a communication hook):

1. **start** (:data:`~gradsync.profiler.probe.START_STEPS` iterations): the job trains on the lossless
   ``base`` (DDP or a 16-bit cast: :func:`~gradsync.profiler.auto._untimed_cast`), DDP rebuilds its buckets;
2. **meter** (:data:`~gradsync.profiler.probe.QUALITY_STEPS` iterations): every lossy candidate predicted
   :data:`~gradsync.profiler.advise.MIN_GAIN` x faster than the fastest lossless setting (one predicted slower
   is never chosen, and metering it cost the DenseNet's jobs at 4 hosts x 60 Mbit/s 300-415 ms steps where fp16's
   took 125-150 ms) is metered on
   the same steps under a :class:`~gradsync.algorithms.meter.QualityMeter`, the first (PowerSGD's highest rank,
   the least error) training the job (its aggregate is DDP's, its error feedback its own), the others on copies
   of the same buckets: each one's relative error against a dense all-reduce of
   :data:`~gradsync.algorithms.meter.REFERENCE_FRACTION` of each gradient tensor, the gradient noise, and its
   computation per step (GraVAC's compression gain measured on the compressor in use, Tyagi & Sharma 2023,
   §3.2). One window for all, right after the start, as the quality model's errors were measured
   (:meth:`OnlineAutoState._meter_stage`): a rank's error halves over the first 50 steps, so ranks metered in
   successive windows compare a late low rank with an early high one. The probe's extra cost is the
   reference's and the copies' traffic; on a slow network a lossless base would cost more (on 2 hosts at
   15 Mbit/s the MobileNetV2's fp16 step was 0.25 s, PowerSGD r=8's 0.13 s);
3. **race**: the all-reduced errors go through the quality model
   (:data:`~gradsync.profiler.quality_model.FITTED_TRAINING`, fitted on errors measured on a copy that trains)
   and the simulator (:func:`~gradsync.profiler.advise.advise`); the short-list (torch's PowerSGD among it, on
   the job's buckets joined into one: :func:`~gradsync.algorithms.joined.joined_hook`; its error is its
   overlapped twin's) then trains the job in rounds (one step of each; a metered candidate keeps the state it
   trained with), each step timed as the period between its first bucket and the next step's (a
   device-synchronising clock: the whole iteration as the job runs it); after
   :data:`~gradsync.profiler.probe.RACE_MIN_STEPS` rounds the medians (MAX over ranks) eliminate
   (:func:`~gradsync.profiler.probe.race`) until one is left, the rest tie, or
   :data:`~gradsync.profiler.probe.TIMED_STEPS` rounds were run. Where nothing is metered but a 16-bit cast is
   predicted faster than DDP by less than the simulator's error (:attr:`OnlinePlan.lossless_race`), the cast
   and DDP are raced alone, right after the start;
4. **settled**: the least timed iteration x (1 + predicted extra steps)
   (:func:`~gradsync.profiler.advise.advise`, as the start-up probe chooses) trains the rest of the job;
   the winner keeps the state it raced with;
5. **re-checked** (opt-in, :attr:`OnlinePlan.recheck_every` > 0; issue 31's item 2, GraVAC's controller, Tyagi &
   Sharma 2023, arXiv 2305.12201, §3.3): a lossy choice that works on any bucket layout trains on under a
   :class:`~gradsync.algorithms.ladder.LadderState` that starts on the chosen hook's own state: from every job
   iteration that is a multiple of ``recheck_every`` its error is metered for
   :data:`~gradsync.profiler.probe.QUALITY_STEPS` steps as in phase 2, and where the all-reduced error-to-noise
   ratio exceeds the quality model's limit for the optimizer family (the one the choice was made under) the next rung
   takes over (PowerSGD rank x 2 up to 16, fp16, DDP). Off by default: the limit was fitted on errors of a job's
   first steps, and later in training the ratio grows (up to 25 % over the VGG's and the SqueezeNet's 1-epoch recipes,
   from 0.17 to 0.38 over the GRU's 4 epochs at r=8; docs/results.md, twentieth session) without a model of what
   that costs.

Every decision is taken at the first bucket of an iteration from all-reduced numbers (one all-reduce
from the hook body), so every rank runs the same hooks. The probe's cost is what its steps took beyond
the chosen setting's: the metered steps' extra traffic and the race's slower candidates
(:meth:`OnlineAutoState.probe_excess_seconds`), plus :func:`plan_online`'s start-up.

A checkpoint taken after the decision resumes the chosen setting with its state; one taken before it
resumes on the base and measures again from the resumed step (every rank loads the same checkpoint, so
every rank measures alike).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..algorithms.base import ADDITIVE_COUNTERS, HookState, compression_ratio
from ..algorithms.joined import joined_hook
from ..algorithms.ladder import LadderState, ladder_hook
from ..algorithms.meter import LOCAL_GRADIENT, REFERENCE_FRACTION, QualityMeter, metered_hook, relative_errors
from ..comm.collectives import collective_device, max_over_ranks
from ..options import AUTO_ONLINE
from ..sim.profile import Profile
from ..validation import check_int
from .advise import CASTS, LOW_CCR, MIN_GAIN, advise, candidates, is_hook, single_bucket
from .compute import device_clock
from .probe import (QUALITY_STEPS, RACE_MIN_STEPS, START_STEPS, TIMED_STEPS, _agreed_medians, _hook_pair,
                    cast_errors, quality_proxy, race)
from .quality_model import FITTED_TRAINING, QualityModel, optimizer_family

__all__ = ["OnlinePlan", "OnlineAutoState", "online_auto_hook", "plan_online", "register_online_auto"]


@dataclass(frozen=True)
class OnlinePlan:
    """What :func:`plan_online` measured before training, the same on every rank.

    Attributes:
        prof: the agreed compute profile (seconds; MAX over ranks).
        world_size: ranks.
        bandwidth_mbit: the measured network as one link rate (Mbit/s;
            :func:`~gradsync.profiler.auto.effective_bandwidth_mbit`).
        base: the lossless entry (``allreduce``, ``fp16`` or ``bf16``) the job trains on in its start step, and
            for good where nothing is worth metering or no race is paid for.
        metered: the lossy candidates metered on the job's steps (entries that work on any bucket layout).
        errors: ``{entry: relative error}`` known before training (the 16-bit casts').
        family: the optimizer family the quality model judges errors against.
        budget_s: seconds the whole probe may cost (:data:`~gradsync.profiler.auto.PROBE_SHARE` of the job's
            predicted time; ``math.inf``: the job's length is not known), :attr:`setup_seconds` included.
        setup_seconds: what :func:`plan_online` took (seconds, MAX over ranks).
        phases: its cost by step (seconds: ``profile``, ``ccr``).
        shortlist: candidates raced besides DDP.
        joined: the single-bucket hooks (torch's PowerSGD) raced on the job's buckets joined into one
            (:func:`~gradsync.algorithms.joined.joined_hook`), never metered: their error and computation per
            step are read off their :func:`~gradsync.profiler.probe.quality_proxy`'s, as the start-up probe
            reads them.
        lossless_race: nothing is metered, and a 16-bit cast is predicted faster than DDP but not
            :data:`~gradsync.profiler.advise.MIN_GAIN` x (within the simulator's error): the two are raced on
            the job's steps, and the faster is chosen.
        quality: the quality model that turns a measured error into extra steps (default
            :data:`~gradsync.profiler.quality_model.FITTED_TRAINING`).
        recheck_every: steps between re-checks of a settled lossy choice (module docstring, phase 5); 0: never. Its
            rungs are the ladder's (:func:`~gradsync.algorithms.ladder.rungs`) whatever ``allowed`` held at planning.
    """

    prof: Profile
    world_size: int
    bandwidth_mbit: float
    base: str
    metered: tuple = ()
    errors: dict = field(default_factory=dict)
    family: Optional[str] = None
    budget_s: float = math.inf
    setup_seconds: float = 0.0
    phases: dict = field(default_factory=dict)
    shortlist: int = 3
    joined: tuple = ()
    lossless_race: bool = False
    quality: QualityModel = FITTED_TRAINING
    recheck_every: int = 0

    def advice(self, errors: Optional[dict] = None, noise: Optional[float] = None,
               iterations: Optional[dict] = None, allowed: Callable[[str], bool] = lambda e: True,
               overheads: Optional[dict] = None):
        """:func:`~gradsync.profiler.advise.advise` on the plan's profile and network (``overheads``:
        ``{entry: seconds}`` each lossy hook computes per step, added to its simulated iteration)."""
        return advise(self.prof, self.world_size, self.bandwidth_mbit, errors=errors, iterations=iterations,
                      noise=noise, family=self.family, allowed=allowed, overheads=overheads, model=self.quality)


def plan_online(model: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable,
                make_optimizer: Callable, workload: str, batch_size: int, bucket_cap_mb: float,
                allowed: Callable[[str], bool] = lambda entry: True, group: Any = None,
                job_steps: Optional[int] = None, shortlist: int = 3, recheck_every: int = 0) -> OnlinePlan:
    """Collective (every rank, its own batches): the measurements :class:`OnlineAutoState` needs before
    the job's first step: the compute profile and the dense all-reduce time (MAX over ranks,
    :func:`~gradsync.profiler.auto.measure_start`) and the 16-bit casts' errors
    (:func:`~gradsync.profiler.probe.cast_errors`). Each lossy hook's own computation per step is timed
    later, while it is metered on the job (not in a group of the rank alone, as the start-up probe does).
    Only ``allowed`` communication hooks are candidates: the job's own DDP runs them. Those that work on
    any DDP bucket layout (``is_hook(e, any_buckets=True)``) are metered; a single-bucket one (torch's
    PowerSGD) is raced on the buckets joined into one where its quality proxy is metered (:attr:`OnlinePlan.joined`).

    ``job_steps`` (the job's optimizer steps, or None: no budget) sets the probe's budget as
    :func:`~gradsync.profiler.auto.decide` does (:data:`~gradsync.profiler.auto.PROBE_SHARE` of the job at
    the fastest lossless setting), of which each metered stage and the race spend what is left
    (:meth:`OnlineAutoState._meter_stage`, :meth:`OnlineAutoState._race_step`). ``recheck_every``: see
    :attr:`OnlinePlan.recheck_every`.

    Raises:
        ValueError: for empty ``batches``, a world size < 2, ``job_steps`` < 1 or ``recheck_every`` outside
            [0, 1000000].
    """
    from .auto import _probe_budget, _untimed_cast, effective_bandwidth_mbit, measure_start, split_candidates

    if not batches:
        raise ValueError("batches must hold at least one (inputs, targets) batch")
    recheck_every = check_int("recheck_every", recheck_every, 0, 1_000_000)
    if dist.get_world_size(group) < 2:
        raise ValueError(f"world size must be >= 2 for algorithm 'auto'; got {dist.get_world_size(group)}")
    hookable = lambda e: allowed(e) and is_hook(e, any_buckets=True)  # noqa: E731
    t0 = time.perf_counter()
    prof, allreduce_s, phases = measure_start(model, batches, loss_fn, make_optimizer, workload, batch_size,
                                              bucket_cap_mb, hookable, group, job_steps)
    world = dist.get_world_size(group)
    bandwidth = effective_bandwidth_mbit(prof, world, allreduce_s)
    simulated = advise(prof, world, bandwidth, allowed=hookable)
    device = next(model.parameters()).device
    family = optimizer_family(make_optimizer([torch.nn.Parameter(torch.zeros(1, device=device))]))
    errors: dict[str, float] = {}
    metered: list[str] = []
    budget = math.inf if job_steps is None else _probe_budget(simulated, hookable, job_steps)
    sim = {r.entry: r.iteration_s for r in simulated.predictions}
    casts: list[str] = []
    if simulated.ccr >= LOW_CCR:
        _, metered = split_candidates(simulated, hookable)
        # not split_candidates' casts (worth measuring: MIN_GAIN x ahead): any cast ahead of DDP may win the race
        casts = [e for e in CASTS if hookable(e) and e in sim and sim[e] < sim["allreduce"]]
        if casts:
            errors.update(cast_errors(model, batches[0], loss_fn, casts, process_group=group))
    lossless = advise(prof, world, bandwidth, errors=errors, allowed=lambda e: hookable(e) and (
        e == "allreduce" or e in CASTS)).choice.entry  # DDP unless a cast is predicted MIN_GAIN x faster
    base = lossless if lossless == "allreduce" else (_untimed_cast(errors, hookable) or "allreduce")
    metered = faster_than_lossless(metered, sim, casts)
    lossless_race = not metered and bool(casts) and base == "allreduce"
    setup = max_over_ranks([time.perf_counter() - t0], group)[0]  # the ranks' clocks differ
    joined = tuple(e for e, _, _ in candidates() if allowed(e) and is_hook(e) and single_bucket(e)
                   and quality_proxy(e) in metered)
    return OnlinePlan(prof, world, bandwidth, base, tuple(metered), errors, family, budget, setup, phases, shortlist,
                      joined, lossless_race, recheck_every=recheck_every)


def faster_than_lossless(entries: Sequence[str], sim: dict, casts: Sequence[str]) -> list[str]:
    """The lossy ``entries`` whose simulated iteration (``sim``: ``{entry: seconds}``) is at least
    :data:`~gradsync.profiler.advise.MIN_GAIN` x faster than the fastest lossless setting (DDP and ``casts``):
    a lossy setting only that much faster could repay its extra steps, so the rest are not metered."""
    fastest = min(sim[e] for e in ["allreduce", *casts])
    return [e for e in entries if sim[e] * MIN_GAIN <= fastest]


def _rank(entry: str) -> Optional[int]:
    """The PowerSGD rank of a ``powersgd-overlap`` entry, else None."""
    name, _, rest = entry.partition(":")
    if name != "powersgd-overlap":
        return None
    options = dict(item.split("=", 1) for item in rest.split(":") if "=" in item)
    return int(options.get("matrix_approximation_rank", 2))


def _meter_excess(metered: Sequence[str], sim: dict, compute_s: float, ddp_s: float) -> float:
    """Predicted seconds one metered step costs beyond the iteration of its first entry (which trains the
    job): every other entry's simulated communication and compression (its iteration minus compute) and the
    reference's share of DDP's."""
    return (sum(max(0.0, sim.get(quality_proxy(e), sim[e]) - compute_s) for e in dict.fromkeys(metered[1:]))
            + REFERENCE_FRACTION * max(0.0, ddp_s - compute_s))


def _affordable_meter(metered: Sequence[str], sim: dict, compute_s: float, ddp_s: float, room: float) -> list[str]:
    """The ``metered`` candidates whose :data:`QUALITY_STEPS` metered steps, and the race of
    :data:`RACE_MIN_STEPS` rounds of the fastest of them beside the base, ``room`` seconds pay for;
    the costliest (greatest simulated iteration) dropped first."""
    kept = list(metered)
    while kept and (QUALITY_STEPS * _meter_excess(kept, sim, compute_s, ddp_s)
                    + RACE_MIN_STEPS * min(sim[e] for e in kept)) > room:
        kept.remove(max(kept, key=lambda e: (sim[e], e)))
    return kept


class OnlineAutoState(HookState):
    """State of :func:`online_auto_hook`: the module docstring's phases 1-4 on the job's own DDP.

    Args:
        plan: :func:`plan_online`'s result (the same on every rank).
        model: the module DDP wraps (each candidate's hook is built on it).
        process_group: the group of every collective.
        seed: the hooks' seed (PowerSGD's initial factors).
        clock: the step clock (seconds); default a device-synchronising ``perf_counter``
            (:func:`~gradsync.profiler.compute.device_clock` of ``model``).

    Attributes:
        phase: ``"start"``, ``"meter"``, ``"race"`` or ``"settled"``.
        current: the entry whose aggregate DDP receives this iteration.
        choice: the chosen entry once settled, else None.
        errors, noise: the measured relative errors (``{entry: float}``) and gradient noise, all-reduced.
        medians: ``{entry: median step seconds}`` of the raced entries (MAX over ranks).
        stages: the candidates metered together (one stage of :data:`QUALITY_STEPS` steps; none where nothing
            was metered).
        overheads: ``{entry: seconds}`` each metered candidate computed per step (its hook's
            ``compress_seconds``; MAX over ranks), added to its simulated iteration.
        step_seconds: ``[(entry, seconds)]`` of every timed probe step (metered and raced), this rank's.
        ladder: the :class:`~gradsync.algorithms.ladder.LadderState` re-checking the settled choice (phase 5), else
            None; once it escalated, :attr:`current` is its rung.
    """

    def __init__(self, plan: OnlinePlan, model: torch.nn.Module, process_group: Any = None, seed: int = 0,
                 clock: Optional[Callable[[], float]] = None):
        super().__init__(process_group)
        self.plan, self.model, self.seed = plan, model, seed
        self.clock = clock or device_clock(model)
        self.hooks: dict[str, tuple] = {}
        self.spent: list[tuple] = []  # every hook state the job ran (their counters add up in stats)
        self.errors: dict[str, float] = dict(plan.errors)
        self.noise: Optional[float] = None
        self.medians: dict[str, float] = {}
        self.stages: list[list[str]] = []
        self.overheads: dict[str, float] = {}
        self.step_seconds: list[tuple[str, float]] = []
        self.choice: Optional[str] = None
        self.reason = ""
        self.ladder: Optional[LadderState] = None
        self.meter = QualityMeter([], primary=0, process_group=process_group, sample_fraction=REFERENCE_FRACTION,
                                  seed=seed)
        self._in_step = False
        self._restart(0)

    # -- phases --------------------------------------------------------------------------------
    def _restart(self, iteration: int) -> None:
        """Measure from ``iteration`` on, training on the base (at start-up, and on a resume before the
        decision)."""
        self.start = iteration
        self.current = self.plan.base
        self._hook(self.plan.base)
        self.phase = "start" if self.plan.metered or self.plan.lossless_race else "settled"
        if self.phase == "settled":
            self.choice, self.reason = self.plan.base, "nothing to measure: no lossy setting could pay off"
        self._round: list[str] = []
        self._times: dict[str, list[float]] = {}
        self._rounds = 0
        self._last: Optional[tuple[str, float]] = None
        self._noises: list[float] = []
        self._probe_s, self._probe_steps = 0.0, 0
        self._stage_medians: list[float] = []
        self._stage: list[str] = []
        self._stage_start = iteration

    def _build(self, entry: str) -> tuple:
        """A new ``(state, hook)`` of ``entry`` on the job's model, compressing from its first step once DDP
        has rebuilt its buckets; its counters add up in :meth:`stats`."""
        state, hook = _hook_pair(entry, self.model, None, self.process_group, self.seed, 1, 0)
        if self.iteration > 0:
            state.skip_start()
        pair = (state, joined_hook(hook) if single_bucket(entry) else hook)
        self.spent.append(pair)
        return pair

    def _hook(self, entry: str) -> tuple:
        """``entry``'s ``(state, hook)`` that trains the job, built at its first use."""
        if entry not in self.hooks:
            self.hooks[entry] = self._build(entry)
        return self.hooks[entry]

    def _begin_step(self) -> None:
        """At an iteration's first bucket: time the last step, then take this step's decision (nothing once
        settled: the clock synchronises the device)."""
        if self.phase == "settled":
            return
        now = self.clock()
        if self._last is not None:
            self.step_seconds.append((self._last[0], now - self._last[1]))
            if self.phase == "race":
                self._times[self._last[0]].append(now - self._last[1])
        self._last = None
        if self.phase == "start" and self.iteration - self.start >= START_STEPS:
            self._start_stage(self._meter_stage())
        elif self.phase == "meter" and self.iteration - self._stage_start >= QUALITY_STEPS:
            self._end_stage()
        if self.phase == "race":
            self._race_step()
        if self.phase in ("meter", "race"):
            self._last = (self.current, self.clock())

    def _meter_stage(self) -> list[str]:
        """The candidates to meter, all on the same steps, cut to what the budget pays for (the costliest
        dropped first): PowerSGD's ranks (:func:`_rank`) highest first, so the least lossy trains the job while
        the others are metered on copies, then any other candidate. On the LeNet's jobs a bisection that
        metered one rank per stage read r=4 0.54-0.64 in the first stage and r=2 0.25-0.36 in the third, and
        chose r=2, which missed the target."""
        plan = self.plan
        ranked = plan.advice(self.errors, self.noise).predictions
        ladder = sorted((e for e in plan.metered if _rank(e) is not None), key=_rank, reverse=True)
        stage = ladder + [e for e in plan.metered if _rank(e) is None]
        sim = {r.entry: r.iteration_s for r in ranked}
        return _affordable_meter(stage, sim, plan.prof.compute_s, sim["allreduce"], self._left(sim))

    def _left(self, sim: dict) -> float:
        """Seconds of the budget left (agreed: from the plan and agreed step times): the start-up, and the
        probe's steps so far beyond the fastest stage's median step (a metered step is the candidate's own
        training step plus the reference; the simulated iteration only before any was measured: on 4 hosts at
        15 Mbit/s it put PowerSGD's step at half the measured one, and the budget ran out before a race)."""
        if self._stage_medians:
            best = min(self._stage_medians)
        else:
            best = min(sim[e] for e in sim if e == "allreduce" or e in self.plan.metered or e in CASTS)
        return self.plan.budget_s - self.plan.setup_seconds - (self._probe_s - self._probe_steps * best)

    def _start_stage(self, stage: Sequence[str]) -> None:
        """Meter ``stage`` for the next :data:`QUALITY_STEPS` steps, its first entry training the job (its
        aggregate is DDP's) and any other on copies of the same buckets (or, empty, start the race)."""
        if not stage:
            self._start_race()
            return
        self.phase, self._stage, self._stage_start = "meter", list(stage), self.iteration
        self.stages.append(list(stage))
        self.current = stage[0]
        self.meter.hooks = [self._hook(stage[0]), *(self._build(e) for e in stage[1:]), LOCAL_GRADIENT]
        self.meter.primary = 0
        self.meter.reset()
        self.meter.on = True

    def _end_stage(self) -> None:
        """All-reduce the stage's sums (errors and noise), its entries' computation per step and the probe
        steps' seconds (MAX over ranks); then the race."""
        self.meter.on = False
        sums = self.meter.sums().to(collective_device(self.process_group))
        dist.all_reduce(sums, group=self.process_group)
        self.count_collective(sums)
        *errors, noise = relative_errors(sums / self.plan.world_size)
        hooks = self.meter.hooks[:-1]
        agreed = max_over_ranks([*(state.stats()["compress_seconds"] / QUALITY_STEPS for state, _ in hooks),
                                 statistics.median(s for _, s in self.step_seconds[-QUALITY_STEPS:]),
                                 sum(s for _, s in self.step_seconds)], self.process_group)
        self.count_payload(8 * len(agreed))
        for state, _ in hooks[1:]:  # the copies' hooks; the first trained the job and may be raced
            state.close()
        self.meter.hooks = []
        self.errors.update(zip(self._stage, errors))
        self.overheads.update(zip(self._stage, agreed[:-2]))
        self._stage_medians.append(agreed[-2])
        self._noises.append(noise)
        self.noise = sum(self._noises) / len(self._noises)
        self._probe_s, self._probe_steps = agreed[-1], len(self.step_seconds)
        self._start_race()

    def _start_race(self) -> None:
        """Short-list the measured candidates (as the start-up probe does) and start the race where the budget
        left pays for its first :data:`RACE_MIN_STEPS` rounds (the least promising dropped first), else settle
        on the base."""
        from .auto import DDP_CONTENDER, _short_list

        errors = self._with_joined(self.errors)
        ranked = self.plan.advice(errors, self.noise, overheads=self._with_joined(self.overheads)).predictions
        short = _short_list(ranked, self.plan.shortlist, errors)
        ddp = next(r for r in ranked if r.entry == "allreduce")
        if short and ddp.time_to_quality_s <= DDP_CONTENDER * min(r.time_to_quality_s for r in ranked
                                                                  if r.entry in short):
            short.append("allreduce")
        if len(short) == 1 and short[0] != self.plan.base:
            short.append(self.plan.base)  # a lossy setting is chosen only once timed, here beside the base
        self._factors = {r.entry: r.time_to_quality_s / r.iteration_s for r in ranked if r.entry in short}
        sim = {r.entry: r.iteration_s for r in ranked}
        self._budget_left = self._left(sim)

        def round_excess(entries: Sequence[str]) -> float:  # a round's steps beyond its fastest entry's
            return sum(sim[e] for e in entries) - len(entries) * min(sim[e] for e in entries)

        while len(short) > 2 and RACE_MIN_STEPS * round_excess(short) > self._budget_left:
            short.remove(max(short, key=lambda e: (self._factors[e] * sim[e], e)))
        if len(short) < 2 or RACE_MIN_STEPS * round_excess(short) > self._budget_left:
            self._settle(self.plan.base, "no lossy setting could be timed within the probe's budget")
            return
        self.phase = "race"
        self._live = list(short)
        self._times = {e: [] for e in short}
        for e in short:  # a metered entry keeps the state it trained the job with
            self._hook(e)

    def _race_step(self) -> None:
        """Choose this step's entry: the next of the round. At a round's end, from round
        :data:`RACE_MIN_STEPS` on, the agreed medians eliminate (:func:`~gradsync.profiler.probe.race`), and
        the race ends when it is settled, after :data:`TIMED_STEPS` rounds, or when the budget left does not
        pay for another round's steps beyond its best entry's."""
        if not self._round:
            if self._rounds >= RACE_MIN_STEPS:
                agreed, spread = _agreed_medians({e: self._times[e] for e in self._live}, self.process_group)
                self.count_payload(16 * len(self._live))
                self.medians.update(agreed)
                scores = {e: agreed[e] * self._factors[e] for e in self._live}
                lead = agreed[min(scores, key=lambda e: (scores[e], e))]
                spent = sum(len(t) * self.medians[e] for e, t in self._times.items()) - lead * sum(
                    len(t) for t in self._times.values())
                self._live, settled = race(scores, spread)
                next_round = sum(agreed[e] for e in self._live) - len(self._live) * lead
                if settled or self._rounds >= TIMED_STEPS or next_round > self._budget_left - spent:
                    self._decide()
                    return
            self._round = list(self._live)
            self._rounds += 1
        self.current = self._round.pop(0)

    def _with_joined(self, measured: dict) -> dict:
        """``measured`` (``{entry: value}`` of metered entries) with each of :attr:`OnlinePlan.joined` given its
        quality proxy's value."""
        return {**measured, **{e: measured[quality_proxy(e)] for e in self.plan.joined if quality_proxy(e) in measured}}

    def _decide(self) -> None:
        timed = dict(self.medians)
        advice = self.plan.advice(self._with_joined(self.errors), self.noise, iterations=timed,
                                  allowed=lambda e: e in timed or e == "allreduce",
                                  overheads=self._with_joined(self.overheads))
        self._settle(advice.choice.entry, advice.reason)

    def _settle(self, entry: str, reason: str) -> None:
        self.phase, self.choice, self.current, self.reason = "settled", entry, entry, reason
        self._hook(entry)
        for e, (state, _) in list(self.hooks.items()):
            if e != entry:
                state.close()
                del self.hooks[e]
        if not dist.is_initialized() or dist.get_rank(self.process_group) == 0:
            print(f"auto (online): iteration {self.iteration}: {entry}: {reason}", flush=True)
        if self.plan.recheck_every and self._rechecked(entry):
            self._start_ladder(entry)

    @staticmethod
    def _rechecked(entry: str) -> bool:
        """Whether a settled ``entry`` is re-checked: a lossy hook that works on any bucket layout."""
        return entry != "allreduce" and entry not in CASTS and is_hook(entry, any_buckets=True)

    def _start_ladder(self, entry: str, check_every: Optional[int] = None) -> None:
        """Hand the settled ``entry``'s hook, with its state, to a ladder (phase 5) that owns it from now on."""
        pair = self.hooks.pop(entry)
        self.spent.remove(pair)  # the ladder's stats count it
        every = check_every or self.plan.recheck_every
        limit = self.plan.quality.limit(self.plan.family)
        self.ladder = LadderState(entry, check_every=every, max_error_to_noise=limit,
                                  reference_fraction=REFERENCE_FRACTION, model=self.model,
                                  process_group=self.process_group, seed=self.seed,
                                  window=min(QUALITY_STEPS, every), first=pair)
        self.ladder.iteration = self.iteration  # its checks and switches count the job's iterations

    # -- what it cost ---------------------------------------------------------------------------
    def probe_excess_seconds(self, settled_step_s: float) -> float:
        """Seconds the probe's timed steps (metered and raced) took beyond ``settled_step_s`` (the chosen
        setting's step, seconds) each, this rank's: the probe's cost on the job's steps."""
        return sum(s - settled_step_s for _, s in self.step_seconds)

    # -- the protocol ----------------------------------------------------------------------------
    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        out = {"auto_phase": float(("start", "meter", "race", "settled").index(self.phase))}
        if self.ladder is not None:
            out.update(self.ladder.observe_step(seconds, samples))
        return out

    def stats(self) -> dict[str, Any]:
        out = dict(super().stats())
        for state, _ in self.spent:
            for key, value in state.stats().items():
                if key in ADDITIVE_COUNTERS:
                    out[key] = out[key] + value
        out["wire_bytes"] += self.meter.dense_wire_bytes
        if self.ladder is not None:  # its rungs, its checks' references and decisions
            rechecked = self.ladder.stats()
            for key in ADDITIVE_COUNTERS:
                out[key] = out[key] + rechecked[key]
            out.update(auto_rung=self.ladder.current, auto_switches=len(self.ladder.switches))
        out["compression_ratio"] = compression_ratio(out["dense_wire_bytes"], out["wire_bytes"])
        out["auto_choice"] = self.choice
        return out

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures of the decision (for metrics.json)."""
        return {"auto_choice": self.choice, "auto_reason": self.reason, "auto_errors": self.errors,
                "auto_noise": self.noise, "auto_iterations_s": self.medians,
                "auto_setup_seconds": self.plan.setup_seconds, "auto_setup_phases_s": self.plan.phases,
                "auto_stages": self.stages, "auto_compression_s": self.overheads, "auto_decided_at": self.iteration,
                "auto_recheck_every": self.plan.recheck_every,
                "auto_switches": list(self.ladder.switches) if self.ladder is not None else []}

    def config(self) -> dict[str, Any]:
        return {"algorithm": AUTO_ONLINE, "base": self.plan.base, "metered": list(self.plan.metered)}

    def state_dict(self) -> dict[str, Any]:
        settled = self.phase == "settled"
        ladder = self.ladder
        return {"iteration": self.iteration, "choice": self.choice if settled else None, "reason": self.reason,
                "errors": dict(self.errors), "noise": self.noise, "medians": dict(self.medians),
                "inner": self.hooks[self.choice][0].state_dict() if settled and ladder is None else None,
                "meter_dense_wire_bytes": self.meter.dense_wire_bytes,
                "ladder": None if ladder is None else {"check_every": ladder.check_every, "state": ladder.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s, _ in self.hooks.values():
            s.close()
        self.hooks = {}
        if self.ladder is not None:
            self.ladder.close()
            self.ladder = None
        self.iteration = int(state["iteration"])
        self.meter.dense_wire_bytes = float(state.get("meter_dense_wire_bytes", 0.0))
        if state.get("choice") is None:
            self._restart(self.iteration)
            return
        self.errors, self.noise, self.medians = dict(state["errors"]), state["noise"], dict(state["medians"])
        self.phase, self.choice, self.current, self.reason = "settled", state["choice"], state["choice"], state["reason"]
        if state.get("ladder") is None:
            self._hook(self.choice)[0].load_state_dict(state["inner"])
            return
        # the checkpoint's re-checks go on (their period with them), on the rung they had reached
        self._hook(self.choice)
        self._start_ladder(self.choice, state["ladder"]["check_every"])
        self.ladder.load_state_dict(state["ladder"]["state"])
        self.current = self.ladder.current

    def close(self) -> None:
        for state, _ in self.hooks.values():
            state.close()
        if self.ladder is not None:
            self.ladder.close()


def online_auto_hook(state: OnlineAutoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of :class:`OnlineAutoState`: at an iteration's first bucket the step's
    decision (from all-reduced numbers only); then, while metering, the metered candidate under the quality
    meter, once settled and re-checked the ladder's rung (:func:`~gradsync.algorithms.ladder.ladder_hook`), else the
    current entry's hook."""
    if not state._in_step:
        state._in_step = True
        state._begin_step()
    if state.ladder is not None:
        fut = ladder_hook(state.ladder, bucket)
        state.current = state.ladder.current
    elif state.meter.on:
        fut = metered_hook(state.meter, bucket)
    else:
        inner, hook = state.hooks[state.current]
        fut = hook(inner, bucket)
    state.end_bucket_of(bucket.buffer(), bucket.is_last())
    if bucket.is_last():
        state._in_step = False
    return fut


def register_online_auto(ddp: Any, optimizer: torch.optim.Optimizer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         job_steps: Optional[int] = None, recheck_every: int = 0) -> OnlineAutoState:
    """Collective: ``--algorithm auto`` for a script's own ``DistributedDataParallel``, decided on the job's
    own first steps: :func:`plan_online` on copies of ``ddp.module`` (the profile and the dense all-reduce),
    then :func:`online_auto_hook` registered on ``ddp``. Call it on every rank after building ``ddp`` and
    ``optimizer`` and before training; ``state.phase`` is ``"settled"`` and ``state.choice`` names the
    setting once it has decided (``state.summary()`` for a log), and ``state.state_dict()`` goes into
    checkpoints (``load_state_dict`` before the first step of a resumed run).

    Args:
        ddp, optimizer, batches, loss_fn, job_steps: as :func:`gradsync.profiler.auto.register_auto`.
        recheck_every: steps between re-checks of a settled lossy choice (:attr:`OnlinePlan.recheck_every`); 0: never.

    Raises:
        ValueError: for a ``ddp`` that is no ``DistributedDataParallel``, empty ``batches`` or a world
            size < 2.
    """
    from .auto import script_job

    batches = list(batches)
    make_optimizer, batch_size, bucket_cap_mb = script_job(ddp, optimizer, batches)
    plan = plan_online(ddp.module, batches, loss_fn, make_optimizer, "script", batch_size, bucket_cap_mb,
                       group=ddp.process_group, job_steps=job_steps, recheck_every=recheck_every)
    state = OnlineAutoState(plan, ddp.module, process_group=ddp.process_group)
    ddp.register_comm_hook(state, online_auto_hook)
    ddp.gradsync_state = state
    return state
