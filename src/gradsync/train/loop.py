"""The data-parallel training loop one rank runs, with any registered algorithm (a Synchroniser)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from ..algorithms import BuildContext, Precision, build, parse_entry
from ..algorithms.synchroniser import HookSynchroniser
from ..options import AUTO
from ..profiler.auto import probe_batches, resolve_auto
from ..profiler.online import OnlineAutoState, online_auto_hook, plan_online
from ..algorithms.base import compression_ratio
from ..comm.agreement import check_config_agreement
from ..launch import rank_progress
from ..comm.buckets import bucket_overlap_warning, resolve_bucket_cap_mb
from ..profiler.ccr import measure_ccr
from ..profiler.compute import time_compute
from ..profiler.stragglers import gather_stragglers
from ..workloads import get_workload, load_data
from .checkpoint import (epoch_dir, load_checkpoint, resolve_resume, restore_training, resume_batches,
                         save_training_checkpoint, step_dir)
from .config import TrainConfig
from .evaluate import evaluate



def _probe_batches(cfg: TrainConfig, train_x: torch.Tensor, train_y: torch.Tensor, workload: Any, rank: int,
                   world: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's probe batches for auto (:func:`~gradsync.profiler.auto.probe_batches`), augmented as the
    run trains and on ``device``."""
    probe = probe_batches(train_x, train_y, cfg.batch_size, rank, world, cfg.seed,
                          augment=lambda t: workload.augment(t.to(device)))
    return [(x, y.to(device)) for x, y in probe]


def _resolve_auto(cfg: TrainConfig, model: torch.nn.Module, train_x: torch.Tensor, train_y: torch.Tensor,
                  workload: Any, loss_fn: Callable, make_optimizer: Callable, bucket_cap_mb: float, rank: int,
                  world: int, device: torch.device, job_steps: int) -> tuple[TrainConfig, dict[str, Any]]:
    """``cfg`` with ``--algorithm auto`` replaced by the setting auto chose, and the figures for the
    summary (collective). A resumed run takes the choice its checkpoint recorded (measuring again could
    choose another setting, whose state the checkpoint does not hold); a run without a checkpoint to
    resume measures and chooses (:func:`~gradsync.profiler.auto.resolve_auto`) within a share of the
    run's ``job_steps`` steps."""
    if cfg.resume:
        path = resolve_resume(cfg.resume, cfg.checkpoint, rank, world)
        if path is not None:
            recorded = load_checkpoint(path, rank, world)["config"]
            entry = ":".join([recorded["algorithm"], *(f"{k}={v}" for k, v in recorded["options"].items())])
            if rank == 0:
                print(f"auto: {entry}: the choice recorded in {path}", flush=True)
            return (dataclasses.replace(cfg, algorithm=recorded["algorithm"], options=recorded["options"]),
                    {"auto_choice": entry, "auto_reason": f"resumed from {path}"})
    probe = _probe_batches(cfg, train_x, train_y, workload, rank, world, device)
    decision = resolve_auto(model, probe, loss_fn, make_optimizer, cfg.workload,
                            cfg.batch_size, bucket_cap_mb, seed=cfg.seed, job_steps=job_steps)
    if rank == 0:
        print(f"auto: {decision.entry}: {decision.advice.reason} (measuring took "
              f"{decision.probe_seconds:.1f} s: {decision.describe_phases()})", flush=True)
    name, options = parse_entry(decision.entry)
    return dataclasses.replace(cfg, algorithm=name, options=options), decision.summary()


def _online_auto(cfg: TrainConfig, ctx: BuildContext, train_x: torch.Tensor, train_y: torch.Tensor, workload: Any,
                 loss_fn: Callable, rank: int, world: int, device: torch.device, job_steps: int) -> OnlineAutoState:
    """``--algorithm auto --auto-probe online`` (collective): the start-up measurements on copies of ``ctx.model``
    (:func:`~gradsync.profiler.online.plan_online`, within a share of the run's ``job_steps`` steps) and the
    hook state that decides on the run's own first steps. A resumed run measures the start-up again; its
    checkpoint's hook state then holds the choice (or, taken before the decision, restarts the measurement)."""
    probe = _probe_batches(cfg, train_x, train_y, workload, rank, world, device)
    plan = plan_online(ctx.model, probe, loss_fn, ctx.make_optimizer, cfg.workload, cfg.batch_size,
                       ctx.bucket_cap_mb, job_steps=job_steps, recheck_every=cfg.auto_recheck_every)
    if rank == 0:
        print(f"auto (online): base {plan.base}, metering {', '.join(plan.metered) or 'nothing'} on the first steps "
              f"(start-up {plan.setup_seconds:.1f} s)", flush=True)
    return OnlineAutoState(plan, ctx.model, seed=cfg.seed)


