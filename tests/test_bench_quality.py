"""``gradsync bench --to-quality``: the summary arithmetic (olympic mean, not reached, pairwise wins,
target from dense), the configuration checks, and one tiny 2-rank run end to end."""

import json
import os

import pytest

from gradsync.bench.config import BenchConfig
from gradsync.bench.quality import GATE_MARGIN, default_target, lazy_curve, olympic_mean, summarise_quality
from gradsync.bench.report import print_quality_table
from gradsync.workloads import fashion_mnist
from cli_runner import run_cli


def test_olympic_mean_drops_fastest_and_slowest_and_counts_not_reached_as_slowest():
    assert olympic_mean([5.0, 1.0, 3.0, 4.0, 100.0]) == pytest.approx(4.0)
    assert olympic_mean([5.0, None, 3.0, 4.0, 1.0]) == pytest.approx(4.0)  # None dropped as the slowest
    assert olympic_mean([5.0, None, None, 4.0, 1.0]) is None  # a kept seed never reached
    assert olympic_mean([1.0, 2.0, 3.0, 4.0]) is None  # needs 5 seeds


def test_summary_target_from_dense_wins_and_never_reached():
    seeds = [0, 1, 2, 3, 4]
    # dense (1 s per 10 steps) ends at 0.90-0.92 (target 0.905): seeds 1, 2, 4 reach it at the end only;
    # "fast" (0.5 s per 10 steps) reaches it at 20 steps except on seed 3; "never" stays at 0.5
    curves = {
        "allreduce": [[[10, 1.0, 0.5], [20, 2.0, 0.7], [30, 3.0, 0.90], [40, 4.0, f]] for f in
                      (0.90, 0.91, 0.92, 0.90, 0.92)],
        "fast": [[[10, 0.5, 0.5], [20, 1.0, 0.5 if s == 3 else 0.95], [30, 1.5, 0.6 if s == 3 else 0.95],
                  [40, 2.0, 0.6 if s == 3 else 0.95]] for s in seeds],
        "never": [[[10, 0.1, 0.5], [40, 0.4, 0.5]] for _ in seeds],
    }
    out = summarise_quality(curves, seeds, higher_is_better=True, dense="allreduce")
    assert out["target"] == pytest.approx(0.91 - 0.005) and out["target_from"] == "allreduce"
    d, f, n = (out["entries"][k] for k in ("allreduce", "fast", "never"))
    assert d["final_mean"] == pytest.approx(0.91)
    assert d["seconds_by_seed"] == [None, 4.0, 4.0, None, 4.0] and d["steps_by_seed"] == [None, 40, 40, None, 40]
    assert d["median_s"] == 4.0 and d["spread_s"] == [4.0, None] and d["olympic_mean_s"] is None
    assert f["seconds_by_seed"] == [1.0, 1.0, 1.0, None, 1.0] and f["olympic_mean_s"] == pytest.approx(1.0)
    assert f["median_s"] == 1.0 and f["reached"] == 4
    assert f["wins"] == {"allreduce": [0, 1, 2, 4], "never": [0, 1, 2, 4]}
    assert d["wins"] == {"fast": [], "never": [1, 2, 4]} and n["wins"] == {"allreduce": [], "fast": []}
    assert n["median_s"] is None and n["spread_s"] == [None, None] and n["reached"] == 0
    # an absolute target; lower-is-better quality (bits per character): dense + 0.5 %
    assert summarise_quality(curves, seeds, True, target=0.6)["entries"]["fast"]["seconds_by_seed"][3] == 1.5
    assert default_target([2.0, 2.2], higher_is_better=False) == pytest.approx(2.1 * 1.005)
    loss = summarise_quality({"allreduce": [[[10, 1.0, 3.0], [20, 2.0, 2.0]]], "x": [[[10, 0.5, 2.005]]]}, [0],
                             higher_is_better=False, dense="allreduce")
    assert loss["entries"]["x"]["seconds_by_seed"] == [0.5] and loss["entries"]["allreduce"]["seconds_by_seed"] == [2.0]
    with pytest.raises(ValueError, match="dense must name an entry"):
        summarise_quality(curves, seeds, True, dense=None)
    with pytest.raises(ValueError, match="one non-empty curve per seed"):
        summarise_quality({"allreduce": [[]]}, [0], True, dense="allreduce")


