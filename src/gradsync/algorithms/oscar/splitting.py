"""OSCAR-SW and OSCAR with ASC: :class:`OscarState` and :func:`oscar_hook` (reconstructed; the
source, the per-bucket pipeline and the statistics are described in :mod:`gradsync.algorithms.oscar`).

This module deliberately does not use ``from __future__ import annotations``: DDP's
``register_comm_hook`` compares the hook's annotations with ``dist.GradBucket`` and
``torch.futures.Future[torch.Tensor]`` and refuses string annotations.
"""

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync.algorithms.base import HookState
from gradsync.compressors.countsketch import DEFAULT_SEED, CountSketch, HashCache, sketch_cols
from gradsync.validation import check_choice, check_float, check_int

if TYPE_CHECKING:  # gradsync.coding needs the 'oscar' extra; only mode='asc' imports it
    from gradsync.coding.asc import ASCRingCoder

from .bucket_worker import OrderedBucketWorker, reduce_bucket
from .coded_part import coders_from_state, reduce_coded
from .quantiser import default_levels, quantise, wire_dtype

__all__ = ["OscarASCState", "OscarSWState", "OscarState", "oscar_hook", "split_by_mask"]


class _Mean:
    """Running mean (NaN when empty)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def append(self, x: float) -> None:
        self.total += float(x)
        self.count += 1

    def value(self) -> float:
        return self.total / self.count if self.count else float("nan")



def split_by_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coordinates of the probable-zero part (``mask`` True) and of the other part.

    Args:
        mask: ``(n,)`` bool tensor.

    Returns:
        ``(idx_a, idx_b)``: ascending int64 index tensors partitioning ``0 .. n-1`` (either may be
        empty: an all-False mask gives ``idx_a`` empty, an all-True mask ``idx_b`` empty).

    Raises:
        ValueError: if ``mask`` is not a 1-D bool tensor.
    """
    if mask.dtype != torch.bool or mask.dim() != 1:
        raise ValueError("mask must be a 1-D bool tensor")
    return torch.nonzero(mask).reshape(-1), torch.nonzero(~mask).reshape(-1)


