"""The per-rank side of ``gradsync bench``: time every algorithm on one process group, interleaved.

Every rank runs ``run_bench(cfg)`` after ``init_process_group``. For each round, each algorithm in
turn trains a fresh copy of the same model (same seed) for ``warmup`` untimed and ``steps`` timed
iterations on the same batches; a compute-only pass (all ranks computing at once, no communication,
so CPU contention on one machine matches the communicating runs) is timed in every round too.
Run as ``python -m gradsync.bench.worker CONFIG.json RESULT.json`` with the torch.distributed
environment variables set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 writes the result.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.agreement import check_config_agreement
from ..comm.futures import shutdown_process_group
from ..launch import write_result
from ..options import AUTO
from ..profiler.auto import resolve_auto
from ..profiler.online import OnlineAutoState, online_auto_hook, plan_online
from ..profiler.probe import QUALITY_STEPS, START_STEPS
from ..profiler.ccr import measure_ccr, time_dense_rs_ag
from ..profiler.compute import time_compute
from ..profiler.profile import record_profile
from ..train.evaluate import evaluate
from ..algorithms import BuildContext, Synchroniser, build
from ..algorithms.synchroniser import HookSynchroniser
from ..algorithms.base import compression_ratio
from ..workloads import get_workload
from .config import BenchConfig, parse_entry


def _batches(x: torch.Tensor, y: torch.Tensor, rank: int, world: int, n: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    idx = torch.randperm(x.shape[0], generator=g)[: n * batch]
    return [(x[idx[i * batch:(i + 1) * batch]], y[idx[i * batch:(i + 1) * batch]]) for i in range(n)]


def _train_steps(dp: Synchroniser, batches, loss_fn, times: list[float] | None,
                 ks: list[int] | None = None) -> None:
    """Train on ``batches``; append each step's seconds to ``times`` and, with ``ks``, the COVAP
    ratio K the step used (``stats()["covap_k"]``)."""
    for x, y in batches:
        t0 = time.perf_counter()
        dp.train_step(x, y, loss_fn)
        if times is not None:
            times.append(time.perf_counter() - t0)
        if ks is not None:
            ks.append(int(dp.stats()["covap_k"]))


def _summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10) if len(values) >= 2 else [values[0]] * 9
    return {"median": statistics.median(values), "p10": q[0], "p90": q[-1], "mean": statistics.fmean(values)}


def budget_steps(cfg: BenchConfig, train_samples: int, world: int) -> int:
    """Iterations of ``cfg``'s ``--to-quality`` budget: ``cfg.epochs`` passes over the first
    ``cfg.train_samples`` of ``train_samples`` training samples at ``cfg.batch_size`` per rank on
    ``world`` ranks.

    Raises:
        ValueError: if the samples do not give every rank one batch.
    """
    n = train_samples if cfg.train_samples is None else min(train_samples, cfg.train_samples)
    per_epoch = n // world // cfg.batch_size
    if per_epoch < 1:
        raise ValueError(f"train_samples ({n}) must give every rank at least one batch of batch_size {cfg.batch_size}")
    return cfg.epochs * per_epoch


def run_bench(cfg: BenchConfig) -> dict[str, Any] | None:
    """Benchmark ``cfg.algorithms`` on the initialised default group; rank 0 returns the results.

    Raises:
        ConfigMismatchError: if the ranks were given different configurations.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.threads)
    check_config_agreement(json.loads(cfg.to_json()))
    workload = get_workload(cfg.workload, cfg.model)
    train_x, train_y, test_x, test_y = workload.load(cfg.data_dir)
    torch.manual_seed(cfg.seed)
    model0 = workload.make_model()
    n_batches = cfg.warmup + cfg.steps + 2
    batches = _batches(train_x, train_y, rank, world, n_batches, cfg.batch_size, cfg.seed)
    # the recipe's augmentation, once, outside every timer: the timed steps (and auto's measurements on them)
    # see the gradients training sees (on the MobileNetV2 PowerSGD r=4's error-to-noise ratio was 0.90 on raw
    # batches, 0.82 on the augmented ones the quality model's probe measured)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.seed * 1000 + rank)
        batches = [(workload.augment(x), y) for x, y in batches]

    def loss_fn(out, y):
        return F.cross_entropy(out, y)

    def make_optimizer(params):  # the recipe's optimizer settings (SGD: Nesterov momentum, L2 weight decay)
        return workload.make_optimizer(params, lr=cfg.lr, momentum=workload.recipe.momentum,
                                       weight_decay=workload.recipe.weight_decay)

    def make(name: str, model: torch.nn.Module | None = None, seed: int | None = None,
             job: bool = False) -> Synchroniser:
        """A fresh copy of ``model`` (default: this run's start model) under ``--algorithms`` entry
        ``name``, calibrated with this run's CCR. With ``job`` (a to-quality run) ``auto`` under
        ``--auto-probe online`` decides on that run's own steps (a fresh
        :class:`~gradsync.profiler.online.OnlineAutoState` of this run's plan); otherwise it is the entry
        chosen in the timing rounds."""
        ctx = BuildContext(model=copy.deepcopy(model0 if model is None else model), make_optimizer=make_optimizer,
                           bucket_cap_mb=cfg.bucket_cap_mb, seed=cfg.seed if seed is None else seed,
                           batch_size=cfg.batch_size)
        if name == AUTO and job and online is not None:
            return HookSynchroniser(AUTO, ctx, OnlineAutoState(online, ctx.model, seed=ctx.seed), online_auto_hook)
        entry = chosen[AUTO]["entry"] if name == AUTO else name
        dp = build(parse_entry(entry)[0], ctx, cfg.algorithm_options(entry))
        if dp.needs_ccr:
            chosen[name] = {**chosen.get(name, {}), **dp.calibrate(ccr_for(dp.wire_dtype).ccr)}
        return dp

    def ccr_for(dtype: torch.dtype | None):
        """The CCR with the buckets sent in ``dtype`` (an algorithm that casts, e.g. COVAP's
        ``cast``); measured once per dtype, collectively (every rank builds the same algorithms)."""
        if dtype is None or dtype == torch.float32:
            return ccr
        if dtype not in ccr_by_dtype:
            ccr_by_dtype[dtype] = measure_ccr(bucket_numels, compute0.backward_s, dtype=dtype)
        return ccr_by_dtype[dtype]

    # Dense all-reduce CCR on this network: what "auto" settings are chosen from, and a report figure.
    chosen: dict[str, dict[str, Any]] = {}
    dist.barrier()
    compute0 = time_compute(model0, batches, loss_fn, make_optimizer, steps=5)
    probe = build("allreduce", BuildContext(model=copy.deepcopy(model0), make_optimizer=make_optimizer,
                                            bucket_cap_mb=cfg.bucket_cap_mb))
    probe.warm_up(batches[:2], loss_fn)
    bucket_numels = probe.bucket_numels()  # after DDP's bucket rebuild: the layout the hooks see
    ccr = measure_ccr(bucket_numels, compute0.backward_s)
    ccr_by_dtype: dict[torch.dtype, Any] = {}
    rs_ag_s = time_dense_rs_ag(sum(probe.bucket_numels()))

    # A compute profile recorded with all ranks computing at once: gradsync simulate's input for
    # validating its prediction against this run.
    dist.barrier()
    it = iter(batches * 4)
    profile = record_profile(copy.deepcopy(model0), lambda: next(it), loss_fn, make_optimizer, cfg.workload,
                             cfg.batch_size, cfg.bucket_cap_mb, iterations=5)
    online = None
    if AUTO in cfg.algorithms and cfg.auto_probe == "online":
        # measured on the auto entry's own first steps in round 1 (_online_auto); here only the start-up part
        online = plan_online(model0, batches[:QUALITY_STEPS], loss_fn, make_optimizer, cfg.workload, cfg.batch_size,
                             cfg.bucket_cap_mb, job_steps=budget_steps(cfg, train_x.shape[0], world))
    elif AUTO in cfg.algorithms:  # the choice from this run's profile, network and gradients (every rank the same)
        # what --algorithm auto does in a job (its own profile, dense all-reduce and probe), so that
        # probe_seconds is what measuring costs a job on this network; the job is the --to-quality budget
        decision = resolve_auto(model0, batches[:QUALITY_STEPS], loss_fn, make_optimizer,
                                cfg.workload, cfg.batch_size, cfg.bucket_cap_mb, seed=cfg.seed,
                                job_steps=budget_steps(cfg, train_x.shape[0], world))
        chosen[AUTO] = {"entry": decision.entry, "reason": decision.advice.reason,
                        "errors": decision.errors, "noise": decision.noise, "iterations_s": decision.iterations,
                        "probe_seconds": decision.probe_seconds, "probe_phases_s": decision.phases,
                        "probe_budget_s": decision.budget_s, "timed_steps": decision.timed_steps}
        if rank == 0:
            print(f"auto: {decision.entry}: {decision.advice.reason} (measuring took {decision.probe_seconds:.1f} s: "
                  f"{decision.describe_phases()})", flush=True)

    records: dict[str, dict[str, list[float]]] = {
        a: {"iter_s": [], "wire_bytes": [], "payload_bytes": [], "dense_wire_bytes": [], "compress_s": [],
            "rs_wait_s": [], "ag_wait_s": [], "coding_s": [], "covap_k": []}
        for a in cfg.algorithms
    }
    compute_steps: list[float] = []
    for rnd in range(cfg.rounds):
        dist.barrier()
        t = time_compute(model0, batches[2:], loss_fn, make_optimizer, steps=cfg.steps)
        compute_steps.append(t.step_s + t.optimizer_s)
        for name in cfg.algorithms:
            dist.barrier()
            if name == AUTO and online is not None and rnd == 0:
                dp = _online_auto(online, model0, make_optimizer, cfg, batches[2:], loss_fn, chosen)
            else:
                dp = make(name)
                dp.warm_up(batches[:2], loss_fn)
            _train_steps(dp, batches[2:2 + cfg.warmup], loss_fn, None)
            s0 = dp.stats()
            times: list[float] = []
            _train_steps(dp, batches[2 + cfg.warmup:], loss_fn, times,
                         records[name]["covap_k"] if "covap_k" in s0 else None)
            dp.flush()
            s1 = dp.stats()
            rec = records[name]
            rec["iter_s"].extend(times)
            n = len(times)
            for key in ("wire_bytes", "payload_bytes", "dense_wire_bytes"):
                rec[key].append((s1[key] - s0[key]) / n)
            rec["compress_s"].append((s1["compress_seconds"] - s0["compress_seconds"]) / n)
            rec["rs_wait_s"].append((s1.get("rs_wait_seconds", 0.0) - s0.get("rs_wait_seconds", 0.0)) / n)
            rec["ag_wait_s"].append((s1.get("ag_wait_seconds", 0.0) - s0.get("ag_wait_seconds", 0.0)) / n)
            rec["coding_s"].append((s1.get("coding_seconds", 0.0) - s0.get("coding_seconds", 0.0)) / n)
            if rank == 0:
                print(f"round {rnd + 1}/{cfg.rounds} {name}: median {statistics.median(times) * 1e3:.1f} ms",
                      flush=True)
            dp.close()

    accuracy = (_time_to_accuracy(cfg, workload, make, train_x, train_y, test_x, test_y, loss_fn)
                if cfg.to_accuracy else {})
    quality = (_time_to_quality(cfg, workload, functools.partial(make, job=True), train_x, train_y, test_x, test_y,
                                loss_fn) if cfg.to_quality else None)
    if rank != 0:
        return None
    compute_s = statistics.median(compute_steps)
    if online is not None:  # the probe's cost: start-up, and its steps beyond the settled setting's
        auto = chosen[AUTO]
        settled = statistics.median(records[AUTO]["iter_s"])
        auto["probe_seconds"] = auto["setup_seconds"] + sum(auto["online_steps_s"]) - len(auto["online_steps_s"]) * settled
    base = statistics.median(records[cfg.algorithms[0]]["iter_s"])
    if "allreduce" in records:
        base = statistics.median(records["allreduce"]["iter_s"])
    rows = []
    for name in cfg.algorithms:
        rec = records[name]
        it = _summary(rec["iter_s"])
        compress = statistics.median(rec["compress_s"])
        rows.append({
            "algorithm": name,
            "iteration_s": it,
            "speedup_vs_allreduce": base / it["median"],
            "scaling_efficiency": compute_s / it["median"],
            "exposed_comm_s": max(0.0, it["median"] - compute_s - compress),
            "compression_overhead_s": compress,
            # per rank per iteration: wire bytes (gradsync.comm.collectives.wire_bytes), the tensors
            # handed to collectives, and a dense ring all-reduce's wire bytes; ratio on wire bytes
            "wire_bytes_per_iteration": statistics.median(rec["wire_bytes"]),
            "payload_bytes_per_iteration": statistics.median(rec["payload_bytes"]),
            "dense_wire_bytes_per_iteration": statistics.median(rec["dense_wire_bytes"]),
            "compression_ratio": compression_ratio(statistics.median(rec["dense_wire_bytes"]),
                                                   statistics.median(rec["wire_bytes"])),
            "options": {**cfg.algorithm_options(chosen[AUTO]["entry"] if name == AUTO else name).to_dict(), **{
                k: v for k, v in chosen.get(name, {}).items() if k != "ccr"}},
            "rs_wait_s": statistics.median(rec["rs_wait_s"]),
            "ag_wait_s": statistics.median(rec["ag_wait_s"]),
            "coding_s": statistics.median(rec["coding_s"]),
            "iteration_samples_s": rec["iter_s"],
            **({"covap_k": rec["covap_k"]} if rec["covap_k"] else {}),
            **({"time_to_accuracy": accuracy[name]} if name in accuracy else {}),
        })
    return {
        "config": json.loads(cfg.to_json()),
        "world_size": world,
        "compute_only_s": compute_s,
        "compute_only_rounds_s": compute_steps,
        "forward_s": compute0.forward_s,
        "backward_s": compute0.backward_s,
        "dense_allreduce_s": ccr.allreduce_s,
        "dense_ccr": ccr.ccr,
        "dense_rs_ag_s": rs_ag_s,
        "chosen_from_ccr": chosen,
        "rows": rows,
        "profile": profile.to_dict(),
        **({"quality": quality} if quality is not None else {}),
    }


