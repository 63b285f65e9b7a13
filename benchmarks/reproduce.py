"""Regenerate every results table of docs/results.md from scratch: one named experiment per table.

Usage:
    PYTHONPATH=src python benchmarks/reproduce.py --list
    PYTHONPATH=src python benchmarks/reproduce.py [--only NAME[,NAME...]] [--out results] [--dry-run] [--quick]
    make reproduce            # every experiment, into results/

Each experiment runs its commands (``gradsync train`` / ``gradsync bench`` / a script in
``benchmarks/``) with ``--out`` under ``OUT/NAME/``, so the raw JSON (``metrics.json`` per training
run, ``bench.json`` per benchmark, the scripts' own JSON) lies next to the generated markdown table
``OUT/NAME/NAME.md``; ``OUT/NAME/commands.txt`` lists the exact commands. Every figure in
docs/results.md traces to one experiment here (its heading there is in ``--list``).

``--dry-run`` prints the commands without running them. ``--quick`` shrinks every run to a few steps
(a smoke test of the pipeline, used by the test suite; its numbers mean nothing). Experiments marked
"root" build an emulated cluster (network namespaces + tc); without root ``gradsync bench`` falls back
to loopback and the table is labelled "NOT shaped". Timings depend on the machine and its load: the
ones in docs/results.md were taken on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # a checkout without PYTHONPATH=src
from gradsync.bench.report import accuracy_rows, time_to_target_cell  # noqa: E402
from gradsync.report.training import fmt_bytes  # noqa: E402

GRADSYNC = [sys.executable, "-m", "gradsync"]
QUICK_TRAIN = ["--max-steps", "3", "--train-samples", "512", "--eval-samples", "500", "--no-progress"]
QUICK_BENCH = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--eval-every", "5", "--max-accuracy-steps", "10"]


@dataclass
class Run:
    """One command of an experiment: ``kind`` is ``train``, ``bench``, ``sweep`` or ``script``; ``argv`` its
    arguments (after ``gradsync train``/``bench``/``sweep``, or the script path and its arguments);
    ``name`` the row label and output sub-directory."""

    name: str
    kind: str
    argv: list[str]
    quick: list[str] | None = None  # arguments appended in --quick mode (None: the kind's default)


@dataclass
class Experiment:
    name: str
    readme: str  # the docs/results.md paragraph or table it regenerates
    runs: list[Run]
    table: Callable[[Path, list[Run]], str]
    root: bool = False
    notes: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------- tables
def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def train_table(out: Path, runs: list[Run]) -> str:
    """One row per training run: test accuracy (bits per character for the KJV workloads), steps,
    wire bytes per rank per iteration, compression ratio (wire), mean iteration time, network."""
    rows = []
    for run in runs:
        s = json.loads((out / run.name / "metrics.json").read_text())["summary"]
        metric = (f"{s['bits_per_char']:.3f} bits/char" if "bits_per_char" in s
                  else f"{s['test_accuracy'] * 100:.2f} %")
        algo = s["algorithm"] + (f" (K={s['ratio']})" if "ratio" in s else "")
        rows.append([run.name, algo, metric, str(s["steps"]), fmt_bytes(s["wire_bytes_per_iteration"]),
                     f"{s['compression_ratio']:.2f}x", f"{s['mean_iteration_s'] * 1e3:.1f}",
                     s.get("network", "")])
    return _md(["run", "algorithm", "test metric", "steps", "wire/iter", "compression", "iteration ms",
                "network"], rows)


def bench_table(out: Path, runs: list[Run]) -> str:
    """The ``gradsync bench`` table of each bench run (and the time-to-accuracy table when measured)."""
    parts = []
    for run in runs:
        res = json.loads((out / run.name / "bench.json").read_text())
        parts.append(f"**{run.name}**: {res.get('network', '')}, {res['world_size']} ranks, dense all-reduce "
                     f"CCR {res['dense_ccr']:.2f}\n")
        rows = []
        for r in res["rows"]:
            opts = r.get("options", {})
            name = r["algorithm"] + (f" (K={opts['ratio']})" if opts.get("ratio") is not None else "")
            rows.append([name, f"{r['iteration_s']['median'] * 1e3:.1f}", f"{r['speedup_vs_allreduce']:.2f}x",
                         f"{r['scaling_efficiency'] * 100:.0f} %", f"{r['exposed_comm_s'] * 1e3:.1f}",
                         fmt_bytes(r["wire_bytes_per_iteration"]), f"{r['compression_ratio']:.2f}x",
                         fmt_bytes(r["payload_bytes_per_iteration"])])
        parts.append(_md(["algorithm", "median ms", "speedup", "scaling eff.", "exposed comm ms", "wire/iter",
                          "ratio", "payload/iter"], rows))
        if any("time_to_accuracy" in r for r in res["rows"]):
            target = res["config"]["to_accuracy"] * 100
            rows = [[r["algorithm"] + (f" ({r['options']})" if r["options"] else ""),
                     time_to_target_cell(r),
                     "-" if r["final_accuracy"] is None else f"{r['final_accuracy'] * 100:.1f} %",
                     f"{r['iteration_ms']:.1f}", f"{r['scaling_efficiency'] * 100:.0f} %",
                     fmt_bytes(r["wire_bytes_per_iteration"]), "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"]
                    for r in accuracy_rows(res)]
            parts.append("\n" + _md(["algorithm", f"time to {target:.0f} % (s)", "final accuracy", "iteration ms",
                                     "scaling eff.", "wire/iter", "speed-up"], rows))
    return "\n".join(parts)


def script_table(out: Path, runs: list[Run]) -> str:
    """A script's own report: its markdown output when it writes one, else its stdout."""
    parts = []
    for run in runs:
        d = out / run.name
        mds = sorted(d.glob("*.md"))
        body = "\n".join(p.read_text() for p in mds) if mds else "```\n" + (d / "stdout.txt").read_text() + "```\n"
        parts.append(f"**{run.name}**\n\n{body}")
    return "\n".join(parts)


