"""Fit gradsync's quality model (:mod:`gradsync.profiler.quality_model`) on every grid and print it with
its leave-one-workload-out cross-validated error.

    python benchmarks/fit_quality_model.py [--costs benchmarks/data/accuracy_costs.json]
                                           [--errors benchmarks/data/probe_errors.json]
                                           [--with benchmarks/data/accuracy_costs_held_out.json
                                                   benchmarks/data/probe_errors_held_out.json]
                                           [--held-out-costs benchmarks/data/accuracy_costs_held_out.json
                                            --held-out-errors benchmarks/data/probe_errors_held_out.json]

With ``--held-out-costs`` and ``--held-out-errors`` the fit (frozen by its inputs) also predicts every held-out row
whose setting was measured (its quality proxy's error: torch's PowerSGD as the overlapped one), and prints each
prediction against the outcome: out of sample, unlike the leave-one-workload-out figure. ``--with COSTS ERRORS``
(repeatable) adds such a pair's measured rows to the fit itself: workloads that were out of sample for an earlier
fit and are in sample for this one.

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


def points(costs_path: str, errors_path: str, skip_unmeasured: bool = False):
    from gradsync.algorithms import split_dense_tail
    from gradsync.profiler.probe import quality_proxy
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
        if key not in measured and skip_unmeasured:
            key = (r["model"], r["world_size"], quality_proxy(split_dense_tail(r["entry"])[0]))
            if key not in measured:
                continue
        if key not in measured:
            raise SystemExit(f"no probe error for {key}: run benchmarks/probe_quality.py")
        extra = math.inf if r["not_reached"] else r["steps"] / r["dense_steps"] - 1
        if r.get("per_seed_steps") is not None:
            seeds = tuple(s is None for s in r["per_seed_steps"])
        else:  # copied from docs/results.md: only how many seeds reached
            reached = r.get("seeds_reached", 0)
            seeds = (False,) * reached + (True,) * (r["seeds"] - reached)
        out.append(QualityPoint(statistics.mean(measured[key]), statistics.mean(noise[key[:2]]), r["world_size"],
                                extra, f"{r['model']} x{r['world_size']}", r["optimizer"], r["entry"], seeds))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default=str(HERE / "data" / "accuracy_costs.json"))
    p.add_argument("--errors", default=str(HERE / "data" / "probe_errors.json"))
    p.add_argument("--with", dest="also", nargs=2, action="append", default=[], metavar=("COSTS", "ERRORS"),
                   help="more accuracy costs and their probe errors to fit on (rows whose setting was measured)")
    p.add_argument("--held-out-costs", default=None, help="accuracy costs of workloads the fit never reads")
    p.add_argument("--held-out-errors", default=None, help="probe errors measured on those workloads")
    args = p.parse_args(argv)
    from gradsync.profiler.quality_model import cross_validate, fit

    pts = fit_points(args.costs, args.errors, args.also)
    print(f"{'workload':<40} {'entry':<58} {'error':>6} {'noise':>6} {'ratio':>6} {'extra':>7}")
    for q in sorted(pts, key=lambda q: (q.workload, q.error)):
        extra = "miss" if math.isinf(q.extra) else f"{q.extra:+.3f}"
        print(f"{q.workload:<40} {q.entry:<58} {q.error:6.3f} {q.noise:6.3f} {q.ratio:6.3f} {extra:>7}")
    model = fit(pts)
    cv = cross_validate(pts)
    print("fit: " + "; ".join(f"{f}: limit={model.limits[f]:.3f} slope={model.slopes[f]:.3f} "
                              f"miss=({model.miss[f][0]:.3f}, {model.miss[f][1]:.3f})" for f in model.limits))
    print(f"leave-one-workload-out: {cv['misclassified']} of {cv['points']} points misclassified (accepted/missed) over "
          f"{cv['workloads']} workloads ({cv['accepted_missed']} of them predicted to reach and missed); mean absolute error of the extra-steps fraction {cv['mae_extra']:.3f}")
    for q in cv["wrong"]:
        print(f"  held out, called wrong: {q.workload} {q.entry} (ratio {q.ratio:.3f}, "
              f"{sum(q.outcomes)} of {len(q.outcomes)} seeds missed)")
    if args.held_out_costs and args.held_out_errors:
        predict_held_out(model, points(args.held_out_costs, args.held_out_errors, skip_unmeasured=True))


def predict_held_out(model, pts) -> None:
    """Print ``model``'s prediction for each held-out point beside its outcome, and the count called wrong."""
    from gradsync.profiler.quality_model import optimizer_family, score

    scored = score(model, pts)
    for q in sorted(pts, key=lambda q: (q.workload, q.error)):
        pred = model.extra_steps(q.error, q.noise, q.world_size, optimizer_family(q.optimizer))
        shown = ["miss" if math.isinf(v) else f"{v:+.3f}" for v in (pred, q.extra)]
        print(f"  out of sample: {q.workload:<28} {q.entry:<52} ratio {q.ratio:6.3f} predicted {shown[0]:>7} "
              f"measured {shown[1]:>7} ({sum(q.outcomes)}/{len(q.outcomes)} seeds missed)"
              f"{'  WRONG' if q in scored['wrong'] else ''}")
    errors = scored["abs_errors"]
    mae = sum(errors) / len(errors) if errors else 0.0
    print(f"out of sample: {scored['misclassified']} of {scored['points']} points misclassified (accepted/missed; "
          f"{scored['accepted_missed']} of them predicted to reach and missed); mean absolute error of the "
          f"extra-steps fraction {mae:.3f}")


def fit_points(costs: str, errors: str, also: list[tuple[str, str]] = ()):
    """The fit's points: ``costs`` with ``errors``, and each ``(costs, errors)`` pair of ``also`` (rows whose
    setting the probe measured, :func:`points` ``skip_unmeasured``)."""
    return points(costs, errors) + [q for c, e in also for q in points(c, e, skip_unmeasured=True)]


if __name__ == "__main__":
    main()
