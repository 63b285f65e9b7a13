"""Crossover sweep: below which link rate does each algorithm beat dense all-reduce?

Usage (as root, so ``gradsync bench`` can build its emulated cluster; on an otherwise idle machine):

    PYTHONPATH=src python benchmarks/crossover.py --bandwidths 10,25,50,100,250,1000 \\
        --algorithms allreduce,oscar-sw,oscar-asc,topk,covap --hosts 2 --steps 20 --warmup 5 --rounds 3 \\
        --out runs/crossover [-- extra gradsync bench flags, e.g. --density 0.01]

For every rate it runs ``gradsync bench --hosts H --bandwidth RATE --workload fashion-mnist`` (the
workload's default model, the algorithms interleaved in one run, so each row's
``speedup_vs_allreduce`` compares iteration-time medians measured under the same conditions), keeps
each run's ``bench.json`` under ``OUT/bw_RATE/`` (an existing one is reused with ``--reuse``), and
writes

* ``OUT/crossover.json``: per rate and algorithm the speedup, median iteration time, wire bytes per
  rank per iteration (what the rank puts on the network, :func:`gradsync.comm.collectives.wire_bytes`),
  payload bytes per rank per iteration (tensors handed to collectives), the compression ratio on wire
  bytes, compression overhead and entropy-coding time per iteration (``coding_s``, from the
  algorithm's ``coding_seconds`` stat: ``oscar-asc``), plus the crossover rates;
* ``OUT/crossover.md``: the same as markdown tables.

The **crossover rate** of an algorithm is where its speedup over dense crosses 1 going from a slower
link (speedup > 1) to a faster one (speedup <= 1), interpolated linearly in ``log(rate)`` between the
two measured rates around the crossing. If the speedup is above 1 at every rate the crossover is
reported as ``>= max rate``; below or at 1 at every rate, ``< min rate``; if the speedup crosses 1
several times (noise), the fastest such crossing is reported and the algorithm is flagged
``non-monotone``.
"""

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def crossover_rate(rates: list[float], speedups: list[float]) -> dict:
    """The link rate below which ``speedup > 1``, interpolated in ``log(rate)``.

    Args:
        rates: link rates (Mbit/s, > 0), any order, no repeats.
        speedups: speedup over dense at each rate (same length).

    Returns:
        dict with ``rate`` (float Mbit/s, or None), ``kind`` (``"interpolated"``, ``"above_all"``: beats
        dense at every rate tested, ``"below_all"``: at none, ``"rising"``: only at the faster rates),
        and ``non_monotone`` (bool: more than one crossing, or a crossing from <= 1 to > 1).

    Raises:
        ValueError: for mismatched lengths, no rates, or a non-positive rate.
    """
    if len(rates) != len(speedups) or not rates:
        raise ValueError(f"rates and speedups must be non-empty and of equal length, got {len(rates)} and "
                         f"{len(speedups)}")
    if any(r <= 0 for r in rates):
        raise ValueError(f"rates must be > 0, got {rates}")
    pts = sorted(zip(rates, speedups))
    f = [s - 1.0 for _, s in pts]
    down = [i for i in range(len(pts) - 1) if f[i] > 0 >= f[i + 1]]
    up = [i for i in range(len(pts) - 1) if f[i] <= 0 < f[i + 1]]
    non_monotone = len(down) + len(up) > 1 or bool(up)
    if down:
        i = down[-1]
        (r0, _), (r1, _) = pts[i], pts[i + 1]
        t = f[i] / (f[i] - f[i + 1])
        rate = math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
        return {"rate": rate, "kind": "interpolated", "non_monotone": non_monotone}
    if all(x > 0 for x in f):
        return {"rate": pts[-1][0], "kind": "above_all", "non_monotone": False}
    if all(x <= 0 for x in f):
        return {"rate": pts[0][0], "kind": "below_all", "non_monotone": False}
    return {"rate": None, "kind": "rising", "non_monotone": True}


def _fmt_crossover(c: dict) -> str:
    if c["kind"] == "interpolated":
        s = f"{c['rate']:.0f}" if c["rate"] >= 10 else f"{c['rate']:.1f}"
    elif c["kind"] == "above_all":
        s = f">= {c['rate']:g}"
    elif c["kind"] == "below_all":
        s = f"< {c['rate']:g}"
    else:
        s = "only at faster rates"
    return s + (" (non-monotone)" if c["non_monotone"] else "")


