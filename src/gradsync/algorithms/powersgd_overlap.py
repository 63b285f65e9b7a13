"""PowerSGD on every DDP bucket, overlapped with backward on Gloo (Vogels, Karimireddy & Jaggi,
NeurIPS 2019, arXiv 1905.13727, Algorithm 1: rank-r power iteration with error feedback and warm
start).

torch's ``powerSGD_hook`` launches its second all-reduce (Q) from a ``.then`` callback of the first
(P); with several buckets in flight Gloo runs those callbacks in a different order on different ranks,
so the collectives mismatch (``../shared/specs/platform.md``), and gradsync's ``powersgd`` runs it on
one DDP bucket, after backward. This hook issues every collective from the hook body, in bucket
order, so their order is the same on every rank:

    hook of bucket b:  wait for P(b-1), orthogonalise it, Q(b-1) = M(b-1)^T P(b-1), all-reduce Q(b-1);
                       P(b) = M(b) Q(b) (with the 1-D tensors of b), all-reduce P(b);
                       the last bucket also finishes itself: wait for P(b), all-reduce Q(b).

So the P and Q all-reduces of early buckets run while backward computes the later ones (wait-free
back-propagation); only the wait for the previous bucket's P, a small message, blocks backward.
Decompression (``M ~ P Q^T``, error feedback, warm-start memory) runs in the Q all-reduce's ``.then``
callback, which launches no collective.

The arithmetic per tensor is torch's: tensors with one dimension, or whose rank-r factors are not 2x
smaller than the matrix ``tensor.view(shape[0], -1)`` (torch's ``min_compression_rate``), are
all-reduced uncompressed; P is orthonormalised after its all-reduce; the all-reduced Q is divided by
the world size and kept as the next step's warm start. Where it differs: the residual covers only
the compressed tensors (torch's also holds each rank's deviation from the mean of the uncompressed
ones, which sums to zero over ranks), Q starts from a generator seeded by ``(seed, bucket index)``,
and P is orthonormalised by ``torch.linalg.qr``. Compression runs in float32 whatever the bucket's
dtype.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.buckets import gradient_offsets
from ..comm.collectives import dense_allreduce
from ..comm.futures import then
from ..compressors.lowrank import compressed_matrix
from ..validation import check_dense_from, check_float, check_int
from .base import HookState
from .powersgd import PowerSGDOptions, dense_tail, move_bucket_memories
from .spec import hook_algorithm

@dataclass(frozen=True)
class PowerSGDOverlapOptions(PowerSGDOptions):
    """Options of ``powersgd-overlap``: those of ``powersgd``."""

    OWNER = "powersgd-overlap"


@dataclass
class _Phase1:
    """A bucket between its P all-reduce and its Q all-reduce."""

    index: int
    buffer: torch.Tensor           # the DDP bucket ([numel], its own dtype): receives the result
    m: torch.Tensor                # float32 [numel]: gradient + residual
    matrices: list                 # (offset, rows, cols) of the compressed tensors in ``m``
    plain: list                    # (offset, numel) of the tensors all-reduced uncompressed
    work: Any                      # the P all-reduce
    flat: torch.Tensor             # float32 [uncompressed numel + sum rows x r]: its input and output
    result: torch.futures.Future   # the future DDP holds for this bucket


class PowerSGDOverlapState(HookState):
    """State of :func:`powersgd_overlap_hook`.

    Args:
        matrix_approximation_rank: rank r of the approximation ``M ~ P Q^T``, in [1, 64].
        start_iter: dense all-reduce for the first ``start_iter`` iterations (>= 2: DDP rebuilds its
            buckets after the first).
        process_group: group of the all-reduces.
        seed: seeds the initial Q of each bucket (must be the same on every rank).
        dense_from: from this iteration on, torch's fp16 all-reduce (see ``powersgd``'s dense tail);
            0 (default): never; else >= ``start_iter``.
        tail_chunk_mb: the dense tail all-reduces a bucket in chunks of this many MB, in (0, 1024].

    Attributes:
        error_dict: bucket index -> float32 ``[numel]`` error-feedback residual.
        q_memory_dict: bucket index -> list of float32 ``[cols, r]`` warm-start Q, one per
            compressed tensor.

    Raises:
        ValueError: for arguments outside those ranges.
    """

    def __init__(self, matrix_approximation_rank: int = 2, start_iter: int = 2,
                 process_group: Optional[dist.ProcessGroup] = None, seed: int = 0, dense_from: int = 0,
                 tail_chunk_mb: float = 25.0):
        super().__init__(process_group)
        self.matrix_approximation_rank = check_int("matrix_approximation_rank", matrix_approximation_rank, 1, 64)
        self.start_iter = check_int("start_iter", start_iter, 2)
        self.seed = check_int("seed", seed, 0)
        self.dense_from = check_dense_from(dense_from, self.start_iter)
        self.tail_chunk_mb = check_float("tail_chunk_mb", tail_chunk_mb, 0.0, 1024.0, low_inclusive=False)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, list] = {}
        self._pending: Optional[_Phase1] = None

    def skip_start(self) -> None:
        """Compress from the next iteration on, for a state that joins a DDP whose buckets were
        already rebuilt (the start-up probe's copies): the dense start iterations exist only for
        that rebuild. No residual or warm-start memory exists yet, so nothing else changes."""
        self.iteration = max(self.iteration, self.start_iter)

    def _snapshot(self) -> Any:
        # residuals and Q lists are replaced, never modified in place
        return dict(self.error_dict), dict(self.q_memory_dict)

    def _restore(self, saved: Any) -> None:
        self.error_dict, self.q_memory_dict = (dict(d) for d in saved)

    def config(self) -> dict[str, Any]:
        return {"algorithm": "powersgd-overlap", "matrix_approximation_rank": self.matrix_approximation_rank,
                "start_iter": self.start_iter, "dense_from": self.dense_from, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "error_dict": dict(self.error_dict),
                "q_memory_dict": {k: list(v) for k, v in self.q_memory_dict.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.error_dict = dict(state["error_dict"])
        self.q_memory_dict = {k: list(v) for k, v in state["q_memory_dict"].items()}

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_pending"] = None
        return d

    # -- the two phases ------------------------------------------------------------------------
    def _initial_q(self, index: int, cols: list, device: torch.device) -> list:
        # drawn on the CPU, so every rank gets the same Q whatever its device
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return [torch.randn(c, self.matrix_approximation_rank, generator=gen, device="cpu").to(device) for c in cols]

    def phase1(self, bucket: dist.GradBucket) -> _Phase1:
        """Add the residual, compute P = M Q for the compressed tensors and launch one all-reduce of
        the uncompressed tensors and every P."""
        with self.compression_timer():
            return self._phase1(bucket)

    def _phase1(self, bucket: dist.GradBucket) -> _Phase1:
        buf, index, r = bucket.buffer(), bucket.index(), self.matrix_approximation_rank
        m = buf.to(torch.float32, copy=True)
        matrices, plain = [], []
        for off, g in gradient_offsets(bucket):
            mat = compressed_matrix(g.shape, r)
            if mat is None:
                plain.append((off, g.numel()))
            else:
                matrices.append((off, *mat))
        cols = [c for _, _, c in matrices]
        qs = self.q_memory_dict.get(index) or self._initial_q(index, cols, buf.device)
        error = self.error_dict.get(index)
        if [q.shape[0] for q in qs] != cols or (error is not None and error.numel() != m.numel()):
            raise ValueError(f"powersgd-overlap: bucket {index} holds other tensors than its saved residual and "
                             "warm-start Q (DDP's bucket_cap_mb or the model differs from the run the state was "
                             "saved in)")
        if error is not None:
            m.add_(error)
        parts = [m[o:o + n] for o, n in plain]
        parts += [(m[o:o + rows * cols].view(rows, cols) @ q).reshape(-1) for (o, rows, cols), q in zip(matrices, qs)]
        flat = torch.cat(parts) if parts else m.new_zeros(0)
        self.count_collective(flat, kind="allreduce")
        work = dist.all_reduce(flat, group=self.process_group, async_op=True)
        return _Phase1(index, buf, m, matrices, plain, work, flat, torch.futures.Future())

    def phase2(self, p1: _Phase1) -> None:
        """Wait for ``p1``'s P, orthonormalise it, launch the all-reduce of Q = M^T P; its callback
        decompresses into the bucket and completes ``p1.result``."""
        if not p1.matrices:  # nothing compressed: the P all-reduce carried the whole bucket
            then(p1.work.get_future(), lambda f: self._finish(p1, f, [], p1.flat.new_zeros(0)))
            return
        p1.work.wait()  # blocks backward: a small message, launched one bucket earlier
        with self.compression_timer():
            self._phase2(p1)

    def _phase2(self, p1: _Phase1) -> None:
        world, r = self.world_size, self.matrix_approximation_rank
        plain_numel = sum(n for _, n in p1.plain)
        ps, at = [], plain_numel
        for _, rows, _ in p1.matrices:
            ps.append(torch.linalg.qr(p1.flat[at:at + rows * r].view(rows, r)).Q)
            at += rows * r
        qflat = torch.cat([(p1.m[o:o + rows * cols].view(rows, cols).t() @ p).reshape(-1)
                           for (o, rows, cols), p in zip(p1.matrices, ps)])
        self.count_collective(qflat, kind="allreduce")
        work = dist.all_reduce(qflat, group=self.process_group, async_op=True)
        then(work.get_future(), lambda f: self._finish(p1, f, ps, qflat.div_(world)))

    def _finish(self, p1: _Phase1, last: torch.futures.Future, ps: list, qflat: torch.Tensor) -> None:
        """Complete ``p1.result`` with the decompressed bucket, or with the error of the bucket's
        last all-reduce (``last``), so that DDP raises it instead of waiting."""
        try:
            last.value()
            self._decompress(p1, ps, qflat)
        except Exception as exc:  # noqa: BLE001  handed to DDP through the bucket's future
            p1.result.set_exception(exc)
            return
        p1.result.set_result(p1.buffer)

    def _decompress(self, p1: _Phase1, ps: list, qflat: torch.Tensor) -> None:
        out = torch.empty_like(p1.m)
        at, qs = 0, []
        for (o, rows, cols), p in zip(p1.matrices, ps):
            q = qflat[at:at + cols * self.matrix_approximation_rank].view(cols, -1)
            at += q.numel()
            qs.append(q)
            out[o:o + rows * cols].view(rows, cols).copy_(p @ q.t())
        error = p1.m - out
        at, world = 0, self.world_size
        for o, n in p1.plain:
            out[o:o + n].copy_(p1.flat[at:at + n]).div_(world)
            error[o:o + n].zero_()
            at += n
        self.error_dict[p1.index] = error
        if qs:
            self.q_memory_dict[p1.index] = qs
        p1.buffer.copy_(out)


def powersgd_overlap_hook(state: PowerSGDOverlapState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PowerSGD on ``bucket`` (``[numel]`` of any floating dtype, compressed in float32), pipelined
    with the neighbouring buckets as the module docstring says. Per compressed iteration it
    all-reduces, per bucket, ``uncompressed numel + sum_t rows_t x r`` and ``sum_t cols_t x r``
    float32 elements.

    A non-finite input on any rank reaches every rank's result through the all-reduced factors,
    so the result decides (:class:`~gradsync.feedback.finite.FiniteGuard`, no extra collective): a
    non-finite step restores the residuals and warm-start memories and returns NaN, so GradScaler
    skips it on every rank."""
    move_bucket_memories(bucket, state.error_dict, state.q_memory_dict)
    if state.dense_from and state.iteration >= state.dense_from:
        return dense_tail(state, bucket, state.error_dict)
    if state.iteration < state.start_iter:
        fut = dense_allreduce(bucket.buffer(), state.process_group, state.count_collective)
        state.end_bucket(bucket)
        return fut
    state.finite_guard.begin(state.iteration, state._snapshot)
    # the previous bucket is taken off before its second phase runs, and this one is left pending
    # only once its first phase succeeded: an error in either (a failed collective) leaves no
    # bucket of the failed iteration for the next step to finish; nor does a backward pass that
    # stopped between two buckets (DDP calls the hooks in bucket order: bucket 0 starts an iteration)
    previous, state._pending = state._pending, None
    if previous is not None and bucket.index() != 0:
        state.phase2(previous)
    current = state.phase1(bucket)
    if bucket.is_last():
        state.phase2(current)
    else:
        state._pending = current
    state.end_bucket(bucket)
    return state.guarded(bucket, current.result)


SPEC = hook_algorithm(
    "powersgd-overlap", "PowerSGD with error feedback on every DDP bucket, its all-reduces overlapped with backward "
    "on Gloo (Vogels, Karimireddy & Jaggi, NeurIPS 2019, arXiv 1905.13727)", PowerSGDOverlapOptions,
    lambda opts, ctx: (PowerSGDOverlapState(opts.matrix_approximation_rank, process_group=ctx.process_group,
                                            seed=ctx.seed, dense_from=opts.dense_from,
                                            tail_chunk_mb=ctx.bucket_cap_mb), powersgd_overlap_hook))

#: the algorithms this module registers
SPECS = (SPEC,)
