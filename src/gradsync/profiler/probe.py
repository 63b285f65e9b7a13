"""Measure candidate settings on the user's own job: compression quality on the job's own gradients
and iteration time on the real network. Every function is a collective on the job's process group,
runs private copies of the model on the job's batches (each rank its own) and returns the same
numbers on every rank (all-reduced statistics), so every rank takes the same decision.

* :class:`QualityProbe` / :func:`measure_quality`: candidates on one copy of the model that does not
  train while it is measured (the job's initial model on its first batches); a :class:`QualityMeter`
  runs each candidate's hook on copies of the same buckets and compares each aggregate ``c`` with the
  dense average ``d`` of a random sample of every gradient tensor (:data:`REFERENCE_FRACTION` of its elements, the same on every rank). The
  relative error ``sqrt(sum ||c - d||^2 / sum ||d||^2)`` over :data:`QUALITY_STEPS` steps and every
  bucket is GraVAC's compression gain seen from the other side (Tyagi & Sharma 2023, arXiv
  2305.12201, §3.2: the gain is ``||C(g)||^2 / ||g||^2``; here the error of the error-fed, aggregated
  result, which is what the optimizer receives). An entry's error does not depend on which entries
  are measured with it, so auto measures the costly ones only where they could be chosen. The same
  steps give the job's gradient noise: how far one rank's own gradient lies from the dense average
  (the unit :mod:`gradsync.profiler.quality_model` measures errors in);
* :func:`cast_errors`: the 16-bit casts' error from one backward, without communication;
* :func:`compression_seconds`: each hook's own computation per step (compression, error feedback,
  decompression), timed in a process group of the rank alone;
* :func:`time_candidates`: the candidates in turn on one DDP copy per bucket layout (the quality
  probe's copy where it can serve); the median step (a device-synchronising clock), MAX over the
  ranks;
* :func:`measure_quality_on_loopback`: :func:`measure_quality` on forked loopback ranks, for
  ``gradsync doctor`` and ``benchmarks/probe_quality.py``.

The copies' training (the timing steps) is thrown away: the probe's cost is start-up time, which auto
reports.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import copy
import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.agreement import replicas_agree
from ..comm.collectives import max_over_ranks
from ..validation import check_int
from ..algorithms.joined import JoinedBucket
from ..algorithms.meter import (LOCAL_GRADIENT, REFERENCE_FRACTION, ProxyBucket, QualityMeter,  # noqa: F401
                                metered_hook, relative_errors)
from .advise import single_bucket
from .compute import device_clock
from .quality_model import optimizer_family

__all__ = ["ProxyBucket", "QualityMeter", "metered_hook", "relative_errors", "CandidateProbe", "MeasuredQuality",
           "QualityProbe",
           "measure_quality", "quality_proxy", "time_candidates", "cast_errors", "compression_seconds", "probe_batches",
           "race", "START_STEPS", "QUALITY_STEPS", "REFERENCE_FRACTION", "RACE_MIN_STEPS", "TIMED_STEPS", "RACE_TIE",
           "COMPRESSION_REPEATS"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class MeasuredQuality:
    """What :func:`measure_quality` measured, identical on every rank.

    Attributes:
        errors: ``{entry: relative error}`` (dimensionless, 0 for an exact setting).
        noise: the gradient noise ``sqrt(mean_i sum ||g_i - d||^2 / sum ||d||^2)`` of rank ``i``'s own
            gradient ``g_i`` against the dense average ``d`` over the same steps and elements
            (dimensionless; :func:`gradsync.profiler.quality_model.error_to_noise`).
        family: the optimizer family of ``make_optimizer``'s optimizer
            (:func:`gradsync.profiler.quality_model.optimizer_family`), whose limit applies.
        compression_s: ``{entry: seconds}`` each entry's hook computes per step
            (:func:`compression_seconds`), where it was measured (``gradsync doctor``); else empty.
    """

    errors: dict
    noise: float
    family: str
    compression_s: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class CandidateProbe:
    """One candidate measured on the job.

    Attributes:
        entry: the ``--algorithms`` entry.
        iteration_s: median seconds of a timed step (forward, backward with the hook, optimizer step),
            MAX over the ranks; None when it was not timed.
        relative_error: ``sqrt(sum ||c - d||^2 / sum ||d||^2)`` over the quality steps (dimensionless;
            0 for an exact setting), the same on every rank; None when not measured.
        wire_bytes_per_step: the hook's own wire bytes per timed step (bytes); None when not timed.
        timed_steps: how many steps were timed (fewer for an entry a race dropped); None when not timed.
    """

    entry: str
    iteration_s: Optional[float] = None
    relative_error: Optional[float] = None
    wire_bytes_per_step: Optional[float] = None
    timed_steps: Optional[int] = None


def _hook_pair(entry: str, model: nn.Module, make_optimizer: Any, process_group: Any, seed: int,
               batch_size: int, steps_per_epoch: int) -> tuple[Any, Callable]:
    """``(state, hook)`` of a communication-hook entry, built on ``model``.

    Raises:
        ValueError: for an entry that is not a communication hook.
    """
    from ..algorithms import REGISTRY, BuildContext, make_options, parse_entry

    name, options = parse_entry(entry)
    spec = REGISTRY[name]
    if spec.make_hook is None:
        raise ValueError(f"entries: {entry!r} is not a communication hook; only hook algorithms are probed")
    ctx = BuildContext(model=model, make_optimizer=make_optimizer, process_group=process_group, seed=seed,
                       batch_size=batch_size, steps_per_epoch=steps_per_epoch)
    return spec.make_hook(make_options(name, options), ctx)


def _ddp(model: nn.Module, process_group: Any, bucket_cap_mb: float) -> DistributedDataParallel:
    """``model`` in DDP; rank 0's state is broadcast only where the replicas differ: a copy of a job's
    model is usually equal on every rank already, and the broadcast costs the probe a network transfer of
    the whole model (1 s for 0.16 M parameters at 5 Mbit/s) per copy."""
    device = next(model.parameters()).device
    return DistributedDataParallel(model, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                                   device_ids=[device.index] if device.type == "cuda" else None,
                                   init_sync=not replicas_agree(model, process_group))


def _train_steps(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, batches: Sequence[Batch],
                 loss_fn: Callable, steps: range) -> list[float]:
    """Train ``ddp`` for the steps in ``steps`` (batches cycled by step number); return each step's
    seconds on a device-synchronising clock."""
    clock = device_clock(ddp.module)
    times = []
    for i in steps:
        x, y = batches[i % len(batches)]
        t = clock()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        times.append(clock() - t)
    return times


#: Measured steps of :func:`measure_quality`: the error of an error-fed compressor grows over its first
#: steps while the residual builds up (PowerSGD r=4 on the ResNet-8: 0.43 after 4 steps, 0.64 after 8,
#: 0.87 after 16), so the count is fixed, and the same where the quality model was fitted
#: (benchmarks/probe_quality.py) and where it is used.
QUALITY_STEPS = 8

#: Start-up steps of every probe copy: DDP puts every gradient in one bucket in its first iteration and
#: rebuilds its buckets after it. The copy runs them as forward and backward passes only, with a hook that
#: sends nothing and no optimizer step (:func:`~gradsync.algorithms.meter.local_gradient_hook`), and every entry compresses from its
#: first step (``skip_start``: PowerSGD's dense start iterations exist only for the rebuild). Before, 2
#: steps trained the copy with the fp16 cast: half a dense all-reduce each (1.2 s of the GRU's probe at
#: 5 Mbit/s per copy).
START_STEPS = 1


#: Rounds every raced candidate is timed before any is dropped (:meth:`_ProbeCopy.time`).
RACE_MIN_STEPS = 3
#: Most rounds of :func:`time_candidates` (a raced timing ends earlier when it is settled).
TIMED_STEPS = 8
#: Width of a raced entry's interval in standard errors of its median step time.
RACE_Z = 2.0
#: Entries whose intervals of time to quality all lie within this fraction of each other are not
#: told apart by more steps: any of them is within it of the best.
RACE_TIE = 0.05


def race(scores: Mapping[str, float], spreads: Mapping[str, float], z: float = RACE_Z,
         tie: float = RACE_TIE) -> tuple[list[str], bool]:
    """One elimination round of a race between timed candidates (successive elimination, as in
    Maron & Moore's Hoeffding races, NIPS 1993): ``(survivors, settled)``.

    Args:
        scores: ``{entry: predicted time to quality}`` (seconds per DDP step-equivalent: median step x
            (1 + extra steps)).
        spreads: ``{entry: relative standard error of its median}`` (dimensionless).

    An entry survives while the lower end of its interval ``[score / (1 + z x spread), score x (1 + z x
    spread)]`` (symmetric in the logarithm: a time stays positive) is at most the upper end of the best
    entry's; the race is settled when one survives or every survivor's interval
    lies within ``tie`` of every other's (more steps would choose between settings at most ``tie``
    apart)."""
    lo = {e: s / (1 + z * spreads[e]) for e, s in scores.items()}
    hi = {e: s * (1 + z * spreads[e]) for e, s in scores.items()}
    best = min(scores, key=lambda e: (scores[e], e))
    live = [e for e in scores if lo[e] <= hi[best]]
    settled = len(live) == 1 or max(hi[e] for e in live) <= (1 + tie) * min(lo[e] for e in live)
    return live, settled


def _agreed_medians(times: Mapping[str, Sequence[float]], group: Any) -> tuple[dict, dict]:
    """Collective: ``({entry: median step seconds}, {entry: relative standard error of that median})``,
    each the MAX over the ranks (one all-reduce). The standard error of a median of ``n`` steps is
    taken as 1.253 x 1.4826 x MAD / sqrt(n) (normal errors; the MAD resists a step stalled by the machine)."""
    stats = []
    for t in times.values():
        m = statistics.median(t)
        mad = statistics.median(abs(x - m) for x in t)
        stats += [m, 1.253 * 1.4826 * mad / math.sqrt(len(t)) / m if m > 0 else 0.0]
    v = max_over_ranks(stats, group)
    return ({e: v[2 * k] for k, e in enumerate(times)}, {e: v[2 * k + 1] for k, e in enumerate(times)})


class _ProbeCopy:
    """A private copy of ``model`` in ``DistributedDataParallel`` whose communication hook is a
    :class:`QualityMeter` over the entries' hooks (one bucket for ``one_bucket``), on the job's
    batches. After construction it has run :data:`START_STEPS` untrained start steps (DDP's bucket
    rebuild; nothing sent), its parameters are still ``model``'s and every hook compresses from its
    next step. :meth:`measure_errors` measures entries without training the copy;
    :meth:`measure_errors_training` and :meth:`time` train it."""

    def __init__(self, model: nn.Module, entries: Sequence[str], batches: Sequence[Batch], loss_fn: Callable,
                 make_optimizer: Callable, bucket_cap_mb: float, process_group: Any, seed: int,
                 steps_per_epoch: int, one_bucket: bool = False, sample_fraction: float = 1.0):
        if not batches:
            raise ValueError("batches must hold at least one (inputs, targets) batch")
        self.entries: list[str] = []
        self.batches, self.loss_fn, self.process_group, self.seed = batches, loss_fn, process_group, seed
        self.local = copy.deepcopy(model)
        self._build = lambda e: _hook_pair(e, self.local, make_optimizer, process_group, seed,
                                           int(batches[0][0].shape[0]), steps_per_epoch)
        # DDP receives the rank's own gradient while nothing trains (the start step, the measured steps);
        # metered, it gives the gradient noise
        self.meter = QualityMeter([LOCAL_GRADIENT], primary=0, process_group=process_group,
                                  sample_fraction=sample_fraction, seed=seed)
        self.ddp = _ddp(self.local, process_group, 1e4 if one_bucket else bucket_cap_mb)
        self.ddp.register_comm_hook(self.meter, metered_hook)
        self.opt = make_optimizer(self.ddp.parameters())
        self.family = optimizer_family(self.opt)
        self.step = 0
        self.noise: Optional[float] = None
        self._backward(range(START_STEPS))
        self.meter.hooks = []
        self.add(entries)

    def add(self, entries: Sequence[str]) -> None:
        """Build the hooks of the ``entries`` the copy does not hold yet; each compresses from its
        first step (``skip_start``: the copy's buckets are rebuilt)."""
        for e in entries:
            if e not in self.entries:
                state, hook = self._build(e)
                state.skip_start()
                self.entries.append(e)
                self.meter.hooks.append((state, hook))

    def _backward(self, steps: range) -> None:
        for i in steps:
            x, y = self.batches[i % len(self.batches)]
            self.loss_fn(self.ddp(x), y).backward()
            self.opt.zero_grad(set_to_none=True)

    def train(self, steps: int) -> list[float]:
        """Train ``steps`` more steps; each step's seconds (a device-synchronising clock)."""
        times = _train_steps(self.ddp, self.opt, self.batches, self.loss_fn, range(self.step, self.step + steps))
        self.step += steps
        return times

    def measure_errors(self, entries: Sequence[str], steps: int) -> dict[str, float]:
        """Collective: each of ``entries``' relative error over ``steps`` metered steps on the job's first
        ``steps`` batches (cycled), the same on every rank. Nothing trains (the rank's own gradient is
        DDP's result, the optimizer does not step) and the reference samples the same positions and
        the forward passes draw the same random numbers at every call, so an entry's error does not
        depend on which entries are measured with it, nor when: a later call measures more entries
        exactly as one call would have measured them all."""
        device = next(self.local.parameters()).device

        def frozen_steps() -> None:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(self.seed)
                self._backward(range(steps))

        return self._metered(list(entries), None, frozen_steps)

    def measure_errors_training(self, entries: Sequence[str], steps: int, base: str) -> dict[str, float]:
        """Collective: :meth:`measure_errors`, but the copy trains while it is measured, as a job would: each
        of the ``steps`` steps (the next batches, cycled) steps the optimizer on the aggregate of the
        ``base`` entry's hook (its result is DDP's), and every entry is metered beside it on copies of the
        same buckets. The errors then depend on the base and on what was measured before (the copy
        trained), so a second call measures other parameters."""
        # a hook runs once per bucket: the base is not metered twice
        measured = self._metered([base, *(e for e in entries if e != base)], base, lambda: self.train(steps))
        return {e: measured[e] for e in entries}

    def _metered(self, metered: list[str], base: Optional[str], run: Callable[[], Any]) -> dict[str, float]:
        """Run ``run()`` with the meter on over the rank's own gradient (the noise) and the ``metered``
        entries, DDP receiving ``base``'s result (None: the rank's own gradient); each metered entry's
        all-reduced relative error."""
        self.add(metered)
        hooks, primary = self.meter.hooks, self.meter.primary
        self.meter.hooks = [LOCAL_GRADIENT] + [hooks[self.entries.index(e)] for e in metered]
        self.meter.primary = 0 if base is None else 1 + metered.index(base)
        self.meter.restart_sample()
        self.meter.on = True
        self.meter.reset()
        try:
            run()
        finally:
            self.meter.on = False
            sums = self.meter.sums()
            self.meter.hooks, self.meter.primary = hooks, primary
        dist.all_reduce(sums, group=self.process_group)
        noise, *errors = relative_errors(sums / dist.get_world_size(self.process_group))
        self.noise = noise
        return dict(zip(metered, errors))

    def time(self, entries: Sequence[str], steps: int, factors: Optional[Mapping[str, float]] = None,
             min_steps: int = RACE_MIN_STEPS) -> dict[str, CandidateProbe]:
        """Collective: up to ``steps`` timed steps of each entry, taken in rounds (entry 1, entry 2, ...,
        entry 1, ...), so a drift of the network or the machine reaches every entry alike; each entry's
        median, MAX over the ranks. An entry the copy does not hold yet joins it (after the start steps:
        it compresses at once).

        With ``factors`` (``{entry: 1 + predicted extra steps}``) the entries race (:func:`race`): from
        round ``min_steps`` on, after every round, an entry whose time to quality (median x factor) is
        worse than the best's beyond both their spreads stops being timed, and the timing ends when one
        entry is left or the rest lie within :data:`RACE_TIE` of each other; the decisions use medians
        and spreads all-reduced (MAX), so every rank times the same steps."""
        self.add(entries)
        index = {e: self.entries.index(e) for e in entries}
        wire0 = {e: float(self.meter.hooks[i][0].stats()["wire_bytes"]) for e, i in index.items()}
        times: dict[str, list[float]] = {e: [] for e in entries}
        medians: dict[str, float] = {}
        live = list(entries)
        for done in range(1, steps + 1):
            for e in live:
                self.meter.primary = index[e]
                times[e] += self.train(1)
            if done < steps and (factors is None or done < min_steps):
                continue
            agreed, spread = _agreed_medians({e: times[e] for e in live}, self.process_group)
            medians.update(agreed)
            if factors is None:
                break
            live, settled = race({e: agreed[e] * factors[e] for e in live}, spread)
            if settled:
                break
        return {e: CandidateProbe(e, medians[e], None,
                                  (float(self.meter.hooks[i][0].stats()["wire_bytes"]) - wire0[e]) / len(times[e]),
                                  len(times[e]))
                for e, i in index.items()}

    def close(self) -> None:
        for state, _ in self.meter.hooks:
            state.close()


class QualityProbe(_ProbeCopy):
    """Collective: the start-up quality probe: entries' relative errors against dense all-reduce on
    one copy of the model that does not train while it measures (:meth:`_ProbeCopy.measure_errors`: each
    entry's hook on copies of the buckets, against a dense all-reduce of ``reference_fraction`` of
    each gradient tensor); :meth:`measure` adds entries later, measured exactly as if they had been
    measured with the first; afterwards :meth:`time` times entries on the same copy.

    Attributes:
        errors: ``{entry: relative error}`` of the measured entries (the quality proxies of the
            entries given: :func:`quality_proxy`), identical on every rank.
        noise: the gradient noise over the same steps (:class:`MeasuredQuality`), identical on every
            rank; the same at every :meth:`measure`.
        family: the optimizer family of ``make_optimizer``'s optimizer (:class:`MeasuredQuality`).
    """

    def __init__(self, model: nn.Module, batches: Sequence[Batch], loss_fn: Callable,
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], entries: Sequence[str],
                 bucket_cap_mb: float, *, steps: int = QUALITY_STEPS, process_group: Any = None, seed: int = 0,
                 steps_per_epoch: int = 0, reference_fraction: float = REFERENCE_FRACTION):
        self.steps = check_int("steps", steps, 1, 1000)
        super().__init__(model, [], batches, loss_fn, make_optimizer, bucket_cap_mb, process_group, seed,
                         steps_per_epoch, sample_fraction=reference_fraction)
        self.errors: dict[str, float] = {}
        self.measure(entries)

    def measure(self, entries: Sequence[str]) -> dict[str, float]:
        """Collective: measure the quality proxies of ``entries`` not measured yet; return
        ``{entry: relative error}`` for ``entries``."""
        todo = [p for p in dict.fromkeys(quality_proxy(e) for e in entries) if p not in self.errors]
        if todo:
            self.errors.update(self.measure_errors(todo, self.steps))
        return {e: self.errors[quality_proxy(e)] for e in entries}


