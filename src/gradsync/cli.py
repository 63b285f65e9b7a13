"""The ``gradsync`` command line: ``train``, ``bench``, ``profile``, ``doctor``, ``simulate``
(see ``gradsync CMD --help``)."""

from __future__ import annotations

import argparse
import sys


def _add_algorithm_options(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One flag per option of every registered algorithm (an option shared by several algorithms is
    one flag); a flag not given leaves the algorithm's own default."""
    from .algorithms import REGISTRY
    from .options import add_arguments

    group = p.add_argument_group("algorithm options (each applies to the algorithms that take it)")
    seen: set[str] = set()
    for spec in REGISTRY.values():
        add_arguments(group, spec.options, use_defaults=False, seen=seen, defaults=defaults)


def _algorithm_values(args: argparse.Namespace) -> dict:
    """The algorithm options given on the command line."""
    from .algorithms import REGISTRY

    keys = {k for spec in REGISTRY.values() for k in spec.options.keys()}
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _auto_adapt(options: dict, algorithms: list[str]) -> dict:
    """``--ratio auto`` on the command line also follows the network: COVAP's ``adapt_every``
    defaults to :data:`~gradsync.algorithms.covap.AUTO_ADAPT_EVERY` steps there (the library's
    default is 0, K fixed) when an algorithm of the run takes it and it was not given. ``algorithms``
    are ``--algorithms`` entries (:func:`gradsync.algorithms.parse_entry`).

    Raises:
        ValueError: for an entry naming no registered algorithm (see :func:`parse_entry`).
    """
    from .algorithms import REGISTRY, parse_entry
    from .algorithms.covap import AUTO_ADAPT_EVERY

    if (options.get("ratio") == "auto" and "adapt_every" not in options
            and any("adapt_every" in REGISTRY[parse_entry(a)[0]].options.keys() for a in algorithms if a != "auto")):
        options = {**options, "adapt_every": AUTO_ADAPT_EVERY}
    return options


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .options import add_arguments
    from .train.config import TrainConfig

    p = sub.add_parser("train", help="data-parallel training with a gradient-synchronisation algorithm")
    add_arguments(p, TrainConfig)
    p.add_argument("--hosts", type=int, default=None,
                   help="run the ranks on this many emulated hosts (network namespaces, needs root and "
                        "--bandwidth); --workers then defaults to hosts and must be a multiple of it")
    p.add_argument("--launcher", choices=["local", "torchrun"], default="local",
                   help="with --hosts: 'local' starts the ranks itself; 'torchrun' starts one torchrun agent per "
                        "emulated host (c10d rendezvous across the hosts, --workers / --hosts processes each), "
                        "as on real nodes")
    _add_network_arguments(p)
    p.set_defaults(workers=None)  # None: not given (2 on loopback, --hosts on an emulated cluster)
    _add_algorithm_options(p)
    p.set_defaults(func=_train)


def _add_network_arguments(p: argparse.ArgumentParser) -> None:
    """``--bandwidth``, ``--bandwidth-schedule``, ``--latency``, ``--burst``: the emulated cluster's links."""
    p.add_argument("--bandwidth", default=None,
                   help="link rate in Mbit/s, or one rate per host separated by commas; "
                        "omitted: loopback, not shaped")
    p.add_argument("--bandwidth-schedule", default=None,
                   help="rate changes during the run as seconds:Mbit/s pairs, e.g. '60:50,120:500'")
    p.add_argument("--latency", type=float, default=None,
                   help="one-way delay in ms (needs the netem qdisc, which not every kernel has)")
    p.add_argument("--burst", default="auto",
                   help="tbf bucket size (tc syntax, e.g. 32kb); auto: max(16kb, 4 ms at each link's rate) "
                        "(gradsync.cluster.auto_burst), small enough that a burst does not hide the shaping "
                        "of small gradients")


def _rates(args: argparse.Namespace, hosts: int) -> list[float] | None:
    """The link rates of ``--bandwidth`` (None without it).

    Raises:
        ValueError: naming bandwidth for a malformed list or a count other than 1 or ``hosts``;
            naming latency / bandwidth-schedule when given without ``--bandwidth``.
    """
    if args.bandwidth is None:
        if args.latency is not None or args.bandwidth_schedule:
            raise ValueError("latency and bandwidth-schedule need --bandwidth (an emulated cluster)")
        return None
    try:
        rates = [float(r) for r in str(args.bandwidth).split(",")]
    except ValueError:
        raise ValueError(f"bandwidth must be Mbit/s or comma-separated Mbit/s per host, got {args.bandwidth!r}") from None
    if len(rates) not in (1, hosts):
        raise ValueError(f"bandwidth must give one rate or {hosts} rates, got {len(rates)}")
    return rates


def _cluster(args: argparse.Namespace, hosts: int, rates: list[float]):
    """An (unstarted) :class:`gradsync.cluster.EmulatedCluster` for ``--bandwidth`` and friends."""
    from .cluster import EmulatedCluster

    return EmulatedCluster(hosts, rates if len(rates) > 1 else rates[0], burst=args.burst,
                           latency_ms=args.latency)


def _train_network(args: argparse.Namespace) -> tuple[int, int | None, list[float] | None]:
    """``(workers, hosts, rates)`` of a ``gradsync train`` command line; ``hosts`` is None on loopback.

    Raises:
        ValueError: naming hosts, workers, bandwidth, latency or bandwidth-schedule for a bad
            combination (hosts without bandwidth, workers not a multiple of hosts, hosts under torchrun).
    """
    from .train.launcher import under_torchrun
    from .validation import check_int

    hosts = args.hosts
    if hosts is None and args.bandwidth is not None:
        hosts = args.workers if args.workers is not None else 2
    if hosts is None:
        _rates(args, 1)
        return (2 if args.workers is None else args.workers), None, None
    hosts = check_int("hosts", hosts, 1, 64)
    if under_torchrun():
        raise ValueError("hosts/bandwidth build an emulated cluster on this machine; under torchrun the "
                         "network is the real one: drop --hosts and --bandwidth")
    rates = _rates(args, hosts)
    if rates is None:
        raise ValueError("hosts needs --bandwidth (the emulated hosts' link rate in Mbit/s, e.g. 100)")
    workers = hosts if args.workers is None else args.workers
    if workers % hosts:
        raise ValueError(f"workers must be a multiple of hosts ({hosts}) on an emulated cluster, got {workers}")
    return workers, hosts, rates


def _train(args: argparse.Namespace) -> int:
    from .launch import limit_launcher_threads
    from .options import values_from_args
    from .report import print_summary, write_outputs
    from .train.config import TrainConfig
    from .train.launcher import launch, network_label
    from .workloads import get_workload, load_data

    workers, hosts, rates = _train_network(args)
    if args.launcher == "torchrun" and hosts is None:
        raise ValueError("launcher torchrun starts agents on emulated hosts: give --hosts and --bandwidth "
                         "(on real nodes run torchrun yourself, see docs/train.md)")
    values = dict(values_from_args(TrainConfig, args), workers=workers)
    cfg = TrainConfig(**values, options=_auto_adapt(_algorithm_values(args), [args.algorithm]))
    limit_launcher_threads()
    try:  # fail before starting workers when the data is absent or damaged (DatasetCorrupt: a ValueError)
        load_data(get_workload(cfg.workload), cfg.data_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    if hosts is None:
        label, changes = network_label(cfg), None
        result = launch(cfg)
    else:
        result, label, changes = _train_on_cluster(args, cfg, hosts, rates)
        if result is None:
            return 2
        if isinstance(result, int):  # torchrun agents: rank 0 reported
            return result
    if result is None:
        return 0
    result["network"] = result["summary"]["network"] = label
    if changes is not None:
        result["bandwidth_changes"] = changes
    print_summary(result)
    if cfg.out:
        metrics, curves = write_outputs(result, cfg.out)
        print(f"wrote {metrics}" + (f" and {curves}" if curves else ""))
    return 0


def _train_on_cluster(args: argparse.Namespace, cfg, hosts: int, rates: list[float]):
    """Run ``cfg`` on an emulated cluster of ``hosts`` hosts (loopback, labelled NOT shaped, when this
    process cannot build one); return ``(result, label, bandwidth changes or None)``, result None
    (after one error line) when the cluster cannot be built as asked."""
    from .cluster import BandwidthSchedule, ClusterError
    from .train.launcher import launch_on_cluster

    steps = BandwidthSchedule.parse(args.bandwidth_schedule) if args.bandwidth_schedule else None
    cluster = _cluster(args, hosts, rates)
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"gradsync train: error: cannot build the emulated cluster: {exc}", file=sys.stderr)
        return None, None, None
    try:
        label = cluster.label
        if steps is not None and cluster.shaped:
            label += ", then " + ", ".join(f"{r:g} Mbit/s at {t:g} s" for t, r in steps)
        if not cluster.shaped:
            print(f"gradsync train: cannot emulate {hosts} hosts ({cluster.reason}): running on {label}",
                  flush=True)
        else:
            print(f"network: {label}", flush=True)
        schedule = None
        if steps is not None:
            schedule = BandwidthSchedule(cluster, steps).start()
        try:
            if args.launcher == "torchrun":
                return _torchrun_on_cluster(args, cfg, cluster, label), label, None
            result = launch_on_cluster(cfg, cluster)
        finally:
            if schedule is not None:
                schedule.stop()
        return result, label, (schedule.applied if schedule is not None else None)
    finally:
        cluster.close()


#: Options of the emulated cluster, which the torchrun agents' own ``gradsync train`` must not see.
_CLUSTER_OPTIONS = ("--hosts", "--bandwidth", "--bandwidth-schedule", "--latency", "--burst", "--launcher", "--workers")


def _torchrun_on_cluster(args: argparse.Namespace, cfg, cluster, label: str) -> int:
    """Run this ``gradsync train`` command as one torchrun agent per host of ``cluster``
    (:mod:`gradsync.cluster.torchrun`); rank 0 prints the summary and writes the outputs. Returns
    the exit code (the largest of the agents')."""
    import os

    from .cluster.torchrun import TorchrunNodes, wait_all
    from .comm.rendezvous import free_port
    from .train.launcher import EMULATED_NETWORK_VAR

    argv, skip = [], False
    for a in args.argv[1:]:  # drop "train" and the cluster's own options
        if skip:
            skip = False
        elif a in _CLUSTER_OPTIONS:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in _CLUSTER_OPTIONS)):
            argv.append(a)
    nodes = TorchrunNodes(nproc_per_node=cfg.workers // cluster.hosts, port=free_port(), rdzv_id=f"gs{os.getpid()}")
    env = dict(os.environ, **{EMULATED_NETWORK_VAR: label})
    print(f"torchrun: {cluster.hosts} agents x {nodes.nproc_per_node} processes, rendezvous at "
          f"{cluster.address(0)}:{nodes.port}", flush=True)
    codes = wait_all(nodes.start(cluster, "gradsync", ["train", *argv], env=env), timeout_s=7 * 24 * 3600)
    return max(codes)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from .bench.config import BenchConfig
    from .options import add_arguments

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

    from .bench.config import BenchConfig
    from .bench.launch import RankError, run_ranks
    from .bench.report import print_accuracy_table, print_quality_table, print_table, write_outputs
    from .cluster import BandwidthSchedule
    from .launch import limit_launcher_threads
    from .options import values_from_args

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


def _add_sweep(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="predicted time to quality on several networks: steps to quality on "
                                     "loopback x iteration time per emulated network (gradsync.bench.sweep)")
    p.add_argument("--algorithms", required=True, help="comma-separated gradsync bench entries, allreduce among "
                                                       "them unless --quality-target is given")
    p.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the to-quality runs (>= 5 for olympic means)")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (>= 2)")
    p.add_argument("--bandwidths", required=True, help="comma-separated link rates in Mbit/s, one network each")
    p.add_argument("--quality-target", type=float, default=None,
                   help="absolute target; default: allreduce's mean final quality minus 0.5 points (accuracy) "
                        "or plus 0.5 %% (bits per character)")
    for flag in ("--workload", "--model", "--data-dir"):
        p.add_argument(flag, default=None, help="as gradsync bench")
    for flag, kind in (("--batch-size", int), ("--lr", float), ("--bucket-cap-mb", float), ("--epochs", int),
                       ("--train-samples", int), ("--eval-every", int), ("--eval-samples", int)):
        p.add_argument(flag, type=kind, default=None, help="as gradsync bench (default: the workload's recipe)")
    p.add_argument("--steps", type=int, default=20, help="timed iterations per entry and round on each network")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per entry and round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    p.add_argument("--validate-bandwidth", default=None,
                   help="comma-separated rates (among --bandwidths): also run a full shaped to-quality run at each "
                        "and compare it with the prediction")
    p.add_argument("--validate-algorithms", default="allreduce", help="entries of the validation run")
    p.add_argument("--validate-seeds", default="0", help="seeds of the validation run")
    p.add_argument("--out", default="runs/sweep", help="folder of the sub-runs and sweep.json (reused when rerun)")
    p.set_defaults(func=_sweep)


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from .bench.report import plot_quality
    from .cluster.commands import why_unshaped
    from .bench.sweep import MODEL_FLAGS, QUALITY_FLAGS, TOLERANCE, run_sweep, summary_rows

    try:
        rates = [float(x) for x in args.bandwidths.split(",")]
    except ValueError:
        raise ValueError(f"bandwidths must be comma-separated Mbit/s, got {args.bandwidths!r}") from None
    if any(not 0.1 <= r <= 100_000 for r in rates):
        raise ValueError(f"bandwidths must be rates in [0.1, 100000] Mbit/s, got {args.bandwidths}")
    entries = [e.strip() for e in args.algorithms.split(",") if e.strip()]
    validate_at = None
    if args.validate_bandwidth is not None:
        v_entries = [e.strip() for e in args.validate_algorithms.split(",")]
        if not set(v_entries) <= set(entries):
            raise ValueError(f"validate-algorithms must be entries of --algorithms; got {args.validate_algorithms}")
        try:
            v_rates = [float(x) for x in args.validate_bandwidth.split(",")]
        except ValueError:
            raise ValueError(f"validate-bandwidth must be comma-separated Mbit/s, got {args.validate_bandwidth!r}") from None
        validate_at = (v_rates, v_entries, _int_list("validate-seeds", args.validate_seeds))
    unshaped = why_unshaped()
    if unshaped is not None:  # before the loopback runs, not after them
        print(f"gradsync sweep: error: the timing runs need an emulated cluster (network namespaces and tc), and "
              f"this process cannot build one: {unshaped}", file=sys.stderr)
        return 1
    values = {k: getattr(args, k) for k in MODEL_FLAGS + QUALITY_FLAGS}
    result = run_sweep(entries, _int_list("seeds", args.seeds), args.hosts, rates, Path(args.out), values, main,
                       steps=args.steps, warmup=args.warmup, rounds=args.rounds, quality_target=args.quality_target,
                       validate_at=validate_at)
    q = result["quality"]
    hib = q["higher_is_better"]
    target = f"{q['target'] * 100:.2f}%" if hib else f"{q['target']:.4f}"
    console = Console(width=max(Console().width, 120))
    for rate, pred in result["networks"].items():
        table = Table(title=f"gradsync sweep: predicted time to {q['metric']} {target}, {args.hosts} hosts at {rate} "
                            f"Mbit/s (dense CCR {pred['dense_ccr']:.2f})",
                      caption=f"steps to target on loopback ({len(q['seeds'])} seeds: {q['seeds']}) x mean "
                              f"iteration time on {pred['network']}; seconds: olympic mean over >= 5 seeds, "
                              f"else median")
        for col in ("entry", "iteration ms", "median steps", "predicted s", "vs allreduce", "reached", "final (mean)"):
            table.add_column(col, justify="left" if col == "entry" else "right", overflow="fold")
        for r in summary_rows(pred):
            name = r["entry"] + (f" (chose {pred['auto_choice']})" if r["entry"] == "auto" else "")
            tail = "" if r["tail_iteration_ms"] is None else f" (tail {r['tail_iteration_ms']:.1f})"
            table.add_row(name, f"{r['iteration_ms']:.1f}{tail}",
                          "-" if r["median_steps"] is None else f"{r['median_steps']:g}",
                          "not reached" if r["predicted_s"] is None else f"{r['predicted_s']:.1f}",
                          "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                          f"{r['reached']}/{len(q['seeds'])}",
                          f"{r['final_mean'] * 100:.2f}%" if hib else f"{r['final_mean']:.4f}")
        console.print(table)
        if pred["auto_not_swept"]:
            print(f"auto chose {pred['auto_not_swept']} at {rate} Mbit/s, which the sweep did not train: add it to "
                  f"--algorithms to predict its time to quality")
        figure = plot_quality({**pred, "metric": q["metric"], "higher_is_better": hib},
                              Path(args.out) / f"predicted-{args.hosts}x{rate}mbit.png",
                              f"predicted training time (s): loopback steps x mean iteration time at {rate} Mbit/s",
                              f"{args.hosts} hosts at {rate} Mbit/s, dense CCR {pred['dense_ccr']:.2f}")
        if figure is not None:
            print(f"wrote {figure}")
    for v in result["validation"]:
        for row in v["rows"]:
            err = "-" if row["error"] is None else f"{row['error'] * 100:+.1f} %"
            pred, meas = (("not reached" if x is None else f"{x:.1f} s") for x in (row["predicted_s"], row["measured_s"]))
            print(f"validation at {v['bandwidth_mbit']:g} Mbit/s: {row['entry']} seed {row['seed']}: predicted "
                  f"{pred}, measured {meas}, error {err}")
        largest = "-" if v["max_error"] is None else f"{v['max_error'] * 100:.1f} %"
        print(f"prediction {'HOLDS' if v['holds'] else 'DOES NOT HOLD'} within {TOLERANCE:.0%} "
              f"(largest error {largest})")
    print(f"wrote {Path(args.out) / 'sweep.json'}")
    return 0


