"""Which gradient-synchronisation setting to use, and why (``gradsync doctor``, ``--algorithm auto``).

A pure function of a compute profile (:class:`~gradsync.sim.profile.Profile`, measured by
:func:`~gradsync.profiler.profile.record_profile`), a network (world size, bandwidth, latency) and what
was measured on the job itself (:mod:`gradsync.profiler.probe`):

1. the dense all-reduce time of every bucket without overlap is *modelled* with the ring
   alpha-beta cost model (:func:`~gradsync.profiler.profile.ccr_at`; Patarasuk & Yuan 2009) and
   divided by the measured backward time: the CCR (Meng, Sun & Li 2023, arXiv 2311.04499, §3);
2. every candidate setting (:func:`candidates`) is replayed on the profile as gradsync runs it
   (PowerSGD on one bucket, COVAP's shards in 16 bits) by the trace-driven simulator
   (:func:`gradsync.sim.simulate`: wait-free back-propagation, FIFO collectives); where the setting was
   timed on the real network (``iterations``), the measured time replaces the simulated one;
3. each candidate's predicted time to quality is its iteration time x (1 + extra-steps fraction), the
   fraction predicted by the quality model (:data:`~gradsync.profiler.quality_model.FITTED`) from the
   setting's relative error measured on the job's own gradients (``errors``) in units of their noise
   (``noise``), with the limit of the job's optimizer family (``family``); 0 for the settings
   whose arithmetic equals DDP's (allreduce, DeAR);
4. the candidates with a known cost are ranked by it; lossy settings whose error was not measured
   follow, by iteration time, labelled "not measured". The first is recommended unless the CCR is
   below :data:`LOW_CCR` or it gains less than :data:`MIN_GAIN` over DDP: then plain DDP. A lossless
   setting (0 extra steps) timed beside DDP on the same steps needs no margin: the faster of the two is
   recommended (MIN_GAIN covers the simulator's error, which a measured pair does not carry).

No table of other models' runs enters the choice: a cost measured on one model does not carry to
another (PowerSGD r=4 with a dense tail reached the target on 4 of 5 seeds of the ResNet-8 and on 1
of 3 at twice its width).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..comm.buckets import bucket_overlap_warning
from ..sim.costmodel import Network
from ..sim.engine import simulate
from ..sim.plans import (AlgorithmPlan, CovapSimPlan, DeARPlan, DensePlan, FP16Plan, PeriodicPlan, PowerSGDPlan,
                         TopKPlan)
from ..sim.profile import Profile, ProfileBucket, load_profile
from ..validation import check_float, check_int
from .quality_model import FITTED, RISK, SEEDS, TOLERATED_MISSES, QualityModel, error_to_noise, seeds_missing_risk
from .profile import ccr_at

__all__ = ["Advice", "Prediction", "advise", "candidates", "is_hook", "lossy", "periodic_candidates",
           "periodic_predictions", "single_bucket", "train_command", "worth_measuring", "CASTS", "LOSSLESS", "LOW_CCR",
           "MIN_GAIN", "PERIODIC_COST"]

#: Below this CCR a dense all-reduce takes less than half the backward pass, which DDP overlaps it
#: with: only the last bucket's collective is exposed, and compression only adds work.
LOW_CCR = 0.5
#: Least predicted gain in time to quality over DDP for recommending anything else: the simulator
#: predicted fp16 and COVAP within 10 % of measured iteration times (max 8.9 %, README Results,
#: "Simulator validation": benchmarks/validate_simulator.py --hosts 4 --bandwidths 10,25,50).
MIN_GAIN = 1.10
#: Casts to 16 bits, counted as lossless where no measurement exists (fp16 is measured: 0 extra steps).
CASTS = ("fp16", "bf16")


def candidates() -> list[tuple[str, str, AlgorithmPlan]]:
    """The settings ``gradsync doctor`` compares: ``(entry, label, plan)``, ``entry`` a ``gradsync
    bench --algorithms`` entry, ``plan`` its simulator plan (:mod:`gradsync.sim.plans`). The first is
    DDP's all-reduce, the reference. bf16 moves the bytes of fp16 (same plan)."""
    return [
        ("allreduce", "DDP all-reduce", DensePlan()),
        ("fp16", "fp16 cast", FP16Plan()),
        ("bf16", "bf16 cast", FP16Plan()),
        *[(f"powersgd:matrix_approximation_rank={r}", f"PowerSGD r={r}", PowerSGDPlan(r)) for r in (1, 2, 4, 8, 16)],
        *[(f"powersgd-overlap:matrix_approximation_rank={r}", f"PowerSGD r={r}, overlapped",
           PowerSGDPlan(r, fused=True)) for r in (1, 2, 4, 8, 16)],
        *[(f"covap:ratio={k}:cast=fp16", f"COVAP K={k}, fp16 shards", CovapSimPlan(k)) for k in range(2, 7)],
        ("dear", "DeAR", DeARPlan()),
        ("topk:density=0.01", "top-k density 0.01", TopKPlan(0.01)),
    ]


