"""ASC, adaptive stepwise coding of quantised gradients on ring hops (OSCAR, reconstructed).

Source: OSCAR (Majhi, Laskar, Muzahid, Kim 2026, "Compression-Aware Gradient Splitting for Collective
Communications in Distributed Training"). No paper text or code is public; this is a
**reconstruction** from the abstract: "ASC is a variant of Adaptive Arithmetic Coding that generates
a distinct probability table for each timestep of AllReduce to adapt to its unique value ranges and
avoids sending the probability table". The static-table baseline follows Atalanta (Delmas Lascorz et
al., ASPLOS'24), whose table is profiled once and sent once. The entropy coder is ``constriction``'s
ANS coder (``constriction.stream.stack.AnsCoder`` with a ``Categorical`` model); no coder is written
here. Each message is coded by **one** ``constriction`` call on the int32 symbol array
(``encode_reverse`` / ``decode``) with one model built in one call from the counts, so no Python code
runs per symbol; the symbol histogram that updates the model is counted on the same int32 array.
(Until 2026-11-23 the coder was the range coder ``queue.RangeEncoder``, an arithmetic coder in the
narrow sense; ANS codes the same model at the same rate, same bytes within a word, and is faster to
encode and decode here: ``benchmarks/asc_coding_time.py`` times both. Only the model, not the coder,
is what the abstract's "adaptive" refers to.) ``constriction``
appears to hold the GIL while it codes (two threads decoding 1 M symbols each took no less time
than one thread decoding both, 2026-11-23), so the bucket worker's coding does not overlap Python
work on other threads.

Choices (made here, measured below):

* **One model per (ring link, reduce-scatter step).** At reduce-scatter step ``s`` a chunk holds
  partial sums of ``s + 1`` ranks, so its value range widens with ``s``. Rank r's *send* model for step
  ``s`` and rank r+1's *receive* model for step ``s`` are updated with the same symbols (the sender
  knows what it sent, the receiver what it decoded), so the two stay identical and **no table is
  sent**. The model for step ``s`` at iteration t is the symbol histogram of step ``s`` at iteration
  t-1, decayed (``counts = decay * counts + hist``, default ``decay=0.5``), Laplace-smoothed with
  ``alpha`` (default 0.5).
* **All-gather model shared by all ranks.** All-gather bytes are forwarded unchanged hop to hop, so
  every rank must decode them with the owner's model: that model is the histogram of the previous
  iteration's fully reduced values, which every rank holds after the all-reduce.
* **8-byte header per message**: the int32 minimum and maximum of the message; the model is
  restricted to ``[min, max]`` so no probability is wasted on values that cannot occur (and a
  constant message needs no payload). The first iteration (empty counts) codes uniformly in
  ``[min, max]``.
* The model is fixed within a message (no per-symbol update): per-symbol adaptation would need a
  model per symbol (``constriction`` takes a ``(m, n)`` probability array, i.e. ``m`` models built per
  message, far slower than one model over a ``2 P L + 1`` alphabet); the iteration-to-iteration
  similarity of gradients is what ASC exploits.

Measurements (bytes against raw ints, zstd, zlib and a static table; coding time; load balance of
``balanced_bounds``): docs/results.md.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from gradsync.extras import require
from gradsync.validation import check_float, check_int

constriction = require("constriction", "gradsync.coding (OSCAR's ASC)")
zstandard = require("zstandard", "gradsync.coding (OSCAR's ASC)")

HEADER_BYTES = 8


def _as_numpy_int(values: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values).reshape(-1).astype(np.int64, copy=False)


def _as_int32(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """``(m,)`` int32 numpy view or copy of integer ``values`` (no copy for contiguous CPU int32)."""
    if isinstance(values, torch.Tensor):
        t = values.detach().reshape(-1)
        if t.dtype != torch.int32:
            if t.numel() and (int(t.min()) < -(1 << 31) or int(t.max()) >= (1 << 31)):
                raise ValueError(f"values must lie in [-{1 << 31}, {(1 << 31) - 1}]")
            t = t.to(torch.int32)
        return t.cpu().numpy()
    v = np.asarray(values).reshape(-1)
    if v.dtype != np.int32:
        if v.size and (int(v.min()) < -(1 << 31) or int(v.max()) >= (1 << 31)):
            raise ValueError(f"values must lie in [-{1 << 31}, {(1 << 31) - 1}]")
        v = v.astype(np.int32)
    return v


def _model(counts: np.ndarray, lo: int, hi: int, max_abs: int, alpha: float):
    """The Categorical model over ``[lo, hi]`` (symbol ``v - lo``), built in one call from the counts."""
    probs = counts[lo + max_abs : hi + max_abs + 1] + alpha
    return constriction.stream.model.Categorical(probs.astype(np.float64, copy=False), perfect=False)


def _encode_symbols(v: np.ndarray, counts: np.ndarray, max_abs: int, alpha: float
                    ) -> tuple[torch.Tensor, np.ndarray | None, int]:
    """Encode int32 ``v``; returns ``(payload, symbols v - lo as int32 or None when constant, lo)``."""
    if v.size == 0:
        return torch.from_numpy(np.array([0, -1], dtype=np.int32).view(np.uint8).copy()), None, 0
    lo, hi = int(v.min()), int(v.max())
    if lo < -max_abs or hi > max_abs:
        raise ValueError(f"values must lie in [-{max_abs}, {max_abs}], got [{lo}, {hi}]")
    header = np.array([lo, hi], dtype=np.int32).view(np.uint8)
    if lo == hi:
        return torch.from_numpy(header.copy()), None, lo
    sym = v - np.int32(lo)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym, _model(counts, lo, hi, max_abs, alpha))  # one call for the whole message
    words = coder.get_compressed().astype(np.uint32, copy=False)
    return torch.from_numpy(np.concatenate([header, words.view(np.uint8)])), sym, lo


def _decode_symbols(payload: torch.Tensor | np.ndarray, numel: int, counts: np.ndarray, max_abs: int,
                    alpha: float) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Decode to ``(values as int32, symbols or None when constant, lo)``."""
    buf = payload.numpy() if isinstance(payload, torch.Tensor) else np.asarray(payload, dtype=np.uint8)
    if buf.size < HEADER_BYTES or (buf.size - HEADER_BYTES) % 4:
        raise ValueError(f"payload of {buf.size} bytes is not a valid ASC message")
    lo, hi = (int(x) for x in buf[:HEADER_BYTES].copy().view(np.int32))
    if numel == 0:
        return np.zeros(0, dtype=np.int32), None, 0
    if lo < -max_abs or hi > max_abs or lo > hi:
        raise ValueError(f"payload range [{lo}, {hi}] outside [-{max_abs}, {max_abs}]")
    if lo == hi:
        return np.full(numel, lo, dtype=np.int32), None, lo
    words = buf[HEADER_BYTES:].copy().view(np.uint32)
    sym = constriction.stream.stack.AnsCoder(words).decode(_model(counts, lo, hi, max_abs, alpha), numel)
    sym = sym.astype(np.int32, copy=False)
    return sym + np.int32(lo), sym, lo


