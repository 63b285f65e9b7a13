"""Communication-to-computation ratio (CCR): the time of a dense all-reduce of every bucket *without
overlap* divided by the backward compute time (Meng, Sun & Li 2023, arXiv 2311.04499, §3). Every rank
measures locally and the CCR is all-reduced with MAX, so every rank gets the same value; algorithms
that choose a setting from it (COVAP's K) receive it through ``Synchroniser.calibrate``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..comm.collectives import all_gather_flat, collective_device, reduce_scatter_flat
from ..validation import check_int


@dataclass(frozen=True)
class CCRMeasurement:
    """Result of :func:`measure_ccr`: ``allreduce_s`` and ``backward_s`` (seconds, this rank) and
    ``ccr`` (all-reduced MAX over ranks)."""

    allreduce_s: float
    backward_s: float
    ccr: float


def ddp_bucket_numels(ddp: DistributedDataParallel) -> list[int]:
    """Numel of each DDP bucket in reduction order, as the reducer holds them now (after DDP's
    bucket rebuild at the first iterations, the layout a communication hook sees), read from the
    reducer's buckets; if that private call is unavailable, from DDP's logging data
    (``rebuilt_bucket_sizes`` when logged, else the construction-time ``bucket_sizes``; DDP logs at
    sampled iterations only), in bytes divided by the parameters' element size (4 for float32, 2
    for bf16/fp16); falls back to the parameter total when neither matches the parameters."""
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    try:
        numels = [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]
    except (AttributeError, RuntimeError):
        numels = []
    if numels and sum(numels) == total:
        return numels
    itemsizes = {p.element_size() for p in params}
    if len(itemsizes) != 1:
        return [total]
    itemsize = itemsizes.pop()
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
    try:
        numels = [int(s) // itemsize for s in str(sizes).split(",") if s.strip()]
    except ValueError:
        numels = []
    return numels if numels and sum(numels) == total else [total]


def time_dense_allreduce(
    numels: Sequence[int], group: dist.ProcessGroup | None = None, reps: int = 5,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> float:
    """Median seconds of blocking all-reduces of one ``dtype`` tensor per bucket, one after another
    (no overlap). One untimed repetition warms the connections up.

    Args:
        device: where the buckets live (the model's device); default
            :func:`~gradsync.comm.collectives.collective_device` of ``group`` (CUDA for NCCL, CPU for
            Gloo). On CUDA the device is synchronised before the clock is read.
        dtype: the buckets' dtype (the parameters' dtype: float32, or bfloat16/float16).
    """
    device = collective_device(group) if device is None else torch.device(device)
    tensors = [torch.zeros(int(n), dtype=dtype, device=device) for n in numels]

    def run() -> None:
        for t in tensors:
            dist.all_reduce(t, group=group)

    return _median_seconds(run, group, reps, device)


def time_dense_rs_ag(numel: int, group: dist.ProcessGroup | None = None, reps: int = 3,
                     device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of a blocking reduce-scatter followed by an all-gather of ``numel`` ``dtype``
    elements (padded to a multiple of the world size): DeAR's pair, for calibrating the simulator.
    ``device`` as in :func:`time_dense_allreduce`."""
    world = dist.get_world_size(group)
    n = -(-int(numel) // world) * world
    device = collective_device(group) if device is None else torch.device(device)
    full = torch.zeros(n, dtype=dtype, device=device)
    shard = torch.zeros(n // world, dtype=dtype, device=device)

    def run() -> None:
        reduce_scatter_flat(shard, full, group=group)
        all_gather_flat(full, shard, group=group)

    return _median_seconds(run, group, reps, device)


def _median_seconds(run: Callable[[], None], group: dist.ProcessGroup | None, reps: int,
                    device: torch.device) -> float:
    """Median wall-clock seconds of ``reps`` calls of ``run`` started together on every rank (a
    barrier before each), after one untimed call that warms the connections up. On a CUDA
    ``device`` the device is synchronised before each clock read, since NCCL collectives return
    once enqueued."""
    reps = check_int("reps", reps, 1)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = []
    for r in range(reps + 1):
        sync()
        dist.barrier(group=group)
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ccr(
    numels: Sequence[int], backward_s: float, group: dist.ProcessGroup | None = None, reps: int = 5,
    device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> CCRMeasurement:
    """Collective: measure the dense all-reduce time of buckets ``numels`` (``dtype`` on ``device``,
    see :func:`time_dense_allreduce`) and return the CCR against ``backward_s`` (seconds),
    all-reduced with MAX so every rank gets the same value."""
    device = collective_device(group) if device is None else torch.device(device)
    allreduce_s = time_dense_allreduce(numels, group, reps, device, dtype)
    ccr = torch.tensor([allreduce_s / max(backward_s, 1e-9)], dtype=torch.float64, device=device)
    dist.all_reduce(ccr, op=dist.ReduceOp.MAX, group=group)
    value = float(ccr.item())
    return CCRMeasurement(allreduce_s, backward_s, value)


#: Fewest DDP buckets with which COVAP or a compressor can hide its communication behind the backward
#: pass. A bucket's collective starts when its gradients are ready, so the last bucket's starts when
#: the backward pass ends and is never hidden: at least 1/B of the communication is exposed with B
#: equal buckets, more than a quarter below 4. Measured (6.3 MB of gradients, 2 ranks at 100 Mbit/s,
#: covap K=2 fp16): DDP's 25 MB default gave 2 buckets and 344 ms per iteration, 1 MB buckets 271 ms.
MIN_OVERLAP_BUCKETS = 4
#: Buckets that ``bucket_cap_mb="auto"`` (:func:`suggested_bucket_cap_mb`) aims at: twice the minimum,
#: so the exposed last bucket is ~1/8 of the communication, while each collective stays large
#: enough that its fixed cost does not dominate.
TARGET_BUCKETS = 8
#: Range of :func:`suggested_bucket_cap_mb` (MB): below 10 KB per collective the per-call latency
#: dominates; above DDP's 25 MB default nothing is gained.
BUCKET_CAP_RANGE_MB = (0.01, 25.0)


def suggested_bucket_cap_mb(gradient_bytes: int) -> float:
    """DDP ``bucket_cap_mb`` giving at least :data:`TARGET_BUCKETS` buckets for ``gradient_bytes`` bytes of
    gradients (all trainable parameters, their own dtype): ``gradient MB / (2 * TARGET_BUCKETS)``
    clamped to :data:`BUCKET_CAP_RANGE_MB`, rounded to 3 significant digits (MB = 2**20 bytes, DDP's
    unit). The factor 2: DDP closes a bucket once it holds ``bucket_cap_mb``, so a bucket holds
    between the cap and the cap plus one tensor (up to twice the cap when tensors are as large as
    the cap), and a cap of total / 8 gave only 5 buckets for 10 equal layers.

    Raises:
        ValueError: if ``gradient_bytes`` is negative.
    """
    gradient_bytes = check_int("gradient_bytes", gradient_bytes, 0)
    lo, hi = BUCKET_CAP_RANGE_MB
    mb = min(hi, max(lo, gradient_bytes / 2**20 / (2 * TARGET_BUCKETS)))
    return float(f"{mb:.3g}")


def bucket_overlap_warning(numels: Sequence[int], element_size: int, ratio: int = 1) -> str | None:
    """The warning to give when DDP's ``numels`` buckets (elements per bucket, ``element_size``
    bytes each) are too few for COVAP or compression to overlap with the backward pass, else
    ``None``: fewer than :data:`MIN_OVERLAP_BUCKETS`, or (COVAP) fewer than its ``ratio`` K: K
    round-robin turns over fewer than K buckets leave some iterations with nothing to send and give
    others a whole bucket, the last of which is exposed. The message names the ``bucket_cap_mb`` of
    :func:`suggested_bucket_cap_mb`."""
    need = max(MIN_OVERLAP_BUCKETS, int(ratio))
    if len(numels) >= need:
        return None
    total = sum(int(n) for n in numels) * int(element_size)
    why = f"fewer than {need}" + (f" (COVAP's K = {ratio})" if ratio > MIN_OVERLAP_BUCKETS else "")
    return (f"DDP has {len(numels)} gradient bucket(s) for {total / 2**20:.2f} MB of gradients, {why}: the last "
            f"bucket's communication cannot overlap with the backward pass, so compression saves little time; "
            f"use bucket_cap_mb={suggested_bucket_cap_mb(total):g} (at least {TARGET_BUCKETS} buckets)")


def resolve_bucket_cap_mb(bucket_cap_mb: float | str, model: torch.nn.Module) -> float:
    """``bucket_cap_mb`` as a number: ``"auto"`` becomes :func:`suggested_bucket_cap_mb` of ``model``'s
    trainable gradient bytes; a number is returned as it is."""
    if bucket_cap_mb != "auto":
        return float(bucket_cap_mb)
    return suggested_bucket_cap_mb(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
