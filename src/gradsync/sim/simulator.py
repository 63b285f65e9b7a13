"""Trace-driven simulator of one data-parallel training iteration with wait-free back-propagation.

A :class:`Profile` records, for one model on one worker, the forward, backward and optimizer compute
times and, for every DDP gradient bucket (in DDP reduction order), its size and the time after the
start of backward at which it becomes ready. An :class:`AlgorithmPlan` says, per bucket, which
collectives an algorithm launches (kind and bytes) and what compression overhead it adds.
:func:`simulate` replays the profile on an alpha-beta network (:mod:`gradsync.sim.costmodel`):

* Wait-free back-propagation (WFBP; Zhang et al., "Poseidon", USENIX ATC 2017; PyTorch DDP, Li et al.,
  VLDB 2020, Sec. 3.2.3): the collective(s) of bucket ``i`` start at
  ``max(ready_i, end of the previous collective)``; one collective at a time, FIFO in bucket order.
* Iteration time ``= forward_end + max(backward_s, end of last backward-phase collective)
  + optimizer_s + compression overhead``. ``forward_end = forward_s`` unless the plan has
  forward-phase collectives (DeAR's all-gathers, see :class:`DeARPlan`).
* Compute-only time ``= forward_s + backward_s + optimizer_s``; exposed communication
  ``= iteration - compute - compression overhead``; scaling efficiency ``= compute-only / iteration``.

Compression overhead is added serially (never overlapped): an upper bound for hooks that compress on
the autograd thread. Plans whose bucket selection changes from step to step (COVAP) are simulated over
their whole period and averaged.

Profile JSON schema (``"gradsync-profile/1"``, written by ``gradsync profile``)::

    {"schema": "gradsync-profile/1", "model": "resnet18-fmnist", "batch_size": 64, "dtype_bytes": 4,
     "forward_s": 0.010, "backward_s": 0.030, "optimizer_s": 0.002,
     "buckets": [{"index": 0, "numel": 123456, "ready_s": 0.012}, ...]}

``ready_s`` is seconds after backward start (clamped to ``backward_s`` when it exceeds it by at most
10 %, as medians over iterations can); buckets are listed in DDP reduction order. A bucket may
carry an optional ``"shapes"`` list (parameter shapes, e.g. ``[[64, 3, 3, 3], [64]]``) which
:class:`PowerSGDPlan` uses for exact matrix sizes; other top-level keys are kept in ``Profile.meta``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradsync.compressors.covap_shards import MAX_RATIO, CovapPlan
from gradsync.sim.costmodel import COLLECTIVES, Network, collective_time
from gradsync.validation import check_float, check_int

logger = logging.getLogger(__name__)

SCHEMA = "gradsync-profile/1"

__all__ = [
    "PLANS",
    "SCHEMA",
    "AlgorithmPlan",
    "BucketPlan",
    "CommStep",
    "CovapSimPlan",
    "DeARPlan",
    "DensePlan",
    "FP16Plan",
    "PowerSGDPlan",
    "Profile",
    "ProfileBucket",
    "Result",
    "TopKPlan",
    "load_profile",
    "make_plan",
    "plot_scaling",
    "simulate",
    "sweep",
    "synthetic_profile",
]


# ----------------------------------------------------------------------------------------------
# Profile
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileBucket:
    """One DDP gradient bucket: ``numel`` elements, ready ``ready_s`` seconds after backward start.

    ``shapes`` (optional) lists the shapes of the parameters in the bucket; their sizes sum to numel.
    """

    index: int
    numel: int
    ready_s: float
    shapes: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "numel": self.numel, "ready_s": self.ready_s}
        if self.shapes is not None:
            d["shapes"] = [list(s) for s in self.shapes]
        return d


@dataclass(frozen=True)
class Profile:
    """A per-worker compute profile of one training iteration (see module docstring for the schema).

    Times are seconds, ``dtype_bytes`` is the gradient element size in bytes (4 for fp32);
    ``buckets`` are in DDP reduction order. Build with :func:`load_profile` (validates) or
    :func:`synthetic_profile`.
    """

    model: str
    batch_size: int
    dtype_bytes: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: tuple[ProfileBucket, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        """Compute-only iteration time in seconds: forward + backward + optimizer."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def total_numel(self) -> int:
        """Number of gradient elements over all buckets."""
        return sum(b.numel for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        """Gradient size in bytes (``total_numel * dtype_bytes``)."""
        return self.total_numel * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (schema ``gradsync-profile/1``); ``meta`` keys are written back."""
        d: dict[str, Any] = dict(self.meta)
        d.update(
            {
                "schema": SCHEMA,
                "model": self.model,
                "batch_size": self.batch_size,
                "dtype_bytes": self.dtype_bytes,
                "forward_s": self.forward_s,
                "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s,
                "buckets": [b.to_dict() for b in self.buckets],
            }
        )
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None, indent: int | None = 1) -> str:
        """Serialise to JSON; also write it to ``path`` when given. Returns the JSON text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text


_REQUIRED = ("schema", "model", "batch_size", "dtype_bytes", "forward_s", "backward_s",
             "optimizer_s", "buckets")


def load_profile(source: str | os.PathLike[str] | Mapping[str, Any] | Profile) -> Profile:
    """Load and validate a profile from a JSON file path, a dict, or a :class:`Profile`.

    Raises:
        ValueError: wrong or missing ``schema``, a missing key, a value of the wrong type or out of
            range (the message names the key, e.g. ``buckets[3].ready_s``), duplicate bucket
            indices, ``ready_s`` more than 10 % later than ``backward_s``, or ``shapes`` not summing to ``numel``.
        FileNotFoundError: if a path does not exist.
    """
    if isinstance(source, Profile):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"profile {os.fspath(source)!r} is not valid JSON: {exc}") from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise ValueError(
            f"profile must be a path, a dict or a Profile, got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ValueError("profile JSON must be an object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"profile is missing key(s): {', '.join(missing)}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"profile schema must be {SCHEMA!r}, got {data['schema']!r}")
    model = data["model"]
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    batch_size = check_int("batch_size", data["batch_size"], 1)
    dtype_bytes = check_int("dtype_bytes", data["dtype_bytes"], 1, 16)
    forward_s = check_float("forward_s", data["forward_s"], 0.0)
    backward_s = check_float("backward_s", data["backward_s"], 0.0)
    optimizer_s = check_float("optimizer_s", data["optimizer_s"], 0.0)
    raw = data["buckets"]
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) == 0:
        raise ValueError("buckets must be a non-empty list")
    buckets = []
    seen: set[int] = set()
    # ready_s and backward_s are usually medians over several iterations, so the last bucket's
    # ready time may exceed backward_s slightly: up to 10 % (+1 us) is clamped, more is an error.
    tol = 1e-6 + 0.1 * backward_s
    for i, b in enumerate(raw):
        if not isinstance(b, Mapping):
            raise ValueError(f"buckets[{i}] must be an object")
        for k in ("index", "numel", "ready_s"):
            if k not in b:
                raise ValueError(f"buckets[{i}] is missing key {k!r}")
        idx = check_int(f"buckets[{i}].index", b["index"], 0)
        if idx in seen:
            raise ValueError(f"buckets[{i}].index {idx} is duplicated")
        seen.add(idx)
        numel = check_int(f"buckets[{i}].numel", b["numel"], 1)
        ready = check_float(f"buckets[{i}].ready_s", b["ready_s"], 0.0, backward_s + tol)
        shapes = None
        if b.get("shapes") is not None:
            shapes = _check_shapes(f"buckets[{i}].shapes", b["shapes"], numel)
        buckets.append(ProfileBucket(idx, numel, min(ready, backward_s), shapes))
    meta = {k: v for k, v in data.items() if k not in _REQUIRED}
    return Profile(model, batch_size, dtype_bytes, forward_s, backward_s, optimizer_s,
                   tuple(buckets), meta)


