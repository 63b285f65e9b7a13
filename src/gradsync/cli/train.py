"""``gradsync train``: data-parallel training with a gradient-synchronisation algorithm, on loopback,
an emulated cluster or under torchrun."""

from __future__ import annotations

import argparse
import sys

from .common import _add_algorithm_options, _add_network_arguments, _algorithm_values, _auto_adapt, _cluster, _rates


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..options import add_arguments
    from ..train.config import TrainConfig

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


def _train_network(args: argparse.Namespace) -> tuple[int, int | None, list[float] | None]:
    """``(workers, hosts, rates)`` of a ``gradsync train`` command line; ``hosts`` is None on loopback.

    Raises:
        ValueError: naming hosts, workers, bandwidth, latency or bandwidth-schedule for a bad
            combination (hosts without bandwidth, workers not a multiple of hosts, hosts under torchrun).
    """
    from ..train.launcher import under_torchrun
    from ..validation import check_int

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
    from ..launch import limit_launcher_threads
    from ..options import values_from_args
    from ..report import print_summary, write_outputs
    from ..train.config import TrainConfig
    from ..train.launcher import launch, network_label
    from ..workloads import get_workload, load_data

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
    from ..cluster import BandwidthSchedule, ClusterError
    from ..train.launcher import launch_on_cluster

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

    from ..cluster.torchrun import TorchrunNodes, wait_all
    from ..comm.rendezvous import free_port
    from ..train.launcher import EMULATED_NETWORK_VAR

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
