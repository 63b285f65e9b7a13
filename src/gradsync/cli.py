"""The ``gradsync`` command line: ``gradsync train ...`` (see ``gradsync train --help``)."""

from __future__ import annotations

import argparse
import sys


def _ratio(value: str):
    """A number or the word ``auto``."""
    if value == "auto":
        return value
    number = float(value)
    return int(number) if number.is_integer() else number


def _add_algorithm_options(p: argparse.ArgumentParser, d) -> None:
    """Options of the algorithms, shared by ``train`` and ``bench`` (defaults from config ``d``)."""
    p.add_argument("--ratio", type=_ratio, default=d.ratio,
                   help="COVAP compression ratio K in [1, 32], or 'auto' (K = ceil(measured CCR))")
    p.add_argument("--density", type=float, default=d.density,
                   help="kept fraction for topk, randomk, dgc, redsync, in (0, 1]")
    p.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=d.error_feedback,
                   help="error feedback for the compressor-library algorithms")
    p.add_argument("--compressor", default=d.compressor, choices=["topk", "dgc", "redsync", "randomk"],
                   help="GraVAC's sparsifier")
    p.add_argument("--levels", type=int, default=d.levels, help="QSGD quantisation levels")
    p.add_argument("--rank", dest="powersgd_rank", type=int, default=d.powersgd_rank,
                   help="PowerSGD matrix approximation rank")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb, help="DDP bucket size (MB)")
    p.add_argument("--fusion-mb", type=_ratio, default=d.fusion_mb,
                   help="DeAR tensor-fusion threshold in MB, or 'auto' (Bayesian optimisation over 1-256 MB)")


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .algorithms import REGISTRY
    from .train.config import TrainConfig
    from .train.parallel import DEAR_ALGORITHMS
    from .workloads import WORKLOADS

    d = TrainConfig()
    p = sub.add_parser("train", help="data-parallel training with a gradient-synchronisation algorithm",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithm", default=d.algorithm, choices=sorted([*REGISTRY, *DEAR_ALGORITHMS]))
    p.add_argument("--workload", default=d.workload, choices=sorted(WORKLOADS))
    p.add_argument("--workers", type=int, default=d.workers,
                   help="local ranks on 127.0.0.1 (ignored under torchrun, which sets the world size)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per worker")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (one-cycle schedule)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    _add_algorithm_options(p, d)
    p.add_argument("--data-dir", default=None,
                   help="directory with the Fashion-MNIST idx files (default /usr/share/datasets/fashion-mnist)")
    p.add_argument("--out", default=None, help="write metrics.json and curves.png here")
    p.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds before a collective waiting on a dead peer fails")
    p.add_argument("--backend", default=d.backend, choices=["auto", "gloo", "nccl"])
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    from .report import print_summary, write_outputs
    from .train.config import TrainConfig
    from .train.launcher import launch
    from .workloads.fashion_mnist import DatasetMissing

    cfg = TrainConfig(
        algorithm=args.algorithm, workload=args.workload, workers=args.workers, threads=args.threads,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        max_steps=args.max_steps, ratio=args.ratio, density=args.density,
        error_feedback=args.error_feedback, compressor=args.compressor, levels=args.levels,
        powersgd_rank=args.powersgd_rank, bucket_cap_mb=args.bucket_cap_mb, fusion_mb=args.fusion_mb,
        data_dir=args.data_dir, out=args.out, timeout=args.timeout, backend=args.backend,
        progress=not args.no_progress,
    )
    if cfg.workload == "fashion-mnist":
        from .workloads import fashion_mnist

        try:  # fail before spawning workers when the data is absent
            fashion_mnist.load(cfg.data_dir, "test")
        except DatasetMissing as exc:
            print(f"gradsync: error: {exc}", file=sys.stderr)
            return 2
    result = launch(cfg)
    if result is None:
        return 0
    print_summary(result)
    if cfg.out:
        metrics, curves = write_outputs(result, cfg.out)
        print(f"wrote {metrics} and {curves}")
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench.config import BenchConfig
    from .workloads import WORKLOADS

    d = BenchConfig()
    p = sub.add_parser("bench", help="several algorithms side by side on one (emulated) network",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithms", default=",".join(d.algorithms), help="comma-separated algorithm names")
    p.add_argument("--hosts", type=int, default=d.hosts, help="emulated hosts, one rank each")
    p.add_argument("--bandwidth", default=None,
                   help="link rate in Mbit/s, or one rate per host separated by commas; "
                        "omitted: loopback, not shaped")
    p.add_argument("--bandwidth-schedule", default=None,
                   help="rate changes during the run as seconds:Mbit/s pairs, e.g. '60:50,120:500'")
    p.add_argument("--latency", type=float, default=None,
                   help="one-way delay in ms (needs the netem qdisc, which not every kernel has)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed iterations per algorithm per round")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed iterations per algorithm per round")
    p.add_argument("--rounds", type=int, default=d.rounds, help="interleaved rounds (A B C A B C ...)")
    p.add_argument("--workload", default=d.workload, choices=sorted(WORKLOADS))
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per rank")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    p.add_argument("--to-accuracy", type=float, default=None,
                   help="also train each algorithm until this test accuracy (0-1) and report the time")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--seed", type=int, default=d.seed)
    _add_algorithm_options(p, d)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--timeout", type=float, default=d.timeout, help="process-group timeout (s)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json and the plots")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    import contextlib

    from .bench.config import BenchConfig
    from .bench.launch import RankError, run_ranks
    from .bench.report import print_table, write_outputs
    from .cluster.netns import BandwidthSchedule, EmulatedCluster

    rates = None
    if args.bandwidth is not None:
        rates = [float(r) for r in str(args.bandwidth).split(",")]
        if len(rates) not in (1, args.hosts):
            raise ValueError(f"bandwidth must give one rate or {args.hosts} rates, got {len(rates)}")
    cfg = BenchConfig(
        algorithms=args.algorithms, hosts=args.hosts, bandwidth_mbit=rates[0] if rates else None,
        steps=args.steps, warmup=args.warmup, rounds=args.rounds, workload=args.workload,
        batch_size=args.batch_size, threads=args.threads, seed=args.seed, bucket_cap_mb=args.bucket_cap_mb,
        fusion_mb=args.fusion_mb, ratio=args.ratio, density=args.density, error_feedback=args.error_feedback,
        compressor=args.compressor, levels=args.levels, powersgd_rank=args.powersgd_rank,
        to_accuracy=args.to_accuracy, eval_every=args.eval_every, timeout=args.timeout, data_dir=args.data_dir)
    if rates is None:
        if args.latency is not None or args.bandwidth_schedule:
            raise ValueError("latency and bandwidth-schedule need --bandwidth (an emulated cluster)")
        cluster, label = None, "loopback, NOT shaped (no --bandwidth)"
    else:
        cluster = EmulatedCluster(args.hosts, rates if len(rates) > 1 else rates[0], latency_ms=args.latency)
    with cluster if cluster is not None else contextlib.nullcontext():
        if cluster is not None:
            label = cluster.label
            print(f"network: {label}", flush=True)
        schedule = None
        if args.bandwidth_schedule:
            schedule = BandwidthSchedule(cluster, BandwidthSchedule.parse(args.bandwidth_schedule)).start()
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
    print_table(result, label)
    paths = write_outputs(result, args.out)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
    except KeyboardInterrupt:
        print("gradsync: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