class OscarState(OrderedBucketWorker, HookState):
    """State of :func:`oscar_hook` (OSCAR-SW and OSCAR with ASC, reconstructed).

    Args:
        process_group: group the collectives run on (``None`` = default group).
        mode: ``"sw"`` (part B dense all-reduce) or ``"asc"`` (part B through the coded ring).
        levels: quantisation levels L per sign, 1..32767, or ``None`` (default) for
            ``max(1, 127 // P)``, so that sums over all ranks still fit int8 on the wire.
        rounding: ``"stochastic"`` (unbiased, default) or ``"nearest"`` (deterministic: small values
            are consistently zero, which is what the zero-mask split relies on).
        sketch: split by the zero mask and sketch part A (False: everything goes to part B).
        sketch_rows: count-sketch rows r, 1..64.
        sketch_ratio: table size (``rows * cols`` entries) as a fraction of the number of sketched
            elements, in (0, 1].
        sketch_basis: ``"part"`` (default): the sketched elements are part A, so the table shrinks
            with |A|; ``"bucket"``: the whole bucket's element count, the size the
            :class:`CountSketchState` baseline uses for the same ``sketch_ratio``.
        heavy_fraction: at most ``ceil(heavy_fraction * cols)`` coordinates recovered per bucket, (0, 1].
        exact_recovery: all-reduce the exact ints at recovered coordinates (a second small round).
        chunking: ``"balanced"`` or ``"equal"`` ring chunk boundaries (``mode="asc"`` only).
        asc_alpha: Laplace pseudo-count of the ASC models, > 0.
        asc_decay: weight of older counts in the ASC models, [0, 1).
        global_balance: all-gather per-step ring bytes to report cross-rank balance (ASC only).
        drain_flagged: coordinates of A whose sketch estimate rounds to non-zero but that were not
            recovered (over the ``k`` cap) leave A for the next iteration (default True). Without this,
            an unrecovered coordinate aggregates to 0, stays in A and its error feedback grows
            (measured: 99 % of A's mass unrecovered on a Fashion-MNIST CNN).
        cache_hashes: keep each bucket's sketch hashes (``sketch_rows * n * 12`` bytes per bucket)
            instead of recomputing them every step.
        start_iter: iterations of plain dense all-reduce first, >= 0 (default 2).
        seed: seed of the stochastic-rounding streams (rank is added) and of the sketch hashes.

    Raises:
        ValueError: for any argument outside its range; at the first compressed bucket, if
            ``mode="asc"`` and ``P * levels > 2**24``.
        ImportError: for ``mode="asc"`` without the ``oscar`` extra (``constriction``, ``zstandard``).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        mode: str = "sw",
        levels: int | None = None,
        rounding: str = "stochastic",
        sketch: bool = True,
        sketch_rows: int = 5,
        sketch_ratio: float = 0.05,
        sketch_basis: str = "part",
        heavy_fraction: float = 0.5,
        exact_recovery: bool = True,
        chunking: str = "balanced",
        asc_alpha: float = 0.5,
        asc_decay: float = 0.5,
        global_balance: bool = False,
        drain_flagged: bool = True,
        cache_hashes: bool = True,
        start_iter: int = 2,
        seed: int = 0,
    ):
        super().__init__(process_group)
        self.drain_flagged = bool(check_choice("drain_flagged", drain_flagged, [True, False]))
        self.cache_hashes = bool(check_choice("cache_hashes", cache_hashes, [True, False]))
        self._hash_cache = HashCache()
        self.mode = check_choice("mode", mode, ["sw", "asc"])
        if self.mode == "asc":  # fail at construction, on every rank, when the 'oscar' extra is missing
            import gradsync.coding.asc  # noqa: F401
        self.levels = None if levels is None else check_int("levels", levels, 1, 32767)
        self.rounding = check_choice("rounding", rounding, ["stochastic", "nearest"])
        self.sketch = bool(check_choice("sketch", sketch, [True, False]))
        self.sketch_rows = check_int("sketch_rows", sketch_rows, 1, 64)
        self.sketch_ratio = check_float("sketch_ratio", sketch_ratio, 0.0, 1.0, low_inclusive=False)
        self.sketch_basis = check_choice("sketch_basis", sketch_basis, ["part", "bucket"])
        self.heavy_fraction = check_float("heavy_fraction", heavy_fraction, 0.0, 1.0, low_inclusive=False)
        self.exact_recovery = bool(check_choice("exact_recovery", exact_recovery, [True, False]))
        self.chunking = check_choice("chunking", chunking, ["balanced", "equal"])
        self.asc_alpha = check_float("asc_alpha", asc_alpha, 0.0, None, low_inclusive=False)
        self.asc_decay = check_float("asc_decay", asc_decay, 0.0, 1.0, high_inclusive=False)
        self.global_balance = bool(check_choice("global_balance", global_balance, [True, False]))
        self.start_iter = check_int("start_iter", start_iter, 0, None)
        self.seed = check_int("seed", seed, 0, None)
        self.error: dict[int, torch.Tensor] = {}
        self.prev_agg: dict[int, torch.Tensor] = {}
        self.zero_mask: dict[int, torch.Tensor] = {}
        self.coders: dict[int, "ASCRingCoder"] = {}
        self._generator: torch.Generator | None = None
        self._rng_state: torch.Tensor | None = None
        # statistics (wire_bytes and payload_bytes: HookState's counters)
        self.warmup_wire_bytes = 0.0
        self.compressed_iterations = 0
        self.encode_seconds = 0.0
        self.decode_seconds = 0.0
        self.coded_hops = 0
        self.coded_elements = 0
        self.coded_bytes = 0
        self.wire_bytes_last_step = 0.0
        self._wire_at_step_start = 0.0
        self.ring_balance = _Mean()
        self.ring_balance_global = _Mean()
        self._sketch_err = _Mean()
        self._unrecovered = _Mean()
        self._zero_frac = _Mean()

    # -- configuration and checkpoints ----------------------------------------------------------
    def config(self) -> dict[str, Any]:
        keys = ("mode", "levels", "rounding", "sketch", "sketch_rows", "sketch_ratio", "sketch_basis", "heavy_fraction",
                "exact_recovery", "drain_flagged", "chunking", "asc_alpha", "asc_decay", "start_iter", "seed")
        return {"algorithm": type(self).__name__, **{k: getattr(self, k) for k in keys}}

    def _snapshot(self) -> Any:
        # error, prev_agg and zero_mask entries are replaced each step; the ASC models update in place
        return (dict(self.error), dict(self.prev_agg), dict(self.zero_mask),
                {k: c.state_dict() for k, c in self.coders.items()})

    def _restore(self, saved: Any) -> None:
        error, prev_agg, zero_mask, coders = saved
        self.error, self.prev_agg, self.zero_mask = dict(error), dict(prev_agg), dict(zero_mask)
        self.coders = coders_from_state(coders)

    def state_dict(self) -> dict[str, Any]:
        gen = self._gen_state()
        return {
            "iteration": self.iteration,
            "error": {k: v.clone() for k, v in self.error.items()},
            "prev_agg": {k: v.clone() for k, v in self.prev_agg.items()},
            "zero_mask": {k: v.clone() for k, v in self.zero_mask.items()},
            "coders": {k: c.state_dict() for k, c in self.coders.items()},
            "rng_state": gen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.error = {int(k): v.clone() for k, v in state["error"].items()}
        self.prev_agg = {int(k): v.clone() for k, v in state["prev_agg"].items()}
        self.zero_mask = {int(k): v.clone() for k, v in state["zero_mask"].items()}
        self.coders = coders_from_state(state["coders"])
        self._generator = None
        # a generator state is a CPU tensor whatever device the rest of the state was moved to
        self._rng_state = None if state["rng_state"] is None else state["rng_state"].to("cpu", copy=True)

    def _gen_state(self) -> torch.Tensor | None:
        if self._generator is not None:
            return self._generator.get_state()
        return None if self._rng_state is None else self._rng_state.clone()

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_rng_state"] = self._gen_state()
        d["_generator"] = None
        d["_hash_cache"] = HashCache()
        return d

    def generator(self) -> torch.Generator:
        """Per-rank generator of the stochastic rounding (seeded ``seed * 1000003 + rank``)."""
        if self._generator is None:
            g = torch.Generator()
            if self._rng_state is not None:
                g.set_state(self._rng_state)
            else:
                g.manual_seed(self.seed * 1000003 + dist.get_rank(self.process_group))
            self._generator = g
        return self._generator

    # -- statistics -------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        out = super().stats()
        it = max(self.compressed_iterations, 1)
        coding = self.encode_seconds + self.decode_seconds
        out.update(
            wire_bytes_per_step=(self.wire_bytes - self.warmup_wire_bytes) / it,
            wire_bytes_last_step=self.wire_bytes_last_step,
            encode_seconds=self.encode_seconds,
            decode_seconds=self.decode_seconds,
            coding_seconds=coding,
            coding_seconds_per_step=coding / it,
            coding_seconds_per_hop=coding / self.coded_hops if self.coded_hops else float("nan"),
            coding_ns_per_element=coding * 1e9 / self.coded_elements if self.coded_elements else float("nan"),
            coded_hops=self.coded_hops,
            coded_elements=self.coded_elements,
            coded_bytes=self.coded_bytes,
            coded_bits_per_element=(8.0 * self.coded_bytes / self.coded_elements if self.coded_elements
                                    else float("nan")),
            ring_balance=self.ring_balance.value(),
            ring_balance_global=self.ring_balance_global.value(),
            sketch_rel_error=self._sketch_err.value(),
            sketch_unrecovered_fraction=self._unrecovered.value(),
            probable_zero_fraction=self._zero_frac.value(),
        )
        return out

    def _count(self, t: torch.Tensor) -> None:
        """Count an all-reduce of ``t`` on :attr:`comm_group` (same ranks as ``process_group``)."""
        self.count_collective(t, kind="allreduce")

    def resolved_levels(self, world_size: int) -> int:
        """``levels``, or ``max(1, 127 // world_size)`` when it was left ``None``."""
        return self.levels if self.levels is not None else default_levels(world_size)

    # -- the algorithm on one flat bucket -------------------------------------------------------
    def reduce(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        """Quantise, split, sketch/code and reduce one flat bucket; return the averaged gradient.

        Must be called on every rank with the same ``key`` sequence and equal-sized ``flat``.

        Args:
            flat: ``(n,)`` float tensor (the local gradient bucket; not modified).
            key: stable bucket id (``bucket.index()``); error feedback, zero mask and ASC models are
                kept per key and reset when ``n`` changes.

        Returns:
            ``(n,)`` tensor of ``flat``'s dtype: the decoded sum over ranks divided by P.
        """
        pg = self.comm_group
        p = self.world_size
        L = self.resolved_levels(p)
        n = flat.numel()
        t0 = time.perf_counter()
        if key in self.error and self.error[key].numel() != n:
            for d in (self.error, self.prev_agg, self.zero_mask, self.coders):
                d.pop(key, None)
        x = flat.detach().to(torch.float32).reshape(-1)
        if key in self.error:
            x = x + self.error[key]
        local_max = x.abs().max().reshape(1) if n else torch.zeros(1)
        self.compress_seconds += time.perf_counter() - t0
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=pg)
        self._count(local_max)
        scale = float(local_max[0])
        if n == 0 or scale == 0.0 or not math.isfinite(scale):
            if not math.isfinite(scale):  # non-finite gradients: pass them through densely
                out = flat.detach().clone()
                dist.all_reduce(out, group=pg)
                self._count(out)
                self.error.pop(key, None)
                self.prev_agg.pop(key, None)
                self.zero_mask.pop(key, None)
                return out / p
            self.error[key] = torch.zeros(n)
            self.prev_agg[key] = torch.zeros(n, dtype=torch.int32)
            self.zero_mask[key] = torch.ones(n, dtype=torch.bool)
            return torch.zeros_like(flat)

        t0 = time.perf_counter()
        step = scale / L
        gen = self.generator() if self.rounding == "stochastic" else None
        q, err = quantise(x, step, L, self.rounding, gen)
        mask = self.zero_mask.get(key)
        if self.sketch and mask is not None:
            idx_a, idx_b = split_by_mask(mask)
        else:
            idx_a, idx_b = torch.zeros(0, dtype=torch.int64), torch.arange(n)
        agg = torch.zeros(n, dtype=torch.int32)
        self._zero_frac.append(idx_a.numel() / n)
        self.compress_seconds += time.perf_counter() - t0

        flagged = None
        if idx_a.numel():
            flagged = self._reduce_sketched(q, err, idx_a, agg, step, n, key)
        if idx_b.numel():
            self._reduce_dense(q, idx_b, agg, key, p, L)

        t0 = time.perf_counter()
        self.error[key] = err
        self.prev_agg[key] = agg
        new_mask = agg == 0
        if flagged is not None and self.drain_flagged:
            new_mask[flagged] = False
        self.zero_mask[key] = new_mask
        out = (agg.to(torch.float32) * (step / p)).to(flat.dtype)
        self.compress_seconds += time.perf_counter() - t0
        return out

    def _reduce_sketched(self, q, err, idx_a, agg, step, n, key) -> torch.Tensor:
        """Sketch part A, recover heavy hitters, feed the rest back; returns the coordinates of A whose
        estimate rounds to non-zero but that were not recovered (identical on every rank)."""
        pg = self.comm_group
        t0 = time.perf_counter()
        basis = idx_a.numel() if self.sketch_basis == "part" else n
        cols = sketch_cols(basis, self.sketch_ratio, self.sketch_rows)
        sk = CountSketch(self.sketch_rows, cols, seed=DEFAULT_SEED + self.seed)
        qa = q[idx_a]
        hashed = self._hash_cache.hashes(sk, key, n, idx_a) if self.cache_hashes else sk.hashes(idx_a)
        sk.accumulate(qa, idx_a, hashed=hashed)
        self.compress_seconds += time.perf_counter() - t0
        dist.all_reduce(sk.table, group=pg)
        self._count(sk.table)
        t0 = time.perf_counter()
        k = max(1, math.ceil(self.heavy_fraction * cols))
        est_all = sk.estimate(idx_a, hashed)
        cand = torch.nonzero(est_all.abs() >= 0.5).reshape(-1)
        if cand.numel() > k:
            cand = cand[torch.topk(est_all[cand].abs(), k, sorted=False).indices].sort().values
        rec_idx, est = idx_a[cand], est_all[cand]
        est_int = torch.round(est).to(torch.int32)
        self.compress_seconds += time.perf_counter() - t0
        if self.exact_recovery and rec_idx.numel():
            exact = q[rec_idx].clone()
            dist.all_reduce(exact, group=pg)
            self._count(exact)
            denom = float(exact.float().norm())
            self._sketch_err.append(float((est_int - exact).float().norm()) / max(denom, 1e-12))
            vals = exact
        else:
            vals = est_int
        t0 = time.perf_counter()
        agg[rec_idx] = vals
        recovered = torch.zeros(n, dtype=torch.bool)
        recovered[rec_idx] = True
        unrec = idx_a[~recovered[idx_a]]
        back = q[unrec].to(torch.float32) * step
        err[unrec] += back  # unrecovered local mass returns to error feedback
        total_l1 = float(qa.abs().sum())
        self._unrecovered.append(float(q[unrec].abs().sum()) / total_l1 if total_l1 > 0 else 0.0)
        flagged_all = torch.zeros(n, dtype=torch.bool)
        flagged_all[idx_a[est_all.abs() >= 0.5]] = True
        flagged_all[rec_idx] = False
        self.compress_seconds += time.perf_counter() - t0
        return torch.nonzero(flagged_all).reshape(-1)

    def _reduce_dense(self, q, idx_b, agg, key, p, L) -> None:
        pg = self.comm_group
        if self.mode == "sw":
            qb = q[idx_b].to(wire_dtype(p * L))
            dist.all_reduce(qb, group=pg)
            self._count(qb)
            agg[idx_b] = qb.to(torch.int32)
            return
        reduce_coded(self, q, idx_b, agg, key, p, L)


class OscarSWState(OscarState):
    """``oscar-sw``: :class:`OscarState` with ``mode="sw"`` (part B dense int all-reduce)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, **kwargs: Any):
        if "mode" in kwargs:
            raise ValueError("mode is fixed to 'sw' for OscarSWState")
        super().__init__(process_group, mode="sw", **kwargs)


class OscarASCState(OscarState):
    """``oscar-asc``: :class:`OscarState` with ``mode="asc"`` (part B through the ASC-coded ring with
    balanced chunks)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, **kwargs: Any):
        if "mode" in kwargs:
            raise ValueError("mode is fixed to 'asc' for OscarASCState")
        super().__init__(process_group, mode="asc", **kwargs)


def oscar_hook(state: OscarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for :class:`OscarState` (``oscar-sw`` / ``oscar-asc``).

    The reduction runs on the state's bucket worker thread (see :class:`.bucket_worker.OrderedBucketWorker`); the Future
    holds the bucket buffer (averaged gradient, same shape and dtype).

    Raises:
        ValueError: if the bucket is not on the CPU (the coders and sketches run on CPU tensors; the
            project targets Gloo).
    """

    def after_last() -> None:
        if state.iteration > state.start_iter:
            state.wire_bytes_last_step = state.wire_bytes - state._wire_at_step_start
            state._wire_at_step_start = state.wire_bytes

    return reduce_bucket(state, bucket, after_last)


