"""Algorithm plans: what each gradient synchronisation algorithm sends per DDP bucket and step.

An :class:`AlgorithmPlan` says, per profile bucket, which collectives an algorithm launches (kind and
bytes, :class:`CommStep`) and what compression overhead it adds (:class:`BucketPlan`);
:func:`gradsync.sim.engine.simulate` replays them on a profile. :func:`make_plan` builds one from a
``"name:param"`` spec.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

from gradsync.comm.fragments import fragment_at
from gradsync.compressors.covap_shards import MAX_RATIO, CovapPlan
from gradsync.compressors.lowrank import compressed_matrix
from gradsync.sim.costmodel import COLLECTIVES
from gradsync.sim.profile import Profile, ProfileBucket
from gradsync.validation import check_float, check_int

__all__ = [
    "PHASES",
    "PLANS",
    "AlgorithmPlan",
    "BucketPlan",
    "CommStep",
    "CovapSimPlan",
    "DeARPlan",
    "DensePlan",
    "FP16Plan",
    "PeriodicPlan",
    "PowerSGDPlan",
    "TopKPlan",
    "make_plan",
]


#: When a :class:`CommStep` is launched.
PHASES = ("backward", "forward", "next_hook", "after_step")


@dataclass(frozen=True)
class CommStep:
    """One collective: ``kind`` in :data:`~gradsync.sim.costmodel.COLLECTIVES`, ``nbytes`` as the
    matching cost function takes it (the full vector for all-reduce/reduce-scatter/all-gather, the
    per-rank payload for ``sparse_allgather``). ``phase`` is ``"backward"`` (launched when the bucket
    is ready, overlapped with backward), ``"forward"`` (must finish before the bucket's layers run
    in the next forward pass, e.g. DeAR's all-gather) or ``"next_hook"`` (launched by the next
    bucket's hook, the last bucket's by its own, after that hook waited for this bucket's
    ``"backward"`` collectives to finish, stalling backward meanwhile: powersgd-overlap's Q after P)
    or ``"after_step"`` (launched after the optimizer step, once every backward-phase collective has
    finished, and waited for before the next iteration: nothing overlaps it; the periodic algorithms'
    syncs). ``overlap_steps`` (``"after_step"`` only): the collective is waited for only after that
    many further iterations, whose compute hides it (diloco's ``overlap``)."""

    kind: str
    nbytes: float
    phase: str = "backward"
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ValueError(f"kind must be one of {', '.join(COLLECTIVES)}; got {self.kind!r}")
        object.__setattr__(self, "nbytes", check_float("nbytes", self.nbytes, 0.0))
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}; got {self.phase!r}")
        check_int("overlap_steps", self.overlap_steps, 0, None if self.phase == "after_step" else 0)


@dataclass(frozen=True)
class BucketPlan:
    """What an algorithm does with one bucket in one step: its collectives (run back to back, in
    order) and the compression overhead in seconds (compress + decompress). No steps = dropped."""

    steps: tuple[CommStep, ...] = ()
    overhead_s: float = 0.0


class AlgorithmPlan(ABC):
    """An algorithm as seen by the simulator. Subclass and implement :meth:`bucket_plans`.

    ``period`` is the number of consecutive steps after which the plan repeats; :func:`simulate`
    averages over ``period`` steps (``step = 0 .. period-1``).
    """

    name: str = "plan"
    period: int = 1

    @abstractmethod
    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        """One :class:`BucketPlan` per profile bucket, in profile (DDP reduction) order."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class DensePlan(AlgorithmPlan):
    """DDP's default: one ring all-reduce of ``numel * dtype_bytes`` bytes per bucket."""

    def __init__(self) -> None:
        self.name = "dense"

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        return [BucketPlan((CommStep("allreduce", b.numel * profile.dtype_bytes),))
                for b in profile.buckets]


class FP16Plan(AlgorithmPlan):
    """torch's ``fp16_compress_hook``: all-reduce in half precision (2 bytes per element).

    Args:
        cast_s_per_element: seconds per element for casting to fp16 and back (both casts together);
            overhead per bucket ``= cast_s_per_element * numel``. Default 0 (measure it to include it).
    """

    def __init__(self, cast_s_per_element: float = 0.0) -> None:
        self.cast_s_per_element = check_float("cast_s_per_element", cast_s_per_element, 0.0)
        self.name = "fp16"

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        return [BucketPlan((CommStep("allreduce", b.numel * 2),), self.cast_s_per_element * b.numel)
                for b in profile.buckets]


class CovapSimPlan(AlgorithmPlan):
    """COVAP / OGC coarse-grained filter with compression ratio ``K`` (Meng, Sun & Li, arXiv
    2311.04499).

    Bucket ``b`` is cut into ``c_b`` strided shards (:class:`gradsync.compressors.covap_shards.CovapPlan`, the same
    rule and schedule the hook runs); shard ``s`` has
    global id ``G = sum_{b'<b} c_b' + s`` and is all-reduced at step ``t`` when ``(G + t) mod K == 0``
    (``ceil((n_b - s) / c_b)`` elements). A bucket with no selected shard is dropped (no collective,
    no cost). ``period = K``: :func:`simulate` averages steps ``0..K-1``. ``K = 1`` is dense.

    Args:
        k: integer compression ratio K >= 1.
        copy_s_per_element: seconds per bucket element for the strided copy + scatter-back and the
            error-feedback update (overhead charged on every bucket, sent or dropped). Default 0.
    """

    def __init__(self, k: int, copy_s_per_element: float = 0.0) -> None:
        self.k = check_int("k", k, 1)
        self.copy_s_per_element = check_float("copy_s_per_element", copy_s_per_element, 0.0)
        self.name = f"covap(K={self.k})"
        self.period = self.k

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        layout = CovapPlan.build([b.numel for b in profile.buckets], min(self.k, MAX_RATIO))
        plans = []
        for i, b in enumerate(profile.buckets):
            s = layout.selected_shard(i, step)
            steps: tuple[CommStep, ...] = ()
            if s is not None:
                n_shard = len(range(s, b.numel, layout.shards[i]))
                steps = (CommStep("allreduce", n_shard * profile.dtype_bytes),)
            plans.append(BucketPlan(steps, self.copy_s_per_element * b.numel))
        return plans


class TopKPlan(AlgorithmPlan):
    """Top-k sparsification with all-gather (e.g. GraVAC's communication: Tyagi & Swany,
    "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL Training", arXiv 2305.12201).

    Per bucket ``k = max(1, ceil(density * numel))``; two sparse all-gathers: the values
    (``k * dtype_bytes`` bytes per rank) and the int32 indices (``k * 4`` bytes per rank). Since k is
    the same on every rank, no size exchange or padding is needed.

    Args:
        density: fraction of elements kept, in (0, 1].
        select_s_per_element: seconds per bucket element for selection, error feedback and
            scatter-add of the ``P`` gathered payloads. Default 0.
    """

    def __init__(self, density: float, select_s_per_element: float = 0.0) -> None:
        self.density = check_float("density", density, 0.0, 1.0, low_inclusive=False)
        self.select_s_per_element = check_float("select_s_per_element", select_s_per_element, 0.0)
        self.name = f"topk(d={self.density:g})"

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        out = []
        for b in profile.buckets:
            k = max(1, math.ceil(self.density * b.numel))
            out.append(BucketPlan(
                (CommStep("sparse_allgather", k * profile.dtype_bytes),
                 CommStep("sparse_allgather", k * 4)),
                self.select_s_per_element * b.numel,
            ))
        return out


class PowerSGDPlan(AlgorithmPlan):
    """PowerSGD rank ``r`` as torch's ``powerSGD_hook`` (Vogels et al., NeurIPS 2019, Alg. 1).

    Per bucket, up to three fp32 all-reduces in order: the uncompressed tensors (1-D parameters, and
    matrices where ``(rows + cols) * r * 2 >= rows * cols``, torch's ``min_compression_rate = 2``),
    then ``P`` (``sum rows * r`` elements), then ``Q`` (``sum cols * r`` elements). A parameter of
    shape ``(d0, d1, ...)`` is the matrix ``rows = d0, cols = d1 * d2 * ...``.

    Approximation: when the profile bucket has no ``shapes``, the whole bucket is treated as one
    square matrix ``rows = cols = ceil(sqrt(numel))``; this gives the fewest bytes possible for the
    bucket (a lower bound on the traffic of per-layer matrices). Record ``shapes`` in the profile for
    the exact count.

    With ``fused=True`` it is gradsync's ``powersgd-overlap``: two fp32 all-reduces per bucket, the
    uncompressed tensors with ``P``, then ``Q``, launched by the next bucket's hook once ``P`` has
    arrived (phase ``"next_hook"``: backward waits for ``P``).

    Args:
        rank: matrix approximation rank r >= 1.
        flops_per_s: compute rate used to charge compression overhead: per matrix
            ``6 * rows * cols * r`` flops (M Q, M^T P, P Q^T) + ``2 * (rows + cols) * r**2``
            (Gram-Schmidt). ``None`` (default) charges no overhead.
        fused: all-reduce the uncompressed tensors (as float32) with ``P``.
    """

    def __init__(self, rank: int, flops_per_s: float | None = None, fused: bool = False) -> None:
        self.rank = check_int("rank", rank, 1)
        self.flops_per_s = (None if flops_per_s is None else
                            check_float("flops_per_s", flops_per_s, 0.0, low_inclusive=False))
        self.fused = bool(fused)
        self.name = f"powersgd(r={self.rank}{', fused' if self.fused else ''})"

    def _matrices(self, b: ProfileBucket) -> tuple[int, list[tuple[int, int]]]:
        if b.shapes is None:
            side = math.ceil(math.sqrt(b.numel))
            shapes: Iterable[tuple[int, ...]] = [(side, side)]
            # the padded square has >= numel elements; compressed volume only depends on sides
        else:
            shapes = b.shapes
        uncompressed = 0
        mats = []
        r = self.rank
        for s in shapes:
            mat = compressed_matrix(s, r)
            if mat is None:
                uncompressed += math.prod(s)
            else:
                mats.append(mat)
        if b.shapes is None and not mats:
            uncompressed = b.numel
        return uncompressed, mats

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        out = []
        r = self.rank
        db = 4  # torch's PowerSGD keeps P and Q in fp32
        for b in profile.buckets:
            unc, mats = self._matrices(b)
            p_bytes = sum(m[0] for m in mats) * r * db
            if self.fused:
                steps = [CommStep("allreduce", unc * db + p_bytes)] if unc or mats else []
            else:
                steps = [CommStep("allreduce", unc * profile.dtype_bytes)] if unc else []
                if mats:
                    steps.append(CommStep("allreduce", p_bytes))
            if mats:
                steps.append(CommStep("allreduce", sum(m[1] for m in mats) * r * db,
                                      "next_hook" if self.fused else "backward"))
            overhead = 0.0
            if self.flops_per_s is not None:
                flops = sum(6 * m[0] * m[1] * r + 2 * (m[0] + m[1]) * r * r for m in mats)
                overhead = flops / self.flops_per_s
            out.append(BucketPlan(tuple(steps), overhead))
        return out


class DeARPlan(AlgorithmPlan):
    """DeAR (Zhang et al., "DeAR: Accelerating Distributed Deep Learning with Fine-Grained
    All-Reduce Pipelining", arXiv 2302.12445): all-reduce decoupled into a
    reduce-scatter overlapped with backward and an all-gather overlapped with the next forward.

    Each profile bucket is one DeAR layer group (no re-grouping by DeAR's 25 MB threshold), padded to
    a multiple of ``P`` elements. In the forward pass groups run in reverse bucket order, each taking
    a share of ``forward_s`` proportional to its numel, and a group cannot start before its
    all-gather has finished (see :func:`simulate`). Overhead (the lazy SGD update) is not charged.
    """

    def __init__(self) -> None:
        self.name = "dear"

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        out = []
        for b in profile.buckets:
            n = b.numel + (-b.numel) % world_size
            nbytes = n * profile.dtype_bytes
            out.append(BucketPlan((CommStep("reduce_scatter", nbytes, "backward"),
                                   CommStep("allgather", nbytes, "forward"))))
        return out


class PeriodicPlan(AlgorithmPlan):
    """``local-sgd`` and ``diloco`` (Lin et al., ICLR 2020; Douillard et al., arXiv 2311.08105), with
    Streaming DiLoCo's fragments (arXiv 2501.18512, Sec. 2.2): no collective during backward; after
    the optimizer step of every ``period``-th step one all-reduce of all the gradient elements of the
    profile (the trainable parameters, or their outer gradient), phase ``"after_step"``: not overlapped
    with compute. With ``fragments = F`` fragment ``f`` is all-reduced after the steps
    :func:`gradsync.comm.fragments.fragment_at` gives (the algorithm's own schedule), ``F`` syncs per
    period; the simulator's fragments are equal element counts (``(f+1) N // F - f N // F``, where the
    algorithm cuts between whole tensors; the profile need not record the shapes). Floating buffers
    (BatchNorm statistics) are not in the profile and not simulated.

    The mean iteration over the period is ``compute + allreduce(N x bytes_per_element) / period``
    (with ``F > 1`` plus ``F - 1`` all-reduce latencies per period). With diloco's ``overlap = tau``
    (Streaming DiLoCo, arXiv 2501.18512, Sec. 2.3) each sync's all-reduce runs behind the next ``tau``
    iterations and only what they cannot hide is charged: ``max(0, allreduce - eta x tau x compute)``
    per sync, ``eta`` the simulation's ``overlap_efficiency`` (the rate a collective progresses while
    compute runs; the compute is not slowed in turn, so a lower bound where they share CPUs). Compute
    overheads (the outer optimizer step, the casts) are not charged. ``period`` is the plan's period
    (:func:`simulate` averages steps ``0 .. period-1``, step ``s`` being the algorithm's inner step ``s + 1``).

    Args:
        period: ``H >= 1`` inner steps per sync (per fragment).
        fragments: ``F`` in ``[1, period]``.
        bytes_per_element: bytes per element on the wire, > 0: 4 for float32, 2 for diloco's
            ``outer_dtype`` fp16 or bf16.
        overlap: diloco's ``tau`` in ``[0, period // fragments - 1]``.

    Raises:
        ValueError: naming the argument and its range.
    """

    def __init__(self, period: int, fragments: int = 1, bytes_per_element: float = 4, overlap: int = 0) -> None:
        self.period = check_int("period", period, 1)
        self.fragments = check_int("fragments", fragments, 1, self.period)
        self.bytes_per_element = check_float("bytes_per_element", bytes_per_element, 0.0, low_inclusive=False)
        self.overlap = check_int("overlap", overlap, 0, self.period // self.fragments - 1)
        extra = "" if self.fragments == 1 else f", F={self.fragments}"
        extra += "" if self.bytes_per_element == 4 else f", {self.bytes_per_element:g} B"
        extra += "" if self.overlap == 0 else f", tau={self.overlap}"
        self.name = f"periodic(H={self.period}{extra})"

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        plans = [BucketPlan() for _ in profile.buckets]
        f = fragment_at(step + 1, self.period, self.fragments)
        if f is not None:
            n, k = profile.total_numel, self.fragments
            elements = (f + 1) * n // k - f * n // k
            plans[-1] = BucketPlan((CommStep("allreduce", elements * self.bytes_per_element, "after_step",
                                             self.overlap),))
        return plans


#: Plan constructors by name, for :func:`make_plan`.
PLANS = {
    "dense": DensePlan,
    "allreduce": DensePlan,
    "fp16": FP16Plan,
    "covap": CovapSimPlan,
    "topk": TopKPlan,
    "powersgd": PowerSGDPlan,
    "dear": DeARPlan,
    "periodic": PeriodicPlan,
}


def make_plan(spec: str) -> AlgorithmPlan:
    """Build a plan from ``"name"`` or ``"name:param"``: ``dense`` (alias ``allreduce``), ``fp16``,
    ``covap:K`` (default K=3, the COVAP code's default), ``topk:density`` (default 0.01),
    ``powersgd:rank`` (default 4), ``dear``, ``periodic:period`` (default 16; local-sgd, diloco).

    Raises:
        ValueError: for an unknown name or a bad parameter.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"plan spec must be a non-empty string, got {spec!r}")
    name, _, param = spec.partition(":")
    name = name.strip().lower()
    if name not in PLANS:
        raise ValueError(f"algorithm must be one of {', '.join(PLANS)}; got {name!r}")
    if name == "covap":
        return CovapSimPlan(check_int("k", _num(param, "k"), 1) if param else 3)
    if name == "topk":
        return TopKPlan(_num(param, "density") if param else 0.01)
    if name == "powersgd":
        return PowerSGDPlan(check_int("rank", _num(param, "rank"), 1) if param else 4)
    if name == "periodic":
        return PeriodicPlan(check_int("period", _num(param, "period"), 1) if param else 16)
    if param:
        raise ValueError(f"algorithm {name!r} takes no parameter, got {param!r}")
    return PLANS[name]()


def _num(s: str, name: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {s!r}") from None
