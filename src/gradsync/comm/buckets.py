"""DDP's gradient buckets: their sizes as the reducer holds them, and how many a run needs.

A bucket's collective starts when its gradients are ready, so how the gradients are cut into
buckets decides how much communication overlaps with the backward pass. Used by the algorithms
(COVAP's bucket warning, the synchronisers' ``bucket_numels``), the training loop
(``bucket_cap_mb="auto"``) and the profiler.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ..validation import check_int


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


#: Fewest DDP buckets with which COVAP or a compressor can hide its communication behind the backward
#: pass. A bucket's collective starts when its gradients are ready, so the last bucket's starts when
#: the backward pass ends and is never hidden: at least 1/B of the communication is exposed with B
#: equal buckets, more than a quarter below 4.
MIN_OVERLAP_BUCKETS = 4
#: Buckets that ``bucket_cap_mb="auto"`` (:func:`suggested_bucket_cap_mb`) aims at: twice the minimum,
#: so the exposed last bucket is ~1/8 of the communication, while each collective stays large
#: enough that its fixed cost does not dominate.
TARGET_BUCKETS = 8
#: Range of :func:`suggested_bucket_cap_mb` (MB): below 10 KB per collective the per-call latency
#: dominates; above DDP's 25 MB default nothing is gained.
BUCKET_CAP_RANGE_MB = (0.01, 25.0)


def gradient_offsets(bucket: Any) -> list[tuple[int, torch.Tensor]]:
    """``(offset, gradient)`` of every gradient of a DDP ``GradBucket``: its position in
    ``bucket.buffer()``, in elements, and the gradient view itself."""
    buf = bucket.buffer()
    base, size = buf.data_ptr(), buf.element_size()
    return [((g.data_ptr() - base) // size, g) for g in bucket.gradients()]


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