def _online_auto(plan: Any, model0: torch.nn.Module, make_optimizer: Callable, cfg: BenchConfig, batches: list,
                 loss_fn: Callable, chosen: dict) -> Synchroniser:
    """The ``auto`` entry decided on its own first steps (:mod:`gradsync.profiler.online`): a copy of
    ``model0`` trains under :class:`~gradsync.profiler.online.OnlineAutoState` on ``batches`` (cycled) until
    it settles (after its start step, DDP's bucket rebuild, run untimed as every entry's warm-up); each of
    those steps' seconds and the decision go to ``chosen[AUTO]``. Returns the synchroniser,
    settled, to be timed like any entry (later rounds build the chosen entry itself)."""
    ctx = BuildContext(model=copy.deepcopy(model0), make_optimizer=make_optimizer, bucket_cap_mb=cfg.bucket_cap_mb,
                       seed=cfg.seed, batch_size=cfg.batch_size)
    state = OnlineAutoState(plan, ctx.model, seed=cfg.seed)
    dp = HookSynchroniser(AUTO, ctx, state, online_auto_hook)
    dp.warm_up(batches[:START_STEPS], loss_fn)  # its start step (DDP's bucket rebuild), untimed as every entry's warm-up
    times: list[float] = []
    step = 0
    while state.phase != "settled":
        _train_steps(dp, [batches[step % len(batches)]], loss_fn, times)
        step += 1
    chosen[AUTO] = {"entry": state.choice, "reason": state.reason, "errors": state.errors, "noise": state.noise,
                    "iterations_s": state.medians, "probe": "online", "setup_seconds": plan.setup_seconds,
                    "setup_phases_s": plan.phases, "online_steps_s": times, "metered": list(plan.metered),
                    "compression_s": state.overheads,
                    "probe_budget_s": None if math.isinf(plan.budget_s) else plan.budget_s}
    if dist.get_rank() == 0:
        print(f"auto (online): {state.choice} after {step} steps: {state.reason} (start-up "
              f"{plan.setup_seconds:.1f} s: {', '.join(f'{k} {v:.1f} s' for k, v in plan.phases.items())})",
              flush=True)
    return dp