def measure_quality(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable,
                    make_optimizer: Callable[[Any], torch.optim.Optimizer], entries: Sequence[str],
                    bucket_cap_mb: float, *, steps: int = QUALITY_STEPS, process_group: Any = None, seed: int = 0,
                    steps_per_epoch: int = 0, reference_fraction: float = REFERENCE_FRACTION,
                    training_base: Optional[str] = None) -> MeasuredQuality:
    """Collective: the relative error of every entry's aggregate against dense all-reduce on this
    job's gradients (:class:`QualityProbe`): all entries at once on one copy of ``model`` that does
    not train (``model``'s parameters, its first ``steps`` batches); per step each entry's own collectives plus a dense all-reduce of
    ``reference_fraction`` of every gradient tensor's elements (in (0, 1]; sampled alike on every
    rank), over ``steps`` steps after :data:`START_STEPS` start-up steps. ``model`` is not changed.
    With ``training_base`` (an entry, e.g. ``fp16``) the copy trains on that entry's aggregate while the
    entries are metered beside it (:meth:`_ProbeCopy.measure_errors_training`): the errors a probe riding on
    a job's first steps would see, instead of the frozen model's the quality model was fitted on.

    Args:
        entries: communication hooks that issue their collectives from the hook body (``fp16``,
            ``bf16``, ``powersgd-overlap:...``, ``allreduce``); torch's ``powersgd`` at rank r is
            measured as ``powersgd-overlap`` at rank r (the same per-tensor compression rule and error
            feedback, run per bucket; :func:`quality_proxy`).
        steps: measured steps (>= 1).

    Returns:
        :class:`MeasuredQuality`: every entry's relative error and the gradient noise.

    Raises:
        ValueError: for an empty ``batches``, ``steps`` < 1, ``reference_fraction`` outside (0, 1]
            or an entry (or ``training_base``) that is no communication hook.
    """
    if training_base is not None:
        steps = check_int("steps", steps, 1, 1000)
        trained = _ProbeCopy(model, [], batches, loss_fn, make_optimizer, bucket_cap_mb, process_group, seed,
                             steps_per_epoch, sample_fraction=reference_fraction)
        proxies = list(dict.fromkeys(quality_proxy(e) for e in entries))
        errors = trained.measure_errors_training(proxies, steps, training_base)
        trained.close()
        return MeasuredQuality({e: errors[quality_proxy(e)] for e in entries}, trained.noise, trained.family)
    probe = QualityProbe(model, batches, loss_fn, make_optimizer, entries, bucket_cap_mb, steps=steps,
                         process_group=process_group, seed=seed, steps_per_epoch=steps_per_epoch,
                         reference_fraction=reference_fraction)
    probe.close()
    return MeasuredQuality({e: probe.errors[quality_proxy(e)] for e in entries}, probe.noise, probe.family)


