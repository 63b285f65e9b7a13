"""The simulator against measured iterations: for every ``gradsync bench`` timing run under RUNS, each entry's
simulated iteration (its recorded compute profile, the network as the link rate at which the ring model gives the
run's measured dense all-reduce time, ``gradsync.profiler.advise``) against the mean iteration the same run
measured. docs/results.md, "The quality model with more AdamW rows" (2026-11-27).

    python benchmarks/simulator_error.py runs/oos5 [runs/...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main(argv: list[str]) -> None:
    from gradsync.profiler.advise import advise
    from gradsync.profiler.auto import effective_bandwidth_mbit
    from gradsync.sim.profile import load_profile

    for root in argv or ["runs"]:
        for f in sorted(Path(root).rglob("bench.json")):
            d = json.loads(f.read_text())
            if "NOT shaped" in str(d.get("network", "")) or "profile" not in d or "quality" in d:
                continue
            prof = load_profile(d["profile"])
            bandwidth = effective_bandwidth_mbit(prof, d["world_size"], d["dense_allreduce_s"])
            simulated = {r.entry: r.iteration_s for r in advise(prof, d["world_size"], bandwidth).predictions}
            cells = [f"{r['algorithm']}: simulated {simulated[r['algorithm']] * 1e3:.0f} ms, measured "
                     f"{r['iteration_s']['mean'] * 1e3:.0f} ms ({simulated[r['algorithm']] / r['iteration_s']['mean'] - 1:+.0%})"
                     for r in d["rows"] if r["algorithm"] in simulated]
            print(f"{f.parent} ({d['network']}, dense CCR {d['dense_ccr']:.1f}):\n  " + "\n  ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
