"""Alpha-beta (Hockney) cost model for the collectives gradsync uses.

A message of ``n`` bytes between two ranks costs ``alpha + n * beta`` seconds, where ``alpha`` is the
per-message latency (seconds) and ``beta`` the transfer time per byte (seconds/byte,
``beta = 8 / bandwidth_bits_per_s``). The collective costs below are the standard bandwidth-optimal
ring algorithms:

* Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
  IJHPCA 19(1), 2005, Section 4 (ring all-gather; reduce-scatter; all-reduce as reduce-scatter
  followed by all-gather, "Rabenseifner's algorithm" / ring variant).
* Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations",
  JPDC 69(2), 2009 (ring all-reduce: ``2(P-1)alpha + 2(P-1)/P * n * beta``, optimal in the
  bandwidth term).

The reduction (computation) term ``gamma`` of Thakur et al. is omitted: on the networks gradsync
models the per-byte reduction cost is small against ``beta``.
All sizes are in bytes, all times in seconds, ``P`` is the world size (number of ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradsync.validation import check_float, check_int

logger = logging.getLogger(__name__)

__all__ = [
    "COLLECTIVES",
    "Network",
    "allgather_time",
    "allreduce_time",
    "collective_time",
    "fit_alpha_beta",
    "reduce_scatter_time",
    "sparse_allgather_time",
]

#: Collective kinds understood by :func:`collective_time`.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "sparse_allgather")


@dataclass(frozen=True)
class Network:
    """A homogeneous network: every rank has a link of ``bandwidth_gbps`` and latency ``latency_s``.

    Args:
        bandwidth_gbps: link bandwidth in Gbit/s (10**9 bits per second), in (0, 1e6].
        latency_s: per-message latency alpha in seconds, in [0, 10].

    Raises:
        ValueError: naming the argument and its allowed range.
    """

    bandwidth_gbps: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "bandwidth_gbps",
            check_float("bandwidth_gbps", self.bandwidth_gbps, 0.0, 1e6, low_inclusive=False),
        )
        object.__setattr__(self, "latency_s", check_float("latency_s", self.latency_s, 0.0, 10.0))

    @property
    def alpha(self) -> float:
        """Per-message latency in seconds."""
        return self.latency_s

    @property
    def beta(self) -> float:
        """Seconds per byte: ``8 / (bandwidth_gbps * 1e9)``."""
        return 8.0 / (self.bandwidth_gbps * 1e9)

    @classmethod
    def from_mbit(cls, bandwidth_mbit: float, latency_s: float = 0.0) -> Network:
        """Build from a bandwidth in Mbit/s (10**6 bits per second), as used by ``tc``."""
        bw = check_float("bandwidth_mbit", bandwidth_mbit, 0.0, 1e9, low_inclusive=False)
        return cls(bw / 1000.0, latency_s)

    @classmethod
    def from_alpha_beta(cls, alpha: float, beta: float) -> Network:
        """Build from alpha (s) and beta (s/byte), e.g. the output of :func:`fit_alpha_beta`."""
        b = check_float("beta", beta, 0.0, None, low_inclusive=False)
        return cls(8.0 / b / 1e9, alpha)


def _args(nbytes: float, world_size: int, network: Network) -> tuple[float, int]:
    n = check_float("nbytes", nbytes, 0.0)
    p = check_int("world_size", world_size, 1)
    if not isinstance(network, Network):
        raise ValueError(f"network must be a gradsync.sim.Network, got {type(network).__name__}")
    return n, p


def allreduce_time(nbytes: float, world_size: int, network: Network) -> float:
    """Ring all-reduce of ``nbytes`` bytes (the full vector on every rank), in seconds.

    ``T = 2(P-1) alpha + 2(P-1)/P * n * beta`` (Patarasuk & Yuan 2009, Sec. 3; Thakur et al. 2005,
    Sec. 4.4: reduce-scatter followed by all-gather). ``P = 1`` costs 0.

    Raises:
        ValueError: for negative ``nbytes``, ``world_size < 1`` or a non-Network ``network``.
    """
    n, p = _args(nbytes, world_size, network)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * network.alpha + 2 * (p - 1) / p * n * network.beta


def reduce_scatter_time(nbytes: float, world_size: int, network: Network) -> float:
    """Ring reduce-scatter of an ``nbytes``-byte vector (each rank ends with n/P bytes), seconds.

    ``T = (P-1) alpha + (P-1)/P * n * beta`` (Thakur et al. 2005, Sec. 4.3, long-message case).
    ``P = 1`` costs 0.

    Raises:
        ValueError: as :func:`allreduce_time`.
    """
    n, p = _args(nbytes, world_size, network)
    if p == 1:
        return 0.0
    return (p - 1) * network.alpha + (p - 1) / p * n * network.beta


def allgather_time(nbytes: float, world_size: int, network: Network) -> float:
    """Ring all-gather producing an ``nbytes``-byte vector (each rank contributes n/P bytes), seconds.

    ``T = (P-1) alpha + (P-1)/P * n * beta`` (Thakur et al. 2005, Sec. 4.1, ring algorithm).
    ``P = 1`` costs 0.

    Raises:
        ValueError: as :func:`allreduce_time`.
    """
    return reduce_scatter_time(nbytes, world_size, network)  # the same ring steps in reverse


def sparse_allgather_time(bytes_per_rank: float, world_size: int, network: Network) -> float:
    """Ring all-gather of sparse payloads where each rank contributes ``m`` bytes (padded to the max).

    Every rank receives the ``(P-1)`` other payloads, so
    ``T = (P-1) alpha + (P-1) * m * beta`` (Thakur et al. 2005, Sec. 4.1 with total size ``P*m``).
    Unlike all-reduce the volume grows with ``P``: this is why Top-k with all-gather stops scaling.
    ``P = 1`` costs 0.

    Raises:
        ValueError: as :func:`allreduce_time`.
    """
    m, p = _args(bytes_per_rank, world_size, network)
    if p == 1:
        return 0.0
    return (p - 1) * network.alpha + (p - 1) * m * network.beta


def collective_time(kind: str, nbytes: float, world_size: int, network: Network) -> float:
    """Dispatch on ``kind`` (one of :data:`COLLECTIVES`); ``nbytes`` as in the matching function.

    Raises:
        ValueError: for an unknown ``kind`` or bad arguments.
    """
    funcs = {
        "allreduce": allreduce_time,
        "reduce_scatter": reduce_scatter_time,
        "allgather": allgather_time,
        "sparse_allgather": sparse_allgather_time,
    }
    if kind not in funcs:
        raise ValueError(f"kind must be one of {', '.join(COLLECTIVES)}; got {kind!r}")
    return funcs[kind](nbytes, world_size, network)


def fit_alpha_beta(
    sizes_bytes: Sequence[float], seconds: Sequence[float], world_size: int
) -> tuple[float, float]:
    """Least-squares fit of ``(alpha, beta)`` to measured ring all-reduce times.

    Solves ``seconds_i ~= 2(P-1) alpha + 2(P-1)/P * sizes_i * beta`` for ``alpha >= 0, beta > 0``
    (ordinary least squares on the two regressors; a negative alpha is clamped to 0 and beta refit
    through the origin). Use it to calibrate :class:`Network` against the emulated cluster:
    ``Network.from_alpha_beta(*fit_alpha_beta(sizes, times, P))``.

    Args:
        sizes_bytes: message sizes in bytes (at least two distinct values).
        seconds: measured all-reduce times in seconds, same length.
        world_size: P >= 2.

    Returns:
        ``(alpha_s, beta_s_per_byte)``.

    Raises:
        ValueError: on mismatched lengths, fewer than two distinct sizes, ``world_size < 2``,
            negative/non-finite values, or a fit whose beta is not positive.
    """
    p = check_int("world_size", world_size, 2)
    x = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    y = np.asarray(seconds, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(
            f"sizes_bytes and seconds must have the same length, got {x.size} and {y.size}"
        )
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x < 0) or np.any(y < 0):
        raise ValueError("sizes_bytes and seconds must be finite and >= 0")
    if np.unique(x).size < 2:
        raise ValueError("sizes_bytes needs at least two distinct sizes to fit alpha and beta")
    a_coef = 2.0 * (p - 1)
    b_coef = 2.0 * (p - 1) / p
    design = np.stack([np.full_like(x, a_coef), b_coef * x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(np.dot(b_coef * x, y) / np.dot(b_coef * x, b_coef * x))
    if not beta > 0:
        raise ValueError(f"fit gave a non-positive beta ({beta}); measurements do not grow with size")
    logger.debug("fit alpha=%.3g s beta=%.3g s/B (%.3f Gbit/s)", alpha, beta, 8 / beta / 1e9)
    return float(alpha), float(beta)