def continue_schedule(make: Callable[[int], Any], saved_total: int, total: int, step: int,
                      announce: bool = False) -> Any:
    """The learning-rate scheduler of a run resumed at optimizer step ``step`` whose length changed
    from ``saved_total`` steps (the checkpoint's schedule) to ``total`` (``--max-steps``/``--epochs``
    now): ``make(total)`` advanced ``step`` steps, so the schedule is defined over the new length;
    None when the length is unchanged (the restored scheduler continues as it was).

    Raises:
        ValueError: if ``step >= total``: the checkpoint is at or past the end of this run.
    """
    if step >= total:
        raise ValueError(f"resume: the checkpoint is at step {step}, and this run ends at step {total} "
                         "(--max-steps/--epochs): nothing left to train; give a larger --max-steps or --epochs "
                         "to continue it")
    if saved_total == total:
        return None
    sched = make(total)
    with warnings.catch_warnings():  # stepping the schedule without optimizer steps is the point here
        warnings.simplefilter("ignore")
        for _ in range(step):
            sched.step()
    if announce:
        print(f"resume: the run now has {total} steps (it had {saved_total}): training steps {step + 1} to "
              f"{total}, with the learning-rate schedule over {total} steps", flush=True)
    return sched


def one_cycle(optimizer: torch.optim.Optimizer, peak_lr: float, total_steps: int,
              warmup_fraction: float) -> torch.optim.lr_scheduler.OneCycleLR:
    """The recipes' learning-rate schedule (:class:`gradsync.workloads.Recipe`): one cycle over
    ``total_steps`` optimizer steps, a cosine warm-up to ``peak_lr`` over the first ``warmup_fraction``
    of them, then a cosine decay to ``peak_lr / 1e4`` (Smith & Topin 2019, arXiv:1708.07120, section 3)."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=peak_lr, total_steps=total_steps,
                                               pct_start=warmup_fraction, anneal_strategy="cos")


def run(cfg: TrainConfig, device: torch.device | None = None) -> dict[str, Any] | None:
    """Train on the already-initialised default process group; return the results on rank 0.

    Returns on rank 0 a dict with ``config``, ``summary`` (algorithm, world size, test accuracy,
    samples/s, mean iteration and compute seconds, bytes per rank per iteration, compression ratio),
    ``iterations`` (per-step loss, seconds, bytes) and ``epochs`` (test loss and accuracy); ``None``
    on other ranks.

    Raises:
        ConfigMismatchError: if ranks were started with different configurations.
        DatasetMissing: if the dataset files are absent.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = device or torch.device("cpu")
    torch.set_num_threads(cfg.threads)
    check_config_agreement(cfg.agreement_fields())

    workload = get_workload(cfg.workload, cfg.model)
    train_x, train_y, test_x, test_y = load_data(workload, cfg.data_dir)
    if cfg.train_samples is not None:
        train_x, train_y = train_x[:cfg.train_samples], train_y[:cfg.train_samples]
    if cfg.eval_samples is not None:
        test_x, test_y = test_x[:cfg.eval_samples], test_y[:cfg.eval_samples]
    sampler = DistributedSampler(TensorDataset(train_x), num_replicas=world, rank=rank,
                                 shuffle=True, seed=cfg.seed, drop_last=True)
    batches = BatchSampler(sampler, cfg.batch_size, drop_last=True)
    loader = DataLoader(TensorDataset(train_x, train_y), sampler=batches, batch_size=None)
    steps_per_epoch = len(batches)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    epochs = math.ceil(total_steps / steps_per_epoch)

    torch.manual_seed(cfg.seed)
    model = workload.make_model().to(device)

    def make_optimizer(params):
        return workload.make_optimizer(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    def loss_fn(out, y):
        return F.cross_entropy(out, y)

    precision = Precision.from_names(cfg.amp, cfg.clip_grad_norm, device)

    warm = [(train_x[i * cfg.batch_size:(i + 1) * cfg.batch_size].to(device),
             train_y[i * cfg.batch_size:(i + 1) * cfg.batch_size].to(device)) for i in range(2)]
    compute = time_compute(model, warm, loss_fn, make_optimizer, cfg.compute_steps,
                           autocast=lambda: precision.autocast(device))

    bucket_cap_mb = resolve_bucket_cap_mb(cfg.bucket_cap_mb, model)
    ctx = BuildContext(model=model, make_optimizer=make_optimizer, bucket_cap_mb=bucket_cap_mb, device=device,
                       seed=cfg.seed, batch_size=cfg.batch_size, steps_per_epoch=steps_per_epoch,
                       scaler=precision.scaler)
    requested, auto, online = cfg.algorithm, None, None
    if cfg.algorithm == AUTO and cfg.auto_probe == "online":
        online = _online_auto(cfg, ctx, train_x, train_y, workload, loss_fn, rank, world, device, total_steps)
        dp = HookSynchroniser(AUTO, ctx, online, online_auto_hook)
    else:
        if cfg.algorithm == AUTO:
            cfg, auto = _resolve_auto(cfg, model, train_x, train_y, workload, loss_fn, make_optimizer, bucket_cap_mb,
                                      rank, world, device, total_steps)
        dp = build(cfg.algorithm, ctx, cfg.options)
    algorithm = cfg.algorithm
    opt = dp.optimizer
    check_config_agreement(dp.config())
    if online is None:  # online auto's first step is its start step (DDP's bucket rebuild), and it trains
        dp.warm_up(warm, loss_fn)
    bucket_warning = None if online is not None else _bucket_warning(algorithm, dp, rank)
    ccr = None
    if dp.needs_ccr:
        ccr = measure_ccr(dp.bucket_numels(), compute.backward_s, dtype=dp.wire_dtype or torch.float32)
        chosen = dp.calibrate(ccr.ccr)
        if rank == 0:
            picked = ", ".join(f"{k} = {v}" for k, v in chosen.items() if k != "ccr")
            print(f"{algorithm}: dense all-reduce {ccr.allreduce_s * 1e3:.2f} ms, backward "
                  f"{ccr.backward_s * 1e3:.2f} ms, CCR {ccr.ccr:.3f} -> {picked}", flush=True)
        check_config_agreement(dp.config())

    def schedule(total: int) -> torch.optim.lr_scheduler.OneCycleLR:
        return one_cycle(opt, cfg.lr, total, cfg.warmup_fraction)

    sched = schedule(total_steps)

    progress = None
    if rank == 0 and cfg.progress:
        from tqdm import tqdm
        progress = tqdm(total=total_steps, desc=f"{algorithm} x{world}", unit="it", dynamic_ncols=True)

    iterations: list[dict[str, float]] = []
    epoch_log: list[dict[str, float]] = []
    start_epoch, step, train_time = 0, 0, 0.0
    ckpt = restore_training(cfg, dp, sched, precision.scaler) if cfg.resume else None
    if ckpt is not None:
        start_epoch, step, train_time = ckpt["epoch"], ckpt["step"], ckpt["train_seconds"]
        iterations, epoch_log = ckpt["iterations"], ckpt["epochs"]
        sched = continue_schedule(schedule, int(ckpt["scheduler"]["total_steps"]), total_steps, step,
                                  announce=rank == 0) or sched
        if progress is not None:
            progress.update(step)
    start_step = step
    reporter = rank_progress(step)
    stats0 = dp.stats()
    last_wire, last_payload = stats0["wire_bytes"], stats0["payload_bytes"]
    wall0 = time.perf_counter() - (iterations[-1]["wall_s"] if iterations else 0.0)
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for xb, yb in resume_batches(loader, ckpt if epoch == start_epoch else None):
            if step >= total_steps:
                break
            xb, yb = workload.augment(xb.to(device)), yb.to(device)
            t0 = time.perf_counter()
            loss = dp.train_step(xb, yb, loss_fn, precision)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            sched.step()
            train_time += dt
            step += 1
            observed = dp.observe_step(dt, cfg.batch_size)
            now = dp.stats()
            record = {"step": step, "epoch": epoch, "loss": float(loss.item()), "iter_s": dt,
                      "wire_bytes": now["wire_bytes"] - last_wire,
                      "payload_bytes": now["payload_bytes"] - last_payload, "wall_s": time.perf_counter() - wall0,
                      "lr": sched.get_last_lr()[0], **observed}
            if precision.scaler is not None:
                record["loss_scale"] = float(precision.scaler.get_scale())
            iterations.append(record)
            last_wire, last_payload = now["wire_bytes"], now["payload_bytes"]
            reporter.report(step)
            if (cfg.checkpoint and cfg.checkpoint_every and step % cfg.checkpoint_every == 0
                    and step % steps_per_epoch and step < total_steps):  # else the epoch's checkpoint
                save_training_checkpoint(step_dir(cfg.checkpoint, step), cfg, dp, sched, epoch=epoch,
                                         epoch_step=step - epoch * steps_per_epoch, step=step,
                                         train_seconds=train_time, iterations=iterations, epochs=epoch_log,
                                         scaler=precision.scaler)
            if progress is not None:
                progress.update(1)
                if step % 20 == 0:
                    progress.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
        dp.flush()
        test_loss, test_acc = evaluate(dp.module, test_x, test_y, device)
        epoch_log.append({"epoch": epoch, "step": step, "test_loss": test_loss, "test_acc": test_acc,
                          "wall_s": time.perf_counter() - wall0})
        if rank == 0:
            line = f"epoch {epoch}: test loss {test_loss:.4f}, test accuracy {test_acc * 100:.2f}%"
            if progress is not None:
                progress.write(line)
            else:
                print(line, flush=True)
        if cfg.checkpoint:
            done = step - epoch * steps_per_epoch  # batches of this epoch trained
            if done < steps_per_epoch:  # --max-steps stopped the epoch: a longer run continues it
                where, next_epoch, epoch_step = step_dir(cfg.checkpoint, step), epoch, done
            else:
                where, next_epoch, epoch_step = epoch_dir(cfg.checkpoint, epoch + 1), epoch + 1, 0
            save_training_checkpoint(where, cfg, dp, sched, epoch=next_epoch, epoch_step=epoch_step, step=step,
                                     train_seconds=train_time, iterations=iterations, epochs=epoch_log,
                                     scaler=precision.scaler)
        if step >= total_steps:
            break
    if progress is not None:
        progress.close()

    stats = dp.stats()
    wire = stats["wire_bytes"] - stats0["wire_bytes"]
    dense_wire = stats["dense_wire_bytes"] - stats0["dense_wire_bytes"]
    payload = stats["payload_bytes"] - stats0["payload_bytes"]
    run_steps = max(1, step - start_step)
    iter_times = [it["iter_s"] for it in iterations]
    summary = {
        "algorithm": requested,
        **(auto or {}), **(online.summary() if online is not None else {}),
        "world_size": world,
        "epochs": len(epoch_log),
        "steps": step,
        "test_accuracy": epoch_log[-1]["test_acc"],
        "test_loss": epoch_log[-1]["test_loss"],
        "test_samples": int(test_x.shape[0]),
        "samples_per_s": step * cfg.batch_size * world / train_time,
        "mean_iteration_s": sum(iter_times) / len(iter_times),
        "mean_compute_s": compute.step_s,
        "optimizer_s": compute.optimizer_s,
        "forward_s": compute.forward_s,
        "backward_s": compute.backward_s,
        # bytes per rank per iteration of this run: wire (what the rank puts on the network,
        # gradsync.comm.collectives.wire_bytes), its dense all-reduce reference, and payload (the
        # tensors handed to collectives); compression ratio on wire bytes
        "wire_bytes_per_iteration": wire / run_steps,
        "dense_wire_bytes_per_iteration": dense_wire / run_steps,
        "payload_bytes_per_iteration": payload / run_steps,
        "compression_ratio": compression_ratio(dense_wire, wire),
        "train_seconds": train_time,
        "wall_seconds": time.perf_counter() - wall0,
    }
    summary.update(workload.extra_metrics(summary["test_loss"], summary["test_accuracy"]))
    if ccr is not None:
        summary.update(ccr=ccr.ccr, ccr_allreduce_s=ccr.allreduce_s)
    if "covap_k" in stats:
        summary["ratio"] = stats["covap_k"]
    summary["bucket_cap_mb"] = bucket_cap_mb
    if bucket_warning is not None:
        summary["bucket_warning"] = bucket_warning
    if world > 1:  # per-rank figures and a link probe, gathered on every rank (collective)
        summary["stragglers"] = gather_stragglers(compute.step_s, summary["mean_iteration_s"])
    dp.close()  # hooks and the algorithm's own process groups go before the default group (on every rank)
    if rank != 0:
        return None
    return {"config": cfg.to_dict(), "summary": summary, "hook_stats": stats,
            "iterations": iterations, "epochs": epoch_log}


def _bucket_warning(algorithm: str, dp: Any, rank: int) -> str | None:
    """The warning when DDP's buckets (after the warm-up's rebuild) are too few for ``algorithm``'s
    compression to overlap with the backward pass (the hook's own, e.g. COVAP's, else
    :func:`~gradsync.comm.buckets.bucket_overlap_warning`; logged once on rank 0); ``None`` for
    dense all-reduce, DeAR (no DDP buckets) and one-bucket algorithms."""
    from ..algorithms import get
    from ..algorithms.synchroniser import HookSynchroniser

    own = dp.stats().get("bucket_warning")
    if own is not None or algorithm == "allreduce" or get(algorithm).single_bucket \
            or not isinstance(dp, HookSynchroniser):
        return own
    itemsize = next(p.element_size() for p in dp.module.parameters() if p.requires_grad)
    msg = bucket_overlap_warning(dp.bucket_numels(), itemsize)
    if msg is not None and rank == 0:
        logging.getLogger(__name__).warning("%s: %s", algorithm, msg)
    return msg
