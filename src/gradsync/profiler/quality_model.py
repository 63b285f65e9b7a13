"""From a setting's compression quality on the job to its extra steps to quality.

:class:`gradsync.profiler.probe.QualityProbe` measures, on the job's own gradients at start-up over
:data:`~gradsync.profiler.probe.QUALITY_STEPS` steps:

* each lossy setting's relative error ``e = sqrt(sum ||c - d||^2 / sum ||d||^2)`` of its error-fed
  aggregate ``c`` against dense all-reduce's average ``d``;
* the gradient noise ``n = sqrt(mean_i sum ||g_i - d||^2 / sum ||d||^2)``: how far one rank's own
  gradient ``g_i`` lies from the average, on the same steps and elements.

With ``P`` ranks drawing independent batches, ``E||g_i - d||^2 = (P - 1) / P * s^2`` and the average's
own sampling noise is ``E||d - G||^2 = s^2 / P`` (``s^2``: one rank's gradient variance), so
``n / sqrt(P - 1)`` is the average's relative sampling noise and

    ``r = e * sqrt(P - 1) / n``   (:func:`error_to_noise`)

is the compression error in units of the noise the dense aggregate already carries. Compression that
adds error ``e`` acts like a smaller batch, ``B / (1 + r^2)``, and the steps to a target grow with the
noise scale over the batch (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
arXiv 1812.06162, §2.2, eq. 2.11), so the model is

* ``r > limit``: the setting is predicted to miss the target (infinite extra steps);
* otherwise ``extra = slope * r^2`` (the fraction of extra steps).

A raw error limit does not transfer between models: the character transformer's gradients (noise
0.11) missed the target at PowerSGD r=16 with ``e`` = 0.12, while the ViT's (noise 0.34-0.51) reached
it at r=8 with ``e`` = 0.08 and at r=4 with 0.20 (docs/results.md, "The quality model in units of
gradient noise"); in units of the noise they are 1.03 against 0.15 and 0.39.

:func:`fit` chooses ``limit`` as the midpoint between a reached and a missed setting's ``r`` that
misclassifies the fewest rows (the stricter of equals), ``slope`` by least squares over the reached
rows. :func:`cross_validate` refits leaving one workload (model and world size) out and scores the
held-out rows. The constants of :data:`FITTED` come from ``benchmarks/fit_quality_model.py`` over
``benchmarks/data/accuracy_costs.json`` (steps to quality, every grid) and
``benchmarks/data/probe_errors.json`` (errors and noise measured as auto measures them); that script
prints them with the cross-validated error quoted in :data:`FITTED`'s comment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..algorithms.meter import error_to_noise

__all__ = ["QualityModel", "QualityPoint", "error_to_noise", "fit", "cross_validate", "FITTED"]


@dataclass(frozen=True)
class QualityPoint:
    """One measured setting: its start-up relative ``error`` and the job's gradient ``noise`` (both
    dimensionless, :class:`~gradsync.profiler.probe.QualityProbe`), the ``world_size``, its ``extra``
    steps fraction to the target (``steps / dense_steps - 1``; ``math.inf`` when it missed the
    target), the ``workload`` (model and world size) it was measured on, its ``optimizer`` family
    and ``entry``."""

    error: float
    noise: float
    world_size: int
    extra: float
    workload: str
    optimizer: str = "sgd"
    entry: str = ""

    @property
    def ratio(self) -> float:
        """:func:`error_to_noise` of the point."""
        return error_to_noise(self.error, self.noise, self.world_size)


@dataclass(frozen=True)
class QualityModel:
    """``extra_steps = slope * r^2`` for ``r = error_to_noise(...)`` up to ``limit``, infinite above
    (module docstring); ``cv`` says how well it predicts held-out workloads (words)."""

    limit: float
    slope: float
    cv: str = ""

    def extra_steps(self, error: float, noise: float, world_size: int) -> float:
        """Predicted fraction of extra steps to dense's quality target (``math.inf``: predicted to miss)
        of a setting with relative ``error`` on a job with gradient ``noise`` on ``world_size`` ranks.

        Raises:
            ValueError: as :func:`error_to_noise`.
        """
        r = error_to_noise(error, noise, world_size)
        return math.inf if r > self.limit else self.slope * r * r


def _threshold(points: Sequence[QualityPoint]) -> float:
    reached = [p.ratio for p in points if math.isfinite(p.extra)]
    missed = [p.ratio for p in points if not math.isfinite(p.extra)]
    if not missed:
        return max(reached, default=0.0) * 1.25 or 1.0
    if not reached:
        return min(missed) / 2
    candidates = sorted(set(reached) | set(missed))
    cuts = [(a + b) / 2 for a, b in zip(candidates, candidates[1:])] + [candidates[0] / 2, candidates[-1] * 1.25]

    def wrong(t: float) -> int:
        return sum(r > t for r in reached) + sum(r <= t for r in missed)

    best = min(wrong(t) for t in cuts)
    return min(t for t in cuts if wrong(t) == best)  # the stricter cut among the equally good


def fit(points: Iterable[QualityPoint]) -> QualityModel:
    """Fit :class:`QualityModel` to measured points (see the module docstring).

    Raises:
        ValueError: with no point.
    """
    pts = list(points)
    if not pts:
        raise ValueError("points must hold at least one measured setting")
    reached = [p for p in pts if math.isfinite(p.extra) and p.ratio > 0]
    den = sum(p.ratio ** 4 for p in reached)
    slope = max(0.0, sum(p.extra * p.ratio ** 2 for p in reached) / den) if den > 0 else 0.0
    return QualityModel(_threshold(pts), slope)


def cross_validate(points: Iterable[QualityPoint]) -> dict[str, float]:
    """Leave-one-workload-out: for each workload, :func:`fit` on the others and predict its points.

    Returns:
        ``{"points", "misclassified" (reach/miss predicted wrong), "mae_extra" (mean absolute error
        of the extra-steps fraction over held-out points that reached and were predicted to),
        "workloads"}``.
    """
    pts = list(points)
    workloads = sorted({p.workload for p in pts})
    wrong, abs_err = 0, []
    for w in workloads:
        model = fit([p for p in pts if p.workload != w])
        for p in (p for p in pts if p.workload == w):
            pred = model.extra_steps(p.error, p.noise, p.world_size)
            if math.isfinite(pred) != math.isfinite(p.extra):
                wrong += 1
            elif math.isfinite(pred):
                abs_err.append(abs(pred - p.extra))
    return {"points": len(pts), "workloads": len(workloads), "misclassified": wrong,
            "mae_extra": sum(abs_err) / len(abs_err) if abs_err else 0.0}


#: Fitted by ``python benchmarks/fit_quality_model.py`` on 26 points of 4 workloads (the ResNet-8 at 2 and 3 ranks,
#: the ResNet-8 at width 32, all with SGD; the character transformer with AdamW), errors and noise measured as the
#: probe measures them (``benchmarks/probe_quality.py --seeds 0,1``, 2026-11-27: the errors bitwise those of the
#: raw-error model before, which needed a separate Adam-family limit, 0.059, and misclassified 5 of 26 held out).
#: One limit serves both optimizers: with the transformer held out, the SGD rows alone put it at 0.997 and call all
#: three of its misses. The ViT and the GRU, auto's out-of-sample workloads, never entered the fit.
FITTED = QualityModel(
    limit=0.997, slope=0.048,
    cv=("leave-one-workload-out: 2 of 26 points misclassified (PowerSGD r=8 overlapped at 3 ranks, which reached "
        "the target on 3 of 5 seeds at the same ratio, 0.83, as torch's r=8 on 5 of 5; the width-32 ResNet-8's r=8, "
        "0.98, above the 0.77 the other workloads give, which reached); mean absolute error of the extra-steps "
        "fraction 0.035"))
