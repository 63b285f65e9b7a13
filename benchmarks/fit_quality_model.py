"""Fit gradsync's quality model (:mod:`gradsync.profiler.quality_model`) on every grid and print it with
its leave-one-workload-out cross-validated error.

    python benchmarks/fit_quality_model.py [--costs benchmarks/data/accuracy_costs.json]
                                           [--errors benchmarks/data/probe_errors.json]

A point is a row of the accuracy costs (a setting's steps to quality against dense in the same grid)
with the start-up error ``benchmarks/probe_quality.py`` measured for that setting on that model and
world size and the gradient noise measured with it (each the mean over its seeds). Lossless rows (error 0: allreduce, fp16, bf16) count. A row with a
dense tail is a point only where it missed the target (the compressed phase alone would have missed
too); one that reached says nothing about the compressed setting without its tail.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def points(costs_path: str, errors_path: str):
    from gradsync.algorithms import split_dense_tail
    from gradsync.profiler.quality_model import QualityPoint

    rows = json.load(open(costs_path))["rows"]
    measured: dict[tuple[str, int, str], list[float]] = {}
    noise: dict[tuple[str, int], list[float]] = {}
    for job in json.load(open(errors_path))["jobs"]:
        noise.setdefault((job["model"], job["world_size"]), []).append(job["noise"])
        for entry, err in job["errors"].items():
            measured.setdefault((job["model"], job["world_size"], entry), []).append(err)
    out = []
    for r in rows:
        tail = split_dense_tail(r["entry"])[1]
        if tail and not r["not_reached"]:
            continue
        key = (r["model"], r["world_size"], r["entry"])
        if key not in measured:
            raise SystemExit(f"no probe error for {key}: run benchmarks/probe_quality.py")
        extra = math.inf if r["not_reached"] else r["steps"] / r["dense_steps"] - 1
        out.append(QualityPoint(statistics.mean(measured[key]), statistics.mean(noise[key[:2]]), r["world_size"],
                                extra, f"{r['model']} x{r['world_size']}", r["optimizer"], r["entry"]))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default=str(HERE / "data" / "accuracy_costs.json"))
    p.add_argument("--errors", default=str(HERE / "data" / "probe_errors.json"))
    args = p.parse_args(argv)
    from gradsync.profiler.quality_model import cross_validate, fit

    pts = points(args.costs, args.errors)
    print(f"{'workload':<40} {'entry':<58} {'error':>6} {'noise':>6} {'ratio':>6} {'extra':>7}")
    for q in sorted(pts, key=lambda q: (q.workload, q.error)):
        extra = "miss" if math.isinf(q.extra) else f"{q.extra:+.3f}"
        print(f"{q.workload:<40} {q.entry:<58} {q.error:6.3f} {q.noise:6.3f} {q.ratio:6.3f} {extra:>7}")
    model = fit(pts)
    cv = cross_validate(pts)
    print("fit: " + "; ".join(f"{f}: limit={model.limits[f]:.3f} slope={model.slopes[f]:.3f}" for f in model.limits))
    print(f"leave-one-workload-out: {cv['misclassified']} of {cv['points']} points misclassified (reach/miss) over "
          f"{cv['workloads']} workloads; mean absolute error of the extra-steps fraction {cv['mae_extra']:.3f}")
    for q in cv["wrong"]:
        print(f"  held out, called wrong: {q.workload} {q.entry} (ratio {q.ratio:.3f}, {'missed' if math.isinf(q.extra) else 'reached'})")


if __name__ == "__main__":
    main()