def sweep_table(out: Path, runs: list[Run]) -> str:
    """Per network of a ``gradsync sweep``: each entry's mean iteration time, median steps to the target,
    predicted olympic-mean seconds to it, speed-up over allreduce and seeds reached; then the
    validation rows (predicted against measured seconds)."""
    parts = []
    for run in runs:
        result = json.loads((out / run.name / "sweep.json").read_text())
        q = result["quality"]
        from gradsync.bench.sweep import auto_label, summary_rows

        target = f"{q['target'] * 100:.2f} %" if q["higher_is_better"] else f"{q['target']:.4f}"
        parts.append(f"Target {target} ({q['target_from']} mean final - 0.5 points), seeds {q['seeds']}.\n")
        for rate, pred in result["networks"].items():
            rows = [[auto_label(pred) if r["entry"] == "auto" else r["entry"],
                     f"{r['iteration_ms']:.1f}", "-" if r["median_steps"] is None else f"{r['median_steps']:g}",
                     "not reached" if r["predicted_s"] is None else f"{r['predicted_s']:.1f}",
                     "-" if r["speedup"] is None else f"{r['speedup']:.2f}x", f"{r['reached']}/{len(q['seeds'])}"]
                    for r in summary_rows(pred)]
            parts.append(f"**{result['hosts']} hosts at {rate} Mbit/s** (dense CCR {pred['dense_ccr']:.2f})\n\n"
                         + _md(["entry", "iteration ms (mean)", "median steps", "predicted s (olympic mean)",
                                "vs allreduce", "reached"], rows))
        for v in result["validation"]:
            parts.append(f"Validation at {v['bandwidth_mbit']:g} Mbit/s ({'holds' if v['holds'] else 'does NOT hold'}"
                         f" within 10 %):\n\n" + _md(["entry", "seed", "predicted s", "measured s", "error"], [
                             [r["entry"], str(r["seed"]), f"{r['predicted_s']:.1f}" if r["predicted_s"] else "-",
                              f"{r['measured_s']:.1f}" if r["measured_s"] else "-",
                              "-" if r["error"] is None else f"{r['error'] * 100:+.1f} %"] for r in v["rows"]]))
    return "\n".join(parts)


def _sweep(name: str, title: str, args: list[str], quick: tuple[str, ...] = ()) -> "Experiment":
    """A one-sweep experiment whose ``--quick`` form trains seed 0 for a few steps (plus ``quick``)."""
    return Experiment(name, title, [Run("sweep", "sweep", args, quick=["--seeds", "0", *quick, *SWEEP_QUICK])],
                      sweep_table, root=True)


