"""Count sketch with shared hashes, linear aggregation, median estimates and heavy-hitter recovery.

Source: the count sketch of Charikar, Chen and Farach-Colton (2002, "Finding frequent items in data
streams"), as used for gradients by Sketched-SGD (Ivkin et al. 2019) and FetchSGD (Rothchild et al.
2020). Written from the description of those papers; no code was copied.

A sketch of a vector ``x`` (length ``n``) is an ``rows x cols`` float32 table. For row ``j``:

* bucket hash ``h_j(i) = ((a_j * i + b_j) mod p) mod cols`` (2-wise independent family),
* sign hash ``s_j(i) = +1 if (((c3 i + c2) i + c1) i + c0 mod p) is even else -1`` (4-wise
  independent family: a random cubic polynomial over GF(p)),

with ``p = 2**31 - 1`` (a Mersenne prime). All arithmetic is torch ``int64``: every intermediate
product is below ``2**62``, so nothing overflows. Coordinates must therefore be ``< 2**31 - 1``. The
coefficients come from ``random.Random(seed)``; every rank that uses the same ``(rows, cols, seed)``
builds the same hashes, which is what makes the sketch *linear across ranks*: the element-wise sum of
the ranks' tables (one ``all_reduce(SUM)``) equals the sketch of the summed vector.

``table[j, h_j(i)] += s_j(i) * x_i`` (``index_add_``); the estimate of coordinate ``i`` is
``median_j s_j(i) * table[j, h_j(i)]``.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from gradsync.validation import check_float, check_int

MERSENNE_P = (1 << 31) - 1
DEFAULT_SEED = 42


class CountSketch:
    """An ``rows x cols`` count sketch (Charikar et al. 2002) over coordinates ``0 .. 2**31 - 2``.

    Args:
        rows: number of independent hash rows r (odd values give a clean median), 1..64.
        cols: number of columns c per row, >= 1.
        seed: hash seed; ranks that must aggregate sketches have to use the same seed (default 42).
        dtype: table dtype, float32 (default) or float64.
        device: device of the table and the hash coefficients (default CPU); vectors accumulated
            into or estimated from the sketch must be on it.

    Attributes:
        table: ``(rows, cols)`` tensor of ``dtype``; may be replaced by an all-reduced copy.

    Raises:
        ValueError: for rows/cols/seed outside their ranges or a non-float dtype.
    """

    def __init__(self, rows: int, cols: int, seed: int = DEFAULT_SEED, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.rows = check_int("rows", rows, 1, 64)
        self.cols = check_int("cols", cols, 1, MERSENNE_P - 1)
        self.seed = check_int("seed", seed, 0, None)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        rng = random.Random(self.seed)
        # 2-wise bucket hash: a in [1, p-1], b in [0, p-1]; 4-wise sign hash: cubic polynomial.
        self._bucket_coef = torch.tensor(
            [[rng.randrange(1, MERSENNE_P), rng.randrange(0, MERSENNE_P)] for _ in range(self.rows)],
            dtype=torch.int64, device=device,
        )
        self._sign_coef = torch.tensor(
            [[rng.randrange(0, MERSENNE_P) for _ in range(4)] for _ in range(self.rows)], dtype=torch.int64,
            device=device,
        )
        self.table = torch.zeros(self.rows, self.cols, dtype=dtype, device=device)

    # -- hashing ------------------------------------------------------------------------------
    def raw_hashes(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket hashes before the reduction to ``[0, cols)`` (``(a i + b) mod p``) and signs.

        Independent of ``cols``, so they can be cached per coordinate range (:class:`HashCache`).

        Returns:
            ``(raw, signs)``: ``(rows, m)`` int64 in ``[0, p)`` and ``(rows, m)`` +1/-1 signs in the
            table dtype.

        Raises:
            ValueError: if an index is negative or ``>= 2**31 - 1``.
        """
        idx = indices.reshape(-1).to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= MERSENNE_P):
            raise ValueError(f"indices must lie in [0, {MERSENNE_P - 1}]")
        p = MERSENNE_P
        raw = torch.remainder(self._bucket_coef[:, 0:1] * idx + self._bucket_coef[:, 1:2], p)
        c = self._sign_coef
        poly = torch.remainder(c[:, 3:4] * idx + c[:, 2:3], p)
        poly = torch.remainder(poly * idx + c[:, 1:2], p)
        poly = torch.remainder(poly * idx + c[:, 0:1], p)
        signs = (1 - 2 * (poly & 1)).to(self.table.dtype)
        return raw, signs

    def hashes(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket and sign hashes of ``indices``.

        Args:
            indices: ``(m,)`` integer tensor of coordinates in ``[0, 2**31 - 2]``.

        Returns:
            ``(buckets, signs)``: ``(rows, m)`` int64 column indices in ``[0, cols)`` and
            ``(rows, m)`` signs (+1/-1) in the table dtype.

        Raises:
            ValueError: if an index is negative or ``>= 2**31 - 1``.
        """
        raw, signs = self.raw_hashes(indices)
        return torch.remainder(raw, self.cols), signs

    # -- building -----------------------------------------------------------------------------
    def accumulate(
        self,
        values: torch.Tensor,
        indices: torch.Tensor | None = None,
        hashed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> CountSketch:
        """Add the vector with ``values`` at ``indices`` (default ``0 .. m-1``) to the table, in place.

        Args:
            values: ``(m,)`` real tensor (any float or int dtype; cast to the table dtype).
            indices: ``(m,)`` integer coordinates, or ``None`` for ``arange(m)``.
            hashed: optional precomputed ``self.hashes(indices)`` (a cache; must match ``indices``).

        Returns:
            ``self``.

        Raises:
            ValueError: if ``values`` and ``indices`` differ in length, or indices are out of range.
        """
        vals = values.reshape(-1).to(self.table.dtype)
        if indices is None:
            indices = torch.arange(vals.numel(), dtype=torch.int64, device=self.table.device)
        if indices.numel() != vals.numel():
            raise ValueError(f"values ({vals.numel()}) and indices ({indices.numel()}) differ in length")
        if vals.numel() == 0:
            return self
        buckets, signs = hashed if hashed is not None else self.hashes(indices)
        offsets = torch.arange(self.rows, dtype=torch.int64, device=self.table.device).unsqueeze(1) * self.cols
        flat = self.table.view(-1)
        flat.index_add_(0, (buckets + offsets).reshape(-1), (signs * vals).reshape(-1))
        return self

    def zero_(self) -> CountSketch:
        """Clear the table in place; returns ``self``."""
        self.table.zero_()
        return self

    def copy(self) -> CountSketch:
        """A sketch with the same hashes and a copy of the table."""
        other = CountSketch.__new__(CountSketch)
        other.__dict__.update(self.__dict__)
        other.table = self.table.clone()
        return other

    def __add__(self, other: CountSketch) -> CountSketch:
        self._check_compatible(other)
        out = self.copy()
        out.table += other.table
        return out

    def _check_compatible(self, other: CountSketch) -> None:
        if (self.rows, self.cols, self.seed) != (other.rows, other.cols, other.seed):
            raise ValueError("sketches differ in rows, cols or seed and cannot be combined")

    # -- querying -----------------------------------------------------------------------------
    def estimate(
        self, indices: torch.Tensor, hashed: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Median estimate ``median_j s_j(i) table[j, h_j(i)]`` for each coordinate.

        Args:
            indices: ``(m,)`` integer coordinates.
            hashed: optional precomputed ``self.hashes(indices)``.

        Returns:
            ``(m,)`` tensor in the table dtype. With an even number of rows the mean of the two
            middle values is used.
        """
        if indices.numel() == 0:
            return torch.zeros(0, dtype=self.table.dtype, device=self.table.device)
        buckets, signs = hashed if hashed is not None else self.hashes(indices)
        vals = torch.gather(self.table, 1, buckets) * signs
        if self.rows == 1:
            return vals[0]
        if self.rows % 2 == 1:
            return vals.median(dim=0).values
        s = vals.sort(dim=0).values
        return 0.5 * (s[self.rows // 2 - 1] + s[self.rows // 2])

    def l2_estimate(self) -> float:
        """Estimate of the L2 norm of the sketched vector: ``sqrt(median_j sum_k table[j,k]**2)``."""
        return float(self.table.pow(2).sum(dim=1).median().sqrt())

    def heavy_hitters(
        self,
        indices: torch.Tensor,
        k: int | None = None,
        threshold: float | None = None,
        hashed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Recover the large coordinates among candidate ``indices``.

        Selection: coordinates whose estimate satisfies ``|x_hat| >= threshold`` (if given), then at
        most the ``k`` largest by ``|x_hat|`` (if given). With neither, all candidates are returned.
        Ties at the k-th place are broken by ``torch.topk`` (deterministic on one platform, so every
        rank with the same table picks the same set).

        Args:
            indices: ``(m,)`` int64 candidate coordinates.
            k: maximal number of coordinates returned, >= 0.
            threshold: minimal absolute estimate, >= 0 (e.g. ``eps * l2_estimate()``).
            hashed: optional precomputed ``self.hashes(indices)``.

        Returns:
            ``(idx, values)``: ``(h,)`` int64 coordinates (subset of ``indices``, ascending) and
            their ``(h,)`` estimates.

        Raises:
            ValueError: if ``k`` or ``threshold`` is negative.
        """
        if k is not None:
            k = check_int("k", k, 0, None)
        if threshold is not None:
            threshold = check_float("threshold", threshold, 0.0, None)
        indices = indices.reshape(-1).to(torch.int64)
        est = self.estimate(indices, hashed)
        keep = torch.ones_like(est, dtype=torch.bool)
        if threshold is not None:
            keep = est.abs() >= threshold
        cand = torch.nonzero(keep).reshape(-1)
        if k is not None and cand.numel() > k:
            top = torch.topk(est[cand].abs(), k, sorted=False).indices
            cand = cand[top].sort().values
        return indices[cand], est[cand]

    # -- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "cols": self.cols, "seed": self.seed, "table": self.table.clone()}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CountSketch:
        sk = cls(state["rows"], state["cols"], state["seed"], dtype=state["table"].dtype,
                 device=state["table"].device)
        sk.table.copy_(state["table"])
        return sk


class HashCache:
    """Cache of a sketch family's raw hashes of ``0 .. n-1`` per key (e.g. per DDP bucket).

    The raw hashes do not depend on ``cols``, so one entry serves sketches of any width with the same
    ``rows`` and seed. Memory: ``rows * n * 12`` bytes per key (int64 + float32). Not part of
    checkpoints (recomputed on demand).
    """

    def __init__(self) -> None:
        self._store: dict[Any, tuple[tuple[int, int, int, str], tuple[torch.Tensor, torch.Tensor]]] = {}

    def hashes(
        self, sketch: CountSketch, key: Any, n: int, idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sketch.hashes(idx)`` (default ``idx = arange(n)``) for coordinates ``idx < n``, from the
        cached raw hashes of ``arange(n)`` under ``key`` (recomputed when n, rows, seed or device change)."""
        sig = (n, sketch.rows, sketch.seed, str(sketch.table.device))
        hit = self._store.get(key)
        if hit is None or hit[0] != sig:
            hit = (sig, sketch.raw_hashes(torch.arange(n, dtype=torch.int64, device=sketch.table.device)))
            self._store[key] = hit
        raw, signs = hit[1]
        if idx is not None:
            raw, signs = raw[:, idx], signs[:, idx]
        if signs.dtype != sketch.table.dtype:
            signs = signs.to(sketch.table.dtype)
        return torch.remainder(raw, sketch.cols), signs

    def clear(self) -> None:
        self._store.clear()


def sketch_cols(numel: int, ratio: float, rows: int) -> int:
    """Columns so that a ``rows x cols`` sketch holds about ``ratio * numel`` numbers in all.

    Returns ``max(1, ceil(ratio * numel / rows))``.

    Raises:
        ValueError: for a negative ``numel``, ``ratio`` outside ``(0, 1]`` or ``rows < 1``.
    """
    numel = check_int("numel", numel, 0, None)
    ratio = check_float("ratio", ratio, 0.0, 1.0, low_inclusive=False)
    rows = check_int("rows", rows, 1, 64)
    return max(1, math.ceil(ratio * numel / rows))
