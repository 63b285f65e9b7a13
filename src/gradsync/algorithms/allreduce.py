"""Dense all-reduce and torch's fp16 compression as gradsync hooks (the baselines).

``allreduce_hook`` does what DDP does without a hook: divide the bucket by the world size and sum it
with ``all_reduce``; ``fp16_hook`` wraps ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.
fp16_compress_hook`` unchanged and only counts its bytes.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ..comm.collectives import dense_allreduce
from .base import HookState
from .spec import NoOptions, hook_algorithm


class AllReduceState(HookState):
    """State of :func:`allreduce_hook`: counters only."""


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's flat gradient (float32 ``[numel]``) over ranks with one ``all_reduce``.

    Bitwise identical to DDP's built-in reduction (it divides by world size before the sum).
    """
    fut = dense_allreduce(bucket.buffer(), state.process_group, state.count_collective)
    state.end_bucket(bucket)
    return fut


class FP16State(HookState):
    """State of :func:`fp16_hook`: counters only."""


def fp16_hook(state: FP16State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``fp16_compress_hook``: cast the bucket to float16, all-reduce, cast back.

    Bytes counted: payload ``numel * 2`` per bucket (the float16 tensor handed to ``all_reduce``),
    wire ``2 (P-1)/P`` times that.
    """
    buf = bucket.buffer()
    state.count_payload(buf.numel() * 2, "allreduce")
    state.end_bucket(bucket)
    return default_hooks.fp16_compress_hook(state.process_group, bucket)


ALLREDUCE = hook_algorithm("allreduce", "dense all-reduce, bitwise equal to DDP's built-in reduction (PyTorch DDP)",
                           NoOptions, lambda opts, ctx: (AllReduceState(ctx.process_group), allreduce_hook))
FP16 = hook_algorithm("fp16", "torch's fp16_compress_hook: cast to float16, all-reduce, cast back",
                      NoOptions, lambda opts, ctx: (FP16State(ctx.process_group), fp16_hook))

#: the algorithms this module registers
SPECS = (ALLREDUCE, FP16)