def quality_proxy(entry: str) -> str:
    """The entry whose quality stands for ``entry`` in :func:`measure_quality`: torch's ``powersgd``
    (its Q all-reduce is launched from a callback, so it cannot run beside other hooks on Gloo) is
    measured as ``powersgd-overlap`` with the same options; a dense tail (``dense_from``) is dropped."""
    from ..algorithms import split_dense_tail

    base = split_dense_tail(entry)[0]
    name, _, rest = base.partition(":")
    return f"powersgd-overlap:{rest}" if name == "powersgd" and rest else base


def time_candidates(model: nn.Module, batches: Sequence[Batch], loss_fn: Callable,
                    make_optimizer: Callable[[Any], torch.optim.Optimizer], entries: Sequence[str],
                    bucket_cap_mb: float, *, steps: int = TIMED_STEPS, process_group: Any = None, seed: int = 0,
                    steps_per_epoch: int = 0, probe: Optional[QualityProbe] = None,
                    factors: Optional[Mapping[str, float]] = None,
                    min_steps: int = RACE_MIN_STEPS) -> dict[str, CandidateProbe]:
    """Collective: each entry's iteration time on this network: ``steps`` timed steps per entry,
    taken in turn (with ``factors``, ``{entry: 1 + predicted extra steps}``, a race: at most ``steps``,
    at least ``min_steps``, an entry clearly slower to quality than the best stops early; the entries
    on DDP's buckets and those on one bucket race separately), on a copy of ``model`` in
    ``DistributedDataParallel`` (:meth:`_ProbeCopy.time`):
    the entries on DDP's buckets share one copy (``probe``'s, when given: no start steps, residuals
    warm), those gradsync runs on one bucket (:func:`~gradsync.profiler.advise.single_bucket`) another, each after
    :data:`START_STEPS` start steps. The median, MAX over ranks. ``model`` is not changed.

    Returns:
        ``{entry: CandidateProbe}`` with ``iteration_s`` (seconds; an entry dropped from a race: its
        median when dropped) and ``wire_bytes_per_step`` (bytes), identical on every rank.

    Raises:
        ValueError: for an empty ``batches``, ``steps`` < 1 or an entry that is no communication hook.
    """
    if not batches:
        raise ValueError("batches must hold at least one (inputs, targets) batch")
    steps = check_int("steps", steps, 1, 1000)
    out: dict[str, CandidateProbe] = {}
    for one_bucket in (False, True):
        group = [e for e in entries if single_bucket(e) == one_bucket]
        if not group:
            continue
        if probe is not None and not one_bucket:
            out.update(probe.time(group, steps, factors, min_steps))
            continue
        copy_ = _ProbeCopy(model, group, batches, loss_fn, make_optimizer, bucket_cap_mb, process_group, seed,
                           steps_per_epoch, one_bucket=one_bucket)
        out.update(copy_.time(group, steps, factors, min_steps))
        copy_.close()
    return {e: out[e] for e in entries}


