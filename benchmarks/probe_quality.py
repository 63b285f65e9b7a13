"""Measure the start-up compression quality (:func:`gradsync.profiler.probe.measure_quality`) of every
setting in ``benchmarks/data/accuracy_costs.json`` on the model and world size it was measured at, as
``--algorithm auto`` measures it on a job (the workload's optimizer at its recipe's learning rate, each
rank its own batches of the recipe's size, DDP's automatic buckets, :data:`QUALITY_STEPS` measured
steps) and the job's gradient noise on the same steps, and write ``benchmarks/data/probe_errors.json``:
the inputs of
``benchmarks/fit_quality_model.py``.

    python benchmarks/probe_quality.py [--seeds 0,1,2] [--out benchmarks/data/probe_errors.json]
    python benchmarks/probe_quality.py --held-out --seeds 0,1 --out benchmarks/data/probe_errors_held_out.json
    python benchmarks/probe_quality.py --held-out --models fashion-mnist:lenet --append --seeds 0,1 --out ...

``--held-out`` measures PowerSGD r=1/2/4/8/16 on auto's earlier out-of-sample workloads instead (the GRU, the MLP-Mixer,
the plain MLP, the MobileNetV2-, LeNet-5-, DenseNet- and SqueezeNet-style CNNs at 2 and 4 ranks), rows the
nineteenth session's fit reads (``--with ...``), and the VGG-style CNN, held out from that fit
(``--out benchmarks/data/probe_errors_out_of_sample[_training].json``): what the frozen model predicts for it
(``benchmarks/fit_quality_model.py --held-out-costs ... --held-out-errors ...``).
``--models`` keeps only the named ones; ``--append`` keeps the jobs ``--out`` already holds for other models, world
sizes or seeds (the file's ``commands`` lists every command that wrote it).

``--training-base fp16`` measures the same steps while the probe's copy trains on fp16's aggregate (the errors a
probe riding on a job's first steps would see, :func:`~gradsync.profiler.probe.measure_quality`'s
``training_base``) and prints each setting beside the frozen measurement of the same job and seed in
``--compare`` (default: the fit's file): relative error, error-to-noise ratio and the fitted model's extra steps::

    python benchmarks/probe_quality.py --seeds 0,1 --training-base fp16 --out benchmarks/data/probe_errors_training.json

Loopback Gloo ranks (quality does not depend on the network); about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
#: auto's out-of-sample workloads (the ViT was one until its rows entered the fit, seventh session; all but the VGG
#: entered it in the nineteenth)
HELD_OUT = ("fashion-mnist:gru", "fashion-mnist:mixer", "fashion-mnist:mlp", "fashion-mnist:mobilenet",
            "fashion-mnist:lenet", "fashion-mnist:densenet", "fashion-mnist:squeezenet", "fashion-mnist:vgg")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--costs", default=str(HERE / "data" / "accuracy_costs.json"))
    p.add_argument("--seeds", default="0")
    p.add_argument("--out", default=str(HERE / "data" / "probe_errors.json"))
    p.add_argument("--held-out", action="store_true", help="the out-of-sample workloads, not the fitted rows")
    p.add_argument("--models", default=None, help="comma-separated workload:model keys to measure (default: all)")
    p.add_argument("--append", action="store_true", help="keep --out's jobs of other models, world sizes or seeds")
    p.add_argument("--training-base", default=None,
                   help="an entry (fp16): measure while the copy trains on its aggregate, not on a frozen copy")
    p.add_argument("--compare", default=str(HERE / "data" / "probe_errors.json"),
                   help="frozen measurements to print beside a --training-base run")
    args = p.parse_args(argv)
    from gradsync.bench.accuracy_costs import provenance
    from gradsync.profiler.probe import QUALITY_STEPS, measure_quality_on_loopback, quality_proxy
    from gradsync.workloads import get_workload

    if args.held_out:
        ranks = [f"powersgd-overlap:matrix_approximation_rank={r}" for r in (1, 2, 4, 8, 16)]
        jobs = {(model, world): ranks for model in HELD_OUT for world in (2, 4)}
    else:
        jobs: dict[tuple[str, int], list[str]] = {}
        for r in json.load(open(args.costs))["rows"]:
            entries = jobs.setdefault((r["model"], r["world_size"]), [])
            if r["entry"] not in entries:
                entries.append(r["entry"])
    if args.models is not None:
        keep = {m.strip() for m in args.models.split(",") if m.strip()}
        unknown = keep - {model for model, _ in jobs}
        if unknown:
            p.error(f"models must be among {', '.join(sorted({m for m, _ in jobs}))}; got {', '.join(sorted(unknown))}")
        jobs = {k: v for k, v in jobs.items() if k[0] in keep}
    out = []
    for (model_key, world), entries in jobs.items():
        entries = ["allreduce", *entries]
        for seed in [int(s) for s in args.seeds.split(",")]:
            name, _, arch = model_key.partition(":")
            batch_size = get_workload(name, arch or None).defaults["batch_size"]
            quality = measure_quality_on_loopback(model_key, batch_size, entries, world, seed=seed,
                                                  training_base=args.training_base)
            print(model_key, world, seed, f"noise {quality.noise:.3f}",
                  {e: round(v, 3) for e, v in quality.errors.items()}, flush=True)
            out.append({"model": model_key, "world_size": world, "seed": seed, "noise": quality.noise,
                        "errors": {e: quality.errors[e] for e in entries},
                        "measured_as": {e: quality_proxy(e) for e in entries}})
    commit, machine = provenance(HERE)
    command = "python benchmarks/probe_quality.py " + " ".join(argv or sys.argv[1:])
    doc = {"schema": "gradsync-probe-errors/2", "command": command,
           "commit": commit, "machine": machine, "quality_steps": QUALITY_STEPS,
           "training_base": args.training_base, "jobs": out}
    if args.append and Path(args.out).exists():
        old = json.loads(Path(args.out).read_text())
        if old.get("training_base") != args.training_base:
            p.error(f"--append: {args.out} was measured with training base {old.get('training_base')!r}, "
                    f"not {args.training_base!r}")
        new = {(j["model"], j["world_size"], j["seed"]) for j in out}
        doc["jobs"] = [j for j in old["jobs"] if (j["model"], j["world_size"], j["seed"]) not in new] + out
        doc["commands"] = [*old.get("commands", [f"{old['command']} (commit {old['commit']})"]),
                           f"{command} (commit {commit})"]
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("wrote", args.out)
    if args.training_base is not None and Path(args.compare).exists():
        print_beside(json.loads(Path(args.compare).read_text())["jobs"], out)


def print_beside(frozen: list[dict], training: list[dict]) -> None:
    """Per job, seed and setting: the frozen and the training measurement's relative error, error-to-noise
    ratio (:func:`~gradsync.algorithms.meter.error_to_noise`) and the fitted quality model's extra steps
    (the strictest family's limit), as a markdown table."""
    from gradsync.algorithms.meter import error_to_noise
    from gradsync.profiler.quality_model import FITTED

    by_key = {(j["model"], j["world_size"], j["seed"]): j for j in frozen}
    print("| model | ranks | seed | setting | error frozen / training | ratio frozen / training "
          "| extra steps frozen / training |")
    print("|---|---|---|---|---|---|---|")
    for j in training:
        f = by_key.get((j["model"], j["world_size"], j["seed"]))
        if f is None:
            continue
        for e, err in j["errors"].items():
            if e == "allreduce" or e not in f["errors"]:
                continue
            ratios = [error_to_noise(x["errors"][e], x["noise"], x["world_size"]) for x in (f, j)]
            extra = [FITTED.extra_steps(x["errors"][e], x["noise"], x["world_size"], None) for x in (f, j)]
            print(f"| {j['model']} | {j['world_size']} | {j['seed']} | {e} | {f['errors'][e]:.3f} / {err:.3f} "
                  f"| {ratios[0]:.3f} / {ratios[1]:.3f} | {extra[0]:.2f} / {extra[1]:.2f} |")


if __name__ == "__main__":
    main()