def _check_shapes(name: str, shapes: Any, numel: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(shapes, Sequence) or isinstance(shapes, (str, bytes)):
        raise ValueError(f"{name} must be a list of shapes")
    out = []
    for j, s in enumerate(shapes):
        if not isinstance(s, Sequence) or isinstance(s, (str, bytes)):
            raise ValueError(f"{name}[{j}] must be a list of positive integers")
        out.append(tuple(check_int(f"{name}[{j}]", d, 1) for d in s))
    total = sum(math.prod(s) for s in out)
    if total != numel:
        raise ValueError(f"{name} sum to {total} elements but numel is {numel}")
    return tuple(out)


def synthetic_profile(
    bucket_numels: Sequence[int],
    forward_s: float,
    backward_s: float,
    optimizer_s: float = 0.0,
    *,
    ready_s: Sequence[float] | None = None,
    model: str = "synthetic",
    batch_size: int = 1,
    dtype_bytes: int = 4,
) -> Profile:
    """Build a validated profile from bucket sizes (DDP reduction order).

    Without ``ready_s``, bucket ``i`` is ready when the backward pass has done the fraction
    ``sum(numel[:i+1]) / sum(numel)`` of ``backward_s`` (compute proportional to parameters).

    Raises:
        ValueError: as :func:`load_profile`, or if ``ready_s`` has the wrong length.
    """
    numels = [check_int(f"bucket_numels[{i}]", n, 1) for i, n in enumerate(bucket_numels)]
    if not numels:
        raise ValueError("bucket_numels must be non-empty")
    if ready_s is None:
        cum = np.cumsum(numels) / float(sum(numels))
        bw = check_float("backward_s", backward_s, 0.0)
        ready = [float(c) * bw for c in cum]
    else:
        if len(ready_s) != len(numels):
            raise ValueError(
                f"ready_s must have one entry per bucket ({len(numels)}), got {len(ready_s)}"
            )
        ready = list(ready_s)
    return load_profile(
        {
            "schema": SCHEMA, "model": model, "batch_size": batch_size,
            "dtype_bytes": dtype_bytes, "forward_s": forward_s, "backward_s": backward_s,
            "optimizer_s": optimizer_s,
            "buckets": [{"index": i, "numel": n, "ready_s": r}
                        for i, (n, r) in enumerate(zip(numels, ready))],
        }
    )


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommStep:
    """One collective: ``kind`` in :data:`~gradsync.sim.costmodel.COLLECTIVES`, ``nbytes`` as the
    matching cost function takes it (the full vector for all-reduce/reduce-scatter/all-gather, the
    per-rank payload for ``sparse_allgather``). ``phase`` is ``"backward"`` (launched when the bucket
    is ready, overlapped with backward) or ``"forward"`` (must finish before the bucket's layers run
    in the next forward pass, e.g. DeAR's all-gather)."""

    kind: str
    nbytes: float
    phase: str = "backward"

    def __post_init__(self) -> None:
        if self.kind not in COLLECTIVES:
            raise ValueError(f"kind must be one of {', '.join(COLLECTIVES)}; got {self.kind!r}")
        object.__setattr__(self, "nbytes", check_float("nbytes", self.nbytes, 0.0))
        if self.phase not in ("backward", "forward"):
            raise ValueError(f"phase must be 'backward' or 'forward', got {self.phase!r}")


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
    2311.04499; algorithms.md §1(a)).

    Bucket ``b`` is cut into ``c_b`` strided shards (:class:`gradsync.algorithms.covap.CovapPlan`, the same
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
    """Top-k sparsification with all-gather (e.g. GraVAC's communication, algorithms.md §2).

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

    Args:
        rank: matrix approximation rank r >= 1.
        flops_per_s: compute rate used to charge compression overhead: per matrix
            ``6 * rows * cols * r`` flops (M Q, M^T P, P Q^T) + ``2 * (rows + cols) * r**2``
            (Gram-Schmidt). ``None`` (default) charges no overhead.
    """

    def __init__(self, rank: int, flops_per_s: float | None = None) -> None:
        self.rank = check_int("rank", rank, 1)
        self.flops_per_s = (None if flops_per_s is None else
                            check_float("flops_per_s", flops_per_s, 0.0, low_inclusive=False))
        self.name = f"powersgd(r={self.rank})"

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
            n = math.prod(s)
            if len(s) <= 1:
                uncompressed += n
                continue
            rows, cols = s[0], n // s[0]
            if (rows + cols) * r * 2 >= rows * cols:
                uncompressed += n
            else:
                mats.append((rows, cols))
        if b.shapes is None and not mats:
            uncompressed = b.numel
        return uncompressed, mats

    def bucket_plans(self, profile: Profile, world_size: int, step: int) -> list[BucketPlan]:
        out = []
        r = self.rank
        db = 4  # torch's PowerSGD keeps P and Q in fp32
        for b in profile.buckets:
            unc, mats = self._matrices(b)
            steps = []
            if unc:
                steps.append(CommStep("allreduce", unc * profile.dtype_bytes))
            if mats:
                steps.append(CommStep("allreduce", sum(m[0] for m in mats) * r * db))
                steps.append(CommStep("allreduce", sum(m[1] for m in mats) * r * db))
            overhead = 0.0
            if self.flops_per_s is not None:
                flops = sum(6 * m[0] * m[1] * r + 2 * (m[0] + m[1]) * r * r for m in mats)
                overhead = flops / self.flops_per_s
            out.append(BucketPlan(tuple(steps), overhead))
        return out


class DeARPlan(AlgorithmPlan):
    """DeAR (Zhang et al., arXiv 2302.12445; algorithms.md §3): all-reduce decoupled into a
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


#: Plan constructors by name, for :func:`make_plan`.
PLANS = {
    "dense": DensePlan,
    "allreduce": DensePlan,
    "fp16": FP16Plan,
    "covap": CovapSimPlan,
    "topk": TopKPlan,
    "powersgd": PowerSGDPlan,
    "dear": DeARPlan,
}


def make_plan(spec: str) -> AlgorithmPlan:
    """Build a plan from ``"name"`` or ``"name:param"``: ``dense`` (alias ``allreduce``), ``fp16``,
    ``covap:K`` (default K=3, the COVAP code's default), ``topk:density`` (default 0.01),
    ``powersgd:rank`` (default 4), ``dear``.

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
    if param:
        raise ValueError(f"algorithm {name!r} takes no parameter, got {param!r}")
    return PLANS[name]()


def _num(s: str, name: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {s!r}") from None


# ----------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """Simulated iteration, averaged over the plan's period. Times in seconds, bytes per rank.

    ``exposed_comm_s = iteration_s - compute_s - compression_s`` (communication not hidden under
    compute); ``scaling_efficiency = compute_s / iteration_s``; ``comm_s`` is the total time the
    network is busy; ``payload_bytes`` the bytes of the collectives' input buffers per rank and
    ``wire_bytes`` the bytes each rank sends under the ring algorithms.
    """

    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    scaling_efficiency: float
    compression_s: float = 0.0
    comm_s: float = 0.0
    payload_bytes: float = 0.0
    wire_bytes: float = 0.0


def _wire_bytes(kind: str, nbytes: float, p: int) -> float:
    if p == 1:
        return 0.0
    if kind == "allreduce":
        return 2 * (p - 1) / p * nbytes
    if kind in ("reduce_scatter", "allgather"):
        return (p - 1) / p * nbytes
    return (p - 1) * nbytes  # sparse_allgather: ring forwards every other rank's payload


def _overlapped_end(start: float, cost: float, compute_end: float, eta: float) -> float:
    """End time of a collective of ``cost`` seconds starting at ``start`` when it progresses at rate
    ``eta`` (0 < eta <= 1) while compute runs (until ``compute_end``) and at full rate after."""
    if start >= compute_end or eta >= 1.0:
        return start + cost
    capacity = (compute_end - start) * eta
    if cost <= capacity:
        return start + cost / eta
    return compute_end + (cost - capacity)


def _simulate_step(profile: Profile, plans: list[BucketPlan], p: int, net: Network,
                   eta: float = 1.0) -> tuple:
    n = len(profile.buckets)
    if len(plans) != n:
        raise ValueError(f"plan gave {len(plans)} bucket plans for {n} buckets")
    total_numel = profile.total_numel
    comm_free = 0.0
    comm_busy = 0.0
    payload = wire = 0.0
    # forward phase: collectives needed by the next forward, FIFO in forward (reverse bucket) order
    fwd_t = 0.0
    has_fwd = any(s.phase == "forward" for bp in plans for s in bp.steps)
    if has_fwd:
        for i in reversed(range(n)):
            for s in plans[i].steps:
                if s.phase == "forward":
                    cost = collective_time(s.kind, s.nbytes, p, net)
                    comm_free += cost
                    comm_busy += cost
            fwd_t = max(fwd_t, comm_free) + profile.forward_s * profile.buckets[i].numel / total_numel
    else:
        fwd_t = profile.forward_s
    forward_end = fwd_t
    # backward phase: wait-free back-propagation, FIFO in bucket order
    for b, bp in zip(profile.buckets, plans):
        for s in bp.steps:
            if s.phase != "backward":
                continue
            cost = collective_time(s.kind, s.nbytes, p, net)
            comm_free = _overlapped_end(max(comm_free, forward_end + b.ready_s), cost,
                                        forward_end + profile.backward_s, eta)
            comm_busy += cost
    for bp in plans:
        for s in bp.steps:
            payload += s.nbytes
            wire += _wire_bytes(s.kind, s.nbytes, p)
    overhead = sum(bp.overhead_s for bp in plans)
    iteration = max(forward_end + profile.backward_s, comm_free) + profile.optimizer_s + overhead
    return iteration, overhead, comm_busy, payload, wire


def simulate(profile: Profile | Mapping[str, Any] | str, plan: AlgorithmPlan | str,
             world_size: int, network: Network, overlap_efficiency: float = 1.0) -> Result:
    """Predict one training iteration of ``profile`` under ``plan`` on ``world_size`` ranks.

    See the module docstring for the timeline model (wait-free back-propagation, FIFO collectives,
    alpha-beta costs). ``profile`` may be anything :func:`load_profile` takes; ``plan`` a plan or a
    :func:`make_plan` spec. ``world_size = 1`` has no communication. ``overlap_efficiency`` (0, 1]
    is the rate at which a collective progresses while backward compute runs (1 = communication is
    free to overlap; below 1 when compute and communication share saturated CPUs, as with Gloo on
    a few cores); after backward it runs at full rate.

    Raises:
        ValueError: for a bad profile, plan spec, ``world_size < 1``, a non-Network ``network`` or
            ``overlap_efficiency`` outside (0, 1].
    """
    profile = load_profile(profile)
    if isinstance(plan, str):
        plan = make_plan(plan)
    if not isinstance(plan, AlgorithmPlan):
        raise ValueError(f"plan must be an AlgorithmPlan or a spec string, got {type(plan).__name__}")
    p = check_int("world_size", world_size, 1)
    if not isinstance(network, Network):
        raise ValueError(f"network must be a gradsync.sim.Network, got {type(network).__name__}")
    period = check_int("plan.period", plan.period, 1)
    eta = check_float("overlap_efficiency", overlap_efficiency, 0.0, 1.0, low_inclusive=False)
    acc = np.zeros(5)
    for step in range(period):
        acc += _simulate_step(profile, plan.bucket_plans(profile, p, step), p, network, eta)
    iteration, overhead, comm_busy, payload, wire = (acc / period).tolist()
    compute = profile.compute_s
    exposed = max(0.0, iteration - compute - overhead)
    eff = compute / iteration if iteration > 0 else 1.0
    return Result(iteration, compute, exposed, eff, overhead, comm_busy, payload, wire)


def sweep(
    profile: Profile | Mapping[str, Any] | str,
    plans: Sequence[AlgorithmPlan | str],
    world_sizes: Sequence[int],
    bandwidths_gbps: Sequence[float],
    latency_s: float = 0.0,
    overlap_efficiency: float = 1.0,
) -> list[dict[str, Any]]:
    """Simulate every (plan, world size, bandwidth) combination; one dict per row.

    Row keys: ``algorithm, world_size, bandwidth_gbps, latency_s, iteration_s, compute_s,
    exposed_comm_s, compression_s, scaling_efficiency, payload_bytes, wire_bytes, comm_s, speedup``
    (see :class:`Result`) where ``speedup`` is
    the first plan's iteration time divided by this row's (same world size and bandwidth).

    Raises:
        ValueError: for empty lists or bad values (see :func:`simulate`, :class:`Network`).
    """
    profile = load_profile(profile)
    if not plans or not world_sizes or not bandwidths_gbps:
        raise ValueError("plans, world_sizes and bandwidths_gbps must be non-empty")
    built = [make_plan(p) if isinstance(p, str) else p for p in plans]
    rows = []
    for bw in bandwidths_gbps:
        net = Network(bw, latency_s)
        for ws in world_sizes:
            base = None
            for plan in built:
                r = simulate(profile, plan, ws, net, overlap_efficiency)
                if base is None:
                    base = r.iteration_s
                rows.append({
                    "algorithm": plan.name, "world_size": int(ws),
                    "bandwidth_gbps": net.bandwidth_gbps, "latency_s": net.latency_s,
                    "iteration_s": r.iteration_s, "compute_s": r.compute_s,
                    "exposed_comm_s": r.exposed_comm_s, "compression_s": r.compression_s,
                    "scaling_efficiency": r.scaling_efficiency, "payload_bytes": r.payload_bytes,
                    "wire_bytes": r.wire_bytes, "comm_s": r.comm_s,
                    "speedup": base / r.iteration_s if r.iteration_s > 0 else 1.0,
                })
    return rows


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                 title: str | None = None) -> str:
    """Write a PNG of scaling efficiency against world size (log2 x axis), one line per algorithm
    and one panel per bandwidth, from :func:`sweep` rows. Renders with matplotlib's Agg canvas
    directly (no pyplot, so the global backend is left alone).

    Returns:
        the path written, as a string.

    Raises:
        ValueError: if ``rows`` is empty or lacks the keys :func:`sweep` writes.
    """
    if not rows:
        raise ValueError("rows must be non-empty")
    for k in ("algorithm", "world_size", "bandwidth_gbps", "scaling_efficiency"):
        if k not in rows[0]:
            raise ValueError(f"rows lack key {k!r}; pass the output of sweep()")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bws = sorted({r["bandwidth_gbps"] for r in rows})
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    fig = Figure(figsize=(4.2 * len(bws), 3.6), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(bws), squeeze=False, sharey=True)[0]
    for ax, bw in zip(axes, bws):
        for algo in algos:
            pts = sorted((r["world_size"], r["scaling_efficiency"]) for r in rows
                         if r["bandwidth_gbps"] == bw and r["algorithm"] == algo)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=algo)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{bw:g} Gbit/s")
        ax.set_xlabel("world size (ranks)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("scaling efficiency")
    axes[-1].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)
