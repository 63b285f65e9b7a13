"""Measure communication hooks against dense all-reduce on the same gradients, while training.

A :class:`QualityMeter` wraps one or more DDP communication hooks; on the steps it is switched on it
also all-reduces each bucket densely and sums, per hook, ``||c - d||^2`` and ``||d||^2`` (``c``: the
hook's aggregate, ``d``: the dense average). ``sqrt`` of their ratio, all-reduced, is the hook's
relative error: GraVAC's compression gain seen from the other side (Tyagi & Sharma 2023, arXiv
2305.12201, §3.2: the gain is ``||C(g)||^2 / ||g||^2``; here the error of the error-fed, aggregated
result the optimizer receives). The dense reference may be a random sample of each gradient tensor's
elements (``sample_fraction``): the sums over the sample estimate the full sums' ratio at that
fraction of the reference's bytes. Metered as a hook, :func:`local_gradient_hook` (the rank's own
gradient, nothing sent) gives the gradient noise, the unit :func:`error_to_noise` measures errors in. Used by the start-up probe (:mod:`gradsync.profiler.probe`) and by the
``ladder`` algorithm's controller (:mod:`gradsync.algorithms.ladder`).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..comm.buckets import gradient_offsets
from ..comm.collectives import collective_device
from ..comm.futures import completed
from ..validation import check_float, check_int

__all__ = ["ProxyBucket", "QualityMeter", "metered_hook", "relative_errors", "local_gradient_hook", "LOCAL_GRADIENT",
           "error_to_noise", "REFERENCE_FRACTION"]


class ProxyBucket:
    """A stand-in for a DDP ``GradBucket`` over a private copy of its buffer: the same index, last flag
    and gradient layout, so a second hook can compress the same gradients without touching the real
    bucket (``buffer()``: ``[numel]`` tensor of the bucket's dtype and device)."""

    def __init__(self, bucket: Any):
        self._buffer = bucket.buffer().detach().clone()
        self._index, self._last = bucket.index(), bucket.is_last()
        self._grads = [self._buffer[offset:offset + g.numel()].view(g.shape) for offset, g in gradient_offsets(bucket)]
        self._params = bucket.parameters()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def gradients(self) -> list:
        return self._grads

    def parameters(self) -> list:
        return self._params


class QualityMeter:
    """Measures communication hooks against dense all-reduce on the same gradients.

    While :attr:`on`, each bucket is also all-reduced densely (issued from the hook body before any
    hook's collective, so every rank issues the same collectives in the same order) and every hook's
    aggregate ``c`` is compared with the dense average ``d``. Off, only the primary hook runs.

    Args:
        hooks: ``[(state, hook), ...]``; every hook must issue its collectives from the hook body
            (gradsync's hooks do; torch's ``powerSGD_hook`` does not: meter it as the primary only,
            on one bucket).
        primary: the index of the hook that gets the real bucket and whose result DDP receives; None:
            DDP receives the dense average (every hook works on a :class:`ProxyBucket`).
        process_group: the group of the collectives.
        sample_fraction: in (0, 1]: the fraction of each gradient tensor's elements the dense
            reference all-reduces and the comparison covers (at least one element per tensor, drawn
            with replacement, the same on every rank: a generator seeded from ``seed`` and the count
            of buckets measured so far); 1 compares every element. Below 1 a ``primary`` is required
            (DDP needs a whole result).
        seed: the sample's seed.

    Raises:
        ValueError: for ``sample_fraction`` outside (0, 1], or below 1 without a ``primary``.

    Attributes:
        on: measure this step (set alike on every rank, from the step counter).
        error_sq, reference_sq: per hook, float64 0-d tensors: ``sum ||c - d||^2`` and ``sum ||d||^2``
            over the buckets measured since :meth:`reset`.
        dense_wire_bytes: wire bytes of the meter's own dense all-reduces (ring, ``2(P-1)/P x n``).
        sampled_buckets: buckets sampled so far (the position in the sample's sequence; a checkpoint
            keeps it so a resumed run compares the same elements).
    """

    def __init__(self, hooks: Sequence[tuple[Any, Callable]], primary: Optional[int] = None,
                 process_group: Any = None, sample_fraction: float = 1.0, seed: int = 0):
        self.hooks = list(hooks)
        self.primary = primary
        self.process_group = process_group
        self.sample_fraction = check_float("sample_fraction", sample_fraction, 0.0, 1.0, low_inclusive=False)
        if self.sample_fraction < 1 and primary is None:
            raise ValueError(f"sample_fraction {sample_fraction} < 1 needs a primary hook: DDP receives its result")
        self.seed = seed
        self.on = False
        self.dense_wire_bytes = 0.0
        self.sampled_buckets = 0
        self.reset()

    def sample(self, bucket: Any) -> Optional[torch.Tensor]:
        """The ``[k]`` int64 positions in ``bucket``'s buffer the reference covers this time (on the
        buffer's device), None for every element; advances the sample's generator."""
        if self.sample_fraction >= 1:
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.sampled_buckets)
        self.sampled_buckets += 1
        parts = []
        for offset, grad in gradient_offsets(bucket):  # drawn on the CPU generator: alike on every device
            n = grad.numel()
            k = max(1, math.ceil(n * self.sample_fraction))
            parts.append(offset + torch.randint(0, n, (k,), generator=g, device="cpu"))
        return torch.cat(parts).to(bucket.buffer().device)

    def restart_sample(self) -> None:
        """Draw the reference's positions from the start of their sequence again: a second measurement
        of the same gradients compares the same elements."""
        self.sampled_buckets = 0

    def reset(self) -> None:
        """Forget the sums."""
        self.error_sq: list[Optional[torch.Tensor]] = [None] * len(self.hooks)
        self.reference_sq: list[Optional[torch.Tensor]] = [None] * len(self.hooks)

    def sums(self) -> torch.Tensor:
        """``[len(hooks), 2]`` float64 tensor on the collective device: each hook's ``[error_sq,
        reference_sq]`` (zeros before any measured bucket), to be all-reduced (:func:`relative_errors`)."""
        device = collective_device(self.process_group)
        rows = [torch.stack([e, r]).to(device) if e is not None else torch.zeros(2, dtype=torch.float64, device=device)
                for e, r in zip(self.error_sq, self.reference_sq)]
        return torch.stack(rows)

    def _add(self, i: int, out: torch.Tensor, dense: torch.Tensor) -> None:
        e = (out.double() - dense.double()).pow(2).sum()
        r = dense.double().pow(2).sum()
        self.error_sq[i] = e if self.error_sq[i] is None else self.error_sq[i] + e
        self.reference_sq[i] = r if self.reference_sq[i] is None else self.reference_sq[i] + r


