"""``gradsync bench --table accuracy``: the rows computed from a bench result (no ranks started)."""

import pytest

from gradsync import cli
from gradsync.bench.report import accuracy_rows, print_accuracy_table


def _row(name, median, tta, options=None):
    return {"algorithm": name, "iteration_s": {"median": median}, "scaling_efficiency": 0.25 / median,
            "wire_bytes_per_iteration": 311016 / (options or {}).get("ratio", 1), "speedup_vs_allreduce": 0.5 / median,
            "options": options or {}, "time_to_accuracy": tta}


RESULT = {"world_size": 2, "dense_ccr": 3.0,
          "config": {"to_accuracy": 0.8, "workload": "fashion-mnist", "batch_size": 64, "lr": 0.05,
                     "eval_every": 25, "rounds": 2, "steps": 10},
          "rows": [_row("allreduce", 0.5, {"seconds": 60.0, "steps": 100, "curve": [[30.0, 0.7], [60.0, 0.81]]}),
                   _row("covap", 0.3, {"seconds": 40.0, "steps": 125, "curve": [[40.0, 0.82]]}, {"ratio": 3}),
                   _row("topk", 0.2, {"seconds": None, "steps": 400, "curve": [[80.0, 0.6]]}, {"density": 0.01})]}


def test_accuracy_rows_speedup_is_time_to_target_ratio(capsys):
    rows = {r["algorithm"]: r for r in accuracy_rows(RESULT)}
    assert rows["allreduce"]["speedup"] == 1.0 and rows["covap"]["speedup"] == pytest.approx(1.5)
    assert rows["topk"]["speedup"] is None and rows["topk"]["final_accuracy"] == 0.6
    assert rows["covap"]["options"] == "K=3" and rows["topk"]["options"] == "density=0.01"
    assert rows["covap"]["iteration_ms"] == pytest.approx(300.0)
    assert rows["covap"]["iteration_speedup"] == pytest.approx(0.5 / 0.3)
    print_accuracy_table(RESULT, "emulated 2 hosts, tbf 10 Mbit/s")
    out = capsys.readouterr().out
    assert "time to 80% test accuracy" in out and "1.50x" in out and "not reached" in out


def test_accuracy_table_needs_to_accuracy(capsys):
    with pytest.raises(ValueError, match="to-accuracy"):
        accuracy_rows({"rows": [{"algorithm": "allreduce"}]})
    with pytest.raises(SystemExit):
        cli.main(["bench", "--table", "accuracy"])
    assert "needs --to-accuracy" in capsys.readouterr().err
