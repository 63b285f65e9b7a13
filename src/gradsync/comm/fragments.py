"""Streaming DiLoCo's fragments: which trainable tensors make up each fragment, and at which steps
each fragment is synchronised (shared by the ``diloco`` algorithm and the simulator's
:class:`~gradsync.sim.plans.PeriodicPlan`, so both follow one schedule).

Source: Douillard et al., "Streaming DiLoCo with overlapping communication", arXiv 2501.18512, Sec. 2.2
("streaming partial updates"): the model is cut into fragments, fragment ``p`` is synchronised every
``H`` steps at its own offset ``t_p``, the offsets spread over the period so the bandwidth is spread
evenly; the *sequential* pattern (consecutive layers in one fragment) is the one used here.

Both functions are pure functions of integers (tensor sizes, the step counter): every rank computes
the same partition and the same schedule, never from local values.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..validation import check_int

__all__ = ["fragment_bounds", "fragment_at", "fragment_offsets"]


def fragment_bounds(numels: Sequence[int], fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of ``numels`` elements (in module order) into ``fragments`` contiguous, non-empty
    groups of about equal element count.

    Cut ``f`` (``f = 1 .. fragments-1``) is the tensor boundary ``j`` whose prefix count ``S_j`` is
    nearest to ``f N / fragments`` (``N = sum(numels)``; ties to the smaller ``j``), among the boundaries
    that leave every group at least one tensor. Tensors are never split (a fragment is a set of
    whole parameters, as the paper's fragments are sets of layers).

    Args:
        numels: element count of each tensor, in module order (ints >= 0).
        fragments: number of groups, an integer in ``[1, len(numels)]``.

    Returns:
        ``fragments`` half-open index ranges ``(lo, hi)`` into ``numels``, covering it in order.

    Raises:
        ValueError: if ``fragments`` is not an integer in ``[1, len(numels)]``.
    """
    k = len(numels)
    fragments = check_int("fragments (at most the number of trainable parameter tensors)", fragments, 1, max(k, 1))
    prefix = [0]
    for n in numels:
        prefix.append(prefix[-1] + int(n))
    total = prefix[-1]
    cuts = [0]
    for f in range(1, fragments):
        allowed = range(cuts[-1] + 1, k - (fragments - f) + 1)
        cuts.append(min(allowed, key=lambda j: (abs(fragments * prefix[j] - f * total), j)))
    cuts.append(k)
    return list(zip(cuts[:-1], cuts[1:]))


def fragment_offsets(period: int, fragments: int) -> list[int]:
    """Offset of each fragment within the period: fragment ``f`` is synchronised after the inner steps
    ``t`` (counted from 1) with ``t % period == offsets[f] % period``, where ``offsets[f] = (f+1) *
    period // fragments`` (in ``[1, period]``, strictly increasing: one fragment per sync step, the
    syncs ``period / fragments`` steps apart; the last fragment at the multiples of ``period``, so
    ``fragments = 1`` is DiLoCo's schedule).

    Raises:
        ValueError: if ``period`` is not an integer >= 1 or ``fragments`` not in ``[1, period]``.
    """
    period = check_int("period", period, 1)
    fragments = check_int("fragments (at most period)", fragments, 1, period)
    return [(f + 1) * period // fragments for f in range(fragments)]


def fragment_at(step: int, period: int, fragments: int) -> int | None:
    """The fragment synchronised after inner step ``step`` (counted from 1), or ``None`` if none is
    (see :func:`fragment_offsets`).

    Raises:
        ValueError: as :func:`fragment_offsets`.
    """
    r = step % period
    for f, offset in enumerate(fragment_offsets(period, fragments)):
        if offset % period == r:
            return f
    return None