#: What ``gradsync doctor`` says of the periodic algorithms' accuracy cost.
PERIODIC_COST = "extra steps not measured (see the grid in docs/results.md)"


def periodic_candidates() -> list[tuple[str, str, AlgorithmPlan]]:
    """``local-sgd`` and ``diloco`` settings ``gradsync doctor`` shows below its ranking: ``(entry,
    label, plan)`` as :func:`candidates`, the plan a :class:`~gradsync.sim.plans.PeriodicPlan`. Not in
    :func:`candidates`, so neither :func:`advise` nor ``--algorithm auto`` ranks or chooses them: their
    accuracy cost is the extra steps of rare syncs, which the probe (DDP communication hooks on one
    iteration's gradients) cannot measure."""
    return [
        *[(f"local-sgd:period={h}", f"local SGD H={h}", PeriodicPlan(h)) for h in (4, 16, 64)],
        *[(f"diloco:period={h}", f"DiLoCo H={h}", PeriodicPlan(h)) for h in (4, 16, 64)],
        ("diloco:period=16:fragments=4", "Streaming DiLoCo H=16, 4 fragments", PeriodicPlan(16, fragments=4)),
        ("diloco:period=16:fragments=4:overlap=3", "Streaming DiLoCo H=16, 4 fragments, overlapped 3 steps",
         PeriodicPlan(16, fragments=4, overlap=3)),
    ]


def periodic_predictions(profile: Profile | Mapping[str, Any] | str, world_size: int, bandwidth_mbit: float,
                         latency_s: float = 0.0, overlap_efficiency: float = 1.0) -> tuple[Prediction, ...]:
    """The simulated iteration of every :func:`periodic_candidates` setting (seconds, the mean over its
    period: compute + one all-reduce of the float32 parameters per period, not overlapped, or with
    ``overlap`` only what the next iterations' compute cannot hide) and its
    speed-up over DDP's simulated iteration; ``extra_steps`` ``None`` and ``cost``
    :data:`PERIODIC_COST` (never measured here).

    Raises:
        ValueError: as :func:`advise` for the profile, ``world_size``, ``bandwidth_mbit``, ``latency_s``
            and ``overlap_efficiency``.
    """
    prof = load_profile(profile)
    world_size = check_int("world_size", world_size, 2)
    bandwidth_mbit = check_float("bandwidth_mbit", bandwidth_mbit, 0.0, 1e9, low_inclusive=False)
    net = Network.from_mbit(bandwidth_mbit, latency_s)
    dense = simulate(prof, DensePlan(), world_size, net, overlap_efficiency).iteration_s
    out = []
    for entry, label, plan in periodic_candidates():
        t = simulate(prof, plan, world_size, net, overlap_efficiency).iteration_s
        out.append(Prediction(entry, label, t, dense / t, None, PERIODIC_COST, None, None))
    return tuple(out)