def run_order(seeds: list[int], entries: list[str], dense: str | None = None) -> list[tuple[int, str]]:
    """``(seed, entry)`` pairs in the order a to-quality bench trains them. Where the target comes from
    the ``dense`` entry's runs, every seed of it first, then every seed of each other entry; else seed
    by seed, each seed's ``entries`` back to back, so a slow spell of the machine falls on every entry
    alike, not on the one that ran then."""
    if dense is not None:
        return [(s, n) for n in [dense] + [e for e in entries if e != dense] for s in seeds]
    return [(s, n) for s in seeds for n in entries]


def _seed_entries(cfg: BenchConfig, workload: Any, make: Callable[..., Any], dense: str | None = None):
    """For each seed of ``cfg.accuracy_seeds()``, each entry of ``cfg.algorithms`` built from that seed's
    start model, in :func:`run_order`: yields ``(seed, name, dp, g)`` with ``g`` the seed's data-order
    generator, so every entry of a seed starts from the same model and sees the same batches."""
    for seed, name in run_order(cfg.accuracy_seeds(), cfg.algorithms, dense):
        torch.manual_seed(seed)
        model = workload.make_model()
        g = torch.Generator().manual_seed(seed + 17)
        dist.barrier()
        yield seed, name, make(name, model, seed), g