# ------------------------------------------------------------------------------------- experiments
DEMO = ["--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=8,"
        "powersgd-overlap:matrix_approximation_rank=8,auto", "--seeds", "0", "--hosts", "2", "--bandwidths", "5",
        "--epochs", "2", "--eval-every", "39", "--rounds", "3"]  # the Makefile's DEMO_ARGS
# --quick: a few steps of everything (sweep-fmnist's and the demo's)
SWEEP_QUICK = ["--train-samples", "512", "--epochs", "1", "--eval-every", "2", "--eval-samples", "200", "--steps", "2",
               "--warmup", "0", "--rounds", "1"]

# time to accuracy over 3 seeds against fp16 and two PowerSGD ranks (after --hosts H --bandwidth R)
SEEDS = ["--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=1,powersgd:matrix_approximation_rank=4,"
         "covap:ratio=2:cast=fp16", "--lr", "0.05", "--steps", "10", "--warmup", "3", "--rounds", "2",
         "--to-accuracy", "0.80", "--seeds", "0,1,2", "--eval-every", "25", "--eval-samples", "2000",
         "--max-accuracy-steps", "500", "--table", "accuracy"]
# the fashion-mnist grid of gradsync sweep (the entries whose loopback steps to quality were measured)
SWEEP_ENTRIES = ("allreduce,fp16,powersgd:matrix_approximation_rank=2,covap:ratio=3:cast=fp16,"
                 "powersgd:matrix_approximation_rank=4,covap:ratio=2:cast=fp16,auto")
# the fashion-mnist grid of PowerSGD ranks and dense tails, with auto (docs/results.md's first section)
TAIL_ENTRIES = ("allreduce,fp16,powersgd:matrix_approximation_rank=4,powersgd:matrix_approximation_rank=8,"
                "powersgd:matrix_approximation_rank=16,powersgd:matrix_approximation_rank=4:dense_from=700,"
                "powersgd:matrix_approximation_rank=4:dense_from=800,auto")


#: The online probe's out-of-sample grid (besides DDP, fp16 and auto).
ONLINE_GRID = "powersgd:matrix_approximation_rank=4," + ",".join(
    f"powersgd-overlap:matrix_approximation_rank={r}" for r in (2, 4, 8))
#: with r=16, which the per-seed risk limit (4bedd88) leaves auto where it rejects r=8
ONLINE_GRID_16 = ONLINE_GRID + ",powersgd-overlap:matrix_approximation_rank=16"


def _fmnist_grid(entries: str, validate: str) -> Run:
    """The 5-seed fashion-mnist sweep on 2 hosts at 5, 15 and 40 Mbit/s, with full shaped runs of
    ``validate`` (seed 0) at 5 and 15 Mbit/s checking its prediction."""
    return Run("sweep", "sweep", ["--algorithms", entries, "--seeds", "0,1,2,3,4", "--hosts", "2",
                                  "--bandwidths", "5,15,40", "--epochs", "2", "--eval-every", "39",
                                  "--validate-bandwidth", "5,15", "--validate-algorithms", validate,
                                  "--validate-seeds", "0"],
               quick=["--seeds", "0", *SWEEP_QUICK])


# the transformer with AdamW (before --algorithm ...)
ADAMW = ["--workload", "kjv-transformer", "--workers", "3", "--max-steps", "150"]

