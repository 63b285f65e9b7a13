"""``gradsync bench`` on the kjv-transformer workload with every registered algorithm: one run, 2
ranks on 127.0.0.1, one timed step each (a smoke test of every algorithm on a sequence model whose
logits are (batch, vocabulary, positions), not a timing)."""

import json
import math
import shutil

import pytest

from gradsync.workloads import kjv
from cli_runner import run_cli
from every_algorithm import installed_algorithms

HAVE_KJV = shutil.which(kjv.BIBLE_PROGRAM) is not None and kjv.BIBLE_DATA.is_file()


@pytest.mark.skipif(not HAVE_KJV, reason="KJV text not installed (apt-get install bible-kjv-text)")
@pytest.mark.timeout(900)
def test_bench_runs_kjv_transformer_with_every_algorithm(tmp_path):
    names = installed_algorithms()
    # --period 1: local-sgd and diloco sync after every step, so their one measured step sends bytes too
    proc = run_cli(["bench", "--workload", "kjv-transformer",
                    "--algorithms", ",".join(names), "--batch-size", "2", "--steps", "1", "--warmup", "0",
                    "--rounds", "1", "--ratio", "2", "--period", "1", "--out", str(tmp_path)],
                    timeout=880)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loopback, NOT shaped" in proc.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["world_size"] == 2 and result["config"]["workload"] == "kjv-transformer"
    rows = {r["algorithm"]: r for r in result["rows"]}
    assert sorted(rows) == names
    for name, r in rows.items():
        assert math.isfinite(r["iteration_s"]["median"]) and r["iteration_s"]["median"] > 0, name
        assert r["wire_bytes_per_iteration"] > 0, name
    # a sparsifier at its default density sends fewer bytes than dense all-reduce of 844,873 fp32 gradients
    assert rows["topk"]["wire_bytes_per_iteration"] < 0.5 * rows["allreduce"]["wire_bytes_per_iteration"]
    assert rows["covap"]["options"]["ratio"] == 2
