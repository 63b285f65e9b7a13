"""Candidate quality signals for PowerSGD on a workload's first steps, scored against the measured outcomes.

    python benchmarks/quality_signals.py measure --out signals.json [--points-from-data] [--models SPEC,...]
        [--world-sizes 2,4] [--ranks 2,4,8] [--seed 0] [--steps 24] [--skip 8]
    python benchmarks/quality_signals.py score signals.json

``measure`` trains each model from its initialisation on loopback Gloo ranks with overlapped PowerSGD at rank r
(:mod:`gradsync.algorithms.powersgd`, its own error feedback) on the batches ``--algorithm auto`` would see
(:func:`gradsync.profiler.probe.probe_batches`, the recipe's optimizer at its peak learning rate), and over the
steps after ``--skip`` compares the aggregate ``c`` the optimizer receives with the dense average ``d`` of the same
step, each rank's own gradient ``g_i`` and the dense gradient ``h`` of a batch no step trains on. Each signal is
in units of the dense average's sampling noise (:func:`gradsync.algorithms.meter.error_to_noise`'s
``sqrt(P - 1)``):

* ``full``: ``sqrt(sum ||c - d||^2 / sum ||g_i - d||^2)``, the quality model's ratio;
* ``directional``: the same along ``h``: ``sqrt(sum (h.(c - d))^2 / sum (h.(g_i - d))^2)``: an error in directions
  the held-out loss is flat along costs nothing to first order;
* ``per_layer``: the mean over weight matrices (parameters of 2+ dimensions) of each one's ``full``, unweighted;
* ``descent``: ``sum h.c / sum h.d`` (not scaled): the share of the dense step's first-order descent on the held-out
  batch that the compressed step keeps.

``--points-from-data`` measures every (model, world size, rank) a PowerSGD row of the accuracy-cost files holds.
``score`` joins the signals with those rows' outcomes (at most 1 of 5 seeds missed,
:attr:`gradsync.profiler.quality_model.QualityPoint.missed`; torch's PowerSGD takes its overlapped twin's signal, the
lossless rows 0) and prints, per optimizer family and signal, the cut that calls the fewest rows wrong, chosen on
those rows (in sample: a floor for any limit on that signal; ``descent`` is cut from above).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

DATA = HERE / "data"
#: (accuracy costs, probe errors measured while training) pairs: every row the quality model was fitted on, and the
#: out-of-sample one.
FILES = [("accuracy_costs.json", "probe_errors_training.json"),
         ("accuracy_costs_held_out.json", "probe_errors_held_out_training.json"),
         ("accuracy_costs_out_of_sample.json", "probe_errors_out_of_sample_training.json")]
SIGNALS = ("full", "directional", "per_layer", "descent")
POWERSGD = ("powersgd:matrix_approximation_rank=", "powersgd-overlap:matrix_approximation_rank=")


def powersgd_rank(entry: str):
    """The rank of a plain (no dense tail) PowerSGD entry, else None."""
    for prefix in POWERSGD:
        if entry.startswith(prefix) and entry[len(prefix):].isdigit():
            return int(entry[len(prefix):])
    return None


def _flat_grad(model) -> "torch.Tensor":
    import torch

    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                      for p in model.parameters()])


def _rank_main(rank: int, world: int, port: int, spec: str, batch_size: int, ranks: list, seed: int, steps: int,
               skip: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.algorithms import build_hook
    from gradsync.profiler import probe
    from gradsync.workloads import get_workload, load_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    name, _, arch = spec.partition(":")
    w = get_workload(name, arch or None)
    x, y, _, _ = load_data(w, None)
    out = {}
    try:
        for r in ranks:
            model, _, loss_fn, make_opt = probe._job_on_rank(spec, batch_size, rank, world, None, seed)
            # the training steps, then as many batches no step trains on, in the sampler's order
            batches = probe.probe_batches(x, y, batch_size, rank, world, seed, count=2 * steps, augment=w.augment)
            train, held = batches[:steps], batches[steps:]
            side = copy.deepcopy(model)
            ddp = DistributedDataParallel(model, bucket_cap_mb=1.0)
            state, hook = build_hook("powersgd-overlap", None, model, matrix_approximation_rank=r)
            ddp.register_comm_hook(state, hook)
            opt = make_opt(ddp.parameters())
            shapes = [(p.numel(), p.dim() > 1) for p in model.parameters()]
            sums = torch.zeros(6, dtype=torch.float64)
            layers = torch.zeros(sum(m for _, m in shapes), 2, dtype=torch.float64)
            for i, (xb, yb) in enumerate(train):
                side.load_state_dict(model.state_dict())
                side.zero_grad(set_to_none=True)
                torch.manual_seed(seed * 7919 + i)
                loss_fn(side(xb), yb).backward()
                g = _flat_grad(side).double()
                d = g.clone()
                dist.all_reduce(d)
                d /= world
                side.zero_grad(set_to_none=True)
                loss_fn(side(held[i][0]), held[i][1]).backward()
                h = _flat_grad(side).double()
                dist.all_reduce(h)
                h /= world
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(seed * 7919 + i)
                loss_fn(ddp(xb), yb).backward()
                c = _flat_grad(model).double()
                if i >= skip:
                    e, n = c - d, g - d
                    sums += torch.stack([e @ e, n @ n, (h @ e) ** 2, (h @ n) ** 2, h @ c, h @ d]).cpu()
                    offset, k = 0, 0
                    for numel, matrix in shapes:
                        if matrix:
                            layers[k] += torch.stack([e[offset:offset + numel].pow(2).sum(),
                                                      n[offset:offset + numel].pow(2).sum()]).cpu()
                            k += 1
                        offset += numel
                opt.step()
            state.close()
            both = torch.cat([sums, layers.flatten()])
            dist.all_reduce(both)
            sums, layers = both[:6], both[6:].view(-1, 2)
            scale = math.sqrt(world - 1)
            per_layer = [math.sqrt(a / b) * scale for a, b in layers.tolist() if b > 0]
            out[r] = {"full": math.sqrt(sums[0] / sums[1]) * scale,
                      "directional": math.sqrt(sums[2] / sums[3]) * scale,
                      "per_layer": sum(per_layer) / len(per_layer),
                      "descent": float(sums[4] / sums[5])}
    finally:
        dist.destroy_process_group()
    return out


def jobs_from_data() -> dict[tuple[str, int], set]:
    """``{(model, world size): {rank, ...}}`` of every PowerSGD row in :data:`FILES`."""
    wanted: dict[tuple[str, int], set] = {}
    for costs, _ in FILES:
        for row in json.load(open(DATA / costs))["rows"]:
            r = powersgd_rank(row["entry"])
            if r is not None:
                wanted.setdefault((row["model"], row["world_size"]), set()).add(r)
    return wanted


def measure(args, argv=None) -> None:
    import torch.multiprocessing as mp

    from gradsync.comm.rendezvous import free_port
    from gradsync.workloads import get_workload

    if args.points_from_data:
        jobs = jobs_from_data()
    else:
        jobs = {(m, w): set(int(r) for r in args.ranks.split(","))
                for m in args.models.split(",") for w in (int(v) for v in args.world_sizes.split(","))}
    from gradsync.bench.accuracy_costs import provenance

    commit, machine = provenance(HERE)
    command = "python benchmarks/quality_signals.py " + " ".join(argv or sys.argv[1:])
    done = json.load(open(args.out)) if Path(args.out).exists() else {"schema": "gradsync-quality-signals/1",
                                                                      "jobs": []}
    done.setdefault("commands", []).append(f"{command} (commit {commit}, {machine})")
    have = {(j["model"], j["world_size"], j["rank"]) for j in done["jobs"]}
    for (spec, world), ranks in sorted(jobs.items()):
        todo = sorted(r for r in ranks if (spec, world, r) not in have)
        if not todo:
            continue
        name, _, arch = spec.partition(":")
        batch_size = get_workload(name, arch or None).defaults["batch_size"]
        port = free_port()
        with mp.get_context("fork").Pool(world) as pool:
            result = pool.starmap(_rank_main, [(k, world, port, spec, batch_size, todo, args.seed, args.steps,
                                                args.skip) for k in range(world)])[0]
        for r in todo:
            done["jobs"].append({"model": spec, "world_size": world, "rank": r, "seed": args.seed,
                                 "steps": args.steps, "skip": args.skip, **result[r]})
            print(spec, world, r, {k: round(v, 3) for k, v in result[r].items()}, flush=True)
        json.dump(done, open(args.out, "w"), indent=1)


def score(args) -> None:
    from fit_quality_model import points
    from outcome_noise import best_cut

    from gradsync.profiler.quality_model import optimizer_family

    signals = {(j["model"], j["world_size"], j["rank"]): j for j in json.load(open(args.signals))["jobs"]}
    rows = []
    for costs, errors in FILES:
        for q in points(str(DATA / costs), str(DATA / errors), skip_unmeasured=True):
            model, world = q.workload.rsplit(" x", 1)
            r = powersgd_rank(q.entry)
            if q.error == 0:
                values = {"full": 0.0, "directional": 0.0, "per_layer": 0.0, "descent": 1.0}
            elif r is not None and (model, int(world), r) in signals:
                values = signals[(model, int(world), r)]
            else:
                continue
            rows.append((optimizer_family(q.optimizer), q, values))
    for family in sorted({f for f, _, _ in rows}):
        group = [(q, v) for f, q, v in rows if f == family]
        workloads = len({q.workload for q, _ in group})
        print(f"{family}: {len(group)} rows over {workloads} workloads, {sum(q.missed for q, _ in group)} missed")
        for name in SIGNALS:
            sign = -1 if name == "descent" else 1  # descent: accept above the cut
            cut, wrong = best_cut([(sign * v[name], q.missed) for q, v in group])
            print(f"  {name:<12} best cut {sign * cut:7.3f}: {wrong} of {len(group)} called wrong")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--points-from-data", action="store_true")
    m.add_argument("--models", default="fashion-mnist:vgg")
    m.add_argument("--world-sizes", default="2")
    m.add_argument("--ranks", default="2,4,8")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--steps", type=int, default=24)
    m.add_argument("--skip", type=int, default=8)
    s = sub.add_parser("score")
    s.add_argument("signals")
    args = p.parse_args(argv)
    measure(args, argv) if args.command == "measure" else score(args)


if __name__ == "__main__":
    main()