def _run_bench(rate: float, args: argparse.Namespace, extra: list[str]) -> dict:
    out = Path(args.out) / f"bw_{rate:g}"
    path = out / "bench.json"
    if args.reuse and path.exists():
        print(f"reusing {path}", flush=True)
        return json.loads(path.read_text())
    cmd = [sys.executable, "-m", "gradsync", "bench", "--workload", args.workload, "--hosts", str(args.hosts),
           "--bandwidth", f"{rate:g}", "--algorithms", args.algorithms, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--out", str(out), *extra]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"gradsync bench failed at {rate:g} Mbit/s (exit {proc.returncode})")
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Flags after '--' are passed to every gradsync bench run.")
    ap.add_argument("--bandwidths", default="10,25,50,100,250,1000", help="link rates, Mbit/s")
    ap.add_argument("--algorithms", default="allreduce,oscar-sw,oscar-asc,topk,covap",
                    help="comma-separated; must include allreduce (the dense baseline)")
    ap.add_argument("--workload", default="fashion-mnist")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per bench run")
    ap.add_argument("--reuse", action="store_true", help="reuse OUT/bw_RATE/bench.json where it exists")
    ap.add_argument("--out", default="runs/crossover")
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.bandwidths.split(",")]
    if len(set(rates)) != len(rates) or any(r <= 0 for r in rates):
        ap.error(f"--bandwidths must be distinct positive rates, got {args.bandwidths}")
    algos = args.algorithms.split(",")
    if "allreduce" not in algos:
        ap.error("--algorithms must include allreduce (the dense baseline)")
    Path(args.out).mkdir(parents=True, exist_ok=True)

    per_rate: dict[str, dict] = {}
    for rate in rates:
        res = _run_bench(rate, args, extra)
        rows = {r["algorithm"]: r for r in res["rows"]}
        per_rate[f"{rate:g}"] = {
            "network": res.get("network"),
            "rows": {a: {"speedup": rows[a]["speedup_vs_allreduce"],
                         "iteration_median_s": rows[a]["iteration_s"]["median"],
                         "wire_bytes_per_iteration": rows[a]["wire_bytes_per_iteration"],
                         "payload_bytes_per_iteration": rows[a]["payload_bytes_per_iteration"],
                         "compression_ratio": rows[a]["compression_ratio"],
                         "compression_overhead_s": rows[a]["compression_overhead_s"],
                         "coding_s": rows[a].get("coding_s", 0.0),
                         "options": rows[a].get("options", {})} for a in algos},
        }
    keys = [f"{r:g}" for r in sorted(rates)]
    cross = {a: crossover_rate(sorted(rates), [per_rate[k]["rows"][a]["speedup"] for k in keys])
             for a in algos if a != "allreduce"}
    result = {"command": " ".join([sys.executable, *sys.argv]), "hosts": args.hosts, "workload": args.workload,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "extra_bench_flags": extra,
              "rates_mbit": sorted(rates), "per_rate": per_rate, "crossover_mbit": cross}
    (Path(args.out) / "crossover.json").write_text(json.dumps(result, indent=1))

    head = "| algorithm | " + " | ".join(f"{k} Mbit/s" for k in keys)
    sep = "|---|" + "---|" * len(keys)
    lines = [f"Speedup over dense all-reduce ({args.hosts} emulated hosts, {args.workload}, "
             f"{args.rounds} rounds x {args.steps} steps), and the rate below which each beats dense:", "",
             head + " | crossover (Mbit/s) |", sep + "---|"]
    for a in algos:
        cells = [f"{per_rate[k]['rows'][a]['speedup']:.2f}x" for k in keys]
        lines.append(f"| {a} | " + " | ".join(cells) + f" | {'-' if a == 'allreduce' else _fmt_crossover(cross[a])} |")
    lines += ["", "Median iteration time (ms) / wire bytes per rank per iteration (KB; ring all-reduce "
              "2(P-1)/P n, all-gather (P-1) m, point-to-point as sent) / payload bytes per rank per iteration "
              "(KB, tensors handed to collectives) / coding time per iteration (ms):",
              "", head + " |", sep]
    for a in algos:
        cells = []
        for k in keys:
            r = per_rate[k]["rows"][a]
            c = f" / {r['coding_s'] * 1e3:.1f}" if r["coding_s"] else ""
            cells.append(f"{r['iteration_median_s'] * 1e3:.1f} / {r['wire_bytes_per_iteration'] / 1e3:.1f}"
                         f" / {r['payload_bytes_per_iteration'] / 1e3:.1f}{c}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    md = "\n".join(lines) + "\n"
    (Path(args.out) / "crossover.md").write_text(md)
    print(md)
    print(f"wrote {Path(args.out) / 'crossover.json'}, {Path(args.out) / 'crossover.md'}")


if __name__ == "__main__":
    main()