def _time_to_accuracy(cfg, workload, make, train_x, train_y, test_x, test_y, loss_fn):
    """Train each entry of ``cfg.algorithms`` once per seed of ``cfg.accuracy_seeds()`` (the seed
    sets the start model, the data order and the algorithm's randomness; every entry of a seed starts
    from the same model and sees the same batches) until test accuracy on the full test set (evaluated
    every ``eval_every`` steps, evaluation time excluded; the first ``eval_samples`` test samples
    when given) reaches ``cfg.to_accuracy``, or ``max_accuracy_steps``.

    Returns per entry ``{"seconds": median over seeds or None, "steps": median steps, "seeds": [...],
    "seconds_by_seed": [float | None, ...], "steps_by_seed": [...], "final_accuracy_by_seed": [...],
    "curve": the first seed's [(train_seconds, accuracy), ...], "curves": one per seed}``. The median
    counts a seed that did not reach the target as slower than any that did; it is None when half or
    more of the seeds did not reach it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.eval_samples is not None:
        test_x, test_y = test_x[:cfg.eval_samples], test_y[:cfg.eval_samples]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cfg.algorithms}
    for seed, name, dp, g in _seed_entries(cfg, workload, make):
        shard = torch.randperm(train_x.shape[0], generator=g)[rank::world]
        elapsed, steps, curve, reached = 0.0, 0, [], None
        while steps < cfg.max_accuracy_steps and reached is None:
            for i in range(cfg.eval_every):
                lo = ((steps + i) * cfg.batch_size) % (shard.numel() - cfg.batch_size)
                idx = shard[lo:lo + cfg.batch_size]
                t0 = time.perf_counter()
                dp.train_step(train_x[idx], train_y[idx], loss_fn)
                elapsed += time.perf_counter() - t0
            steps += cfg.eval_every
            dp.flush()
            _, acc = evaluate(dp.module, test_x, test_y, torch.device("cpu"))
            curve.append((elapsed, acc))
            if acc >= cfg.to_accuracy:
                reached = elapsed
        runs[name].append({"seconds": reached, "steps": steps, "curve": curve})
        if rank == 0:
            print(f"seed {seed} {name}: "
                  + (f"{cfg.to_accuracy:.0%} after {reached:.1f} s ({steps} steps)" if reached is not None
                     else f"{cfg.to_accuracy:.0%} not reached in {steps} steps ({acc:.1%})"), flush=True)
        dp.close()
    return {name: _accuracy_summary(cfg.accuracy_seeds(), r) for name, r in runs.items()}


def _time_to_quality(cfg, workload, make, train_x, train_y, test_x, test_y, loss_fn) -> dict[str, Any]:
    """Train each entry of ``cfg.algorithms`` for the whole budget (``cfg.epochs`` passes over the first
    ``cfg.train_samples`` training samples) once per seed of ``cfg.accuracy_seeds()`` with the recipe's
    one-cycle schedule (peak ``cfg.lr``, warm-up fraction of the recipe); every entry of a seed starts
    from the same model and sees the same batches (a fresh permutation per epoch, rank ``r`` taking
    every world-th sample). Quality (test accuracy, or bits per character when ``cfg.higher_is_better()``
    is False) is measured on the full test set (the first ``eval_samples`` when given): every
    ``eval_every`` steps a cheap evaluation on :data:`~gradsync.bench.quality.GATE_SAMPLES` test samples
    spread evenly over the test set (every n-th: the first ones of fashion-mnist score 1-2 points above
    the whole set)
    and a copy of the model, then the full evaluations :func:`~gradsync.bench.quality.lazy_curve`
    picks once the target is known (the dense entry runs all its seeds first when the target comes
    from it; with a given target each seed runs every entry back to back, so a slow spell of the machine
    falls on the entries alike, not on the one that ran then); the final quality is always a full evaluation. Evaluations are all-reduced and the step
    count fixed, so every rank runs the same collectives. Model copies are held in host memory until
    the target is known (the dense entry's: every seed's, one per evaluation step).

    Returns :func:`gradsync.bench.quality.summarise_quality` of the curves plus ``"metric"``,
    ``"budget_steps"``, ``"epochs"``, ``"train_samples"``, ``"warmup_fraction"``, ``"curves"``
    (per entry, per seed the full evaluations ``[[steps, training seconds, quality], ...]``),
    ``"cheap_curves"`` (the cheap evaluation at every evaluation step, same layout) and
    ``"cheap_samples"`` (None when the test set is small enough to evaluate in full every time) and, where
    ``auto`` decided on its own steps (``--auto-probe online``), ``"auto_decisions"`` (per seed its
    :meth:`~gradsync.profiler.online.OnlineAutoState.summary`; its training seconds start at the plan's
    start-up seconds, which such a job pays before its first step).
    """
    from ..train.loop import one_cycle
    from .quality import GATE_SAMPLES, default_target, lazy_curve, summarise_quality

    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.train_samples is not None:
        train_x, train_y = train_x[:cfg.train_samples], train_y[:cfg.train_samples]
    if cfg.eval_samples is not None:
        test_x, test_y = test_x[:cfg.eval_samples], test_y[:cfg.eval_samples]
    total = budget_steps(cfg, train_x.shape[0], world)
    per_epoch = total // cfg.epochs
    higher = cfg.higher_is_better()
    stride = test_x.shape[0] // GATE_SAMPLES
    cheap_n = GATE_SAMPLES if stride >= 2 else None
    cpu = torch.device("cpu")

    def quality(model, cheap_only: bool = False) -> float:
        x, y = (test_x[::stride][:GATE_SAMPLES], test_y[::stride][:GATE_SAMPLES]) if cheap_only else (test_x, test_y)
        loss, acc = evaluate(model, x, y, cpu)
        return acc if higher else loss / math.log(2)

    seeds = cfg.accuracy_seeds()
    dense = cfg.dense_entry() if cfg.quality_target is None else None
    target = cfg.quality_target
    curves: dict[str, list[Any]] = {name: [None] * len(seeds) for name in cfg.algorithms}
    cheap: dict[str, list[Any]] = {name: [None] * len(seeds) for name in cfg.algorithms}
    pending: list[tuple[str, int, list[dict[str, torch.Tensor]], float]] = []
    dense_finals: list[float] = []
    decisions: list[Any] = [None] * len(seeds)  # an online auto job's decision, per seed

    def resolve(name: str, k: int, snapshots: list[dict[str, torch.Tensor]], final: float) -> None:
        with torch.random.fork_rng():
            scratch = workload.make_model()

        def full(i: int) -> float:
            if i == len(snapshots):
                return final
            scratch.load_state_dict(snapshots[i])
            return quality(scratch)
        curves[name][k] = lazy_curve(cheap[name][k], target, higher, full)

    for seed, name, dp, g in _seed_entries(cfg, workload, make, dense):
        k = seeds.index(seed)
        sched = one_cycle(dp.optimizer, cfg.lr, total, workload.recipe.warmup_fraction)
        torch.manual_seed(seed * 1000 + rank)  # the same augmentation for every entry of the seed
        online = dp.state if isinstance(getattr(dp, "state", None), OnlineAutoState) else None
        # an online auto job pays its start-up measurements (the plan's, once per job) before its first step
        elapsed, points, snapshots = (online.plan.setup_seconds if online else 0.0), [], []
        for epoch in range(cfg.epochs):
            shard = torch.randperm(train_x.shape[0], generator=g)[rank::world]
            for i in range(per_epoch):
                idx = shard[i * cfg.batch_size:(i + 1) * cfg.batch_size]
                x = workload.augment(train_x[idx])
                t0 = time.perf_counter()
                dp.train_step(x, train_y[idx], loss_fn)
                sched.step()
                elapsed += time.perf_counter() - t0
                step = epoch * per_epoch + i + 1
                if step % cfg.eval_every == 0 or step == total:
                    dp.flush()
                    if step == total:
                        final = quality(dp.module)
                        points.append([step, elapsed, final if cheap_n is None else quality(dp.module, True)])
                    elif cheap_n is None:
                        points.append([step, elapsed, quality(dp.module)])
                    else:
                        points.append([step, elapsed, quality(dp.module, True)])
                        snapshots.append({n: t.detach().to(cpu, copy=True) for n, t in dp.module.state_dict().items()})
        cheap[name][k] = points
        if online is not None:
            decisions[k] = online.summary()
        dp.close()
        if cheap_n is None:
            curves[name][k] = [list(p) for p in points]
        elif target is None:
            pending.append((name, k, snapshots, final))
        else:
            resolve(name, k, snapshots, final)
        if rank == 0:
            print(f"seed {seed} {name}: {total} steps, {elapsed:.1f} s, final {workload.metric} {final:.4f}", flush=True)
        if name == dense:
            dense_finals.append(final)
        if target is None and name == dense and k == len(seeds) - 1:
            target = default_target(dense_finals, higher)
            for run in pending:
                resolve(*run)
            pending.clear()
    summary = summarise_quality(curves, seeds, higher, cfg.quality_target, dense)
    return {**summary, "metric": workload.metric, "budget_steps": total, "epochs": cfg.epochs,
            "train_samples": int(train_x.shape[0]), "warmup_fraction": workload.recipe.warmup_fraction,
            "curves": curves, "cheap_curves": cheap, "cheap_samples": cheap_n,
            **({"auto_decisions": decisions} if any(decisions) else {})}


def _accuracy_summary(seeds: list[int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [r["seconds"] for r in runs]
    median = statistics.median(math.inf if s is None else s for s in seconds)
    return {
        "seconds": None if math.isinf(median) else median,
        "steps": statistics.median(r["steps"] for r in runs),
        "seeds": list(seeds),
        "seconds_by_seed": seconds,
        "steps_by_seed": [r["steps"] for r in runs],
        "final_accuracy_by_seed": [r["curve"][-1][1] for r in runs],
        "curve": runs[0]["curve"],
        "curves": [r["curve"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point for one rank: ``python -m gradsync.bench.worker CONFIG.json RESULT.json``."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = BenchConfig.from_json(open(argv[0]).read())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    try:
        result = run_bench(cfg)
    finally:
        shutdown_process_group()
    if result is not None:
        write_result(argv[1], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