EXPERIMENTS = [
    Experiment("demo", "`make demo`: time to quality on 2 emulated hosts at 5 Mbit/s (gradsync sweep, one seed)",
               [Run("sweep", "sweep", DEMO, quick=SWEEP_QUICK)], sweep_table, root=True),
    Experiment("seeds", "Results: time to accuracy against the best peers, 3 seeds", [
        Run("bench", "bench", ["--hosts", "2", "--bandwidth", "15", *SEEDS]),
        Run("bench-2hosts-10", "bench", ["--hosts", "2", "--bandwidth", "10", *SEEDS]),
        Run("bench-4hosts", "bench", ["--hosts", "4", "--bandwidth", "10", *SEEDS]),
    ], bench_table, root=True),
    Experiment("train-default", "Results: `gradsync train` (the default job)", [
        Run("allreduce", "train", ["--algorithm", "allreduce"]),
        Run("covap-auto", "train", ["--algorithm", "covap", "--ratio", "auto"]),
        Run("covap-4", "train", ["--algorithm", "covap", "--ratio", "4"]),
    ], train_table),
    Experiment("bench-4hosts-25", "Results: `gradsync bench --hosts 4 --bandwidth 25 ...` table", [
        Run("bench", "bench", ["--hosts", "4", "--bandwidth", "25", "--algorithms", "allreduce,fp16,powersgd,covap",
                               "--steps", "20", "--rounds", "3"]),
    ], bench_table, root=True),
    Experiment("dear", "Results: DeAR (bitwise-identical losses; 2 hosts at 20 Mbit/s, 4 hosts at 25 Mbit/s)", [
        Run("allreduce", "train", ["--algorithm", "allreduce", "--max-steps", "100"]),
        Run("dear", "train", ["--algorithm", "dear", "--max-steps", "100"]),
        Run("bench-2hosts", "bench", ["--hosts", "2", "--bandwidth", "20", "--algorithms", "allreduce,dear",
                                      "--fusion-mb", "0.1"]),
        Run("bench", "bench", ["--hosts", "4", "--bandwidth", "25", "--algorithms", "allreduce,dear,covap,dear-covap",
                               "--fusion-mb", "0.1"]),
    ], lambda out, runs: train_table(out, runs[:2]) + "\n" + _dear_identical(out) + "\n" + bench_table(out, runs[2:]),
        root=True),
    Experiment("simulator", "Results: simulator validation", [
        Run("validate", "script", ["benchmarks/validate_simulator.py", "--hosts", "4", "--bandwidths", "10,25,50"],
            quick=["--bandwidths", "25", "--steps", "2", "--rounds", "1", "--algorithms", "allreduce,covap"]),
    ], script_table, root=True),
    Experiment("gravac", "Results: GraVAC table (--epochs 2)", [
        Run("allreduce", "train", ["--algorithm", "allreduce", "--epochs", "2"]),
        Run("topk-0.1", "train", ["--algorithm", "topk", "--density", "0.1", "--epochs", "2"]),
        Run("topk-0.01", "train", ["--algorithm", "topk", "--density", "0.01", "--epochs", "2"]),
        Run("topk-0.001", "train", ["--algorithm", "topk", "--density", "0.001", "--epochs", "2"]),
        Run("gravac", "train", ["--algorithm", "gravac", "--epochs", "2"]),
    ], train_table),
    Experiment("kjv-lstm", "Results: kjv-lstm, 1 epoch (bits per character)", [
        Run("allreduce", "train", ["--workload", "kjv-lstm", "--algorithm", "allreduce", "--epochs", "1"]),
        Run("topk-0.1", "train", ["--workload", "kjv-lstm", "--algorithm", "topk", "--density", "0.1", "--epochs", "1"]),
        Run("topk-0.01", "train", ["--workload", "kjv-lstm", "--algorithm", "topk", "--density", "0.01", "--epochs", "1"]),
        Run("gravac", "train", ["--workload", "kjv-lstm", "--algorithm", "gravac", "--epochs", "1"]),
        Run("gravac-floor-0.9", "train", ["--workload", "kjv-lstm", "--algorithm", "gravac", "--gain-floor", "0.9",
                                          "--epochs", "1"]),
    ], train_table),
    Experiment("adamw", "Results: COVAP with AdamW (kjv-transformer, 3 workers, 150 steps)", [
        Run("allreduce", "train", [*ADAMW, "--algorithm", "allreduce"]),
        Run("covap-4", "train", [*ADAMW, "--algorithm", "covap", "--ratio", "4"]),
        Run("covap-2-fp16", "train", [*ADAMW, "--algorithm", "covap", "--ratio", "2", "--cast", "fp16"]),
    ], train_table),
    Experiment("oscar", "Results: OSCAR (--epochs 2; 4 hosts at 25 Mbit/s)", [
        Run("oscar-sw", "train", ["--algorithm", "oscar-sw", "--epochs", "2"]),
        Run("oscar-asc", "train", ["--algorithm", "oscar-asc", "--epochs", "2"]),
        Run("countsketch", "train", ["--algorithm", "countsketch", "--epochs", "2"]),
        Run("bench", "bench", ["--hosts", "4", "--bandwidth", "25", "--algorithms", "allreduce,oscar-sw,oscar-asc"]),
    ], lambda out, runs: train_table(out, runs[:3]) + "\n" + bench_table(out, runs[3:]), root=True),
    Experiment("asc-coding", "Results: ASC coded bytes (benchmarks/asc_coding.py 4 31 12)", [
        Run("asc_coding", "script", ["benchmarks/asc_coding.py", "4", "31", "12"], quick=[]),
    ], script_table),
    Experiment("asc-coding-time", "Results: OSCAR coding cost (benchmarks/asc_coding_time.py)", [
        Run("asc_coding_time", "script", ["benchmarks/asc_coding_time.py", "--json", "{out}/asc_coding_time.json"],
            quick=["--reps", "2", "--numel", "20000"]),
    ], script_table),
    Experiment("sweep-fmnist", "Results: time to quality, MLPerf-style, predicted per network (gradsync sweep)", [
        _fmnist_grid(SWEEP_ENTRIES, validate="powersgd:matrix_approximation_rank=2"),
    ], sweep_table, root=True),
    Experiment("sweep-tails", "Results: time to quality of PowerSGD ranks, dense tails and auto (gradsync sweep)", [
        _fmnist_grid(TAIL_ENTRIES, validate="powersgd:matrix_approximation_rank=4:dense_from=700"),
    ], sweep_table, root=True),
    _sweep("sweep-3-hosts", "Results: time to quality at 3 hosts (gradsync sweep)",
           ["--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=4:dense_from=467,auto", "--seeds", "0,1,2,3,4",
            "--hosts", "3", "--bandwidths", "5,15,40", "--epochs", "2", "--eval-every", "26"]),
    _sweep("sweep-grid-cells", "Results: grid cells, COVAP with fp32 shards and top-k (gradsync sweep)",
           ["--quality-target", "0.89266", "--algorithms", "covap:ratio=2,covap:ratio=4,topk:density=0.01",
            "--seeds", "0,1,2", "--hosts", "2", "--bandwidths", "5,15,40", "--epochs", "2",
            "--eval-every", "39"]),
    _sweep("sweep-bf16", "Results: the bf16 hook under the recipe (gradsync sweep)",
           ["--algorithms", "allreduce,fp16,bf16", "--seeds", "0,1,2,3,4", "--hosts", "2",
            "--bandwidths", "5,15,40", "--epochs", "2", "--eval-every", "39"]),
    _sweep("sweep-overlap", "Results: time to quality with PowerSGD overlapped with backward (gradsync sweep)",
           ["--algorithms", "allreduce,fp16,bf16,powersgd:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=4:dense_from=700,auto", "--seeds", "0,1,2,3,4",
            "--hosts", "2", "--bandwidths", "5,15,40", "--epochs", "2", "--eval-every", "39"]),
    _sweep("sweep-wide-cnn", "Results: time to quality on the larger CNN (ResNet-8 at width 32; gradsync sweep)",
           ["--model", "resnet8-w32", "--algorithms",
            "allreduce,fp16,powersgd:matrix_approximation_rank=4,powersgd:matrix_approximation_rank=8,"
            "powersgd:matrix_approximation_rank=4:dense_from=700,auto", "--seeds", "0,1,2",
            "--hosts", "2", "--bandwidths", "5,15,40", "--epochs", "2", "--eval-every", "26"],
           quick=("--model", "resnet8-w32")),
    _sweep("oos-vit", "Results: auto out of sample, the ViT with AdamW (gradsync sweep)",
           ["--model", "vit-tiny", "--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=8,auto", "--seeds", "0,1,2,3,4", "--hosts", "2",
            "--bandwidths", "5,40", "--epochs", "2", "--eval-every", "52", "--eval-samples", "5000", "--rounds", "3"],
           quick=("--model", "vit-tiny")),
    _sweep("oos-vit-4hosts", "Results: auto out of sample, the ViT with AdamW on 4 hosts (gradsync sweep)",
           ["--model", "vit-tiny", "--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=4,"
            "powersgd-overlap:matrix_approximation_rank=4,powersgd:matrix_approximation_rank=8,"
            "powersgd-overlap:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=16,auto",
            "--seeds", "0,1,2,3,4", "--hosts", "4", "--bandwidths", "5,40", "--epochs", "2", "--eval-every", "26",
            "--eval-samples", "5000", "--rounds", "3"],
           quick=("--model", "vit-tiny")),
    *(_sweep(name, f"Results: auto out of sample, the GRU with SGD{where} (gradsync sweep)",
             ["--model", "gru", "--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=4,"
              "powersgd-overlap:matrix_approximation_rank=4,powersgd-overlap:matrix_approximation_rank=8,auto",
              "--seeds", "0,1,2,3,4", "--hosts", hosts, "--bandwidths", "5,40", "--epochs", "2", "--eval-every",
              every, "--eval-samples", "5000", "--rounds", "3"], quick=("--model", "gru"))
      for name, where, hosts, every in (("oos-gru", "", "2", "52"), ("oos-gru-4hosts", " on 4 hosts", "4", "26"))),
    *(_sweep(name, f"Results: auto out of sample, {family}{where} (gradsync sweep)",
             ["--model", model, "--algorithms", "allreduce,fp16," + compressed + ",auto",
              "--seeds", "0,1,2,3,4", "--hosts", hosts, "--bandwidths", bandwidths, "--epochs", epochs, "--eval-every",
              every, "--eval-samples", "5000", "--rounds", "3", *probe], quick=("--model", model))
      for name, family, model, bandwidths, where, hosts, every, compressed, epochs, probe in (
          ("oos-mixer", "the MLP-Mixer with AdamW", "mixer", "5,40", "", "2", "52",
           "powersgd:matrix_approximation_rank=4,powersgd-overlap:matrix_approximation_rank=2,"
           "powersgd-overlap:matrix_approximation_rank=4,powersgd-overlap:matrix_approximation_rank=8", "2", ()),
          ("oos-mixer-4hosts", "the MLP-Mixer with AdamW", "mixer", "5,40", " on 4 hosts", "4", "26",
           "powersgd:matrix_approximation_rank=4,powersgd-overlap:matrix_approximation_rank=4,"
           "powersgd:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=8", "2", ()),
          *((name, "a plain MLP with SGD", "mlp", "200,3000", where, hosts, every,
             ",".join(f"{n}:matrix_approximation_rank={r}" for n in ("powersgd", "powersgd-overlap") for r in (1, 2, 4, 8)),
             "2", ())
            for name, where, hosts, every in (("oos-mlp", "", "2", "52"), ("oos-mlp-4hosts", " on 4 hosts", "4", "26"))),
          # auto decided on the job's own steps (--auto-probe online), 1 epoch, one grid: torch's PowerSGD r=4 and
          # the overlapped r=2/4/8. The MobileNet since the thirteenth session (its step is 16x the MLP's: a 55 ms
          # forward and backward pass of batch 64 on one thread); the LeNet, the online probe's out-of-sample
          # family (added after it was frozen at 1cef260); the GRU again (the sixth-session rows above trained 2); the
          # ResNet-8, in sample (the grids' workload), at the links of its earlier sweeps
          *((prefix + suffix, family, model, links, where, hosts, every, ONLINE_GRID, "1", ("--auto-probe", "online"))
            for prefix, family, model, links in (
                ("oos-mobilenet", "a MobileNetV2-style CNN with SGD", "mobilenet", "15,50"),
                ("oos-lenet", "a LeNet-5-style CNN with SGD", "lenet", "30,150"),
                ("online-gru", "the GRU with SGD under the online probe", "gru", "15,80"),
                ("online-resnet8", "the ResNet-8 (the quality model's own workload) under the online probe", "resnet8",
                 "5,40"))
            for suffix, where, hosts, every in (("", "", "2", "26"), ("-4hosts", " on 4 hosts", "4", "13"))),
          # the online probe's out-of-sample families, each written after its rule was frozen: the TCN (torch's PowerSGD
          # raced on joined buckets, 073ad38), the S4D and the DenseNet-BC (every candidate metered on the same steps,
          # 330a612), the SqueezeNet (the lossless race and the metering filter, eighteenth session), the VGG (the
          # quality model's per-seed risk limit, 4bedd88); 2 epochs on 4 hosts (234 steps of 1 epoch left the GRU's
          # dense run short of its own target)
          *((prefix + suffix, family, model, "8,60", where, hosts, "26", grid, epochs, ("--auto-probe", "online"))
            for prefix, family, model, grid in (
                ("oos-tcn", "a temporal convolutional network (TCN) with SGD", "tcn", ONLINE_GRID),
                ("oos-s4d", "a diagonal state-space model (S4D) with SGD", "s4d", ONLINE_GRID),
                ("oos-densenet", "a DenseNet-BC with SGD", "densenet", ONLINE_GRID),
                ("oos-squeezenet", "a SqueezeNet with SGD", "squeezenet", ONLINE_GRID),
                ("oos-vgg", "a VGG-style CNN with SGD", "vgg", ONLINE_GRID_16))
            for suffix, where, hosts, epochs in (("", "", "2", "1"), ("-4hosts", " on 4 hosts", "4", "2"))))),
    _sweep("sweep-periodic", "Results: syncing rarely, local SGD and DiLoCo against per-step compression (gradsync sweep)",
           ["--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=8,diloco:period=16,local-sgd:period=16,"
            "diloco:period=16:fragments=4,diloco:period=4,local-sgd:period=4,diloco:period=64,local-sgd:period=64",
            "--seeds", "0,1,2,3,4", "--hosts", "2", "--bandwidths", "1,5,15", "--epochs", "2", "--steps", "64",
            "--warmup", "4", "--rounds", "1"]),
    _sweep("sweep-periodic-4hosts", "Results: syncing rarely on 4 hosts (gradsync sweep)",
           ["--algorithms", "allreduce,fp16,powersgd:matrix_approximation_rank=8,powersgd-overlap:matrix_approximation_rank=8,"
            "local-sgd:period=4,local-sgd:period=16,local-sgd:period=64,diloco:period=16,diloco:period=4,diloco:period=64,"
            "diloco:period=16:fragments=4,torchft-diloco:period=16",
            "--seeds", "0,1,2,3,4", "--hosts", "4", "--bandwidths", "1,5,15", "--epochs", "2", "--steps", "64",
            "--warmup", "4", "--rounds", "1"]),
    Experiment("sweep-kjv", "Results: time to quality on the character transformer with AdamW (gradsync sweep)", [
        Run("sweep", "sweep", ["--workload", "kjv-transformer", "--algorithms",
                               "allreduce,fp16,powersgd:matrix_approximation_rank=4:dense_from=300,auto",
                               "--seeds", "0,1,2", "--hosts", "2", "--bandwidths", "10,30,100,300", "--eval-every",
                               "40", "--steps", "10", "--warmup", "3", "--rounds", "1"],
            quick=["--seeds", "0", "--workload", "kjv-transformer", "--train-samples", "128", "--epochs", "1",
                   "--eval-every", "2", "--eval-samples", "64", "--steps", "2", "--warmup", "0", "--rounds", "1"]),
    ], sweep_table, root=True),
    Experiment("sweep-kjv-ranks", "Results: PowerSGD's ranks on the character transformer with AdamW, the quality "
               "model's AdamW rows (gradsync sweep)", [
        Run("sweep", "sweep", ["--workload", "kjv-transformer", "--algorithms",
                               "allreduce,powersgd:matrix_approximation_rank=16,powersgd:matrix_approximation_rank=8",
                               "--seeds", "0,1,2", "--hosts", "2", "--bandwidths", "30", "--eval-every", "40",
                               "--steps", "3", "--warmup", "1", "--rounds", "1"],
            quick=["--seeds", "0", "--workload", "kjv-transformer", "--train-samples", "128", "--epochs", "1",
                   "--eval-every", "2", "--eval-samples", "64", "--steps", "2", "--warmup", "0", "--rounds", "1"]),
    ], sweep_table, root=True),
    Experiment("crossover", "Results: crossover rates (benchmarks/crossover.py)", [
        Run("crossover", "script", ["benchmarks/crossover.py", "--bandwidths", "10,50,250,1000", "--algorithms",
                                    "allreduce,oscar-sw,oscar-asc,topk,covap", "--hosts", "2", "--steps", "15",
                                    "--warmup", "5", "--rounds", "2", "--out", "{out}"],
            quick=["--bandwidths", "25", "--algorithms", "allreduce,covap", "--steps", "2", "--warmup", "1",
                   "--rounds", "1"]),
    ], script_table, root=True),
]


