"""auto against fixed settings: time to quality = loopback steps per seed x each entry's mean iteration from a
``gradsync bench ... ,auto`` timing run per network, olympic mean over 5 seeds; auto = its choice's steps x its own
iteration + its probe seconds. docs/results.md, "auto with a cheaper probe" (2026-11-27).

    python benchmarks/auto_probe_summary.py [RUNS]   # RUNS (default runs/oos2) holds time-<model>-<Mbit/s>/bench.json
                                                     # and the ViT's other loopback runs vit-<entry>/bench.json
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from gradsync.bench.sweep import dense_tail, dense_tail_seconds, tail_timing_entry  # noqa: E402

R = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/oos2")
# steps to the target per seed (None: missed), loopback: docs/results.md (the ViT and GRU out-of-sample sweeps, the
# ResNet-8 "PowerSGD overlapped with backward" sweep) + the ViT runs read from RUNS (r=4, r=16)
P4, O4, O8, T8 = ("powersgd:matrix_approximation_rank=4", "powersgd-overlap:matrix_approximation_rank=4",
                  "powersgd-overlap:matrix_approximation_rank=8", "powersgd:matrix_approximation_rank=8")
STEPS = {
    "vit-tiny": {"allreduce": [832, 832, 832, 676, 728], "fp16": [832, 832, 832, 676, 728],
                 T8: [832, 832, 884, 676, 728], O8: [832, 832, 884, 676, 728]},
    "gru": {"allreduce": [832, 780, 832, 832, 780], "fp16": [832, 780, 832, 884, 780], P4: [832, 780, 832, 884, 780],
            O4: [832, 780, 832, 884, 884], O8: [832, 780, 832, 884, 780]},
    "resnet8": {"allreduce": [858, 780, 819, 858, 819], "fp16": [819, 858, 819, 819, 819], "bf16": [858, 819, 780, 858, 819],
                T8: [858, 741, 858, 819, 819], O8: [858, 780, 780, 780, 780],
                O4 + ":dense_from=700": [897, 858, 780, None, 819]},
}
for f in sorted(R.glob("vit-*/bench.json")):  # the ViT's loopback runs of entries its sweep did not train (r=4, r=16)
    for entry, e in json.loads(f.read_text())["quality"]["entries"].items():
        STEPS["vit-tiny"][entry] = e["steps_by_seed"]


def olympic(xs):
    xs = sorted((math.inf if x is None else x) for x in xs)[1:-1]
    return sum(xs) / len(xs)


for model in ("gru", "vit-tiny", "resnet8"):
    for bw in ("5", "15", "40"):
        f = R / f"time-{model}-{bw}" / "bench.json"
        if not f.exists():
            continue
        d = json.loads(f.read_text())
        it = {r["algorithm"]: r["iteration_s"]["mean"] for r in d["rows"]}
        tail = {r["algorithm"]: r.get("tail_iteration_s") for r in d["rows"]}
        auto = d.get("chosen_from_ccr", {}).get("auto", {})
        choice, probe = auto.get("entry"), auto.get("probe_seconds", 0.0)
        def secs(e, s, own):
            tail = it.get(tail_timing_entry(e)) if dense_tail(e) else None
            return None if s is None else dense_tail_seconds(e, s, own, tail)

        rows = {}
        for e, steps in STEPS[model].items():
            if e not in it:
                continue
            rows[e] = [secs(e, s, it[e]) for s in steps]
        line = {e: olympic(v) for e, v in rows.items()}
        best = min(line, key=line.get)
        print(f"== {model} {bw} Mbit/s CCR {d.get('dense_ccr')}; compute {d.get('compute_only_ms', '')}")
        for e in sorted(line, key=line.get):
            print(f"   {e:55s} it {it[e]*1e3:7.1f} ms  olympic {line[e]:7.1f} s  seeds {[None if x is None else round(x,1) for x in rows[e]]}")
        print(f"   auto -> {choice}: probe {probe:.1f} s; errors {auto.get('errors')}; timed {auto.get('iterations_s')}")
        if choice in STEPS[model] and "auto" in it:
            a = [None if s is None else secs(choice, s, it["auto"]) + probe for s in STEPS[model][choice]]
            o = olympic(a)
            print(f"   auto olympic {o:.1f} s (its own iteration {it['auto']*1e3:.1f} ms + probe) vs best {best} {line[best]:.1f} s: "
                  f"gap {100*(o/line[best]-1):+.1f} % (without probe {100*((o-probe)/line[best]-1):+.1f} %); missed seeds "
                  f"{[i for i, s in enumerate(STEPS[model][choice]) if s is None]}")
        else:
            print(f"   auto's choice {choice} has no loopback steps here")
