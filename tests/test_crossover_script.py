"""benchmarks/crossover.py: the crossover-rate interpolation (the bench runs themselves need root and
minutes; the script was run by hand at a tiny size)."""

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "crossover", Path(__file__).resolve().parents[1] / "benchmarks" / "crossover.py")
crossover = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crossover)


def test_interpolates_in_log_rate():
    c = crossover.crossover_rate([10, 100], [1.5, 0.5])
    assert c["kind"] == "interpolated" and not c["non_monotone"]
    assert c["rate"] == pytest.approx(math.sqrt(10 * 100))  # halfway in log(rate)
    c = crossover.crossover_rate([1000, 10, 100, 50], [0.8, 2.0, 0.9, 1.2])  # unsorted input
    t = 0.2 / (0.2 + 0.1)
    assert c["rate"] == pytest.approx(math.exp(math.log(50) + t * math.log(2)))
    assert crossover.crossover_rate([10, 100], [1.0 + 1e-9, 1.0])["rate"] == pytest.approx(100)


def test_edges_and_noise():
    assert crossover.crossover_rate([10, 100], [1.2, 1.1]) == {"rate": 100, "kind": "above_all",
                                                               "non_monotone": False}
    assert crossover.crossover_rate([10, 100], [0.9, 1.0]) == {"rate": 10, "kind": "below_all",
                                                               "non_monotone": False}
    assert crossover.crossover_rate([10, 100], [0.9, 1.1])["kind"] == "rising"
    c = crossover.crossover_rate([10, 25, 50, 100], [1.3, 0.9, 1.1, 0.8])  # two crossings: take the fastest
    assert c["non_monotone"] and 50 < c["rate"] < 100
    with pytest.raises(ValueError, match="rates"):
        crossover.crossover_rate([10], [1.0, 2.0])
    with pytest.raises(ValueError, match="rates"):
        crossover.crossover_rate([0, 10], [1.0, 2.0])


def test_tables_report_wire_and_payload_bytes(tmp_path, monkeypatch, capsys):
    """With --reuse the script only reads bench.json rows: the per-rate rows keep wire bytes, payload
    bytes and the wire compression ratio, and the markdown shows wire / payload per iteration."""
    import json
    import sys

    def row(name, speedup, wire, payload):
        return {"algorithm": name, "speedup_vs_allreduce": speedup, "iteration_s": {"median": 0.1 / speedup},
                "wire_bytes_per_iteration": wire, "payload_bytes_per_iteration": payload,
                "compression_ratio": 2000.0 / wire, "compression_overhead_s": 0.0, "coding_s": 0.0,
                "options": {}}

    for rate, s in ((10, 2.0), (100, 0.5)):
        d = tmp_path / f"bw_{rate}"
        d.mkdir()
        (d / "bench.json").write_text(json.dumps({"rows": [row("allreduce", 1.0, 2000.0, 2000),
                                                            row("topk", s, 500.0, 250)]}))
    monkeypatch.setattr(sys, "argv", ["crossover.py", "--bandwidths", "10,100", "--algorithms", "allreduce,topk",
                                      "--reuse", "--out", str(tmp_path)])
    crossover.main()
    res = json.loads((tmp_path / "crossover.json").read_text())
    r = res["per_rate"]["10"]["rows"]["topk"]
    assert (r["wire_bytes_per_iteration"], r["payload_bytes_per_iteration"], r["compression_ratio"]) == (
        500.0, 250, 4.0)
    md = (tmp_path / "crossover.md").read_text()
    assert "wire bytes per rank per iteration" in md and "payload bytes per rank per iteration" in md
    assert "| topk | 50.0 / 0.5 / 0.2 | 200.0 / 0.5 / 0.2 |" in md