def _dear_identical(out: Path) -> str:
    a = [i["loss"] for i in json.loads((out / "allreduce" / "metrics.json").read_text())["iterations"]]
    d = [i["loss"] for i in json.loads((out / "dear" / "metrics.json").read_text())["iterations"]]
    same = sum(x == y for x, y in zip(a, d))
    return f"allreduce and dear training losses: {same} of {min(len(a), len(d))} steps bitwise identical\n"


def commands(exp: Experiment, out: Path, quick: bool) -> list[tuple[Run, list[str]]]:
    """The argv of every run of ``exp`` writing under ``out / exp.name``."""
    base = out / exp.name
    cmds = []
    for run in exp.runs:
        d = base / run.name
        if run.kind == "train":
            argv = GRADSYNC + ["train", *run.argv, "--out", str(d)]
            if quick:
                argv += [a for a in QUICK_TRAIN if a != "--no-progress"] + ["--no-progress"]
                argv = _drop(argv, ["--epochs"]) + ["--epochs", "1"]
        elif run.kind == "bench":
            argv = GRADSYNC + ["bench", *run.argv, "--out", str(d)]
            if quick:
                argv += QUICK_BENCH
        elif run.kind == "sweep":  # quick: later flags replace the earlier ones
            argv = GRADSYNC + ["sweep", *run.argv, *(run.quick if quick and run.quick else []), "--out", str(d)]
        else:
            argv = [sys.executable, *[a.replace("{out}", str(d)) for a in run.argv]]
            if quick and run.quick is not None:
                argv += run.quick
        cmds.append((run, argv))
    return cmds


