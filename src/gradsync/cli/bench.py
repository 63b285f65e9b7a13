"""``gradsync bench``: several algorithms side by side on one (emulated) network."""

from __future__ import annotations

import argparse
import sys

from .common import _add_algorithm_options, _add_network_arguments, _algorithm_values, _auto_adapt, _cluster, _rates


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..bench.config import BenchConfig
    from ..options import add_arguments

    p = sub.add_parser("bench", help="several algorithms side by side on one (emulated) network")
    add_arguments(p, BenchConfig)
    _add_network_arguments(p)
    p.add_argument("--out", default="runs/bench", help="directory for bench.json and the plots")
    p.add_argument("--table", choices=["timing", "accuracy", "quality"], default=None,
                   help="timing: iteration-time breakdown per algorithm; accuracy: time to --to-accuracy, "
                        "final accuracy, iteration time, scaling efficiency, bytes and speed-up (needs --to-accuracy); "
                        "quality: final quality, seconds to the target per seed, olympic mean, median, spread and "
                        "wins (needs --to-quality); default: quality with --to-quality, else timing")
    _add_algorithm_options(p, defaults={"ratio": "auto"})
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    import contextlib

    from ..bench.config import BenchConfig
    from ..bench.launch import RankError, run_ranks
    from ..bench.report import print_accuracy_table, print_quality_table, print_table, write_outputs
    from ..cluster import BandwidthSchedule
    from ..launch import limit_launcher_threads
    from ..options import values_from_args

    rates = _rates(args, args.hosts)
    cfg = BenchConfig(**values_from_args(BenchConfig, args), bandwidth_mbit=rates[0] if rates else None,
                      options=_auto_adapt(_algorithm_values(args), list(args.algorithms)))
    table = args.table or ("quality" if cfg.to_quality else "timing")
    if table == "accuracy" and cfg.to_accuracy is None:
        raise ValueError("table 'accuracy' needs --to-accuracy (a target test accuracy, 0-1)")
    if table == "quality" and not cfg.to_quality:
        raise ValueError("table 'quality' needs --to-quality")
    if rates is None:
        cluster, label = None, "loopback, NOT shaped (no --bandwidth)"
    else:
        cluster = _cluster(args, args.hosts, rates)
    with cluster if cluster is not None else contextlib.nullcontext():
        if cluster is not None:
            label = cluster.label
            print(f"network: {label}", flush=True)
        schedule = None
        if args.bandwidth_schedule:
            schedule = BandwidthSchedule(cluster, BandwidthSchedule.parse(args.bandwidth_schedule)).start()
        limit_launcher_threads()
        try:
            result = run_ranks(cfg, cluster)
        except RankError as exc:
            print(f"gradsync bench: error: {exc}", file=sys.stderr)
            return 1
        finally:
            if schedule is not None:
                schedule.stop()
    result["network"] = label
    if schedule is not None:
        result["bandwidth_changes"] = schedule.applied
    {"accuracy": print_accuracy_table, "quality": print_quality_table, "timing": print_table}[table](result, label)
    paths = write_outputs(result, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
