"""``gradsync profile``: per-bucket sizes and backward ready times, CCR, an optional trace."""

from __future__ import annotations

import argparse

from .common import _add_model_arguments, _measure_profile


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..algorithms import REGISTRY

    p = sub.add_parser("profile", help="per-bucket sizes and backward ready times, CCR, optional trace",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_arguments(p, batch_size=64, bucket_cap_mb=0.1)
    p.add_argument("--bandwidth", type=float, default=1000.0, help="Mbit/s for the CCR estimate")
    p.add_argument("--world-size", type=int, default=2, help="world size for the CCR estimate")
    p.add_argument("--out", default="profile.json", help="profile JSON (input of gradsync simulate)")
    p.add_argument("--trace", default=None, help="also write a Chrome trace of one iteration per rank here")
    p.add_argument("--algorithm", default="allreduce", choices=sorted(n for n, a in REGISTRY.items() if a.make_hook),
                   help="communication-hook algorithm traced")
    p.add_argument("--workers", type=int, default=2, help="ranks in the traced run")
    p.add_argument("--ratio", type=int, default=3, help="COVAP K in the traced run")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..profiler.profile import ccr_at
    from ..validation import check_float, check_int

    check_int("world_size", args.world_size, 1)
    check_float("bandwidth", args.bandwidth, 0.0, 1e7, low_inclusive=False)
    prof = _measure_profile(args)
    ccr = ccr_at(prof, args.world_size, args.bandwidth)
    prof = prof.with_meta(ccr={"world_size": args.world_size, "bandwidth_mbit": args.bandwidth,
                               "dense_allreduce_ccr": ccr})
    table = Table(title=f"gradsync profile: {args.model}, batch {args.batch_size}, {args.threads} thread(s)",
                  caption=(f"forward {prof['forward_s'] * 1e3:.1f} ms, backward {prof['backward_s'] * 1e3:.1f} ms, "
                           f"optimizer {prof['optimizer_s'] * 1e3:.1f} ms; dense all-reduce CCR at "
                           f"{args.bandwidth:g} Mbit/s, {args.world_size} ranks: {ccr:.2f}"))
    for col in ("bucket", "elements", "MB", "ready after backward start (ms)"):
        table.add_column(col, justify="right")
    for b in prof["buckets"]:
        table.add_row(str(b["index"]), f"{b['numel']:,}", f"{b['numel'] * prof['dtype_bytes'] / 1e6:.3f}",
                      f"{b['ready_s'] * 1e3:.1f}")
    Console(width=120).print(table)
    prof.save(args.out)
    print(f"wrote {args.out}")
    if args.trace:
        from ..profiler.trace import run_trace

        from ..algorithms import get

        options = {"ratio": args.ratio} if "ratio" in get(args.algorithm).options.keys() else {}
        path = run_trace(args.trace, args.algorithm, args.model, workers=args.workers,
                         batch_size=args.batch_size, bucket_cap_mb=prof.meta["bucket_cap_mb"], threads=args.threads,
                         data_dir=args.data_dir, **options)
        print(f"wrote {path} (open in chrome://tracing or ui.perfetto.dev)")
    return 0