def _bucket_cap(text: str) -> float | str:
    """``--bucket-cap-mb``: MB, or ``auto`` (:func:`gradsync.comm.buckets.suggested_bucket_cap_mb`)."""
    return text if text == "auto" else float(text)


def _add_model_arguments(p: argparse.ArgumentParser, batch_size: int, bucket_cap_mb: float | str) -> None:
    """The measured model's flags, shared by ``profile`` and ``doctor`` (:func:`_measure_profile`)."""
    p.add_argument("--model", default="fashion-mnist",
                   help="a training workload (fashion-mnist, fashion-mnist:resnet18, kjv-lstm, ...: its model on "
                        "real batches), a torchvision model at ImageNet size (resnet18, resnet50, ...: random "
                        "3x224x224 images), or module:function (function() returns the nn.Module; the module "
                        "defines make_batch(batch_size) -> (inputs, targets) and optionally loss_fn)")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--bucket-cap-mb", type=_bucket_cap, default=bucket_cap_mb,
                   help="DDP bucket size (MB); auto: gradient size / 16, at least 8 buckets")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations (medians)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=None)


def _measure_profile(args: argparse.Namespace):
    """Record the profile of ``args.model`` on this machine (one process,
    :func:`gradsync.profiler.profile.record_profile`).

    Raises:
        ValueError: naming batch_size, threads, bucket_cap_mb or model.
    """
    import torch

    from .comm.buckets import resolve_bucket_cap_mb
    from .profiler.profile import model_for_profile, record_profile
    from .validation import check_int

    check_int("batch_size", args.batch_size, 1)
    check_int("threads", args.threads, 1)
    torch.set_num_threads(args.threads)
    model, make_batch, loss_fn = model_for_profile(args.model, args.batch_size, args.data_dir)
    return record_profile(model, make_batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                          args.model, args.batch_size, resolve_bucket_cap_mb(args.bucket_cap_mb, model),
                          args.iterations)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    from .algorithms import REGISTRY

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

    from .profiler.profile import ccr_at
    from .validation import check_float, check_int

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
        from .profiler.trace import run_trace

        from .algorithms import get

        options = {"ratio": args.ratio} if "ratio" in get(args.algorithm).options.keys() else {}
        path = run_trace(args.trace, args.algorithm, args.model, workers=args.workers,
                         batch_size=args.batch_size, bucket_cap_mb=prof.meta["bucket_cap_mb"], threads=args.threads,
                         data_dir=args.data_dir, **options)
        print(f"wrote {path} (open in chrome://tracing or ui.perfetto.dev)")
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="which algorithm and options to use on a network, and why",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_model_arguments(p, batch_size=32, bucket_cap_mb="auto")
    p.add_argument("--bandwidth", type=float, required=True, help="link rate of each rank in Mbit/s (> 0)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the training job (>= 2)")
    p.add_argument("--latency-us", type=float, default=0.0, help="per-message latency alpha (microseconds)")
    p.add_argument("--compute-scale", type=float, default=1.0,
                   help="multiply the measured (CPU) compute times, e.g. 0.02 for GPUs 50x faster than this CPU")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="the job's optimizer family (the quality model's error limit)")
    p.add_argument("--quality-ranks", type=int, default=2,
                   help="loopback ranks that measure each lossy setting's error on this model's gradients "
                        "(0: measure nothing; lossy settings are then 'not measured')")
    p.add_argument("--json", default=None, help="also write the profile, every prediction and the advice here")
    p.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    """Measure the model here, simulate every candidate on the given network and recommend one
    (:func:`gradsync.profiler.advise.advise`)."""
    import json

    from rich.console import Console
    from rich.table import Table

    import time

    from .profiler.advise import advise, train_command, worth_measuring
    from .profiler.probe import measure_quality_on_loopback
    from .validation import check_float, check_int

    check_float("--bandwidth", args.bandwidth, 0.0, 1e7, low_inclusive=False)
    check_int("--world-size", args.world_size, 2)
    check_float("--latency-us", args.latency_us, 0.0, 1e7)
    scale = check_float("--compute-scale", args.compute_scale, 0.0, 1e6, low_inclusive=False)
    quality_ranks = check_int("--quality-ranks", args.quality_ranks, 0, 64)
    if quality_ranks == 1:
        raise ValueError("--quality-ranks must be 0 (measure nothing) or an integer >= 2; got 1")
    prof = _measure_profile(args).scale_compute(scale)
    simulated = advise(prof, args.world_size, args.bandwidth, latency_s=args.latency_us * 1e-6,
                       optimizer=args.optimizer)
    errors, spent = {}, None
    if quality_ranks:
        worth = worth_measuring(simulated)
        t0 = time.perf_counter()
        errors = measure_quality_on_loopback(args.model, args.batch_size, worth, quality_ranks,
                                             prof.meta["bucket_cap_mb"], args.data_dir) if worth else {}
        spent = time.perf_counter() - t0
    advice = advise(prof, args.world_size, args.bandwidth, errors=errors, latency_s=args.latency_us * 1e-6,
                    optimizer=args.optimizer, probe_seconds=spent)
    command = train_command(advice.choice.entry, prof.meta["bucket_cap_mb"])
    measured = "measured here" + (f" x {scale:g}" if scale != 1 else "")
    table = Table(title=(f"gradsync doctor: {args.model}, batch {args.batch_size}, {args.world_size} ranks at "
                         f"{args.bandwidth:g} Mbit/s"),
                  caption=(f"{measured}: forward {prof.forward_s * 1e3:.1f} ms, backward "
                           f"{prof.backward_s * 1e3:.1f} ms, {len(prof.buckets)} buckets, {prof.total_bytes / 1e6:.2f} "
                           f"MB of gradients; modelled dense all-reduce {advice.dense_allreduce_s * 1e3:.1f} ms: "
                           f"CCR {advice.ccr:.2f}; errors measured on {quality_ranks} loopback ranks"))
    for col, justify in (("setting", "left"), ("ms/iter", "right"), ("vs DDP", "right"),
                         ("accuracy cost", "left"), ("to quality", "right")):
        table.add_column(col, justify=justify)
    ddp = next(r for r in advice.predictions if r.entry == "allreduce")
    for r in advice.predictions:
        ttq = ("?" if not r.measured else "missed" if r.time_to_quality_s == float("inf")
               else f"{ddp.time_to_quality_s / r.time_to_quality_s:.2f}x")
        table.add_row(("-> " if r is advice.choice else "") + r.label, f"{r.iteration_s * 1e3:.1f}",
                      f"{r.speedup:.2f}x", r.cost, ttq, style="bold" if r is advice.choice else None)
    console = Console()
    console.print(table)
    console.print(f"[bold]Recommendation:[/bold] {advice.choice.label}: {command}")
    console.print(f"[bold]Why:[/bold] {advice.reason}", highlight=False)
    for note in advice.notes:
        console.print(f"note: {note}", highlight=False)
    if args.json:
        out = {"model": args.model, "batch_size": args.batch_size, "threads": args.threads, "compute_scale": scale,
               "bucket_cap_mb": prof.meta["bucket_cap_mb"], "profile": prof.to_dict(), **advice.to_dict(),
               "errors": errors, "quality_ranks": quality_ranks, "command": command}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


def _add_simulate(sub: argparse._SubParsersAction) -> None:
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

    from .sim import load_profile, plot_scaling, sweep
    from .validation import check_float

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_bench(sub)
    _add_sweep(sub)
    _add_profile(sub)
    _add_doctor(sub)
    _add_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.error(str(exc))
    except Exception as exc:  # a local rank failed: one message, not the launcher's traceback
        from .launch import RankFailure

        if not isinstance(exc, RankFailure):
            raise
        report = getattr(exc, "report", None)
        print(report(argv) if report else f"gradsync: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gradsync: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
