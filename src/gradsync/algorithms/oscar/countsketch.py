"""Count-sketch gradient compression baseline (FetchSGD and Sketched-SGD variants) as a DDP hook.

Count sketch: Charikar, Chen, Farach-Colton, "Finding Frequent Items in Data Streams", ICALP 2002.
Sketched-SGD: Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, "Communication-efficient
Distributed SGD with Sketching", arXiv:1903.04488, §3 (local error feedback, second round of exact
values). FetchSGD: Rothchild, Panda, Ullah, Ivkin, Stoica, Braverman, Gonzalez, Arora, "FetchSGD:
Communication-Efficient Federated Learning with Sketching", arXiv:2007.07682, §3 (error accumulation
in sketch space).
"""

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync.algorithms.base import HookState
from gradsync.compressors.countsketch import DEFAULT_SEED, CountSketch, HashCache, sketch_cols

from gradsync.validation import check_choice, check_float, check_int

from .bucket_worker import OrderedBucketWorker, reduce_bucket

__all__ = ["CountSketchState", "countsketch_hook"]


class CountSketchState(OrderedBucketWorker, HookState):
    """Count-sketch baseline, state of :func:`countsketch_hook`.

    ``variant="fetchsgd"`` (FetchSGD, Rothchild et al. 2020): per bucket every rank
    sketches its raw gradient (``rows x cols`` float32, ``rows * cols ~ sketch_ratio * n``: with
    ``sketch_basis="bucket"`` the size OSCAR-SW uses), the tables are all-reduced and averaged and
    added to an error accumulator kept *in sketch space* (identical on every rank). The top
    ``k = ceil(heavy_fraction * cols)`` coordinates of its median estimate are returned as the
    gradient (the rest of the bucket is zero) and their sketch is subtracted from the accumulator.
    Momentum is left to the optimizer (FetchSGD keeps it in sketch space too; not done here).
    Unstable at small sketches: collision noise in the estimates is extracted as if it were signal
    and the sketch-space accumulator random-walks. FetchSGD itself used sketches with about as many
    entries as 0.8 x the model size.

    ``variant="local_ef"`` (default; Sketched-SGD, Ivkin et al. 2019): every rank keeps a local
    error-feedback vector ``e += g`` and sketches ``e``; the all-reduced sketch selects the top-k
    candidates; a second all-reduce of the exact ``e`` values at those k coordinates gives the
    update, which is removed from each rank's ``e``. Exact values and local mass conservation make it
    stable where ``fetchsgd`` is not (with ``heavy_fraction=1.0``; a tiny ``k`` does not learn).

    Args:
        process_group, sketch_rows, sketch_ratio, cache_hashes, start_iter, seed: as
            :class:`gradsync.algorithms.oscar.OscarState`.
        variant: ``"fetchsgd"`` or ``"local_ef"``.
        heavy_fraction: at most ``k = ceil(heavy_fraction * cols)`` coordinates recovered per
            bucket, (0, 1]; default 1.0 (k = cols = sketch_ratio * n / rows: 1 % of the bucket at the
            defaults). FetchSGD used k = cols / 20 with a far larger sketch.

    Raises:
        ValueError: for arguments outside their ranges.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        sketch_rows: int = 5,
        sketch_ratio: float = 0.05,
        heavy_fraction: float = 1.0,
        variant: str = "local_ef",
        cache_hashes: bool = True,
        start_iter: int = 2,
        seed: int = 0,
    ):
        super().__init__(process_group)
        self.variant = check_choice("variant", variant, ["fetchsgd", "local_ef"])
        self.cache_hashes = bool(check_choice("cache_hashes", cache_hashes, [True, False]))
        self._hash_cache = HashCache()
        self.sketch_rows = check_int("sketch_rows", sketch_rows, 1, 64)
        self.sketch_ratio = check_float("sketch_ratio", sketch_ratio, 0.0, 1.0, low_inclusive=False)
        self.heavy_fraction = check_float("heavy_fraction", heavy_fraction, 0.0, 1.0, low_inclusive=False)
        self.start_iter = check_int("start_iter", start_iter, 0, None)
        self.seed = check_int("seed", seed, 0, None)
        self.accumulators: dict[int, torch.Tensor] = {}
        self.warmup_wire_bytes = 0.0  # wire_bytes of the dense warm-up (wire_bytes: HookState's counter)
        self.compressed_iterations = 0

    def config(self) -> dict[str, Any]:
        keys = ("variant", "sketch_rows", "sketch_ratio", "heavy_fraction", "start_iter", "seed")
        return {"algorithm": type(self).__name__, **{k: getattr(self, k) for k in keys}}

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out.update(wire_bytes_per_step=(self.wire_bytes - self.warmup_wire_bytes)
                   / max(self.compressed_iterations, 1))
        return out

    def __getstate__(self) -> dict[str, Any]:
        d = super().__getstate__()
        d["_hash_cache"] = HashCache()
        return d

    def _snapshot(self) -> Any:
        return dict(self.accumulators)

    def _restore(self, saved: Any) -> None:
        self.accumulators = dict(saved)

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "accumulators": {k: v.clone() for k, v in self.accumulators.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self.accumulators = {int(k): v.clone() for k, v in state["accumulators"].items()}

    def reduce(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        """Sketch, all-reduce, accumulate and unsketch one flat ``(n,)`` bucket; returns the ``(n,)``
        sparse averaged gradient in ``flat``'s dtype."""
        n = flat.numel()
        p = self.world_size
        t0 = time.perf_counter()
        cols = sketch_cols(n, self.sketch_ratio, self.sketch_rows)
        sk = CountSketch(self.sketch_rows, cols, seed=DEFAULT_SEED + self.seed)
        hashed = self._hash_cache.hashes(sk, key, n) if self.cache_hashes else sk.hashes(torch.arange(n))
        g = flat.detach().reshape(-1).to(torch.float32)
        if self.variant == "local_ef":
            acc = self.accumulators.get(key)
            g = g + acc if acc is not None and acc.numel() == n else g.clone()
            self.accumulators[key] = g  # local error feedback (vector space)
        sk.accumulate(g, hashed=hashed)
        self.compress_seconds += time.perf_counter() - t0
        dist.all_reduce(sk.table, group=self.comm_group)
        self.count_collective(sk.table, kind="allreduce")
        self.finite_guard.agree(sk.table)  # a local inf reaches every rank's table, selected or not
        k = max(1, math.ceil(self.heavy_fraction * cols))
        if self.variant == "local_ef":
            t0 = time.perf_counter()
            idx, _ = sk.heavy_hitters(torch.arange(n), k=k, hashed=hashed)
            self.compress_seconds += time.perf_counter() - t0
            vals = g[idx].clone()
            dist.all_reduce(vals, group=self.comm_group)
            self.count_collective(vals, kind="allreduce")
            g[idx] = 0.0  # what was sent leaves the local error feedback
            out = torch.zeros(n, dtype=torch.float32)
            out[idx] = vals / p
            return out.to(flat.dtype)
        t0 = time.perf_counter()
        acc = self.accumulators.get(key)
        if acc is None or acc.shape != sk.table.shape:
            acc = torch.zeros_like(sk.table)
        acc = acc + sk.table / p  # a new tensor: the guard's snapshot keeps the old one
        sk.table = acc
        idx, vals = sk.heavy_hitters(torch.arange(n), k=k, hashed=hashed)
        removed = CountSketch(self.sketch_rows, cols, seed=DEFAULT_SEED + self.seed).accumulate(vals, idx)
        acc -= removed.table
        self.accumulators[key] = acc
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = vals
        self.compress_seconds += time.perf_counter() - t0
        return out.to(flat.dtype)


def countsketch_hook(state: CountSketchState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for :class:`CountSketchState`, run on the state's bucket worker thread.

    Raises:
        ValueError: if the bucket is not on the CPU.
    """
    return reduce_bucket(state, bucket)

