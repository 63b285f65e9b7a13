"""Measure the start-up compression quality (:func:`gradsync.profiler.probe.measure_quality`) of every
setting in ``benchmarks/data/accuracy_costs.json`` on the model and world size it was measured at, as
``--algorithm auto`` measures it on a job (the workload's optimizer at its recipe's learning rate, each
rank its own batches of the recipe's size, DDP's automatic buckets, :data:`QUALITY_STEPS` measured
steps), and write ``benchmarks/data/probe_errors.json``: the inputs of
``benchmarks/fit_quality_model.py``.

    python benchmarks/probe_quality.py [--seeds 0,1,2] [--out benchmarks/data/probe_errors.json]

Loopback Gloo ranks (quality does not depend on the network); about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def _rank(rank: int, world: int, port: int, model_key: str, entries: list[str], seed: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gradsync.comm.buckets import resolve_bucket_cap_mb
    from gradsync.profiler.auto import probe_batches
    from gradsync.profiler.probe import measure_quality
    from gradsync.workloads import get_workload, load_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        name, _, model = model_key.partition(":")
        w = get_workload(name, model or None)
        x, y, _, _ = load_data(w, None)
        d = w.defaults
        torch.manual_seed(seed)
        m = w.make_model()
        batches = probe_batches(x, y, d["batch_size"], rank, world, seed, augment=w.augment)

        def make_optimizer(params):
            return w.make_optimizer(params, lr=d["lr"], momentum=d["momentum"], weight_decay=d["weight_decay"])

        return measure_quality(m, batches, F.cross_entropy, make_optimizer, entries,
                               resolve_bucket_cap_mb("auto", m), seed=seed)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default=str(HERE / "data" / "accuracy_costs.json"))
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default=str(HERE / "data" / "probe_errors.json"))
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from gradsync.comm.rendezvous import free_port
    from gradsync.profiler.probe import QUALITY_STEPS, quality_proxy

    rows = json.load(open(args.costs))["rows"]
    jobs: dict[tuple[str, int], list[str]] = {}
    for r in rows:
        jobs.setdefault((r["model"], r["world_size"]), [])
        if r["entry"] not in jobs[(r["model"], r["world_size"])]:
            jobs[(r["model"], r["world_size"])].append(r["entry"])
    out = []
    for (model_key, world), entries in jobs.items():
        entries = ["allreduce", *entries]
        for seed in [int(s) for s in args.seeds.split(",")]:
            ctx = mp.get_context("fork")
            with ctx.Pool(world) as pool:
                port = free_port()
                res = pool.starmap(_rank, [(r, world, port, model_key, entries, seed) for r in range(world)])
            errors = res[0]
            print(model_key, world, seed, {e: round(v, 3) for e, v in errors.items()}, flush=True)
            out.append({"model": model_key, "world_size": world, "seed": seed,
                        "errors": {e: errors[e] for e in entries}, "measured_as": {e: quality_proxy(e) for e in entries}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    doc = {"schema": "gradsync-probe-errors/1", "command": "python benchmarks/probe_quality.py " + " ".join(argv or sys.argv[1:]),
           "commit": commit, "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores, no GPU",
           "quality_steps": QUALITY_STEPS, "jobs": out}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
