"""Which gradient-synchronisation setting to use, and why (``gradsync doctor``).

A pure function of a compute profile (:class:`~gradsync.sim.profile.Profile`, measured by
:func:`~gradsync.profiler.profile.record_profile`), a network (world size, bandwidth, latency) and
the table of measured accuracy costs (:mod:`gradsync.profiler.accuracy_costs`):

1. the dense all-reduce time of every bucket without overlap is *modelled* with the ring
   alpha-beta cost model (:func:`~gradsync.profiler.profile.ccr_at`; Patarasuk & Yuan 2009) and
   divided by the measured backward time: the CCR (Meng, Sun & Li 2023, arXiv 2311.04499, §3);
2. every candidate setting (:func:`candidates`) is replayed on the profile as gradsync runs it
   (PowerSGD on one bucket, COVAP's shards in 16 bits) by the trace-driven simulator
   (:func:`gradsync.sim.simulate`: wait-free back-propagation, FIFO collectives);
3. each candidate's predicted time to quality is its iteration time x (1 + extra-steps fraction),
   the fraction taken from the measured steps to a target accuracy against dense all-reduce
   (0 for the settings whose arithmetic equals DDP's and for the fp16/bf16 casts); a measured
   setting with a dense tail (``dense_from``: the end of training through the fp16 hook) is a
   candidate when the job's budget is known, its tail starting at the measured fraction of the
   budget, and its time to quality counts the measured steps before the tail at its own iteration
   time and those after at the fp16 hook's (:func:`tail_candidates`);
4. the candidates with a known cost are ranked by it; lossy settings without a measurement follow,
   by predicted iteration time, labelled "not measured". The first is recommended unless the CCR
   is below :data:`LOW_CCR` or it gains less than :data:`MIN_GAIN` over DDP: then plain DDP.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..algorithms import dense_tail_seconds, split_dense_tail
from ..comm.buckets import bucket_overlap_warning
from ..sim.costmodel import Network
from ..sim.engine import simulate
from ..sim.plans import AlgorithmPlan, CovapSimPlan, DeARPlan, DensePlan, FP16Plan, PowerSGDPlan, TopKPlan
from ..sim.profile import Profile, ProfileBucket, load_profile
from ..validation import check_float, check_int
from .accuracy_costs import LOSSLESS, MEASURED_COSTS, AccuracyCost, rows_for_model, rows_for_world_size
from .profile import ccr_at

__all__ = ["Advice", "Prediction", "advise", "candidates", "tail_candidates", "train_command", "CASTS", "LOW_CCR",
           "MIN_GAIN"]

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


def tail_candidates(costs: Sequence[AccuracyCost], budget_steps: int
                    ) -> list[tuple[str, str, AlgorithmPlan, AccuracyCost]]:
    """The measured settings with a dense tail, offered to a job of ``budget_steps`` iterations:
    ``(entry, label, plan of the compressed phase, cost row)``, the entry's ``dense_from`` scaled from
    the measured run's budget to ``budget_steps`` (the tail starts at the same fraction of the
    one-cycle schedule, at least at iteration 2). A row whose setting without the tail is not among
    :func:`candidates`, or without a budget, is skipped.

    Raises:
        ValueError: for ``budget_steps`` < 1.
    """
    budget_steps = check_int("budget_steps", budget_steps, 1)
    plans = {entry: (label, plan) for entry, label, plan in candidates()}
    out = []
    for row in costs:
        base, tail = split_dense_tail(row.entry)
        if not tail or not row.budget_steps or base not in plans:
            continue
        start = max(2, round(tail * budget_steps / row.budget_steps))
        label, plan = plans[base]
        out.append((f"{base}:dense_from={start}", f"{label} + dense tail from {start}", plan, row))
    return out


def _as_run(prof: Profile, entry: str) -> Profile:
    """``prof`` as ``entry`` runs it: one bucket, ready at the end of backward, for algorithms
    gradsync runs on one DDP bucket (the registry's ``single_bucket``: PowerSGD); 2-byte elements
    for COVAP's 16-bit shards (``cast``)."""
    from ..algorithms import REGISTRY, parse_entry

    name, options = parse_entry(entry)
    if REGISTRY[name].single_bucket and len(prof.buckets) > 1:
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
    tail_iteration_s: float | None = None

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


def _cost_row(entry: str, costs: Sequence[AccuracyCost]) -> AccuracyCost | None:
    """The measurement of ``entry`` over the most seeds (``costs`` hold one world size:
    :func:`~gradsync.profiler.accuracy_costs.rows_for_world_size`)."""
    rows = [c for c in costs if c.entry == entry]
    return max(rows, key=lambda c: c.seeds) if rows else None


def _cost(entry: str, costs: Sequence[AccuracyCost],
          assume_casts: bool = True) -> tuple[float | None, str, str | None]:
    """``(extra_steps, cost in words, source)`` of ``entry``; a 16-bit cast without a measurement
    counts as lossless only with ``assume_casts``."""
    if entry in LOSSLESS:
        return 0.0, "none (same arithmetic as DDP)", LOSSLESS[entry]
    row = _cost_row(entry, costs)
    if row is not None:
        return _row_cost(row)
    if entry in CASTS and assume_casts:
        return 0.0, "0 assumed (16-bit cast, not measured)", None
    return None, "not measured", None


def _row_cost(row: AccuracyCost) -> tuple[float, str, str]:
    """``(extra_steps, cost in words, source)`` of a measurement."""
    if row.not_reached:
        return row.extra_steps, (f"missed the target ({row.target}) on 2 or more of {row.seeds} seeds, "
                                 f"{row.world_size} ranks"), row.source
    seeds = f"{row.seeds} seed{'s' if row.seeds > 1 else ''}"
    return row.extra_steps, (f"{row.extra_steps * 100:+.0f} % steps ({row.steps} vs {row.dense_steps} to "
                             f"{row.target}, {seeds}, {row.world_size} ranks)"), row.source


def _tail_time_to_quality(row: AccuracyCost, iteration_s: float, tail_iteration_s: float) -> float:
    """Seconds per DDP-step-equivalent of a setting with a dense tail: the measured steps before the
    tail at ``iteration_s``, those after it at ``tail_iteration_s``, over dense's steps; infinite when
    the setting missed the target."""
    if row.not_reached:
        return math.inf
    return dense_tail_seconds(row.entry, row.steps, iteration_s, tail_iteration_s) / row.dense_steps


def advise(profile: Profile | Mapping[str, Any] | str, world_size: int, bandwidth_mbit: float,
           costs: Sequence[AccuracyCost] = MEASURED_COSTS, latency_s: float = 0.0,
           overlap_efficiency: float = 1.0, assume_casts: bool = True,
           allowed: Callable[[str], bool] = lambda entry: True, budget_steps: int | None = None,
           optimizer: str | None = None, model_key: str | None = None) -> Advice:
    """Recommend a setting for ``profile`` on ``world_size`` ranks at ``bandwidth_mbit`` Mbit/s
    (see the module docstring for the rule).

    Args:
        profile: a :class:`~gradsync.sim.profile.Profile` or anything
            :func:`~gradsync.sim.profile.load_profile` takes (compute times in seconds, fp32 or
            16-bit buckets in DDP order).
        world_size: ranks, >= 2.
        bandwidth_mbit: link rate in Mbit/s, > 0.
        costs: measured accuracy costs (default: the README's, :data:`MEASURED_COSTS`); only the rows of
            the world size closest to ``world_size`` count
            (:func:`~gradsync.profiler.accuracy_costs.rows_for_world_size`).
        latency_s: per-message latency alpha in seconds, >= 0.
        overlap_efficiency: (0, 1], rate of communication during backward (see
            :func:`gradsync.sim.simulate`).
        assume_casts: count the fp16/bf16 casts as lossless where ``costs`` has no row for them
            (``gradsync doctor``); False ranks them as "not measured" (``--algorithm auto``).
        allowed: which candidate entries to consider (DDP's all-reduce always is).
        budget_steps: the job's budget in iterations (its learning-rate schedule's length); with it the
            measured settings with a dense tail are candidates too (:func:`tail_candidates`).
        optimizer: the job's optimizer family (``"sgd"``, ``"adamw"``): only ``costs`` measured with it
            count; None: every row.
        model_key: the job as ``workload:model`` (``fashion-mnist:resnet8-w32``): where ``costs`` has
            rows of that model, only those count (:func:`~gradsync.profiler.accuracy_costs.rows_for_model`);
            None: every row.

    Returns:
        :class:`Advice`.

    Raises:
        ValueError: naming world_size (an integer >= 2), bandwidth_mbit (> 0), budget_steps (>= 1),
            latency_s or overlap_efficiency out of range, or a bad profile.
    """
    prof = load_profile(profile)
    if optimizer is not None:
        costs = [c for c in costs if c.optimizer == optimizer]
    costs = rows_for_model(costs, model_key)
    world_size = check_int("world_size", world_size, 2)
    costs = rows_for_world_size(costs, world_size)
    bandwidth_mbit = check_float("bandwidth_mbit", bandwidth_mbit, 0.0, 1e9, low_inclusive=False)
    net = Network.from_mbit(bandwidth_mbit, latency_s)
    ccr = ccr_at(prof, world_size, bandwidth_mbit, latency_s)
    rows = []
    for entry, label, plan in candidates():
        if entry != "allreduce" and not allowed(entry):
            continue
        t = simulate(_as_run(prof, entry), plan, world_size, net, overlap_efficiency).iteration_s
        extra, cost, source = _cost(entry, costs, assume_casts)
        rows.append(Prediction(entry, label, t, 0.0, extra, cost, source, None if extra is None else t * (1 + extra)))
    for entry, label, plan, row in tail_candidates(costs, budget_steps) if budget_steps is not None else ():
        if not allowed(entry):
            continue
        t = simulate(_as_run(prof, entry), plan, world_size, net, overlap_efficiency).iteration_s
        tail_t = simulate(_as_run(prof, entry.split(":")[0]), FP16Plan(), world_size, net, overlap_efficiency).iteration_s
        extra, cost, source = _row_cost(row)
        cost = f"{cost}; the tail's iterations at the fp16 hook's {tail_t * 1e3:.1f} ms"
        rows.append(Prediction(entry, label, t, 0.0, extra, cost, source, _tail_time_to_quality(row, t, tail_t), tail_t))
    dense = rows[0].iteration_s
    rows = [dataclasses.replace(r, speedup=dense / r.iteration_s) for r in rows]
    order = {r.entry: i for i, r in enumerate(rows)}
    ranked = sorted(rows, key=lambda r: (not r.measured, r.time_to_quality_s if r.measured else r.iteration_s,
                                         order[r.entry]))
    ddp = next(r for r in ranked if r.entry == "allreduce")
    best = next((r for r in ranked if r.measured and r is not ddp), None)
    gain = ddp.time_to_quality_s / best.time_to_quality_s if best is not None else 0.0
    if best is None:
        choice = ddp
        reason = (f"CCR {ccr:.2f}: no other setting has a measured accuracy cost for this job; use plain DDP "
                  f"(allreduce).")
    elif ccr < LOW_CCR:
        choice = ddp
        reason = (f"CCR {ccr:.2f} < {LOW_CCR}: a dense all-reduce takes under half the backward pass and DDP "
                  f"overlaps it with backward; use plain DDP (allreduce): compression would only add work.")
    elif gain < MIN_GAIN:
        choice = ddp
        reason = (f"CCR {ccr:.2f}: the best measured alternative, {best.label}, is predicted only {gain:.2f}x "
                  f"faster to the same quality, within the simulator's ~10 % error; use plain DDP (allreduce).")
    else:
        choice = best
        reason = (f"CCR {ccr:.2f}: {best.label} is predicted {best.speedup:.2f}x faster per iteration than DDP; "
                  f"accuracy cost {best.cost}, so {gain:.2f}x to the same quality, the best with a known cost.")
    faster = [r for r in ranked if not r.measured and r.iteration_s * MIN_GAIN < choice.time_to_quality_s]
    if faster and ccr >= LOW_CCR:
        f = min(faster, key=lambda r: r.iteration_s)
        reason += (f" {f.label} is predicted {f.speedup:.2f}x per iteration, but its accuracy cost is not "
                   f"measured.")
    return Advice(world_size, bandwidth_mbit, latency_s, prof.backward_s, ccr * prof.backward_s, ccr,
                  tuple(ranked), choice, reason, tuple(_notes(prof)))


def _notes(prof: Profile) -> list[str]:
    """Caveats printed under the recommendation."""
    notes = ["Dense all-reduce time is modelled (ring alpha-beta at the given bandwidth), not measured; "
             "compute times are this machine's.",
             "Compression overhead (casts, shard copies, PowerSGD's matrix products) is not modelled: "
             "predicted speed-ups of compressed settings are upper bounds.",
             "PowerSGD is replayed on one bucket, ready at the end of backward, as gradsync runs torch's hook; "
             "powersgd-overlap on every bucket, each Q launched by the next bucket's hook once P has arrived.",
             "Measured accuracy costs come from fashion-mnist/resnet8, 5 seeds, to dense's final accuracy - 0.5 points "
             "(docs/results.md); "
             "other models may need more or fewer extra steps."]
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
