"""Chrome-trace timeline of training iterations on every rank (compute, compression, communication).

Each rank wraps its DDP communication hook so that the hook body (compression and collective
launch) and the time until the bucket's future completes (communication) are recorded as spans,
next to forward, backward and optimizer spans. Spans use the wall clock (``time.time``), shared by
all ranks on one machine. The merged file opens in chrome://tracing or https://ui.perfetto.dev
(Trace Event Format, "X" complete events; pid = rank).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm.futures import shutdown_process_group, then

LANES = {"compute": 0, "hook (compression + launch)": 1, "communication": 2}


class _Tracer:
    def __init__(self, inner_state: Any, inner_hook: Any, rank: int):
        self.inner_state, self.inner_hook, self.rank = inner_state, inner_hook, rank
        self.events: list[dict[str, Any]] = []
        self.enabled = False

    def span(self, name: str, lane: str, t0: float, t1: float, **args: Any) -> None:
        if self.enabled:
            self.events.append({"name": name, "ph": "X", "ts": t0 * 1e6, "dur": max(0.0, t1 - t0) * 1e6,
                                "pid": self.rank, "tid": LANES[lane], "args": args})


def _traced_hook(tracer: _Tracer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    index, numel = bucket.index(), bucket.buffer().numel()
    t0 = time.time()
    fut = tracer.inner_hook(tracer.inner_state, bucket)
    t1 = time.time()
    tracer.span(f"bucket {index}", "hook (compression + launch)", t0, t1, numel=numel)

    def done(f: torch.futures.Future) -> torch.Tensor:
        tracer.span(f"bucket {index}", "communication", t1, time.time(), numel=numel)
        return f.value()

    return then(fut, done)


def trace_rank(algorithm: str, model: torch.nn.Module, batches: list, loss_fn: Any, make_optimizer: Any,
               bucket_cap_mb: float, iterations: int = 1, warmup: int = 3, **options: Any) -> list[dict]:
    """On an initialised process group: train ``warmup`` untraced then ``iterations`` traced steps of
    ``model`` under DDP + ``algorithm``'s hook; return this rank's trace events."""
    from torch.nn.parallel import DistributedDataParallel

    from ..algorithms import build_hook, get

    rank = dist.get_rank()
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e4 if get(algorithm).single_bucket else bucket_cap_mb)
    state, hook = build_hook(algorithm, model=model, **options)
    tracer = _Tracer(state, hook, rank)
    ddp.register_comm_hook(tracer, _traced_hook)
    opt = make_optimizer(ddp.parameters())
    for it in range(warmup + iterations):
        x, y = batches[it % len(batches)]
        tracer.enabled = it >= warmup
        dist.barrier()
        opt.zero_grad(set_to_none=True)
        t0 = time.time()
        loss = loss_fn(ddp(x), y)
        t1 = time.time()
        loss.backward()
        t2 = time.time()
        opt.step()
        t3 = time.time()
        tracer.span("forward", "compute", t0, t1, iteration=it)
        tracer.span("backward (+ wait for last bucket)", "compute", t1, t2, iteration=it)
        tracer.span("optimizer step", "compute", t2, t3, iteration=it)
    return tracer.events


def merge(per_rank: list[list[dict]], path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write the events of all ranks as one Chrome trace JSON with named processes and lanes."""
    events: list[dict[str, Any]] = []
    t_min = min((e["ts"] for evs in per_rank for e in evs), default=0.0)
    for rank, evs in enumerate(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for lane, tid in LANES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
        for e in evs:
            events.append({**e, "ts": e["ts"] - t_min})
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata or {}}))
    return path


def _trace_worker(index: int, world: int, port: int, spec: dict[str, Any], out_dir: str) -> None:
    import datetime
    import os

    import torch.nn.functional as F

    from .profile import model_for_profile

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(spec["threads"])
    dist.init_process_group("gloo", rank=index, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        model, make_batch, loss_fn = model_for_profile(spec["model"], spec["batch_size"], spec.get("data_dir"))
        batches = [make_batch() for _ in range(2)]
        events = trace_rank(spec["algorithm"], model, batches, loss_fn or F.cross_entropy,
                            lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), spec["bucket_cap_mb"],
                            iterations=spec["iterations"], **spec["options"])
        Path(out_dir, f"rank{index}.json").write_text(json.dumps(events))
    finally:
        shutdown_process_group()


def run_trace(path: str | Path, algorithm: str, model: str, workers: int = 2, batch_size: int = 64,
              bucket_cap_mb: float = 0.1, iterations: int = 1, threads: int = 1,
              data_dir: str | None = None, **options: Any) -> Path:
    """Spawn ``workers`` local Gloo ranks, trace ``iterations`` steps of ``algorithm`` on ``model``
    and write the merged Chrome trace to ``path``."""
    import tempfile

    import torch.multiprocessing as mp

    from ..comm.rendezvous import free_port

    port = free_port()
    spec = {"algorithm": algorithm, "model": model, "batch_size": batch_size, "bucket_cap_mb": bucket_cap_mb,
            "iterations": iterations, "threads": threads, "data_dir": data_dir, "options": options}
    with tempfile.TemporaryDirectory(prefix="gradsync-trace-") as tmp:
        mp.start_processes(_trace_worker, args=(workers, port, spec, tmp), nprocs=workers, start_method="spawn")
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(workers)]
    return merge(per_rank, path, {"algorithm": algorithm, "model": model, "workers": workers})
