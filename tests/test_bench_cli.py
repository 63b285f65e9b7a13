"""``gradsync bench`` smoke run (2 ranks, loopback) and ``gradsync profile`` / ``simulate`` end to end."""

import json

import pytest

from gradsync.bench.config import BenchConfig
from gradsync.workloads import fashion_mnist
from cli_runner import run_cli

needs_data = pytest.mark.skipif(
    not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


@needs_data
def test_bench_smoke_reports_every_field(tmp_path):
    # batch 32, not the recipe's 64: no field checked depends on it, a step costs about half, and every
    # to-accuracy leg still reaches 0.3 (allreduce after 10 steps, covap 20, dear-covap 30)
    proc = run_cli(["bench", "--hosts", "2", "--steps", "3", "--warmup", "1", "--rounds", "2",
                    "--batch-size", "32", "--algorithms", "allreduce,covap,dear-covap", "--ratio", "2",
                    "--to-accuracy", "0.3", "--eval-every", "5", "--max-accuracy-steps", "60",
                    "--eval-samples", "500",
                    "--out", str(tmp_path)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gradsync bench" in proc.stdout and "loopback, NOT shaped" in proc.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["world_size"] == 2 and {r["algorithm"]: r["options"].get("ratio") for r in result["rows"]} == {
        "allreduce": None, "covap": 2, "dear-covap": 2}
    assert result["compute_only_s"] > 0 and result["dense_ccr"] > 0 and result["dense_rs_ag_s"] > 0
    rows = {r["algorithm"]: r for r in result["rows"]}
    assert list(rows) == ["allreduce", "covap", "dear-covap"]
    for r in rows.values():
        assert set(r["iteration_s"]) == {"median", "p10", "p90", "mean"}
        assert r["iteration_s"]["p10"] <= r["iteration_s"]["median"] <= r["iteration_s"]["p90"]
        assert len(r["iteration_samples_s"]) == 2 * 3
        for key in ("speedup_vs_allreduce", "scaling_efficiency", "exposed_comm_s", "compression_overhead_s"):
            assert r[key] >= 0
    assert rows["allreduce"]["speedup_vs_allreduce"] == 1.0
    assert rows["covap"]["wire_bytes_per_iteration"] < 0.75 * rows["allreduce"]["wire_bytes_per_iteration"]
    assert rows["allreduce"]["compression_ratio"] == pytest.approx(1.0)
    assert rows["covap"]["compression_ratio"] > 1.3
    assert (tmp_path / "breakdown.png").stat().st_size > 5000
    assert rows["covap"]["covap_k"] == [2] * 6 and "covap_k" not in rows["allreduce"]  # K per timed step
    assert (tmp_path / "ratio.png").stat().st_size > 5000
    for r in rows.values():
        tta = r["time_to_accuracy"]
        assert tta["curve"] and tta["steps"] <= 60
        assert tta["seconds"] is None or tta["curve"][-1][1] >= 0.3
    assert rows["allreduce"]["time_to_accuracy"]["seconds"] is not None, "0.3 is reached within 60 steps"
    assert (tmp_path / "accuracy.png").exists()


@needs_data
def test_profile_then_simulate(tmp_path):
    prof = tmp_path / "p.json"
    # batch 16: what is checked (bucket layout, ready order, trace lanes, covap beating dense when
    # communication-bound) holds for any batch; the profile and the 2-rank trace compute a quarter
    proc = run_cli(["profile", "--iterations", "1", "--batch-size", "16", "--out", str(prof), "--trace",
                    str(tmp_path / "t.json"), "--algorithm", "covap"],
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads(prof.read_text())
    assert p["schema"] == "gradsync-profile/1" and p["forward_s"] > 0 and len(p["buckets"]) >= 2
    ready = [b["ready_s"] for b in p["buckets"]]
    assert ready == sorted(ready) and 0 < ready[-1] <= p["backward_s"] * 1.05
    assert sum(b["numel"] for b in p["buckets"]) == 77754
    trace = json.loads((tmp_path / "t.json").read_text())
    lanes = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)} <= lanes
    proc = run_cli(["simulate", "--profile", str(prof), "--world-sizes", "2,64", "--bandwidths",
                    "10,10000", "--algorithms", "dense,covap:4", "--out", str(tmp_path / "sim")],
                    timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "sim" / "simulate.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    slow = {r["algorithm"]: r for r in rows if r["bandwidth_gbps"] == 0.01 and r["world_size"] == 64}
    assert slow["covap(K=4)"]["iteration_s"] < slow["dense"]["iteration_s"]
    assert (tmp_path / "sim" / "scaling.png").exists()


def test_bench_config_rejects_bad_values():
    with pytest.raises(ValueError, match="algorithms"):
        BenchConfig(algorithms=["nope"])
    with pytest.raises(ValueError, match="hosts"):
        BenchConfig(hosts=0)
    with pytest.raises(ValueError, match="steps"):
        BenchConfig(steps=0)