def probe_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int, seed: int,
                  count: int = QUALITY_STEPS, augment: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's first ``count`` training batches of ``batch_size`` samples in the order
    ``DistributedSampler(shuffle=True, seed=seed)`` gives them (different on every rank, as in
    training), ``augment`` applied to the inputs: what the probe measures on (:mod:`.probe`). Draws
    nothing from torch's global random generator but ``augment``'s.

    Raises:
        ValueError: if ``x`` holds fewer than ``batch_size x world_size`` samples.
    """
    from torch.utils.data import DistributedSampler, TensorDataset

    if x.shape[0] < batch_size * world_size:
        raise ValueError(f"batch_size {batch_size} x world size {world_size} exceeds the {x.shape[0]} samples")
    order = list(DistributedSampler(TensorDataset(x), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                    drop_last=True))
    batches = []
    for i in range(count):
        idx = torch.tensor([order[(i * batch_size + j) % len(order)] for j in range(batch_size)], device=x.device)
        batches.append((augment(x[idx]), y[idx]))
    return batches


def cast_errors(model: nn.Module, batch: Batch, loss_fn: Callable, casts: Sequence[str],
                process_group: Any = None) -> dict[str, float]:
    """Collective: the relative error of each 16-bit cast (``fp16``, ``bf16``) on this job's gradient,
    without communication: ``||g - cast(g)|| / ||g||`` of one backward of a copy of ``model`` on
    ``batch``, MAX over the ranks. A cast's all-reduced aggregate differs from the dense one by the
    rounding of each rank's gradient and of the sum (``fp16_compress_hook`` divides first), so this is
    its error up to that second rounding (on the ResNet-8: 0.0003 measured with the meter, fp16).

    Raises:
        ValueError: for a cast other than fp16 or bf16.
    """
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for c in casts:
        if c not in dtypes:
            raise ValueError(f"casts must be among {', '.join(dtypes)}; got {c!r}")
    local = copy.deepcopy(model)
    loss_fn(local(batch[0]), batch[1]).backward()
    g = torch.cat([p.grad.reshape(-1).double() for p in local.parameters() if p.grad is not None])
    norm = float(g.norm()) or 1.0
    errors = max_over_ranks([float((g - g.to(dtypes[c]).double()).norm()) / norm for c in casts], process_group)
    return dict(zip(casts, errors))


#: Timed runs of each hook in :func:`compression_seconds`, after one untimed (first-call allocations,
#: PowerSGD's initial ``Q``); the least counts (another process on the machine only adds time). One: on the
#: MLP's 0.7 s probe budget at 3 Gbit/s, two runs of ten hooks took 0.6 s.
COMPRESSION_REPEATS = 1


def compression_seconds(model: nn.Module, batch: Batch, loss_fn: Callable,
                        make_optimizer: Callable[[Any], torch.optim.Optimizer], entries: Sequence[str],
                        bucket_cap_mb: float, *, process_group: Any = None, seed: int = 0,
                        repeats: int = COMPRESSION_REPEATS) -> dict[str, float]:
    """Collective: each hook entry's own computation per step on this job (seconds): the entry's hook
    on copies of this rank's DDP buckets of one backward of a copy of ``model`` on ``batch`` (one
    bucket for an entry gradsync runs on one), in a process group of this rank alone, so its
    collectives carry nothing to another rank and what is timed is the hook's compression, error
    feedback and decompression; the least of ``repeats`` runs after one untimed, MAX over the ranks.
    The simulator leaves this out of a compressing iteration (PowerSGD's ``M Q``, orthogonalisation,
    ``M^T P`` and ``P Q^T``, Vogels et al., NeurIPS 2019, Alg. 1): on the 670k-parameter MLP, r=8 computes
    about as long as the model's forward and backward pass. ``model`` is not changed; nothing is sent but
    the one all-reduce of the result.

    Raises:
        ValueError: for ``repeats`` < 1 or an entry that is no communication hook.
    """
    from ..comm.futures import completed

    repeats = check_int("repeats", repeats, 1, 100)
    if not entries:
        return {}
    alone = dist.new_group([dist.get_rank()], backend=dist.get_backend(process_group),
                           use_local_synchronization=True)
    try:
        local = copy.deepcopy(model)
        ddp = _ddp(local, alone, bucket_cap_mb)
        captured: list[ProxyBucket] = []

        def capture(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            captured.append(ProxyBucket(bucket))
            return completed(bucket.buffer())

        ddp.register_comm_hook(None, capture)
        for _ in range(2):  # DDP's first backward fills one bucket; its buckets are rebuilt after it
            captured.clear()
            loss_fn(ddp(batch[0]), batch[1]).backward()
        joined = [JoinedBucket(captured)]
        clock = device_clock(local)
        seconds = []
        for entry in entries:
            state, hook = _hook_pair(entry, local, make_optimizer, alone, seed, int(batch[0].shape[0]), 0)
            state.skip_start()
            runs = []
            for _ in range(1 + repeats):
                views = [ProxyBucket(b) for b in (joined if single_bucket(entry) else captured)]
                t = clock()
                torch.futures.wait_all([hook(state, v) for v in views])
                runs.append(clock() - t)
            state.close()
            seconds.append(min(runs[1:]))
    finally:
        dist.destroy_process_group(alone)
    return dict(zip(entries, max_over_ranks(seconds, process_group)))


def _job_on_rank(model_spec: str, batch_size: int, rank: int, world: int, data_dir: Any, seed: int):
    """``(model, batches, loss_fn, make_optimizer)`` of ``model_spec`` as rank ``rank`` of ``world`` sees
    it: a training workload's model on its first :data:`QUALITY_STEPS` training batches (augmented, in
    ``DistributedSampler`` order, as ``--algorithm auto`` measures on a job) with its recipe optimizer;
    any other spec's model on ``make_batch`` batches drawn per rank, with SGD (momentum 0.9, lr 0.01)."""
    import torch.nn.functional as F

    from ..workloads import WORKLOADS, get_workload, load_data
    from .profile import model_for_profile

    name, _, arch = model_spec.partition(":")
    if name in WORKLOADS:
        w = get_workload(name, arch or None)
        x, y, _, _ = load_data(w, data_dir)
        d = w.defaults
        torch.manual_seed(seed)
        model = w.make_model()
        batches = probe_batches(x, y, batch_size, rank, world, seed, augment=w.augment)
        return model, batches, F.cross_entropy, lambda p: w.make_optimizer(
            p, lr=d["lr"], momentum=d["momentum"], weight_decay=d["weight_decay"])
    torch.manual_seed(seed)
    model, make_batch, loss_fn = model_for_profile(model_spec, batch_size, data_dir)
    torch.manual_seed(seed + 1 + rank)
    return model, [make_batch() for _ in range(QUALITY_STEPS)], loss_fn, lambda p: torch.optim.SGD(
        p, lr=0.01, momentum=0.9)