def relative_errors(sums: torch.Tensor) -> list[float]:
    """``sqrt(error_sq / reference_sq)`` of each row of :meth:`QualityMeter.sums` (0 where both are 0:
    nothing measured, or an all-zero gradient)."""
    return [(e / r) ** 0.5 if r > 0 else 0.0 for e, r in sums.cpu().tolist()]


#: The share of each gradient tensor's elements the quality probe's and the ladder's dense reference
#: all-reduces (:class:`QualityMeter` ``sample_fraction``): a sixteenth of a dense all-reduce per measured step.
REFERENCE_FRACTION = 1 / 16


def local_gradient_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A hook that sends nothing: the rank's own gradient. Metered beside the dense reference, its
    relative error is the gradient noise ``sqrt(mean_i sum ||g_i - d||^2 / sum ||d||^2)``."""
    return completed(bucket.buffer())


#: ``(state, hook)`` of :func:`local_gradient_hook` for :class:`QualityMeter`.
LOCAL_GRADIENT = (None, local_gradient_hook)


def error_to_noise(error: float, noise: float, world_size: int) -> float:
    """``r = error * sqrt(world_size - 1) / noise``: a relative error in units of the dense average's own
    relative sampling noise. With ``P`` ranks drawing independent batches one rank's gradient lies
    ``E||g_i - d||^2 = (P - 1) / P * s^2`` from the average ``d``, which lies ``s^2 / P`` from the full
    gradient, so ``noise / sqrt(P - 1)`` is the average's noise (:mod:`gradsync.profiler.quality_model`).
    0 for a zero error, ``math.inf`` for a positive error on noiseless gradients.

    Raises:
        ValueError: for a negative or non-finite ``error`` or ``noise``, or ``world_size`` < 2.
    """
    error = check_float("error", error, 0.0, math.inf)
    noise = check_float("noise", noise, 0.0, math.inf)
    world_size = check_int("world_size", world_size, 2)
    if error == 0:
        return 0.0
    return math.inf if noise == 0 else error * math.sqrt(world_size - 1) / noise


def _value(fut: torch.futures.Future) -> torch.Tensor:
    v = fut.value()
    return v[0] if isinstance(v, (list, tuple)) else v


def metered_hook(meter: QualityMeter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The meter's DDP hook (see :class:`QualityMeter`); the comparison runs in a callback that issues
    no collective. With a sample, the reference all-reduces ``k`` elements (float of the bucket's
    dtype) instead of the bucket's ``numel``."""
    if not meter.on:
        state, hook = meter.hooks[meter.primary or 0]
        return hook(state, bucket)
    idx = meter.sample(bucket)
    dense = bucket.buffer().detach().clone() if idx is None else bucket.buffer().detach()[idx]
    world = dist.get_world_size(meter.process_group)
    meter.dense_wire_bytes += 2 * (world - 1) / world * dense.numel() * dense.element_size()
    dense_fut = dist.all_reduce(dense, group=meter.process_group, async_op=True).get_future()
    # every copy is taken before any hook runs: the primary may all-reduce the real bucket in place
    views = [bucket if i == meter.primary else ProxyBucket(bucket) for i in range(len(meter.hooks))]
    futs = [hook(state, view) for (state, hook), view in zip(meter.hooks, views)]

    def compare(done: torch.futures.Future) -> torch.Tensor:
        *outs, _ = (_value(f) for f in done.value())
        average = dense.div_(world)
        for i, out in enumerate(outs):
            meter._add(i, out if idx is None else out[idx], average)
        if meter.primary is None:
            bucket.buffer().copy_(average)
            return bucket.buffer()
        return outs[meter.primary]

    return torch.futures.collect_all([*futs, dense_fut]).then(compare)
