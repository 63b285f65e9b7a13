"""``gradsync simulate``: predicted iteration time and scaling efficiency from a profile."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict iteration time and scaling efficiency from a profile",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", required=True, help="profile JSON from gradsync profile")
    p.add_argument("--algorithms", default="dense,fp16,covap:4,topk:0.01,powersgd:4,dear",
                   help="plans: dense, fp16, covap:K, topk:density, powersgd:rank, dear")
    p.add_argument("--world-sizes", default="2,4,8,16,32,64,128,256")
    p.add_argument("--bandwidths", default="1000,10000,25000", help="link rates in Mbit/s (the unit of bench and profile)")
    p.add_argument("--latency-us", type=float, default=0.0, help="per-message latency alpha (microseconds)")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply the profile's compute times (e.g. 0.02 for a GPU 50x faster than the CPU "
                        "that recorded it)")
    p.add_argument("--overlap-efficiency", type=float, default=1.0,
                   help="rate (0-1] at which communication progresses while backward runs; measured ~0.56 for "
                        "4 Gloo ranks on 2 CPU cores (benchmarks/validate_simulator.py), 1 for GPUs with NICs")
    p.add_argument("--out", default="runs/simulate", help="directory for simulate.json and scaling.png")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ..sim import load_profile, plot_scaling, sweep
    from ..validation import check_float

    scale = check_float("compute_scale", args.compute_scale, 0.0, 1e6, low_inclusive=False)
    profile = load_profile(args.profile).scale_compute(scale)
    plans = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    sizes = [int(w) for w in args.world_sizes.split(",")]
    mbits = [float(b) for b in args.bandwidths.split(",")]
    bws = [b / 1000 for b in mbits]  # the cost model works in Gbit/s
    rows = sweep(profile, plans, sizes, bws, args.latency_us * 1e-6, args.overlap_efficiency)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate.json").write_text(json.dumps({"profile": args.profile, "compute_scale": scale,
                                                    "latency_s": args.latency_us * 1e-6, "rows": rows}, indent=1))
    plot_scaling(rows, out / "scaling.png", title=f"{profile.model}, compute x{scale:g}")
    names = list(dict.fromkeys(r["algorithm"] for r in rows))
    table = Table(title=(f"gradsync simulate: {profile.model}, {profile.total_bytes / 1e6:.1f} MB of gradients, "
                         f"compute {profile.compute_s * 1e3:.1f} ms/iter; cells: iteration ms (scaling efficiency)"))
    table.add_column("Mbit/s", justify="right")
    table.add_column("workers", justify="right")
    for n in names:
        table.add_column(n, justify="right")
    for bw in bws:
        for ws in sizes:
            cells = {r["algorithm"]: r for r in rows if r["bandwidth_gbps"] == bw and r["world_size"] == ws}
            table.add_row(f"{bw * 1000:g}", str(ws), *[f"{cells[n]['iteration_s'] * 1e3:.1f} ({cells[n]['scaling_efficiency'] * 100:.0f}%)"
                                               for n in names])
    Console(width=max(120, 22 * len(names) + 20)).print(table)
    print(f"wrote {out / 'simulate.json'} and {out / 'scaling.png'}")
    return 0
