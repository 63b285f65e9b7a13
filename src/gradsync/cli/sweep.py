"""``gradsync sweep``: predicted time to quality on several networks (steps to quality on loopback x
iteration time on each network)."""

from __future__ import annotations

import argparse
import sys

from .common import _int_list


def add_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--auto-probe", choices=["copies", "online"], default=None,
                   help="as gradsync bench: how the entry auto measures (default copies)")
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


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ..bench.report import plot_quality
    from ..cluster.commands import why_unshaped
    from ..bench.sweep import MODEL_FLAGS, QUALITY_FLAGS, TIMING_FLAGS, TOLERANCE, auto_label, run_sweep, summary_rows
    from . import main

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
    values = {k: getattr(args, k) for k in MODEL_FLAGS + QUALITY_FLAGS + TIMING_FLAGS}
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
            name = auto_label(pred) if r["entry"] == "auto" else r["entry"]
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
    if "allreduce" in q["entries"]:
        print(f"wrote {_write_cost_rows(q, args)}")
    return 0


def _write_cost_rows(quality: dict, args: argparse.Namespace) -> Path:
    """The sweep's accuracy-cost rows (:mod:`gradsync.bench.accuracy_costs`) as ``OUT/accuracy_costs.json``."""
    import json
    import shlex
    from pathlib import Path

    from ..bench.accuracy_costs import SCHEMA, cost_rows, provenance
    from ..workloads import get_workload

    workload = get_workload(quality["workload"], args.model)
    commit, machine = provenance()
    rows = cost_rows(quality, model=workload.key, optimizer=workload.optimizer,
                     command=shlex.join(["gradsync", *args.argv]), commit=commit, machine=machine)
    path = Path(args.out) / "accuracy_costs.json"
    path.write_text(json.dumps({"schema": SCHEMA, "rows": rows}, indent=1))
    return path
