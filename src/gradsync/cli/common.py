"""Arguments and helpers shared by the ``gradsync`` subcommands."""

from __future__ import annotations

import argparse


def _add_algorithm_options(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One flag per option of every registered algorithm (an option shared by several algorithms is
    one flag); a flag not given leaves the algorithm's own default."""
    from ..algorithms import REGISTRY
    from ..options import add_arguments

    group = p.add_argument_group("algorithm options (each applies to the algorithms that take it)")
    seen: set[str] = set()
    for spec in REGISTRY.values():
        add_arguments(group, spec.options, use_defaults=False, seen=seen, defaults=defaults)


def _algorithm_values(args: argparse.Namespace) -> dict:
    """The algorithm options given on the command line."""
    from ..algorithms import REGISTRY

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
    from ..algorithms import REGISTRY, parse_entry
    from ..algorithms.covap import AUTO_ADAPT_EVERY

    if (options.get("ratio") == "auto" and "adapt_every" not in options
            and any("adapt_every" in REGISTRY[parse_entry(a)[0]].options.keys() for a in algorithms if a != "auto")):
        options = {**options, "adapt_every": AUTO_ADAPT_EVERY}
    return options


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
    from ..cluster import EmulatedCluster

    return EmulatedCluster(hosts, rates if len(rates) > 1 else rates[0], burst=args.burst,
                           latency_ms=args.latency)


def _int_list(name: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None


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

    from ..comm.buckets import resolve_bucket_cap_mb
    from ..profiler.profile import model_for_profile, record_profile
    from ..validation import check_int

    check_int("batch_size", args.batch_size, 1)
    check_int("threads", args.threads, 1)
    torch.set_num_threads(args.threads)
    model, make_batch, loss_fn = model_for_profile(args.model, args.batch_size, args.data_dir)
    return record_profile(model, make_batch, loss_fn, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                          args.model, args.batch_size, resolve_bucket_cap_mb(args.bucket_cap_mb, model),
                          args.iterations)
