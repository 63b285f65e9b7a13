#!/usr/bin/env bash
# The prepared GPU check (issue 32), for a machine with a CUDA GPU (the device tool's lent machine), under 8 minutes:
# the CUDA/NCCL tests (every hook algorithm on CUDA, resume of every algorithm from a CPU checkpoint onto the GPU,
# auto's compute profile against CUDA-event timings, the finite check deciding without a host sync), then auto's
# probe on the GPU (quality, timing, each hook's compression time). Output: $OUT/gpu_check.txt (or ./gpu_check.txt).
# Needs a torch with CUDA (python -c "import torch; print(torch.cuda.is_available())"); gradsync installed from this
# checkout (pip install -e .) or on PYTHONPATH.
# On the device tool's lent machine (2026-11-27, H200): its CUDA torch is 2.11 at /opt/torch/.venv/bin/python3 (put a
# `python` wrapper that execs it first on PATH; a symlink loses the venv), PYTHONPATH=src, and the extras carried as
# wheels in .whl (bayesian-optimization, constriction, zstandard for cp312). 13 passed in 100 s there; on 2026-11-28
# (H200) 14 passed in 116 s, and the hooks' compression timed in an NCCL group of one rank: fp16 0.2 ms, PowerSGD
# r=1/4/16 2.5/2.1/1.7 ms on a 256-512-10 MLP (launch-bound: the GPU's matrix products take microseconds).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}/gpu_check.txt"
{
  date; nvidia-smi -L 2>&1 || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  timeout 420 python -m pytest -q tests/test_cuda_nccl.py -rs --durations=10 -p no:cacheprovider
  echo "pytest rc=$?"
  timeout 60 python - <<'PY'
import datetime, os, time
import torch, torch.distributed as dist, torch.nn.functional as F
from gradsync.profiler.probe import measure_quality, time_candidates
store = dist.TCPStore("127.0.0.1", 29533, 1, True)
dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
dev = torch.device("cuda", 0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
batches = [(torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)) for _ in range(8)]
opt = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)
t = time.perf_counter()
errors = measure_quality(model, batches, F.cross_entropy, opt, ["fp16", "powersgd-overlap:matrix_approximation_rank=4"], 1.0)
print("probe errors on the GPU (1 rank: the aggregate is the rank's own gradient):", errors, f"{time.perf_counter() - t:.2f} s")
timed = time_candidates(model, batches, F.cross_entropy, opt, ["allreduce", "fp16"], 1.0)
print({e: round(p.iteration_s * 1e3, 3) for e, p in timed.items()}, "ms per iteration")
from gradsync.profiler.probe import compression_seconds
hooks = ["fp16", "bf16"] + [f"powersgd-overlap:matrix_approximation_rank={r}" for r in (1, 4, 16)]
print({e: round(s * 1e3, 3) for e, s in compression_seconds(model, batches[0], F.cross_entropy, opt, hooks, 1.0).items()},
      "ms of each hook's own computation (an NCCL group of the rank alone)")
dist.destroy_process_group()
PY
  echo "probe rc=$?"
} 2>&1 | tee "$out"
