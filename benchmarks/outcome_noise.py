"""How far any rule on the measured error-to-noise ratio can go: the noise in the outcomes it is judged on.

    python benchmarks/outcome_noise.py [--costs benchmarks/data/accuracy_costs.json]
                                       [--errors benchmarks/data/probe_errors_training.json]
                                       [--with COSTS ERRORS ...]

Prints, over the points of :func:`fit_quality_model.fit_points` (the same files and flags as
``benchmarks/fit_quality_model.py``):

* **twins**: torch's PowerSGD and gradsync's overlapped PowerSGD at the same rank on the same workload apply the same
  per-tensor compression and error feedback (the probe measures one for the other,
  :func:`gradsync.profiler.probe.quality_proxy`), so any rule on the measured error gives them the same verdict. How
  often their outcomes (at most one of five seeds missed, :attr:`QualityPoint.missed`) disagree is the share of
  verdicts no such rule can get right: the outcome's own seed noise;
* **best cut**: per optimizer family, the cut on the ratio that misclassifies the fewest points, chosen on the very
  points it is scored on (in sample: a floor for every rule of the form "accept below a limit", the fitted one
  included);
* **crossings**: per family, each workload that reached (at most 1 of 5 seeds missed) at a greater ratio than a
  setting of another workload missed at: no limit gets both right.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

TORCH, OVERLAPPED = "powersgd:matrix_approximation_rank=", "powersgd-overlap:matrix_approximation_rank="


def twins(pts) -> list[tuple]:
    """``[(torch's point, the overlapped twin's point)]``: the same workload and rank, neither with a dense tail."""
    by_key = {(q.workload, q.entry): q for q in pts}
    out = []
    for (workload, entry), q in sorted(by_key.items()):
        rank = entry[len(TORCH):] if entry.startswith(TORCH) else None
        if rank is not None and rank.isdigit() and (workload, OVERLAPPED + rank) in by_key:
            out.append((q, by_key[(workload, OVERLAPPED + rank)]))
    return out


def best_cut(rows) -> tuple[float, int]:
    """``(limit, misclassified)`` of ``rows`` (``[(value, missed)]``): the limit on the value (accept at or below)
    that calls the fewest rows wrong, tried at every row's value and at 0."""
    cuts = sorted({0.0, *(v for v, _ in rows)})
    wrong, limit = min((sum(missed != (v > c) for v, missed in rows), c) for c in cuts)
    return limit, wrong


def crossings(pts) -> list[tuple]:
    """``[(reached, missed)]``: a point that reached at a greater ratio than a point of another workload that missed,
    the widest such pair per reaching workload, widest first."""
    widest: dict[str, tuple] = {}
    for good in pts:
        for bad in pts:
            if good.missed or not bad.missed or good.workload == bad.workload or good.ratio <= bad.ratio:
                continue
            key = good.workload
            if key not in widest or good.ratio - bad.ratio > widest[key][0].ratio - widest[key][1].ratio:
                widest[key] = (good, bad)
    return sorted(widest.values(), key=lambda gb: gb[1].ratio - gb[0].ratio)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default=str(HERE / "data" / "accuracy_costs.json"))
    p.add_argument("--errors", default=str(HERE / "data" / "probe_errors_training.json"))
    p.add_argument("--with", dest="also", nargs=2, action="append", default=[], metavar=("COSTS", "ERRORS"),
                   help="more accuracy costs and their probe errors (rows whose setting was measured)")
    args = p.parse_args(argv)
    from fit_quality_model import fit_points

    from gradsync.profiler.quality_model import optimizer_family

    pts = fit_points(args.costs, args.errors, args.also)
    pairs = twins(pts)
    split = [(a, b) for a, b in pairs if a.missed != b.missed]
    print(f"twins (torch's and the overlapped PowerSGD, same workload and rank): {len(split)} of {len(pairs)} "
          f"disagree on reaching (at most 1 of 5 seeds missed)")
    for a, b in pairs:
        print(f"  {a.workload:<36} r={a.entry[len(TORCH):]:<3} ratio {a.ratio:6.3f}  seeds missed: torch's "
              f"{sum(a.outcomes)}/{len(a.outcomes)}, overlapped {sum(b.outcomes)}/{len(b.outcomes)}"
              f"{'  DISAGREE' if a.missed != b.missed else ''}")
    families: dict[str, list] = defaultdict(list)
    for q in pts:
        families[optimizer_family(q.optimizer)].append(q)
    for family, group in sorted(families.items()):
        limit, wrong = best_cut([(q.ratio, q.missed) for q in group])
        print(f"{family}: {len(group)} points over {len({q.workload for q in group})} workloads; the best cut on the "
              f"ratio, chosen on these points (in sample), is {limit:.3f} and calls {wrong} wrong")
        crossed = crossings(group)
        print(f"  {len(crossed)} workloads reached at a greater ratio than another workload missed at; each one's "
              f"widest crossing:")
        for good, bad in crossed:
            print(f"  crossing: {good.workload} {good.entry} reached at ratio {good.ratio:.3f} "
                  f"({sum(good.outcomes)}/{len(good.outcomes)} missed); {bad.workload} {bad.entry} missed at "
                  f"{bad.ratio:.3f} ({sum(bad.outcomes)}/{len(bad.outcomes)})")


if __name__ == "__main__":
    main()