def encode_with_counts(
    values: torch.Tensor | np.ndarray, counts: np.ndarray, max_abs: int, alpha: float = 0.5
) -> torch.Tensor:
    """Entropy-code integer ``values`` with the model ``counts + alpha`` restricted to the message range.

    The whole message is coded by one ``constriction`` call (``AnsCoder.encode_reverse`` of the int32
    symbol array with one ``Categorical`` model built in one call), so no Python code runs per symbol.

    Args:
        values: ``(m,)`` integers in ``[-max_abs, max_abs]`` (int32 input avoids a copy).
        counts: ``(2 * max_abs + 1,)`` float64 symbol counts; index ``v + max_abs`` is value ``v``.
        max_abs: largest absolute value representable.
        alpha: Laplace smoothing pseudo-count (> 0).

    Returns:
        ``(8 + 4w,)`` uint8 tensor: int32 min, int32 max, then ``w`` uint32 words of the ANS coder
        (no words when ``min == max`` or ``m == 0``).

    Raises:
        ValueError: if a value lies outside ``[-max_abs, max_abs]``.
    """
    return _encode_symbols(_as_int32(values), counts, max_abs, alpha)[0]


def decode_with_counts(
    payload: torch.Tensor | np.ndarray, numel: int, counts: np.ndarray, max_abs: int, alpha: float = 0.5
) -> torch.Tensor:
    """Invert :func:`encode_with_counts` (same ``counts``, ``max_abs`` and ``alpha``; one
    ``constriction`` decode call for the whole message).

    Args:
        payload: uint8 bytes produced by :func:`encode_with_counts`.
        numel: number of symbols m.

    Returns:
        ``(numel,)`` int64 tensor.

    Raises:
        ValueError: if the payload is shorter than the header or its range is invalid.
    """
    return torch.from_numpy(_decode_symbols(payload, numel, counts, max_abs, alpha)[0]).to(torch.int64)


