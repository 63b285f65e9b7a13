"""Validate ``gradsync simulate`` against ``gradsync bench`` on the emulated cluster (a benchmark,
not a test).

For each bandwidth, one ``gradsync bench`` run measures every algorithm on N emulated hosts and also
records a compute profile with all ranks computing at once (so CPU contention matches). The
simulator then predicts each algorithm's iteration time from that profile alone, with the link rate
scaled by the Gloo efficiency measured on this emulation (``--efficiency``, ~0.96 of the tbf rate),
and the relative error of the prediction against the measured median is printed.

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

from gradsync.sim.costmodel import Network
from gradsync.sim.simulator import load_profile, simulate


def plan_for(algorithm: str, result: dict) -> str:
    """The simulator plan of a bench algorithm, with the same parameters as the bench run."""
    cfg = result["config"]
    return {"allreduce": "dense", "fp16": "fp16", "covap": f"covap:{result['covap_ratio']}",
            "dear": "dear", "topk": f"topk:{cfg['density']}", "powersgd": f"powersgd:{cfg['powersgd_rank']}"}[algorithm]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidths", default="5,10,20", help="Mbit/s, comma-separated")
    ap.add_argument("--algorithms", default="allreduce,fp16,covap,dear")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--efficiency", type=float, default=0.96, help="measured Gloo fraction of the tbf rate")
    ap.add_argument("--out", default="runs/validate")
    args = ap.parse_args()
    rows = []
    for bw in [float(b) for b in args.bandwidths.split(",")]:
        out = Path(args.out) / f"{bw:g}mbit"
        cmd = [sys.executable, "-m", "gradsync", "bench", "--hosts", str(args.hosts), "--bandwidth", f"{bw:g}",
               "--algorithms", args.algorithms, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--out", str(out)]
        print("$ " + " ".join(cmd[2:]), flush=True)
        subprocess.run(cmd, check=True)
        result = json.loads((out / "bench.json").read_text())
        profile = load_profile(result["profile"])
        net = Network.from_mbit(bw * args.efficiency)
        for r in result["rows"]:
            plan = plan_for(r["algorithm"], result)
            if plan is None:
                continue
            pred = simulate(profile, plan, result["world_size"], net).iteration_s
            meas = r["iteration_s"]["median"]
            rows.append((bw, r["algorithm"], meas, pred, (pred - meas) / meas))
    table = Table(title=f"simulate vs bench, {args.hosts} emulated hosts (tbf), median iteration time")
    for c in ("Mbit/s", "algorithm", "measured ms", "predicted ms", "relative error"):
        table.add_column(c, justify="right")
    for bw, alg, meas, pred, err in rows:
        table.add_row(f"{bw:g}", alg, f"{meas * 1e3:.1f}", f"{pred * 1e3:.1f}", f"{err * 100:+.1f}%")
    Console(width=100).print(table)
    errs = [abs(e) for *_, e in rows]
    print(f"mean |error| {sum(errs) / len(errs) * 100:.1f}%, max |error| {max(errs) * 100:.1f}%; "
          f"{sum(e <= 0.10 for e in errs)}/{len(errs)} within 10%")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "validation.json").write_text(json.dumps(
        [dict(zip(("bandwidth_mbit", "algorithm", "measured_s", "predicted_s", "relative_error"), r)) for r in rows],
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