def test_lazy_curve_evaluates_in_full_only_near_the_target_and_stops_at_the_first_crossing():
    full_quality = [0.50, 0.86, 0.90, 0.89, 0.93, 0.92]   # what a full evaluation would say per point
    cheap = [0.52, 0.85, 0.88, 0.91, 0.92, 0.93]          # 1,000-sample evaluations of the same models
    points = [[10 * (i + 1), float(i + 1), c] for i, c in enumerate(cheap)]
    calls = []

    def full(i):
        calls.append(i)
        return full_quality[i]
    curve = lazy_curve(points, 0.905, True, full)
    # points 0-1 are gated out (0.52, 0.85 < 0.905 - 0.04); 2 and 3 run in full and miss, 4 reaches it
    assert calls == [2, 3, 4, 5] and [p[0] for p in curve] == [30, 40, 50, 60]
    brute = summarise_quality({"a": [[[p[0], p[1], full_quality[i]] for i, p in enumerate(points)]]}, [0], True, 0.905)
    assert summarise_quality({"a": [curve]}, [0], True, 0.905)["entries"]["a"]["steps_by_seed"] == \
        brute["entries"]["a"]["steps_by_seed"] == [50]
    calls.clear()
    assert lazy_curve(points, 0.86, True, full)[0] == [20, 2.0, 0.86] and calls == [1, 5]   # reached: stop, then final
    calls.clear()
    assert [p[0] for p in lazy_curve(points, 0.1, False, full)] == [60] and calls == [5]  # a loss: all > 0.1 * 1.04
    assert GATE_MARGIN == 0.04


def test_to_quality_config_is_validated():
    with pytest.raises(ValueError, match="to_accuracy and to_quality"):
        BenchConfig(to_quality=True, to_accuracy=0.8)
    with pytest.raises(ValueError, match="allreduce entry.*quality_target"):
        BenchConfig(to_quality=True, algorithms=["fp16", "powersgd"])
    BenchConfig(to_quality=True, algorithms=["fp16"], quality_target=0.85)  # an absolute target needs no dense
    with pytest.raises(ValueError, match="quality_target needs to_quality"):
        BenchConfig(quality_target=0.85)
    with pytest.raises(ValueError, match=r"quality_target must be a test accuracy in \(0, 1\]"):
        BenchConfig(to_quality=True, quality_target=85.0)
    cfg = BenchConfig(to_quality=True, algorithms=["fp16", "allreduce"])
    assert cfg.dense_entry() == "allreduce" and (cfg.batch_size, cfg.epochs, cfg.lr) == (64, 4, 0.1)
    assert BenchConfig(workload="kjv-transformer").train_samples == 12800


@pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_bench_to_quality_runs_every_seed_and_prints_the_summary(tmp_path):
    proc = run_cli(
        ["bench", "--hosts", "2", "--steps", "2", "--warmup", "0", "--rounds", "1", "--algorithms",
         "allreduce,auto", "--auto-probe", "online", "--seeds", "0,1", "--to-quality", "--epochs", "1",
         "--train-samples", "512", "--eval-every", "2", "--eval-samples", "2400", "--out", str(tmp_path)],
        timeout=400, env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = json.loads((tmp_path / "bench.json").read_text())["quality"]
    assert {"target", "target_from", "higher_is_better", "seeds", "entries", "metric", "budget_steps", "epochs",
            "train_samples", "warmup_fraction", "curves", "cheap_curves"} <= set(q)
    assert q["cheap_samples"] == 1000  # 2,400 test samples: cheap evaluations on 1,000 gate the full ones
    assert q["budget_steps"] == 4 and q["seeds"] == [0, 1] and q["target_from"] == "allreduce"
    for name in ("allreduce", "auto"):
        e = q["entries"][name]
        assert {"final_by_seed", "final_mean", "seconds_by_seed", "steps_by_seed", "olympic_mean_s", "median_s",
                "spread_s", "wins"} <= set(e)
        # cheap evaluations every 2 steps, the last at the end of the budget, on every seed; full ones
        # where the gate let them through, always at the end
        assert [[p[0] for p in c] for c in q["cheap_curves"][name]] == [[2, 4]] * 2
        assert all([p[0] for p in c] in ([4], [2, 4]) for c in q["curves"][name])
        assert all(0 < p[2] <= 1 and p[1] > 0 for c in q["curves"][name] + q["cheap_curves"][name] for p in c)
    # auto decided on its own first steps (--auto-probe online): on loopback (CCR far below 0.5) nothing lossy
    # can pay off, so DDP trains from the first step, nothing is metered, and the probe cost its start-up only
    result = json.loads((tmp_path / "bench.json").read_text())
    auto, decided = next(r for r in result["rows"] if r["algorithm"] == "auto"), result["chosen_from_ccr"]["auto"]
    assert auto["options"]["entry"] == "allreduce" and decided["probe"] == "online"
    assert decided["online_steps_s"] == [] and set(decided["setup_phases_s"]) == {"profile", "ccr"}
    assert decided["probe_seconds"] == pytest.approx(decided["setup_seconds"]) and decided["setup_seconds"] > 0
    assert len(auto["iteration_samples_s"]) == 2 and "auto (online): allreduce" in proc.stdout
    assert [[p[2] for p in c] for c in q["cheap_curves"]["auto"]] == [[p[2] for p in c] for c in q["cheap_curves"]["allreduce"]]
    # each seed's auto ran as the job it is (a fresh online decision on its own steps), its start-up counted
    assert [d["auto_choice"] for d in q["auto_decisions"]] == ["allreduce", "allreduce"]
    assert all(c[0][1] > d["auto_setup_seconds"] > 0 for c, d in zip(q["cheap_curves"]["auto"], q["auto_decisions"]))
    finals = q["entries"]["allreduce"]["final_by_seed"]
    assert q["target"] == pytest.approx(sum(finals) / 2 - 0.005)
    assert q["curves"]["allreduce"][0] != q["curves"]["allreduce"][1], "seeds train different models"
    out = " ".join(proc.stdout.split())
    assert "time to test accuracy" in out and "needs 5 seeds" in out and "seeds 0, 1" in out
    assert (tmp_path / "quality.png").exists()


@pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_bench_to_quality_takes_dense_target_from_a_small_test_set_evaluated_in_full(tmp_path):
    # under 2,000 test samples every evaluation is a full one (no cheap gate); the target still comes
    # from dense's finals (the kjv workloads' case: their test set is small)
    proc = run_cli(
        ["bench", "--hosts", "2", "--steps", "2", "--warmup", "0", "--rounds", "1", "--algorithms", "allreduce,fp16",
         "--seeds", "0", "--to-quality", "--epochs", "1", "--train-samples", "256", "--eval-every", "2",
         "--eval-samples", "500", "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    q = json.loads((tmp_path / "bench.json").read_text())["quality"]
    assert q["cheap_samples"] is None and q["target_from"] == "allreduce"
    assert q["target"] == pytest.approx(q["entries"]["allreduce"]["final_by_seed"][0] - 0.005)
    assert [p[0] for p in q["curves"]["fp16"][0]] == [2]


def test_quality_table_needs_to_quality(capsys):
    with pytest.raises(ValueError, match="needs --to-quality"):
        print_quality_table({"config": {}, "rows": []}, "loopback")


def test_a_given_target_runs_each_seed_s_entries_back_to_back_and_dense_s_target_waits_for_its_seeds():
    from gradsync.bench.worker import run_order

    assert run_order([0, 1], ["fp16", "auto"]) == [(0, "fp16"), (0, "auto"), (1, "fp16"), (1, "auto")]
    assert run_order([0, 1], ["fp16", "allreduce"], dense="allreduce") == [
        (0, "allreduce"), (1, "allreduce"), (0, "fp16"), (1, "fp16")]