#: Settings whose arithmetic equals dense all-reduce's, with the reason.
LOSSLESS: dict[str, str] = {
    "allreduce": "the reference (DDP's own arithmetic)",
    "dear": "DeAR's reduce-scatter + all-gather compute DDP's average (bitwise-identical losses, docs/results.md)",
}


def lossy(entry: str) -> bool:
    """Whether ``entry`` changes the averaged gradient (everything but :data:`LOSSLESS`)."""
    return entry not in LOSSLESS


def single_bucket(entry: str) -> bool:
    """Whether gradsync runs ``entry``'s algorithm on one DDP bucket (the registry's ``single_bucket``:
    torch's PowerSGD)."""
    from ..algorithms import REGISTRY, parse_entry

    return REGISTRY[parse_entry(entry)[0]].single_bucket


def is_hook(entry: str, any_buckets: bool = False) -> bool:
    """Whether ``entry``'s algorithm is a DDP communication hook (a probe or a script's DDP can run
    it), and with ``any_buckets`` one that works on any bucket layout (not :func:`single_bucket`:
    a script's DDP keeps its own buckets)."""
    from ..algorithms import REGISTRY, parse_entry

    return REGISTRY[parse_entry(entry)[0]].make_hook is not None and not (any_buckets and single_bucket(entry))


def worth_measuring(simulated: "Advice", skip: Sequence[str] = ()) -> list[str]:
    """The lossy communication-hook entries of ``simulated``'s predictions that the simulator puts at
    least :data:`MIN_GAIN` x faster per iteration than DDP, but those whose algorithm is in ``skip``:
    the settings whose error ``--algorithm auto`` and ``gradsync doctor`` measure."""
    ddp_s = next(r.iteration_s for r in simulated.predictions if r.entry == "allreduce")
    return [r.entry for r in simulated.predictions if lossy(r.entry) and is_hook(r.entry)
            and r.iteration_s * MIN_GAIN <= ddp_s and r.entry.split(":")[0] not in skip]


def _as_run(prof: Profile, entry: str) -> Profile:
    """``prof`` as ``entry`` runs it: one bucket, ready at the end of backward, for algorithms
    gradsync runs on one DDP bucket (the registry's ``single_bucket``: PowerSGD); 2-byte elements
    for COVAP's 16-bit shards (``cast``)."""
    from ..algorithms import parse_entry

    options = parse_entry(entry)[1]
    if single_bucket(entry) and len(prof.buckets) > 1:
        shapes = [s for b in prof.buckets for s in (b.shapes or ())]
        whole = sum(math.prod(s) for s in shapes) == prof.total_numel
        bucket = ProfileBucket(0, prof.total_numel, prof.backward_s, tuple(shapes) if whole else None)
        prof = dataclasses.replace(prof, buckets=(bucket,))
    if options.get("cast") in CASTS:
        prof = dataclasses.replace(prof, dtype_bytes=2)
    return prof


@dataclass(frozen=True)
class Prediction:
    """One candidate: predicted ``iteration_s`` (seconds), ``speedup`` over DDP's predicted
    iteration, ``extra_steps`` (fraction of extra steps to the target, None when not measured),
    ``cost`` (that cost in words), ``source`` (where the cost comes from), ``time_to_quality_s``
    (``iteration_s * (1 + extra_steps)``, seconds per DDP-step-equivalent; None when not measured)."""

    entry: str
    label: str
    iteration_s: float
    speedup: float
    extra_steps: float | None
    cost: str
    source: str | None
    time_to_quality_s: float | None
    timed: bool = False

    @property
    def measured(self) -> bool:
        """Whether the accuracy cost is known (measured, exact, or a cast)."""
        return self.extra_steps is not None


