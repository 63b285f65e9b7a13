"""torch's PowerSGD hook (Vogels, Karimireddy & Jaggi, NeurIPS 2019), wrapped with gradsync counters.

The compression itself is ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` unchanged
(rank-r approximation ``M ~ P Q^T`` with two all-reduces, error feedback, warm start). On Gloo it
works only with a single DDP bucket (its ``.then`` callbacks launch collectives, which Gloo runs in a
different order on different ranks when several buckets are in flight), so DDP gets one bucket for it.
Bytes sent are read from torch's own element counters (``total_numel_after_compression``).

A dense tail (``dense_from``, not in the paper): from that iteration on the bucket is all-reduced as
torch's ``fp16_compress_hook`` does it (cast to float16, divided by the world size, summed, cast
back), in chunks of the job's DDP bucket size launched together, and the first such step adds torch's
error-feedback residual to the gradient (flushing it), so the end of the schedule runs at fp16
quality (decided by the iteration counter, identical on every rank). The chunks matter on slow links:
PowerSGD's single bucket sent as one message overflowed the emulated link's queue and waited for TCP
retransmissions (docs/results.md, the chunked tail).

Low-precision parameters: torch's hook keeps its error-feedback residual and its factors P, Q in the
bucket's dtype. For bfloat16/float16 buckets the compressed steps run it on a float32 copy of the
bucket (residuals, P and Q in float32; the result is cast back into the bucket), so residuals are
not rounded to 8 (bf16) or 11 (fp16) significant bits; the dense warm-up steps all-reduce the bucket
in its own dtype, as DDP does.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from dataclasses import dataclass

from ..comm.buckets import gradient_offsets
from ..comm.futures import then
from ..comm.sparse import allreduce_payload
from ..options import Options, option
from ..validation import check_dense_from, check_float, check_int
from .base import HookState
from .spec import hook_algorithm


@dataclass(frozen=True)
class PowerSGDOptions(Options):
    """Options of ``powersgd``."""

    OWNER = "powersgd"
    matrix_approximation_rank: int = option(2, "PowerSGD matrix approximation rank r", low=1, high=64)
    dense_from: int = option(0, "from this iteration on torch's fp16 hook, the first such step carrying the "
                             "error-feedback residual, so the end of training runs at fp16 quality; 0: never",
                             low=0, high=100_000_000, units="iterations")


class PowerSGDHookState(HookState):
    """gradsync state around a ``torch`` ``PowerSGDState``.

    Args:
        matrix_approximation_rank: rank r of the approximation ``M ~ P Q^T``, in [1, 64].
        start_iter: dense all-reduce for the first ``start_iter`` iterations (>= 2).
        process_group: group of the all-reduces.
        seed: torch's PowerSGD random seed (the same on every rank).
        dense_from: from this iteration on, the fp16 all-reduce of torch's ``fp16_compress_hook``;
            the first such step adds the error-feedback residual to the gradient. 0 (default):
            never; else >= ``start_iter``.
        tail_chunk_mb: the dense tail all-reduces the bucket in chunks of this many MB of the
            bucket's own dtype (the job's DDP bucket size), in (0, 1024].

    Raises:
        ValueError: for arguments outside those ranges.
    """

    dense_from = 0  # states pickled before the option existed

    def __init__(self, matrix_approximation_rank: int = 2, start_iter: int = 2,
                 process_group: dist.ProcessGroup | None = None, seed: int = 0, dense_from: int = 0,
                 tail_chunk_mb: float = 25.0):
        super().__init__(process_group)
        self.tail_chunk_mb = check_float("tail_chunk_mb", tail_chunk_mb, 0.0, 1024.0, low_inclusive=False)
        self.matrix_approximation_rank = check_int("matrix_approximation_rank", matrix_approximation_rank, 1, 64)
        self.start_iter = check_int("start_iter", start_iter, 2)
        self.dense_from = check_dense_from(dense_from, self.start_iter)
        self.torch_state = torch_powersgd.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=self.matrix_approximation_rank,
            start_powerSGD_iter=self.start_iter, use_error_feedback=True, warm_start=True,
            random_seed=seed)

    def skip_start(self) -> None:
        """Compress from the next iteration on, for a state that joins a DDP whose buckets were
        already rebuilt (the start-up probe's copies): the dense start iterations exist only for
        that rebuild. No residual or warm-start memory exists yet, so nothing else changes."""
        self.iteration = max(self.iteration, self.start_iter)
        self.torch_state.iter = max(self.torch_state.iter, self.torch_state.start_powerSGD_iter)

    def _snapshot(self) -> Any:
        # torch replaces error tensors but computes P and Q into its warm-start memories in place
        ts = self.torch_state
        return (dict(ts.error_dict), {k: v.clone() for k, v in ts.p_memory_dict.items()},
                {k: v.clone() for k, v in ts.q_memory_dict.items()})

    def _restore(self, saved: Any) -> None:
        ts = self.torch_state
        ts.error_dict, ts.p_memory_dict, ts.q_memory_dict = (dict(d) for d in saved)

    def config(self) -> dict[str, Any]:
        return {"algorithm": "powersgd", "matrix_approximation_rank": self.matrix_approximation_rank,
                "start_iter": self.start_iter, "dense_from": self.dense_from}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "torch_state": self.torch_state.__getstate__()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.torch_state.__setstate__(state["torch_state"])
        self.torch_state.process_group = self.process_group or dist.distributed_c10d._get_default_group()


class _Float32Bucket:
    """A float32 copy of a DDP ``GradBucket`` with the methods torch's ``powerSGD_hook`` calls
    (``buffer``, ``gradients``, ``index``, ``is_last``); per-parameter gradients are views of the
    copy at the offsets they have in the original bucket."""

    def __init__(self, bucket: Any):
        self._bucket = bucket
        self._buffer = bucket.buffer().to(torch.float32)
        self._gradients = [self._buffer[off:off + g.numel()].view(g.shape) for off, g in gradient_offsets(bucket)]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list:
        return self._gradients

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` on ``bucket`` (``[numel]`` of float32, or of bfloat16/float16, then
    compressed through a float32 copy: see the module docstring), counting the bytes it sends.

    On compressed iterations a non-finite input on any rank reaches every rank's result (through the
    all-reduced factors P and Q and the dense all-reduce of 1-D tensors), so the result decides
    (:class:`~gradsync.feedback.finite.FiniteGuard`, no extra collective): a non-finite step
    restores torch's error dict and its warm-start P/Q memories and returns NaN, so GradScaler
    skips it on every rank."""
    if bucket.index() == 0 and not bucket.is_last():
        check_one_bucket(state, "powersgd")
    ts = state.torch_state
    move_bucket_memories(bucket, ts.error_dict, ts.p_memory_dict, ts.q_memory_dict)
    if state.dense_from and state.iteration >= state.dense_from:
        return dense_tail(state, bucket, ts.error_dict)
    buf = bucket.buffer()
    before = ts.total_numel_after_compression
    compressed = ts.iter >= ts.start_powerSGD_iter
    low_precision = buf.dtype in (torch.float16, torch.bfloat16) and compressed
    if compressed:
        state.finite_guard.begin(state.iteration, state._snapshot)
    with state.compression_timer():
        if low_precision:
            copy = _Float32Bucket(bucket)
            fut = then(torch_powersgd.powerSGD_hook(ts, copy), lambda f: buf.copy_(f.value()))
        else:
            fut = torch_powersgd.powerSGD_hook(ts, bucket)
    sent = ts.total_numel_after_compression - before
    itemsize = 4 if low_precision else buf.element_size()
    state.count_payload((sent if sent else buf.numel()) * itemsize, "allreduce",
                        collectives=1 if sent == 0 else 2)  # P and Q are all-reduced
    state.end_bucket(bucket)
    return state.guarded(bucket, fut) if compressed else fut


def move_bucket_memories(bucket: dist.GradBucket, *memories: dict) -> None:
    """Move ``bucket``'s entries of ``memories`` (dicts of bucket index -> tensor or list of tensors:
    error-feedback residuals, warm-start factors) to the bucket's device, replacing them in the dict.
    A state loaded directly with ``load_state_dict`` from a checkpoint read on the CPU
    (``map_location="cpu"``) meets a CUDA model's buckets here; torch's PowerSGD hook would add a CPU
    residual to a CUDA gradient."""
    device, index = bucket.buffer().device, bucket.index()
    for memory in memories:
        value = memory.get(index)
        if isinstance(value, torch.Tensor) and value.device != device:
            memory[index] = value.to(device)
        elif isinstance(value, list) and any(t.device != device for t in value):
            memory[index] = [t.to(device) for t in value]


def check_one_bucket(state: HookState, name: str) -> None:
    """Called at bucket 0 of an iteration when it is not the last one (DDP has several buckets):
    raise the same ``ValueError`` on every rank (the bucket layout is the same on every rank, and no
    collective of the iteration has been launched yet) unless the group is NCCL. torch's PowerSGD
    hook launches its second all-reduce from a ``.then`` callback, which Gloo runs on its own threads
    in different orders on different ranks when several buckets are in flight: the collectives
    mismatch (an abort, or a hang until the process-group timeout)."""
    if dist.get_backend(state.process_group) == "nccl":
        return
    raise ValueError(
        f"{name}: DDP has several gradient buckets on a {dist.get_backend(state.process_group)} group, where torch's "
        "PowerSGD hook mismatches its collectives across ranks (it launches them from future callbacks); give DDP "
        "one bucket (DistributedDataParallel(model, bucket_cap_mb=...) at least the model's gradient size in MB, "
        "as gradsync train does for powersgd), register gradsync.algorithms.joined.joined_hook(hook) (the buckets "
        "joined into one at the last, the same result) or use algorithm 'powersgd-overlap', gradsync's PowerSGD "
        "that works on every bucket")


def dense_tail(state: HookState, bucket: dist.GradBucket,
               error_dict: dict) -> torch.futures.Future[torch.Tensor]:
    """An iteration >= ``state.dense_from``: torch's ``fp16_compress_hook`` (the bucket divided by the
    world size, cast to float16, summed, cast back; ``numel`` x 2 bytes), in chunks of
    ``state.tail_chunk_mb`` launched together. While ``error_dict`` (bucket index -> residual, the
    hook's error feedback) holds this bucket's residual it is added to the gradient first and
    removed, under the finite guard: a non-finite step restores it (``state._snapshot`` copies the
    dict) and the next step flushes it again."""
    state.settle()  # a deferred rollback of the last compressed step restores error_dict first
    buf = bucket.buffer()
    error = error_dict.get(bucket.index())
    if error is not None:
        state.finite_guard.begin(state.iteration, state._snapshot)
        del error_dict[bucket.index()]
        buf.add_(error.to(buf.dtype))
    # torch's fp16_compress_hook arithmetic (cast to float16, divide, sum), the float16 copy sent in
    # chunks of the job's bucket size, all launched at once; with 2 ranks bitwise torch's hook
    chunk = max(1, int(state.tail_chunk_mb * 2 ** 20) // buf.element_size())
    summed = allreduce_payload(tuple(buf.to(torch.float16).split(chunk)), state.process_group,
                               state.count_collective)
    fut = then(summed, lambda f: buf.copy_(torch.cat(f.value())))
    state.end_bucket(bucket)
    return state.guarded(bucket, fut) if error is not None else fut


SPEC = hook_algorithm(
    "powersgd", "torch's PowerSGD hook with error feedback, one DDP bucket on Gloo (Vogels, Karimireddy & "
    "Jaggi, NeurIPS 2019, arXiv 1905.13727)", PowerSGDOptions,
    lambda opts, ctx: (PowerSGDHookState(opts.matrix_approximation_rank, process_group=ctx.process_group,
                                         seed=ctx.seed, dense_from=opts.dense_from,
                                         tail_chunk_mb=ctx.bucket_cap_mb), powersgd_hook),
    single_bucket=True)

#: the algorithms this module registers
SPECS = (SPEC,)