def _drop(argv: list[str], flags: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


def _display(argv: list[str]) -> str:
    """``gradsync ...`` / ``python benchmarks/...`` as a user types it."""
    if argv[:len(GRADSYNC)] == GRADSYNC:
        return shlex.join(["gradsync", *argv[len(GRADSYNC):]])
    return shlex.join(["python", *argv[1:]])


def run_experiment(exp: Experiment, out: Path, quick: bool = False, dry_run: bool = False) -> Path | None:
    """Run ``exp``'s commands and write ``OUT/NAME/NAME.md``; return its path (None for a dry run).

    Raises:
        subprocess.CalledProcessError: when a command fails (its output is on the terminal).
    """
    cmds = commands(exp, out, quick)
    if dry_run:
        for _, argv in cmds:
            print(_display(argv))
        return None
    base = out / exp.name
    base.mkdir(parents=True, exist_ok=True)
    (base / "commands.txt").write_text("\n".join(shlex.join(a) for _, a in cmds) + "\n")
    for run, argv in cmds:
        d = base / run.name
        d.mkdir(parents=True, exist_ok=True)
        print(f"[{exp.name}/{run.name}] {shlex.join(argv)}", flush=True)
        t0 = time.monotonic()
        if run.kind == "script":
            proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
            (d / "stdout.txt").write_text(proc.stdout)
            sys.stdout.write(proc.stdout[-4000:])
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, argv)
        else:
            subprocess.run(argv, check=True)
        print(f"[{exp.name}/{run.name}] {time.monotonic() - t0:.0f} s", flush=True)
    md = base / f"{exp.name}.md"
    text = (f"### {exp.readme}\n\n" + ("*(--quick smoke run: these numbers mean nothing)*\n\n" if quick else "")
            + exp.table(base, exp.runs) + "\nCommands:\n" + "".join(f"`{_display(a)}`\n" for _, a in cmds))
    md.write_text(text)
    print(text)
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the experiments and the docs/results.md text each regenerates")
    ap.add_argument("--only", default=None, help="comma-separated experiment names (default: all)")
    ap.add_argument("--out", default="results", help="directory for the tables and raw JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    ap.add_argument("--quick", action="store_true", help="a few steps per run: a smoke test, not results")
    args = ap.parse_args(argv)
    by_name = {e.name: e for e in EXPERIMENTS}
    if args.list:
        for e in EXPERIMENTS:
            print(f"{e.name:16s} {'root ' if e.root else '     '}{e.readme}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        ap.error(f"only must name experiments among {', '.join(by_name)}; got {', '.join(unknown)}")
    for n in names:
        run_experiment(by_name[n], Path(args.out), quick=args.quick, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