@dataclass(frozen=True)
class Advice:
    """Result of :func:`advise`. Times in seconds; ``dense_allreduce_s`` is modelled (ring
    alpha-beta), ``backward_s`` measured; ``predictions`` are ranked (best first);
    ``choice`` is the recommended one; ``reason`` says why in one or two sentences."""

    world_size: int
    bandwidth_mbit: float
    latency_s: float
    backward_s: float
    dense_allreduce_s: float
    ccr: float
    predictions: tuple[Prediction, ...]
    choice: Prediction
    reason: str
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (predictions and choice as dicts) with ``dense_allreduce_source``."""
        d = dataclasses.asdict(self)
        d["dense_allreduce_source"] = "modelled: ring all-reduce, alpha-beta (gradsync.sim.costmodel)"
        return d


def _cost(entry: str, errors: Mapping[str, float], noise: float | None, world_size: int,
          model: QualityModel, family: str | None) -> tuple[float | None, str, str | None]:
    """``(extra_steps, cost in words, source)`` of ``entry`` from its measured relative error, the
    job's gradient noise and its optimizer family."""
    if entry in LOSSLESS:
        return 0.0, "none (same arithmetic as DDP)", LOSSLESS[entry]
    if entry not in errors:
        return None, "not measured", None
    e = errors[entry]
    source = "measured on this job (gradsync.profiler.probe) + quality model (gradsync.profiler.quality_model)"
    if noise is None:
        if entry in CASTS:
            return 0.0, f"error {e:.4f}, a cast's rounding (gradient noise not measured)", source
        return None, f"error {e:.2f}, gradient noise not measured", None
    r = error_to_noise(e, noise, world_size)
    extra = model.extra_at(r, family)
    p = model.miss_probability(r, family)
    risk = "" if p is None else (f"; a seed misses with p {p:.2f}, {TOLERATED_MISSES + 1}+ of {SEEDS} with "
                                 f"{seeds_missing_risk(p):.2f}")
    if math.isinf(extra):
        return extra, f"error {e:.2f} = {r:.2f} x noise > {model.limit(family):.2f}: predicted to miss{risk}", source
    return extra, f"error {e:.2f} = {r:.2f} x noise: {extra * 100:+.0f} % steps predicted{risk}", source


def _raced_lossless(best: Prediction, ddp: Prediction) -> bool:
    """``best`` loses no steps (a cast, DeAR) and both it and DDP were timed on the job's own steps."""
    return best.timed and ddp.timed and best.extra_steps == 0


