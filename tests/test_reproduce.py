"""``benchmarks/reproduce.py``: the list of experiments, their commands, and one tiny run end to end
(a training run of 3 steps whose metrics.json lies next to the generated markdown table)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gradsync.workloads import fashion_mnist

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reproduce", ROOT / "benchmarks" / "reproduce.py")
reproduce = importlib.util.module_from_spec(spec)
sys.modules["reproduce"] = reproduce
spec.loader.exec_module(reproduce)


def test_list_names_every_experiment(capsys):
    assert reproduce.main(["--list"]) == 0
    out = capsys.readouterr().out
    names = [e.name for e in reproduce.EXPERIMENTS]
    assert len(names) == len(set(names)) >= 10
    for e in reproduce.EXPERIMENTS:
        assert e.name in out and e.readme in out


def test_dry_run_prints_commands_writing_under_out(capsys, tmp_path):
    assert reproduce.main(["--dry-run", "--only", "demo,gravac", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("gradsync sweep --algorithms allreduce,fp16,") and "--bandwidths 5 " in lines[0]
    assert lines[0].endswith(f"--out {tmp_path}/demo/sweep")
    assert len(lines) == 1 + 5 and all(line.startswith("gradsync train ") for line in lines[1:])
    assert not any(tmp_path.iterdir()), "a dry run writes nothing"
    with pytest.raises(SystemExit):
        reproduce.main(["--only", "nope"])


def test_makefile_demo_matches_the_demo_experiment():
    make = (ROOT / "Makefile").read_text()
    args = make.split("DEMO_ARGS ?=")[1].split("\ndemo:")[0].replace("\\\n", " ").split()
    demo = next(e for e in reproduce.EXPERIMENTS if e.name == "demo").runs[0].argv
    assert demo == args


@pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
@pytest.mark.timeout(600)
def test_tiny_experiment_writes_table_next_to_raw_json(tmp_path):
    exp = reproduce.Experiment("tiny", "a tiny table", [reproduce.Run("covap-2", "train",
                                                                      ["--algorithm", "covap", "--ratio", "2"])],
                               reproduce.train_table)
    md = reproduce.run_experiment(exp, tmp_path, quick=True)
    assert md == tmp_path / "tiny" / "tiny.md"
    metrics = json.loads((tmp_path / "tiny" / "covap-2" / "metrics.json").read_text())
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| covap-2 |"))
    assert "covap (K=2)" in row and f"{metrics['summary']['test_accuracy'] * 100:.2f} %" in row
    assert "| 3 |" in row and "loopback, NOT shaped" in row
    assert "gradsync train --algorithm covap --ratio 2 --out" in (tmp_path / "tiny" / "commands.txt").read_text()
