"""Time to quality, MLPerf-style: the arithmetic of ``gradsync bench --to-quality`` (no processes).

Every entry trains the workload recipe's whole budget once per seed; its quality (test accuracy,
or bits per character on the kjv workloads) is evaluated every ``--eval-every`` steps and at the
end. The target defaults to dense training's mean final quality over the seeds minus 0.5 points of
accuracy (bits per character: plus 0.5 %); the time to it is the training wall-clock (evaluation
excluded) at the first evaluation at or past it. The summary follows the MLPerf Training rules
(Mattson et al. 2020, "MLPerf Training Benchmark", MLSys, section 3.2: several runs per result,
the fastest and the slowest dropped, the rest averaged): the olympic mean over >= 5 seeds, with
the median and the spread (fastest-slowest) beside it, and who is faster on each seed.

A full test-set evaluation at every evaluation step would cost more than the training (fashion-mnist:
6.3 s per evaluation against 0.12 s per step, measured). So every evaluation step runs a cheap one on
:data:`GATE_SAMPLES` test samples spread evenly over the test set and keeps a copy of the model; once the target is known,
:func:`lazy_curve` runs the full evaluation in step order only where the cheap one is within
:data:`GATE_MARGIN` of the target, up to the first full one that reaches it, plus the final one.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable, Optional

#: Runs the olympic mean needs (MLPerf's count for image classification).
OLYMPIC_MIN_SEEDS = 5
#: Default target below dense's final accuracy (0-1), and above dense's bits per character (relative).
ACCURACY_MARGIN = 0.005
LOSS_MARGIN = 0.005
#: Test samples of the cheap evaluation that decides whether a full one runs.
GATE_SAMPLES = 1000
#: How far the cheap evaluation may miss the target for the full one to run: 0.04 of accuracy (over
#: 4 standard errors of a 1,000-sample accuracy near 0.9), or 4 % more bits per character.
GATE_MARGIN = 0.04


def default_target(dense_finals: list[float], higher_is_better: bool) -> float:
    """The target from dense's final qualities over the seeds: mean - 0.005 (0.5 points of accuracy
    in 0-1) when higher is better, else mean x 1.005 (0.5 % more bits per character).

    Raises:
        ValueError: if ``dense_finals`` is empty.
    """
    if not dense_finals:
        raise ValueError("dense_finals must hold at least one final quality")
    mean = statistics.fmean(dense_finals)
    return mean - ACCURACY_MARGIN if higher_is_better else mean * (1 + LOSS_MARGIN)


def _reach(curve: list[list[float]], target: float, higher_is_better: bool) -> Optional[list[float]]:
    """The first ``[steps, seconds, quality]`` point of ``curve`` at or past ``target``, or None."""
    return next((p for p in curve if (p[2] >= target if higher_is_better else p[2] <= target)), None)


def gate_passes(cheap: float, target: float, higher_is_better: bool) -> bool:
    """Whether a cheap evaluation ``cheap`` is close enough to ``target`` for the full one to run:
    ``cheap >= target - GATE_MARGIN`` (accuracy) or ``cheap <= target * (1 + GATE_MARGIN)`` (a loss)."""
    return cheap >= target - GATE_MARGIN if higher_is_better else cheap <= target * (1 + GATE_MARGIN)


def lazy_curve(points: list[list[float]], target: float, higher_is_better: bool,
               full: Callable[[int], float]) -> list[list[float]]:
    """The full-quality curve of one run from its cheap evaluations.

    Args:
        points: ``[steps, seconds, cheap quality]`` per evaluation step, in step order; the last is the
            end of the budget.
        target: the quality target.
        higher_is_better: True for accuracy, False for a loss.
        full: ``full(i)`` evaluates point ``i``'s model on the full test set (a collective in a
            distributed run: every rank must call it for the same ``i``, which holds because the
            cheap qualities are all-reduced).

    Returns:
        ``[steps, seconds, full quality]`` of the points evaluated: those before the end whose cheap
        quality :func:`gate_passes`, in order, up to the first that reaches ``target``, then always
        the last point (the final quality).
    """
    curve = []
    for i, (step, seconds, cheap) in enumerate(points[:-1]):
        if gate_passes(cheap, target, higher_is_better):
            curve.append([step, seconds, full(i)])
            if _reach(curve[-1:], target, higher_is_better) is not None:
                break
    step, seconds, _ = points[-1]
    return curve + [[step, seconds, full(len(points) - 1)]]


def olympic_mean(seconds: list[Optional[float]]) -> Optional[float]:
    """Mean of ``seconds`` without the fastest and the slowest (None: not reached, slower than any
    time); None with fewer than :data:`OLYMPIC_MIN_SEEDS` values or when a kept one is None."""
    if len(seconds) < OLYMPIC_MIN_SEEDS:
        return None
    kept = sorted(math.inf if s is None else s for s in seconds)[1:-1]
    return None if math.isinf(kept[-1]) else statistics.fmean(kept)


def summarise_quality(curves: dict[str, list[list[list[float]]]], seeds: list[int], higher_is_better: bool,
                      target: Optional[float] = None, dense: Optional[str] = None) -> dict[str, Any]:
    """Summarise the runs of ``gradsync bench --to-quality``.

    Args:
        curves: per entry, per seed (in the order of ``seeds``) the evaluations ``[steps, seconds,
            quality]``, the last one at the end of the budget; seconds are training wall-clock,
            evaluation excluded.
        seeds: the seeds.
        higher_is_better: True for accuracy (0-1), False for a loss such as bits per character.
        target: an absolute target; None: :func:`default_target` of entry ``dense``'s final qualities.
        dense: the dense reference entry (needed when ``target`` is None).

    Returns:
        ``{"target", "target_from" ("absolute" or the dense entry), "higher_is_better", "seeds",
        "entries": {name: {...}}}``; per entry
        ``final_by_seed``, ``final_mean``, ``seconds_by_seed`` and ``steps_by_seed`` (None: not reached),
        ``reached`` (count), ``olympic_mean_s`` (None with < 5 seeds or when a kept seed did not reach),
        ``median_s`` and ``spread_s`` ``[fastest, slowest]`` (None where not reached counts) and ``wins``:
        ``{other entry: [seeds on which this entry reached the target first]}`` (reaching it beats not
        reaching it; equal times and both not reaching win nothing).

    Raises:
        ValueError: if ``target`` is None and ``dense`` is not an entry of ``curves``, or a curve is empty
            or the number of curves of an entry is not the number of seeds.
    """
    for name, per_seed in curves.items():
        if len(per_seed) != len(seeds) or not all(per_seed):
            raise ValueError(f"curves of {name!r} must hold one non-empty curve per seed ({len(seeds)})")
    target_from = "absolute" if target is not None else dense
    if target is None:
        if dense not in curves:
            raise ValueError(f"dense must name an entry of curves ({', '.join(curves)}) when target is None; "
                             f"got {dense!r}")
        target = default_target([c[-1][2] for c in curves[dense]], higher_is_better)
    entries: dict[str, dict[str, Any]] = {}
    for name, per_seed in curves.items():
        hits = [_reach(c, target, higher_is_better) for c in per_seed]
        seconds = [None if h is None else h[1] for h in hits]
        ordered = [math.inf if s is None else s for s in seconds]
        median = statistics.median(ordered)
        finals = [c[-1][2] for c in per_seed]
        entries[name] = {
            "final_by_seed": finals,
            "final_mean": statistics.fmean(finals),
            "seconds_by_seed": seconds,
            "steps_by_seed": [None if h is None else int(h[0]) for h in hits],
            "reached": sum(s is not None for s in seconds),
            "olympic_mean_s": olympic_mean(seconds),
            "median_s": None if math.isinf(median) else median,
            "spread_s": [min(ordered) if min(ordered) < math.inf else None,
                         max(ordered) if max(ordered) < math.inf else None],
        }
    for name, e in entries.items():
        mine = [math.inf if s is None else s for s in e["seconds_by_seed"]]
        e["wins"] = {}
        for other, o in entries.items():
            if other != name:
                theirs = [math.inf if s is None else s for s in o["seconds_by_seed"]]
                e["wins"][other] = [seed for seed, a, b in zip(seeds, mine, theirs) if a < b]
    return {"target": target, "target_from": target_from, "higher_is_better": higher_is_better, "seeds": list(seeds), "entries": entries}
