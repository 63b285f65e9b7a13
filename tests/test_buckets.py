"""DDP bucket count against overlap: the warning when buckets are too few for COVAP or compression
to hide their communication behind the backward pass, and ``gradsync train``'s ``bucket_cap_mb``
"auto" default. Real 2-rank Gloo groups and the real console script; the bucket counts are DDP's own
(after its rebuild), the thresholds those of :mod:`gradsync.profiler.ccr`.
"""

import json
import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms import build_hook
from gradsync.comm.buckets import (MIN_OVERLAP_BUCKETS, TARGET_BUCKETS, bucket_overlap_warning,
                                   ddp_bucket_numels, suggested_bucket_cap_mb)
from gradsync.workloads import fashion_mnist
from cli_runner import run_cli

MB = 2**20


def test_suggested_cap_and_warning_rule():
    assert suggested_bucket_cap_mb(int(6.3 * MB)) == pytest.approx(6.3 / 16, rel=1e-2)  # issue 18's model
    assert suggested_bucket_cap_mb(1000) == 0.01 and suggested_bucket_cap_mb(10**12) == 25.0  # clamped
    with pytest.raises(ValueError, match="gradient_bytes"):
        suggested_bucket_cap_mb(-1)
    # 6.3 MB in DDP's default 25 MB buckets: 2 buckets (the case measured in issue 18)
    msg = bucket_overlap_warning([800_000, 851_000], 4, ratio=2)
    assert msg is not None and "2 gradient bucket(s)" in msg and "bucket_cap_mb=0.394" in msg
    assert bucket_overlap_warning([1000] * MIN_OVERLAP_BUCKETS, 4) is None
    assert bucket_overlap_warning([1000] * (MIN_OVERLAP_BUCKETS - 1), 4) is not None
    assert "K = 6" in bucket_overlap_warning([1000] * 5, 4, ratio=6)  # fewer buckets than K
    assert bucket_overlap_warning([1000] * 6, 4, ratio=6) is None


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(200, 200), nn.Tanh()) for _ in range(8)], nn.Linear(200, 10))


def _covap_buckets(rank, world, cap):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("gradsync.algorithms.covap")
    logger.addHandler(Keep(level=logging.WARNING))
    module = _mlp()
    if cap == "auto":
        cap = suggested_bucket_cap_mb(sum(p.numel() * 4 for p in module.parameters()))
    model = DDP(module, bucket_cap_mb=cap)
    state, hook = build_hook("covap", model=module, ratio=2)
    model.register_comm_hook(state, hook)
    for step in range(4):
        model.zero_grad(set_to_none=True)
        x = torch.randn(8, 200, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).sum().backward()
    return len(ddp_bucket_numels(model)), [m for m in records if "bucket" in m], state.stats().get("bucket_warning")


def test_covap_warns_once_on_rank_0_when_buckets_defeat_the_overlap():
    """1.3 MB of gradients in DDP's default 25 MB: one bucket, so the warning (naming the cap to
    use) is logged once, by rank 0 only, and both ranks report it in stats(); the suggested cap
    gives at least TARGET_BUCKETS buckets and no warning."""
    (n0, logged0, stat0), (n1, logged1, stat1) = run_ranks(_covap_buckets, 2, 25.0, timeout=120)
    assert n0 == n1 < MIN_OVERLAP_BUCKETS
    assert len(logged0) == 1 and logged1 == []
    assert stat0 == stat1 and "use bucket_cap_mb=" in stat0 and stat0 in logged0[0]
    for n, logged, stat in run_ranks(_covap_buckets, 2, "auto", timeout=120):
        assert n >= TARGET_BUCKETS and logged == [] and stat is None


needs_data = pytest.mark.skipif(not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
                                reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def _train(tmp_path, *args):
    out = tmp_path / "run"
    proc = run_cli(["train", "--max-steps", "4", "--no-progress",
                    "--eval-samples", "200", "--train-samples", "2048", "--out", str(out), *args],
                    timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())["summary"], proc.stdout, proc.stderr


@needs_data
def test_train_chooses_bucket_cap_mb_and_warns_for_large_buckets(tmp_path):
    from gradsync.workloads import get_workload

    model = get_workload("fashion-mnist", None).make_model()
    expected = suggested_bucket_cap_mb(sum(p.numel() * p.element_size() for p in model.parameters()))
    s, out, _ = _train(tmp_path / "auto", "--algorithm", "topk")
    assert s["bucket_cap_mb"] == expected and f"{expected:g} MB" in out
    assert "bucket_warning" not in s
    s, out, err = _train(tmp_path / "big", "--algorithm", "covap", "--ratio", "2", "--bucket-cap-mb", "25")
    assert s["bucket_cap_mb"] == 25.0
    assert f"use bucket_cap_mb={expected:g}" in s["bucket_warning"]
    assert "bucket_cap_mb=" in out and err.count("use bucket_cap_mb=") == 1  # logged once (rank 0)


def test_train_config_bucket_cap_mb_takes_auto_or_a_positive_number():
    from gradsync.train.config import TrainConfig

    assert TrainConfig().bucket_cap_mb == "auto" and TrainConfig(bucket_cap_mb=2).bucket_cap_mb == 2
    with pytest.raises(ValueError, match="bucket_cap_mb.*'auto'"):
        TrainConfig(bucket_cap_mb="big")
    for bad in (0, 2000):
        with pytest.raises(ValueError, match=r"bucket_cap_mb must be in \(0.0, 1024.0\]"):
            TrainConfig(bucket_cap_mb=bad)