def advise(profile: Profile | Mapping[str, Any] | str, world_size: int, bandwidth_mbit: float,
           errors: Mapping[str, float] | None = None, iterations: Mapping[str, float] | None = None,
           latency_s: float = 0.0, overlap_efficiency: float = 1.0,
           allowed: Callable[[str], bool] = lambda entry: True, noise: float | None = None,
           family: str | None = None, model: QualityModel = FITTED, probe_seconds: float | None = None,
           overheads: Mapping[str, float] | None = None) -> Advice:
    """Recommend a setting for ``profile`` on ``world_size`` ranks at ``bandwidth_mbit`` Mbit/s
    (see the module docstring for the rule).

    Args:
        profile: a :class:`~gradsync.sim.profile.Profile` or anything
            :func:`~gradsync.sim.profile.load_profile` takes (compute times in seconds, fp32 or
            16-bit buckets in DDP order).
        world_size: ranks, >= 2.
        bandwidth_mbit: link rate in Mbit/s, > 0.
        errors: ``{entry: relative error}`` measured on the job
            (:func:`~gradsync.profiler.probe.measure_quality`); a lossy candidate without one is
            "not measured" and is not recommended.
        iterations: ``{entry: seconds}`` measured on the job's network
            (:func:`~gradsync.profiler.probe.time_candidates`), replacing the simulated times.
        latency_s: per-message latency alpha in seconds, >= 0.
        overlap_efficiency: (0, 1], rate of communication during backward (see
            :func:`gradsync.sim.simulate`).
        allowed: which candidate entries to consider (DDP's all-reduce always is).
        noise: the job's gradient noise measured with ``errors``
            (:class:`~gradsync.profiler.probe.MeasuredQuality`; dimensionless), the unit of the quality
            model; None: a lossy setting but the 16-bit casts is "not measured".
        family: the job's optimizer family (:func:`~gradsync.profiler.quality_model.optimizer_family`),
            whose limit and slope apply; None (not known): the strictest family's.
        model: the quality model (default: the fitted one).
        probe_seconds: what measuring ``errors`` and ``iterations`` cost (seconds), for the notes.
        overheads: ``{entry: seconds}`` each hook computes per step on the job
            (:func:`~gradsync.profiler.probe.compression_seconds`), added to its simulated iteration
            (serially, as the simulator charges compression: :mod:`gradsync.sim.engine`); not to a
            measured one, which holds it.

    Returns:
        :class:`Advice`.

    Raises:
        ValueError: naming world_size (an integer >= 2), bandwidth_mbit (> 0), latency_s or
            overlap_efficiency out of range, or a bad profile.
    """
    prof = load_profile(profile)
    errors, iterations = dict(errors or {}), dict(iterations or {})
    world_size = check_int("world_size", world_size, 2)
    bandwidth_mbit = check_float("bandwidth_mbit", bandwidth_mbit, 0.0, 1e9, low_inclusive=False)
    net = Network.from_mbit(bandwidth_mbit, latency_s)
    ccr = ccr_at(prof, world_size, bandwidth_mbit, latency_s)
    rows = []
    for entry, label, plan in candidates():
        if entry != "allreduce" and not allowed(entry):
            continue
        t = iterations.get(entry)
        if t is None:
            t = simulate(_as_run(prof, entry), plan, world_size, net, overlap_efficiency).iteration_s
            t += (overheads or {}).get(entry, 0.0)
        extra, cost, source = _cost(entry, errors, noise, world_size, model, family)
        rows.append(Prediction(entry, label, t, 0.0, extra, cost, source,
                               None if extra is None else t * (1 + extra), timed=entry in iterations))
    dense = rows[0].iteration_s
    rows = [dataclasses.replace(r, speedup=dense / r.iteration_s) for r in rows]
    order = {r.entry: i for i, r in enumerate(rows)}
    ranked = sorted(rows, key=lambda r: (not r.measured, r.time_to_quality_s if r.measured else r.iteration_s,
                                         order[r.entry]))
    ddp = next(r for r in ranked if r.entry == "allreduce")
    best = next((r for r in ranked if r.measured and r is not ddp and math.isfinite(r.time_to_quality_s)), None)
    gain = ddp.time_to_quality_s / best.time_to_quality_s if best is not None else 0.0
    raced = best is not None and _raced_lossless(best, ddp)
    if best is None:
        choice = ddp
        reason = (f"CCR {ccr:.2f}: no other setting is predicted to reach dense quality on this job; use plain DDP "
                  f"(allreduce).")
    elif ccr < LOW_CCR:
        choice = ddp
        reason = (f"CCR {ccr:.2f} < {LOW_CCR}: a dense all-reduce takes under half the backward pass and DDP "
                  f"overlaps it with backward; use plain DDP (allreduce): compression would only add work.")
    elif gain <= 1.0 or (gain < MIN_GAIN and not raced):
        choice = ddp
        reason = (f"CCR {ccr:.2f}: the best alternative, {best.label}, is {'measured' if best.timed else 'predicted'} "
                  f"only {gain:.2f}x faster to the same quality"
                  + (", timed beside DDP on the job's own steps" if raced
                     else ", within the predictions' ~10 % error") + "; use plain DDP (allreduce).")
    else:
        choice = best
        how = "measured" if best.timed else "predicted"
        reason = (f"CCR {ccr:.2f}: {best.label} is {how} {best.speedup:.2f}x faster per iteration than DDP; "
                  f"accuracy cost: {best.cost}, so {gain:.2f}x to the same quality.")
    faster = [r for r in ranked if not r.measured and r.iteration_s * MIN_GAIN < choice.time_to_quality_s]
    if faster and ccr >= LOW_CCR:
        f = min(faster, key=lambda r: r.iteration_s)
        reason += (f" {f.label} is predicted {f.speedup:.2f}x per iteration, but its error was not "
                   f"measured on this job.")
    return Advice(world_size, bandwidth_mbit, latency_s, prof.backward_s, ccr * prof.backward_s, ccr,
                  tuple(ranked), choice, reason,
                  tuple(_notes(prof, model, errors, noise, world_size, family, probe_seconds, overheads or {})))