class ASCRingCoder:
    """Per-bucket ASC models for :func:`gradsync.comm.ring.ring_all_reduce_coded`.

    Pass ``coder.encode`` and ``coder.decode`` as the ring callbacks, then call
    :meth:`end_iteration` with the fully reduced integer vector (identical on every rank).

    Args:
        world_size: P >= 1.
        max_abs: largest absolute value of any partial or full sum (``P * levels`` for quantised
            gradients with ``levels`` levels per rank).
        alpha: Laplace smoothing pseudo-count, > 0 (default 0.5).
        decay: weight of older counts in ``[0, 1)`` (default 0.5); 0 keeps only the previous iteration.

    Raises:
        ValueError: for arguments outside their ranges.
    """

    def __init__(self, world_size: int, max_abs: int, alpha: float = 0.5, decay: float = 0.5):
        self.world_size = check_int("world_size", world_size, 1, None)
        self.max_abs = check_int("max_abs", max_abs, 1, 1 << 24)
        self.alpha = check_float("alpha", alpha, 0.0, None, low_inclusive=False)
        self.decay = check_float("decay", decay, 0.0, 1.0, high_inclusive=False)
        n = 2 * self.max_abs + 1
        self.send_counts = np.zeros((max(self.world_size - 1, 1), n), dtype=np.float64)
        self.recv_counts = np.zeros_like(self.send_counts)
        self.ag_counts = np.zeros(n, dtype=np.float64)

    def _hist(self, values: torch.Tensor | np.ndarray) -> np.ndarray:
        v = _as_int32(values)
        return np.bincount(v + np.int32(self.max_abs), minlength=2 * self.max_abs + 1).astype(np.float64)

    def _decay(self, row: np.ndarray) -> None:
        if self.decay > 0:
            row *= self.decay
        else:
            row[:] = 0.0

    def _update(self, row: np.ndarray, values) -> None:
        self._decay(row)
        row += self._hist(values)

    def _update_symbols(self, row: np.ndarray, sym: np.ndarray | None, lo: int, numel: int) -> None:
        """``row = decay * row + histogram``, the histogram counted on the symbols ``v - lo`` the coder
        already holds (range ``hi - lo + 1`` instead of ``2 max_abs + 1``; no int64 copy)."""
        self._decay(row)
        if numel == 0:
            return
        base = lo + self.max_abs
        if sym is None:  # constant message
            row[base] += numel
            return
        h = np.bincount(sym)
        row[base : base + h.size] += h

    def encode(self, phase: str, step: int, chunk: int, values: torch.Tensor) -> torch.Tensor:
        """Ring encode callback; updates the send model of ``step`` after encoding (reduce-scatter)."""
        v = _as_int32(values)
        if phase == "rs":
            out, sym, lo = _encode_symbols(v, self.send_counts[step], self.max_abs, self.alpha)
            self._update_symbols(self.send_counts[step], sym, lo, v.size)
            return out
        return _encode_symbols(v, self.ag_counts, self.max_abs, self.alpha)[0]

    def decode(self, phase: str, step: int, chunk: int, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Ring decode callback; updates the receive model of ``step`` after decoding. Returns a
        ``(numel,)`` int32 tensor."""
        if phase == "rs":
            vals, sym, lo = _decode_symbols(payload, numel, self.recv_counts[step], self.max_abs, self.alpha)
            self._update_symbols(self.recv_counts[step], sym, lo, numel)
            return torch.from_numpy(vals)
        return torch.from_numpy(_decode_symbols(payload, numel, self.ag_counts, self.max_abs, self.alpha)[0])

    def end_iteration(self, reduced: torch.Tensor) -> None:
        """Update the shared all-gather model with the fully reduced ``(n,)`` integer vector."""
        self._update(self.ag_counts, reduced)

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "max_abs": self.max_abs,
            "alpha": self.alpha,
            "decay": self.decay,
            "send_counts": self.send_counts.copy(),
            "recv_counts": self.recv_counts.copy(),
            "ag_counts": self.ag_counts.copy(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ASCRingCoder:
        c = cls(state["world_size"], state["max_abs"], state["alpha"], state["decay"])
        c.send_counts[:] = state["send_counts"]
        c.recv_counts[:] = state["recv_counts"]
        c.ag_counts[:] = state["ag_counts"]
        return c


# -- baselines ------------------------------------------------------------------------------------
def int_dtype_for(max_abs: int) -> np.dtype:
    """Narrowest signed numpy integer dtype holding ``[-max_abs, max_abs]``."""
    for dt in (np.int8, np.int16, np.int32):
        if max_abs <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def raw_bytes(values: torch.Tensor | np.ndarray, max_abs: int) -> bytes:
    """The values as raw little-endian bytes of the narrowest integer dtype (int8 when
    ``max_abs <= 127``)."""
    return _as_numpy_int(values).astype(int_dtype_for(max_abs)).tobytes()


def zlib_size(values: torch.Tensor | np.ndarray, max_abs: int, level: int = 6) -> int:
    """Bytes of ``zlib.compress(raw_bytes(values), level)``."""
    return len(zlib.compress(raw_bytes(values, max_abs), level))


def zstd_size(values: torch.Tensor | np.ndarray, max_abs: int, level: int = 3) -> int:
    """Bytes of zstandard level ``level`` of ``raw_bytes(values)``."""
    return len(zstandard.ZstdCompressor(level=level).compress(raw_bytes(values, max_abs)))


class StaticTableCoder:
    """Atalanta-style baseline: one table per key, built from the first message and sent once.

    ``size(key, values)`` returns the bytes of coding ``values`` with the key's table (8-byte header +
    range-coder words). The first message of a key builds the table; its transmission cost (8 bytes
    of range + 2 bytes per 16-bit count over the range) is added to ``table_bytes``. Messages are coded
    with the first table, Laplace-smoothed over ``[-max_abs, max_abs]`` so unseen values stay codable.

    Raises:
        ValueError: for ``max_abs`` or ``alpha`` out of range.
    """

    def __init__(self, max_abs: int, alpha: float = 0.5):
        self.max_abs = check_int("max_abs", max_abs, 1, 1 << 24)
        self.alpha = check_float("alpha", alpha, 0.0, None, low_inclusive=False)
        self.tables: dict[Any, np.ndarray] = {}
        self.table_bytes = 0

    def size(self, key: Any, values: torch.Tensor | np.ndarray) -> int:
        v = _as_numpy_int(values)
        if key not in self.tables:
            counts = np.bincount(v + self.max_abs, minlength=2 * self.max_abs + 1).astype(np.float64)
            nz = np.nonzero(counts)[0]
            span = int(nz[-1] - nz[0] + 1) if nz.size else 0
            self.tables[key] = counts
            self.table_bytes += 8 + 2 * span
        return encode_with_counts(v, self.tables[key], self.max_abs, self.alpha).numel()


# -- measurement ----------------------------------------------------------------------------------
def simulate_ring_messages(
    per_rank: list[torch.Tensor], bounds: list[int]
) -> Iterable[tuple[str, int, int, torch.Tensor]]:
    """Messages of a ring all-reduce of integer vectors, computed in one process (for measurement).

    Args:
        per_rank: P ``(n,)`` integer tensors (one per rank).
        bounds: ``P + 1`` chunk boundaries.

    Yields:
        ``(phase, step, sender_rank, values)`` for every non-empty hop: reduce-scatter hops carry
        partial sums, all-gather hops the reduced chunks.
    """
    p = len(per_rank)
    work = [t.clone().to(torch.int64) for t in per_rank]
    for s in range(p - 1):
        sends = []
        for r in range(p):
            c = (r - s) % p
            sends.append((r, c, work[r][bounds[c]:bounds[c + 1]].clone()))
        for r, c, vals in sends:
            if vals.numel():
                yield "rs", s, r, vals
            work[(r + 1) % p][bounds[c]:bounds[c + 1]] += vals
    total = work[0].clone()
    for r in range(p):
        c = (r + 1) % p
        total[bounds[c]:bounds[c + 1]] = work[r][bounds[c]:bounds[c + 1]]
    for s in range(p - 1):
        for r in range(p):
            c = (r + 1 - s) % p
            vals = total[bounds[c]:bounds[c + 1]]
            if vals.numel():
                yield "ag", s, r, vals


def measure_ring_coding(
    iterations: list[list[torch.Tensor]],
    bounds_per_iter: list[list[int]],
    max_abs: int,
    skip_first: int = 1,
    alpha: float = 0.5,
    decay: float = 0.5,
) -> dict[str, Any]:
    """Bytes of every ring hop under ASC, raw ints, static table, zlib and zstd (one process).

    ASC is run with one :class:`ASCRingCoder` per sending rank (its send models mirror the receiver's,
    so coding with the send model gives the receiver's bytes); the all-gather hops are encoded once by
    the owner and forwarded, so each forwarded hop carries the owner's bytes. zlib/zstd/raw are applied
    per message to the same values as raw integers; every message of ASC and static table includes
    its 8-byte range header. Decoding is checked: every ASC message must decode exactly.

    Args:
        iterations: per iteration, the P ``(n,)`` integer vectors.
        bounds_per_iter: per iteration, the ``P + 1`` chunk boundaries.
        max_abs: bound on every partial sum.
        skip_first: iterations excluded from the totals (ASC's first iteration has no history).
        alpha, decay: ASC model parameters (see :class:`ASCRingCoder`).

    Returns:
        dict with byte totals ``asc``, ``raw``, ``static``, ``zlib``, ``zstd``
        , ``per_step_max_mean`` (mean over iterations and ring steps of max/mean bytes across ranks,
        ASC) and ``asc_encode_seconds`` / ``asc_decode_seconds`` (summed over all simulated ranks).

    Raises:
        AssertionError: if an ASC message does not decode to its input.
    """
    p = len(iterations[0])
    coders = [ASCRingCoder(p, max_abs, alpha, decay) for _ in range(p)]
    receivers = [ASCRingCoder(p, max_abs, alpha, decay) for _ in range(p)]
    static = StaticTableCoder(max_abs)
    tot: dict[str, Any] = {"asc": 0, "raw": 0, "static": 0, "zlib": 0, "zstd": 0}
    enc_s = dec_s = 0.0
    balance: list[float] = []
    for it, (vecs, bounds) in enumerate(zip(iterations, bounds_per_iter)):
        count = it >= skip_first
        step_bytes: dict[tuple[str, int], list[int]] = {}
        ag_cache: dict[int, torch.Tensor] = {}
        for phase, s, r, vals in simulate_ring_messages(vecs, bounds):
            t0 = time.perf_counter()
            if phase == "rs":
                payload = coders[r].encode("rs", s, 0, vals)
            else:
                key = hash(vals.numpy().tobytes())
                if key not in ag_cache:
                    ag_cache[key] = coders[r].encode("ag", 0, 0, vals)
                payload = ag_cache[key]
            t1 = time.perf_counter()
            back = receivers[(r + 1) % p].decode(phase, s if phase == "rs" else 0, 0, payload, vals.numel())
            t2 = time.perf_counter()
            if count:
                enc_s += t1 - t0
                dec_s += t2 - t1
            assert torch.equal(back, vals.to(torch.int64)), "ASC round trip failed"
            nbytes = payload.numel()
            step_bytes.setdefault((phase, s), [0] * p)[r] = nbytes
            if count:
                tot["asc"] += nbytes
                tot["raw"] += len(raw_bytes(vals, max_abs))
                tot["static"] += static.size((phase, s, r), vals)
                tot["zlib"] += zlib_size(vals, max_abs)
                tot["zstd"] += zstd_size(vals, max_abs)
            else:
                static.size((phase, s, r), vals)  # the table is profiled on the first iteration
        full = torch.stack([v.to(torch.int64) for v in vecs]).sum(0)
        for c in coders + receivers:
            c.end_iteration(full)
        if count:
            for sizes in step_bytes.values():
                mean = sum(sizes) / len(sizes)
                if mean > 0:
                    balance.append(max(sizes) / mean)
    tot["static"] += static.table_bytes
    tot["asc_encode_seconds"] = enc_s
    tot["asc_decode_seconds"] = dec_s
    tot["per_step_max_mean"] = float(np.mean(balance)) if balance else 1.0
    return tot
