"""``gradsync bench --algorithms`` entries with their own options and ``--seeds``: parsing, the
options each entry gets, the seeds' summary in the accuracy table, and a 2-rank run end to end."""

import json
import os

import pytest

from gradsync.bench.config import BenchConfig, parse_entry
from gradsync.bench.report import accuracy_rows, print_accuracy_table
from gradsync.workloads import fashion_mnist
from cli_runner import run_cli


def test_parse_entry_converts_values_to_the_option_types():
    assert parse_entry("allreduce") == ("allreduce", {})
    assert parse_entry("powersgd:matrix_approximation_rank=4") == ("powersgd", {"matrix_approximation_rank": 4})
    assert parse_entry("covap:ratio=2:cast=fp16") == ("covap", {"ratio": 2, "cast": "fp16"})
    assert parse_entry("covap:ratio=auto:adapt-every=10") == ("covap", {"ratio": "auto", "adapt_every": 10})
    assert parse_entry("topk:density=0.05:error_feedback=false") == ("topk", {"density": 0.05,
                                                                              "error_feedback": False})


@pytest.mark.parametrize("entry, message", [
    ("nope", "algorithms must be among"),
    ("covap:4", "must be KEY=VALUE"),
    ("covap:density=0.1", "covap takes adapt_every, cast, dense_from, max_ratio, ratio"),
    ("allreduce:ratio=2", "allreduce takes no options"),
    ("covap:ratio=0", "ratio must be"),
    ("covap:cast=fp8", "cast must be"),
    ("covap:ratio=2:ratio=3", "repeats 'ratio'"),
    ("topk:error_feedback=maybe", "error_feedback must be true or false"),
])
def test_parse_entry_rejects_bad_entries_naming_them(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_entry(entry)
    with pytest.raises(ValueError, match="algorithms"):
        BenchConfig(algorithms=["allreduce", entry])


def test_entry_options_override_the_shared_ones_and_a_fixed_ratio_is_not_adapted():
    cfg = BenchConfig(algorithms=["covap", "covap:ratio=2:cast=bf16", "covap:ratio=3:adapt_every=5",
                                  "powersgd:matrix_approximation_rank=1", "powersgd"],
                      options={"ratio": "auto", "adapt_every": 20, "matrix_approximation_rank": 2})
    assert (cfg.algorithm_options("covap").ratio, cfg.algorithm_options("covap").adapt_every) == ("auto", 20)
    fixed = cfg.algorithm_options("covap:ratio=2:cast=bf16")
    assert (fixed.ratio, fixed.cast, fixed.adapt_every) == (2, "bf16", 0)
    assert cfg.algorithm_options("covap:ratio=3:adapt_every=5").adapt_every == 5
    assert cfg.algorithm_options("powersgd:matrix_approximation_rank=1").matrix_approximation_rank == 1
    assert cfg.algorithm_options("powersgd").matrix_approximation_rank == 2


def test_entries_and_seeds_are_validated():
    with pytest.raises(ValueError, match="repeat an entry"):
        BenchConfig(algorithms=["covap:ratio=2", "covap:ratio=2"])
    BenchConfig(algorithms=["covap:ratio=2", "covap:ratio=4"])  # the same algorithm twice is fine
    assert BenchConfig(seeds=["0", "1", "2"]).seeds == [0, 1, 2]
    assert BenchConfig(seed=7).accuracy_seeds() == [7]
    for bad, message in ((["a"], "seeds must be integers"), ([-1], "seeds must be integers"),
                         ([1, 1], "seeds must not repeat")):
        with pytest.raises(ValueError, match=message):
            BenchConfig(seeds=bad)


def _row(name, median, by_seed):
    seconds = [s for s, _ in by_seed]
    finite = sorted(float("inf") if s is None else s for s in seconds)
    med = finite[len(finite) // 2]
    return {"algorithm": name, "iteration_s": {"median": median}, "scaling_efficiency": 0.5,
            "wire_bytes_per_iteration": 1000.0, "speedup_vs_allreduce": 0.5 / median, "options": {},
            "time_to_accuracy": {"seconds": None if med == float("inf") else med, "steps": 100,
                                 "seconds_by_seed": seconds, "final_accuracy_by_seed": [a for _, a in by_seed],
                                 "curve": [[1.0, by_seed[0][1]]]}}


def test_accuracy_rows_summarise_the_seeds(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # one line per row
    result = {"world_size": 2, "dense_ccr": 3.0,
              "config": {"to_accuracy": 0.8, "workload": "fashion-mnist", "batch_size": 64, "lr": 0.05,
                         "eval_every": 25, "rounds": 2, "steps": 10, "seeds": [0, 1, 2],
                         "eval_samples": 2000},
              "rows": [_row("allreduce", 0.5, [(60.0, 0.81), (50.0, 0.82), (70.0, 0.80)]),
                       _row("covap:ratio=2", 0.3, [(30.0, 0.80), (None, 0.79), (40.0, 0.81)]),
                       _row("topk", 0.2, [(None, 0.6), (None, 0.7), (20.0, 0.8)])]}
    rows = {r["algorithm"]: r for r in accuracy_rows(result)}
    assert rows["allreduce"]["seconds_range"] == (50.0, 70.0) and rows["allreduce"]["reached"] == 3
    assert rows["allreduce"]["final_accuracy"] == 0.81
    assert rows["covap:ratio=2"]["seconds"] == 40.0 and rows["covap:ratio=2"]["speedup"] == pytest.approx(1.5)
    assert rows["covap:ratio=2"]["seconds_range"] == (30.0, None) and rows["covap:ratio=2"]["reached"] == 2
    assert rows["topk"]["seconds"] is None and rows["topk"]["speedup"] is None
    print_accuracy_table(result, "emulated 2 hosts, tbf 10 Mbit/s")
    out = " ".join(capsys.readouterr().out.split())
    assert "first 2,000 test samples" in out and "median over seeds 0, 1, 2" in out and "2/3 reached" in out and "30.0-not reached" in out


@pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_bench_runs_entries_of_one_algorithm_and_several_seeds(tmp_path):
    # batch 32 and 5 steps per time-to-accuracy run (one evaluation each): what is checked is the entries'
    # options and wire bytes and that every entry trains once per seed, none of which needs more
    proc = run_cli(
        ["bench", "--hosts", "2", "--steps", "2", "--warmup", "0", "--batch-size", "32",
         "--rounds", "1", "--algorithms", "allreduce,powersgd:matrix_approximation_rank=1,"
         "powersgd:matrix_approximation_rank=2", "--seeds", "0,1", "--to-accuracy", "0.5", "--eval-every", "5",
         "--max-accuracy-steps", "5", "--eval-samples", "1000", "--table", "accuracy", "--out", str(tmp_path)],
        timeout=400, env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["algorithm"]: r for r in result["rows"]}
    assert list(rows) == ["allreduce", "powersgd:matrix_approximation_rank=1", "powersgd:matrix_approximation_rank=2"]
    assert rows["powersgd:matrix_approximation_rank=1"]["options"]["matrix_approximation_rank"] == 1
    assert rows["powersgd:matrix_approximation_rank=2"]["options"]["matrix_approximation_rank"] == 2
    # rank 2 sends twice rank 1's factors (P and Q of every compressed matrix)
    w1 = rows["powersgd:matrix_approximation_rank=1"]["wire_bytes_per_iteration"]
    w2 = rows["powersgd:matrix_approximation_rank=2"]["wire_bytes_per_iteration"]
    assert 1.5 * w1 < w2 < rows["allreduce"]["wire_bytes_per_iteration"]
    for r in rows.values():
        tta = r["time_to_accuracy"]
        assert tta["seeds"] == [0, 1] and len(tta["curves"]) == 2 and len(tta["seconds_by_seed"]) == 2
        assert all(0 < c[-1][1] <= 1 for c in tta["curves"])
    a = rows["allreduce"]["time_to_accuracy"]["curves"]
    assert a[0] != a[1], "the seeds train from different models and data orders"
    out = " ".join(proc.stdout.split())
    assert "first 1,000 test samples" in out and "median over seeds 0, 1" in out and "powersgd:matrix_approximation_rank=2 (r=2)" in out
