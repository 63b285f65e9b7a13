"""Validate ``gradsync simulate`` against ``gradsync bench`` on the emulated cluster (a benchmark,
not a test).

For each bandwidth, one ``gradsync bench`` run measures every algorithm on N emulated hosts. The
simulator then predicts each algorithm's iteration time from the run's compute profile, twice:

* **nominal**: the profile as recorded (all ranks computing at once) and the tbf link rate times
  the Gloo efficiency measured on this emulation (``--efficiency``, ~0.96);
* **calibrated**: compute times scaled so forward+backward+optimizer equals the compute-only time
  the bench measured in its rounds, and the link rate scaled so the alpha-beta model reproduces the
  bench's single blocking dense all-reduce (for DeAR: its blocking reduce-scatter + all-gather)
  measurement. Two numbers a user can measure on any cluster; everything else (overlap, dropped
  buckets, compression) is left to the model;
* **calibrated + overlap**: as calibrated, plus the overlap efficiency (the rate at which
  communication progresses while backward compute runs) fitted on the dense ``allreduce`` row of
  the same run; the other algorithms are then predicted with it. The allreduce row is the fit, not a
  prediction.

    python benchmarks/validate_simulator.py --hosts 4 --bandwidths 5,10,20 \\
        --algorithms allreduce,fp16,covap,dear --out runs/validate
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradsync.sim import Network, Profile, allreduce_time, load_profile, reduce_scatter_time, simulate


def plan_for(algorithm: str, result: dict) -> str:
    """The simulator plan of a bench algorithm, with the same parameters as the bench run."""
    opts = next(r["options"] for r in result["rows"] if r["algorithm"] == algorithm)
    return {"allreduce": "dense", "fp16": "fp16", "covap": f"covap:{opts.get('ratio')}", "dear": "dear",
            "topk": f"topk:{opts.get('density')}",
            "powersgd": f"powersgd:{opts.get('matrix_approximation_rank')}"}[algorithm]


def _scale_compute(profile: dict, compute_s: float) -> Profile:
    """The profile with forward, backward, optimizer and ready times scaled to total ``compute_s``."""
    prof = load_profile(profile)
    return prof.scale_compute(compute_s / prof.compute_s)


def _fit_overlap(profile, world_size: int, net: Network, measured_s: float) -> float:
    """Overlap efficiency in (0, 1] at which simulated dense all-reduce matches ``measured_s``
    (bisection; the iteration time falls monotonically as the efficiency rises)."""
    lo, hi = 0.01, 1.0
    if simulate(profile, "dense", world_size, net, overlap_efficiency=hi).iteration_s >= measured_s:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        if simulate(profile, "dense", world_size, net, overlap_efficiency=mid).iteration_s > measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidths", default="5,10,20", help="Mbit/s, comma-separated")
    ap.add_argument("--algorithms", default="allreduce,fp16,covap,dear")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--efficiency", type=float, default=0.96, help="measured Gloo fraction of the tbf rate")
    ap.add_argument("--out", default="runs/validate")
    ap.add_argument("--reuse", action="store_true", help="reuse bench.json files already in --out")
    args = ap.parse_args()
    rows = []
    for bw in [float(b) for b in args.bandwidths.split(",")]:
        out = Path(args.out) / f"{bw:g}mbit"
        cmd = [sys.executable, "-m", "gradsync", "bench", "--hosts", str(args.hosts), "--bandwidth", f"{bw:g}",
               "--algorithms", args.algorithms, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--out", str(out)]
        if not (args.reuse and (out / "bench.json").exists()):
            print("$ " + " ".join(cmd[2:]), flush=True)
            subprocess.run(cmd, check=True)
        result = json.loads((out / "bench.json").read_text())
        profile = load_profile(result["profile"])
        calibrated_profile = _scale_compute(result["profile"], result["compute_only_s"])
        numels = [b["numel"] for b in result["profile"]["buckets"]]
        p = result["world_size"]
        nominal = Network.from_mbit(bw * args.efficiency)
        ar_model = sum(allreduce_time(4 * n, p, Network.from_mbit(bw)) for n in numels)
        rsag_model = 2 * reduce_scatter_time(4 * sum(numels), p, Network.from_mbit(bw))
        net_ar = Network.from_mbit(bw * ar_model / result["dense_allreduce_s"])
        net_rsag = Network.from_mbit(bw * rsag_model / result["dense_rs_ag_s"])
        dense = next((r for r in result["rows"] if r["algorithm"] == "allreduce"), None)
        eta = 1.0
        if dense is not None:
            eta = _fit_overlap(calibrated_profile, p, net_ar, dense["iteration_s"]["median"])
        for r in result["rows"]:
            plan = plan_for(r["algorithm"], result)
            meas = r["iteration_s"]["median"]
            pred = simulate(profile, plan, p, nominal).iteration_s
            net = net_rsag if plan == "dear" else net_ar
            cal = simulate(calibrated_profile, plan, p, net).iteration_s
            ov = simulate(calibrated_profile, plan, p, net, overlap_efficiency=eta).iteration_s
            rows.append((bw, r["algorithm"], meas, pred, (pred - meas) / meas, cal, (cal - meas) / meas,
                         ov, (ov - meas) / meas, eta))
    table = Table(title=f"simulate vs bench, {args.hosts} emulated hosts (tbf), median iteration time")
    for c in ("Mbit/s", "algorithm", "measured ms", "nominal ms", "error", "calibrated ms", "error",
              "+overlap ms", "error", "eta"):
        table.add_column(c, justify="right")
    for bw, alg, meas, pred, err, cal, cerr, ov, oerr, eta in rows:
        table.add_row(f"{bw:g}", alg, f"{meas * 1e3:.1f}", f"{pred * 1e3:.1f}", f"{err * 100:+.1f}%",
                      f"{cal * 1e3:.1f}", f"{cerr * 100:+.1f}%", f"{ov * 1e3:.1f}",
                      "fit" if alg == "allreduce" else f"{oerr * 100:+.1f}%", f"{eta:.2f}")
    Console(width=130).print(table)
    for label, col, skip_fit in (("nominal", 4, False), ("calibrated", 6, False), ("calibrated + overlap", 8, True)):
        errs = [abs(r[col]) for r in rows if not (skip_fit and r[1] == "allreduce")]
        print(f"{label}: mean |error| {sum(errs) / len(errs) * 100:.1f}%, max {max(errs) * 100:.1f}%, "
              f"{sum(e <= 0.10 for e in errs)}/{len(errs)} within 10%")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "validation.json").write_text(json.dumps(
        [dict(zip(("bandwidth_mbit", "algorithm", "measured_s", "nominal_s", "nominal_error", "calibrated_s",
                   "calibrated_error", "overlap_s", "overlap_error", "overlap_efficiency"), r)) for r in rows],
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