def _loopback_rank(rank: int, world: int, port: int, model_spec: str, batch_size: int, entries: list,
                   bucket_cap_mb: Optional[float], data_dir: Any, seed: int,
                   reference_fraction: float, compression: bool, training_base: Optional[str]) -> MeasuredQuality:
    import datetime

    from ..comm.buckets import resolve_bucket_cap_mb

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        model, batches, loss_fn, make_optimizer = _job_on_rank(model_spec, batch_size, rank, world, data_dir, seed)
        cap = resolve_bucket_cap_mb("auto", model) if bucket_cap_mb is None else bucket_cap_mb
        measured = measure_quality(model, batches, loss_fn, make_optimizer, entries, cap, seed=seed,
                                   reference_fraction=reference_fraction, training_base=training_base)
        if not compression:
            return measured
        seconds = compression_seconds(model, batches[0], loss_fn, make_optimizer, entries, cap, seed=seed)
        return dataclasses.replace(measured, compression_s=seconds)
    finally:
        dist.destroy_process_group()


def measure_quality_on_loopback(model_spec: str, batch_size: int, entries: Sequence[str], world_size: int,
                                bucket_cap_mb: Optional[float] = None, data_dir: Any = None, seed: int = 0,
                                reference_fraction: float = REFERENCE_FRACTION,
                                compression: bool = False, training_base: Optional[str] = None) -> MeasuredQuality:
    """:func:`measure_quality` of ``entries`` on ``world_size`` forked Gloo ranks on 127.0.0.1 (the
    error does not depend on the network), for a model spec of
    :func:`~gradsync.profiler.profile.model_for_profile`, each rank on its own batches: a training
    workload on its first training batches as ``--algorithm auto`` sees them (:func:`probe_batches`)
    with its recipe optimizer, any other model on ``make_batch`` batches with SGD (momentum 0.9,
    learning rate 0.01; the probe does not step it). ``bucket_cap_mb`` None: the size gradsync picks for the
    model (:func:`~gradsync.comm.buckets.resolve_bucket_cap_mb`). With ``compression``, also each
    entry's :func:`compression_seconds` (on one thread per rank); with ``training_base``, errors measured while
    the copy trains on that entry (:func:`measure_quality`). What ``gradsync doctor`` and
    ``benchmarks/probe_quality.py`` measure.

    Raises:
        ValueError: for ``world_size`` < 2 or a bad model spec.
    """
    import torch.multiprocessing as mp

    from ..comm.rendezvous import free_port

    world_size = check_int("world_size", world_size, 2, 64)
    port = free_port()
    with mp.get_context("fork").Pool(world_size) as pool:
        results = pool.starmap(_loopback_rank, [(r, world_size, port, model_spec, batch_size, list(entries),
                                                 bucket_cap_mb, data_dir, seed, reference_fraction, compression,
                                                 training_base)
                                                for r in range(world_size)])
    return results[0]