def _notes(prof: Profile, model: QualityModel, errors: Mapping[str, float], noise: float | None, world_size: int,
           family: str | None, probe_seconds: float | None, overheads: Mapping[str, float]) -> list[str]:
    """Caveats printed under the recommendation."""
    notes = ["Dense all-reduce time is modelled (ring alpha-beta at the given bandwidth); compute times are this "
             "machine's; iteration times marked 'measured' were timed on the job's own network.",
             ("Each hook's own computation per step (casts, shard copies, PowerSGD's matrix products) was timed on "
              "this job and added to its simulated iteration, serially (no overlap with backward assumed): "
              + ", ".join(f"{e} {s * 1e3:.1f} ms" for e, s in overheads.items()) + "."
              if overheads else
              "Compression overhead (casts, shard copies, PowerSGD's matrix products) is not simulated: simulated "
              "speed-ups of compressed settings are upper bounds."),
             "PowerSGD is replayed on one bucket, ready at the end of backward, as gradsync runs torch's hook; "
             "powersgd-overlap on every bucket, each Q launched by the next bucket's hook once P has arrived."]
    if errors:
        notes.append("Extra steps are predicted from each setting's relative error on this job's gradients "
                     f"(gradsync.profiler.quality_model; {model.cv}).")
        if noise is not None:
            notes.append(f"Gradient noise on this job: one rank's gradient lies {noise:.3f} (relative) from the "
                         f"average, so the average carries {noise / math.sqrt(world_size - 1):.3f}; a setting is "
                         f"predicted to miss above {model.limit(family):.2f} x that, where {TOLERATED_MISSES + 1} or more of "
                         f"{SEEDS} seeds miss with {RISK:.0%} chance (optimizer family "
                         f"{model.family(family)}{'' if family else ', the strictest: the optimizer is not known'}).")
    else:
        notes.append("No compression error was measured on this job: lossy settings are 'not measured' and not "
                     "recommended.")
    if probe_seconds is not None:
        notes.append(f"Measuring this job took {probe_seconds:.1f} s.")
    warning = bucket_overlap_warning([b.numel for b in prof.buckets], prof.dtype_bytes)
    if warning is not None:
        notes.append(warning)
    return notes


def train_command(entry: str, bucket_cap_mb: float | None = None) -> str:
    """The ``gradsync train`` flags of a ``--algorithms`` entry (``covap:ratio=2:cast=fp16`` ->
    ``gradsync train --algorithm covap --ratio 2 --cast fp16``), plus ``--bucket-cap-mb`` for
    hook algorithms that use DDP's buckets (not DeAR's fusion groups, not one-bucket PowerSGD).

    Raises:
        ValueError: for an entry :func:`gradsync.algorithms.parse_entry` refuses.
    """
    from ..algorithms import REGISTRY, parse_entry

    name, options = parse_entry(entry)
    flags = [f"--algorithm {name}"] + [f"--{k.replace('_', '-')} {v}" for k, v in options.items()]
    if bucket_cap_mb is not None and REGISTRY[name].make_hook and not REGISTRY[name].single_bucket:
        flags.append(f"--bucket-cap-mb {bucket_cap_mb:g}")
    return "gradsync train " + " ".join(flags)
