"""``gradsync doctor``: which algorithm and options to use on a network, and why, from what it measures on the model."""

from __future__ import annotations

import argparse

from .common import _add_model_arguments, _measure_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="which algorithm and options to use on a network, and why",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_arguments(p, batch_size=32, bucket_cap_mb="auto")
    p.add_argument("--bandwidth", type=float, required=True, help="link rate of each rank in Mbit/s (> 0)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the training job (>= 2)")
    p.add_argument("--latency-us", type=float, default=0.0, help="per-message latency alpha (microseconds)")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply the measured (CPU) compute times, e.g. 0.02 for GPUs 50x faster than this CPU")
    p.add_argument("--quality-ranks", type=int, default=2,
                   help="loopback ranks that measure each lossy setting's error on this model's gradients "
                        "(0: measure nothing; lossy settings are then 'not measured')")
    p.add_argument("--optimizer", default=None,
                   help="the optimizer the job trains with (a torch.optim class name, e.g. SGD, AdamW): its family's "
                        "limit on the compression error applies; default: a workload's recipe optimizer, for any "
                        "other model the strictest family's limit")
    p.add_argument("--json", default=None, help="also write the profile, every prediction and the advice here")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    """Measure the model here, simulate every candidate on the given network and recommend one
    (:func:`gradsync.profiler.advise.advise`)."""
    import dataclasses
    import json

    from rich.console import Console
    from rich.table import Table

    import time

    from ..profiler.advise import advise, periodic_predictions, train_command, worth_measuring
    from ..profiler.probe import measure_quality_on_loopback
    from ..profiler.quality_model import optimizer_family
    from ..workloads import WORKLOADS
    from ..validation import check_float, check_int

    check_float("--bandwidth", args.bandwidth, 0.0, 1e7, low_inclusive=False)
    check_int("--world-size", args.world_size, 2)
    check_float("--latency-us", args.latency_us, 0.0, 1e7)
    scale = check_float("--compute-scale", args.compute_scale, 0.0, 1e6, low_inclusive=False)
    quality_ranks = check_int("--quality-ranks", args.quality_ranks, 0, 64)
    if quality_ranks == 1:
        raise ValueError("--quality-ranks must be 0 (measure nothing) or an integer >= 2; got 1")
    prof = _measure_profile(args).scale_compute(scale)
    simulated = advise(prof, args.world_size, args.bandwidth, latency_s=args.latency_us * 1e-6)
    errors, noise, family, spent, overheads = {}, None, None, None, {}
    if quality_ranks:
        worth = worth_measuring(simulated)
        t0 = time.perf_counter()
        if worth:
            quality = measure_quality_on_loopback(args.model, args.batch_size, worth, quality_ranks,
                                                  prof.meta["bucket_cap_mb"], args.data_dir, compression=True)
            errors, noise = quality.errors, quality.noise
            overheads = {e: s * scale for e, s in quality.compression_s.items()}
            if args.model.partition(":")[0] in WORKLOADS:
                family = quality.family
        spent = time.perf_counter() - t0
    if args.optimizer is not None:
        family = optimizer_family(args.optimizer)
    advice = advise(prof, args.world_size, args.bandwidth, errors=errors, latency_s=args.latency_us * 1e-6,
                    noise=noise, family=family, probe_seconds=spent, overheads=overheads)
    command = train_command(advice.choice.entry, prof.meta["bucket_cap_mb"])
    measured = "measured here" + (f" x {scale:g}" if scale != 1 else "")
    table = Table(title=(f"gradsync doctor: {args.model}, batch {args.batch_size}, {args.world_size} ranks at "
                         f"{args.bandwidth:g} Mbit/s"),
                  caption=(f"{measured}: forward {prof.forward_s * 1e3:.1f} ms, backward "
                           f"{prof.backward_s * 1e3:.1f} ms, {len(prof.buckets)} buckets, {prof.total_bytes / 1e6:.2f} "
                           f"MB of gradients; modelled dense all-reduce {advice.dense_allreduce_s * 1e3:.1f} ms: "
                           f"CCR {advice.ccr:.2f}; errors and each hook's compression time (in ms/iter) measured on "
                           f"{quality_ranks} loopback ranks"))
    for col, justify in (("setting", "left"), ("ms/iter", "right"), ("vs DDP", "right"),
                         ("accuracy cost", "left"), ("to quality", "right")):
        table.add_column(col, justify=justify)
    ddp = next(r for r in advice.predictions if r.entry == "allreduce")
    for r in advice.predictions:
        ttq = ("?" if not r.measured else "missed" if r.time_to_quality_s == float("inf")
               else f"{ddp.time_to_quality_s / r.time_to_quality_s:.2f}x")
        table.add_row(("-> " if r is advice.choice else "") + r.label, f"{r.iteration_s * 1e3:.1f}",
                      f"{r.speedup:.2f}x", r.cost, ttq, style="bold" if r is advice.choice else None)
    # local-sgd and diloco: shown with their predicted iteration, never ranked (their extra steps are unknown)
    periodic = periodic_predictions(prof, args.world_size, args.bandwidth, latency_s=args.latency_us * 1e-6)
    table.add_section()
    for r in periodic:
        table.add_row(r.label, f"{r.iteration_s * 1e3:.1f}", f"{r.speedup:.2f}x", r.cost, "?")
    console = Console()
    console.print(table)
    console.print(f"[bold]Recommendation:[/bold] {advice.choice.label}: {command}")
    console.print(f"[bold]Why:[/bold] {advice.reason}", highlight=False)
    for note in advice.notes:
        console.print(f"note: {note}", highlight=False)
    if args.json:
        out = {"model": args.model, "batch_size": args.batch_size, "threads": args.threads, "compute_scale": scale,
               "bucket_cap_mb": prof.meta["bucket_cap_mb"], "profile": prof.to_dict(), **advice.to_dict(),
               "errors": errors, "noise": noise, "optimizer_family": family, "compression_s": overheads,
               "quality_ranks": quality_ranks, "command": command,
               "periodic": [dataclasses.asdict(r) for r in periodic]}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")
    return 0
