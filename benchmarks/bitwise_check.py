"""Refactoring check: every registered algorithm's per-step losses and wire bytes, bitwise.

``python benchmarks/bitwise_check.py OUT.json`` trains every registered algorithm (plus variants:
covap and dear-covap with ``cast`` fp16/bf16, every DeAR algorithm with fp16 GradScaler and
clipping) for ``--steps`` steps on 2 Gloo ranks on 127.0.0.1, on the small MLP of
``tests/every_algorithm.py`` (fixed seed, the same batches in every run) and writes, per variant and
rank, the per-step losses (``float.hex``) and per-step ``stats()['wire_bytes']`` (``float.hex``).
``python benchmarks/bitwise_check.py --compare A.json B.json`` prints per variant whether the two
runs are bitwise equal and exits 1 when one differs or is missing.

It is a check, not a benchmark: no timing is taken. About a minute on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def variants() -> dict[str, tuple[str, dict, str]]:
    """``{variant: (algorithm, extra options, amp)}``: every registered algorithm plus the cast and
    GradScaler variants."""
    from gradsync.algorithms import REGISTRY

    out = {name: (name, {}, "off") for name in sorted(REGISTRY)}
    for cast in ("fp16", "bf16"):
        out[f"covap/cast={cast}"] = ("covap", {"cast": cast}, "off")
        out[f"dear-covap/cast={cast}"] = ("dear-covap", {"cast": cast}, "off")
    for name in ("dear", "dear-covap", "covap"):
        out[f"{name}/fp16-scaler"] = (name, {}, "fp16")
    return out


def _train(rank: int, world: int, steps: int) -> dict[str, dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from every_algorithm import OPTIONS, batches, small_model

    from gradsync.algorithms import REGISTRY, BuildContext, Precision, build

    data = batches(rank, 2 + steps)
    out: dict[str, dict] = {}
    for variant, (name, extra, amp) in variants().items():
        try:
            torch.manual_seed(1)
            precision = Precision.from_names(amp, 1.0 if amp != "off" else None, torch.device("cpu"))
            ctx = BuildContext(model=small_model(),
                               make_optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                                        weight_decay=5e-4),
                               bucket_cap_mb=0.01, seed=0, batch_size=8, steps_per_epoch=4, scaler=precision.scaler)
            keys = REGISTRY[name].options.keys()
            dp = build(name, ctx, {**{k: v for k, v in OPTIONS.items() if k in keys}, **extra})
            dp.warm_up(data[:2], F.cross_entropy)
            losses, wire = [], []
            for x, y in data[2:]:
                losses.append(float(dp.train_step(x, y, F.cross_entropy, precision).item()).hex())
                dp.observe_step(0.08, 8)
                wire.append(float(dp.stats()["wire_bytes"]).hex())
            dp.close()
            out[variant] = {"losses": losses, "wire_bytes": wire}
        except Exception as exc:  # noqa: BLE001 - reported per variant
            out[variant] = {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
        dist.barrier()
    return out


def run(path: str, steps: int) -> None:
    from distributed import run_ranks

    res = run_ranks(_train, 2, steps, timeout=600, pg_timeout=60)
    merged = {v: {f"rank{r}": res[r][v] for r in range(len(res))} for v in res[0]}
    Path(path).write_text(json.dumps(merged, indent=1, sort_keys=True))
    errors = {v: r["rank0"]["error"] for v, r in merged.items() if "error" in r["rank0"]}
    print(f"wrote {path}: {len(merged)} variants, {steps} steps" + (f"; errors: {errors}" if errors else ""))


def compare(a: str, b: str) -> int:
    """Print ``variant: equal|DIFFERENT|missing`` per variant of ``a`` or ``b``; 0 when all equal."""
    ja, jb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    bad = 0
    for v in sorted(set(ja) | set(jb)):
        if v not in ja or v not in jb:
            verdict = "missing in " + (a if v not in ja else b)
        elif any("error" in r for r in (*ja[v].values(), *jb[v].values())):
            verdict = "error" if ja[v] == jb[v] else "DIFFERENT (error)"
        else:
            verdict = "equal" if ja[v] == jb[v] else "DIFFERENT"
        bad += verdict != "equal"
        print(f"{v:28s} {verdict}")
    print(f"{len(set(ja) | set(jb)) - bad} equal, {bad} not")
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="JSON file to write")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    if args.compare:
        sys.exit(compare(*args.compare))
    if not args.out:
        p.error("give OUT.json or --compare A B")
    run(args.out, args.steps)


if __name__ == "__main__":
    main()
