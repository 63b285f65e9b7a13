"""GraVAC's controller: pure arithmetic on all-reduced statistics, no tensors and no communication.

Source: Tyagi & Swany, "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL
Training", IEEE CLOUD 2023 (arXiv 2305.12201), §III-IV: EWMA-smoothed compression gain, the
compression-throughput table, the candidate search between ``theta_min`` and ``theta_max`` and its
plateau stop. :mod:`gradsync.algorithms.gravac` feeds it from a DDP communication hook; every rank
gives it the same (all-reduced) numbers, so every rank takes the same branch.
"""

from __future__ import annotations

from typing import Any

from gradsync.validation import check_choice, check_float, check_int

BRANCHES = ("min", "candidate", "dense")


class EWMA:
    """Exponentially weighted moving average with a mean-of-first-``window`` start.

    The first ``window`` samples are averaged arithmetically (no bias towards the initial value);
    after that ``value = (1 - alpha) * value + alpha * sample``.
    """

    def __init__(self, alpha: float, window: int):
        self.alpha = alpha
        self.window = window
        self.value: float | None = None
        self.count = 0

    def update(self, sample: float) -> float:
        self.count += 1
        if self.value is None:
            self.value = float(sample)
        elif self.count <= self.window:
            self.value += (float(sample) - self.value) / self.count
        else:
            self.value = (1.0 - self.alpha) * self.value + self.alpha * float(sample)
        return self.value

    def reset(self) -> None:
        self.value, self.count = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.value, self.count = s["value"], int(s["count"])


class GravacController:
    """GraVAC's decision logic, free of communication: feed it rank-averaged statistics once per step.

    Args:
        theta_min: least compression as a kept fraction, in (0, 1] (0.1 = 10x).
        theta_max: most compression as a kept fraction, in (0, theta_min] (1e-4 = 10,000x).
        step_factor: multiplier of the candidate kept fraction at each search boundary, in (0, 1)
            (0.5 doubles the compression factor: exponential search).
        window: warm-up steps at ``theta_min`` and EWMA start window (reference 25).
        alpha: EWMA smoothing factor, in (0, 1] (reference 0.05).
        epsilon: gain floor, in (0, inf) (reference 0.75).
        omega: plateau tolerance of the two best compression throughputs, relative, in [0, inf)
            (reference 0.05).
        search_interval: steps between search boundaries (>= 1; reference: one epoch).

    Raises:
        ValueError: on arguments outside the ranges above.
    """

    def __init__(
        self,
        theta_min: float = 0.1,
        theta_max: float = 1e-4,
        step_factor: float = 0.5,
        window: int = 25,
        alpha: float = 0.05,
        epsilon: float = 0.75,
        omega: float = 0.05,
        search_interval: int = 200,
    ):
        self.theta_min = check_float("theta_min", theta_min, 0.0, 1.0, low_inclusive=False)
        self.theta_max = check_float("theta_max", theta_max, 0.0, self.theta_min, low_inclusive=False)
        self.step_factor = check_float("step_factor", step_factor, 0.0, 1.0, False, False)
        self.window = check_int("window", window, 0, None)
        self.alpha = check_float("alpha", alpha, 0.0, 1.0, low_inclusive=False)
        self.epsilon = check_float("epsilon", epsilon, 0.0, None, low_inclusive=False)
        self.omega = check_float("omega", omega, 0.0, None)
        self.search_interval = check_int("search_interval", search_interval, 1, None)
        self.ng = EWMA(self.alpha, self.window)
        self.nmin = EWMA(self.alpha, self.window)
        self.ng_c = EWMA(self.alpha, self.window)
        self.nc = EWMA(self.alpha, self.window)
        self.theta_c = self.theta_min
        self.searching = True
        self.ct: dict[float, list[float]] = {}  # kept fraction -> [sum of tput*gain, count]
        self.branch = "min"  # branch for the next step
        self.gain_min: float | None = None
        self.gain_c: float | None = None
        self._used: dict[int, tuple[float, float]] = {}  # step -> (kept fraction, gain) sent

    # -- queries --------------------------------------------------------------------------------
    @property
    def candidate_active(self) -> bool:
        """Whether the candidate compressor differs from ``theta_min`` (then it is evaluated each step)."""
        return self.theta_c != self.theta_min

    def kept_fraction(self, branch: str | None = None) -> float:
        """Kept fraction of ``branch`` (default: the branch of the next step); 1.0 for dense."""
        b = self.branch if branch is None else branch
        return {"min": self.theta_min, "candidate": self.theta_c, "dense": 1.0}[b]

    def compression_throughput(self) -> dict[float, float]:
        """``CT``: kept fraction -> mean of samples/s x gain over the steps sent at it."""
        return {cf: s / n for cf, (s, n) in self.ct.items() if n}

    # -- update ---------------------------------------------------------------------------------
    def update(
        self,
        step: int,
        ng: float,
        nmin: float,
        nc: float | None = None,
        tput_prev: float | None = None,
        tput_cur: float | None = None,
    ) -> str:
        """Account step ``step`` and decide the branch of step ``step + 1``.

        Args:
            step: the step just finished (its branch was ``self.branch``).
            ng: rank-averaged ``sum_b ||g_b||`` of the step.
            nmin: rank-averaged ``sum_b ||C_theta_min(g_b + e_b)||``.
            nc: same for the candidate (``None`` if it was not evaluated).
            tput_prev: system throughput (samples/s, all ranks) of step ``step - 1``, if measured.
            tput_cur: system throughput of step ``step``, if measured.

        Returns:
            The branch for step ``step + 1``: ``"min"``, ``"candidate"`` or ``"dense"``.
        """
        ng_v = self.ng.update(ng)
        nmin_v = self.nmin.update(nmin)
        self.gain_min = nmin_v / ng_v if ng_v > 0 else 1.0
        if nc is not None:
            ngc_v = self.ng_c.update(ng)
            nc_v = self.nc.update(nc)
            self.gain_c = nc_v / ngc_v if ngc_v > 0 else 1.0
        gain_used = {"min": self.gain_min, "candidate": self.gain_c, "dense": 1.0}[self.branch]
        self._used[step] = (self.kept_fraction(), 1.0 if gain_used is None else gain_used)
        for s in list(self._used):
            if s < step - 1:
                del self._used[s]
        if tput_prev is not None and (step - 1) in self._used:
            self._record(*self._used[step - 1], tput_prev)
        if tput_cur is not None:
            self._record(*self._used[step], tput_cur)
        nxt = step + 1
        if nxt >= self.window and nxt % self.search_interval == 0:
            self._search_boundary()
        self.branch = self._decide(nxt)
        return self.branch

    def _record(self, cf: float, gain: float, tput: float) -> None:
        entry = self.ct.setdefault(cf, [0.0, 0])
        entry[0] += tput * gain
        entry[1] += 1

    def _set_candidate(self, theta: float) -> None:
        if theta != self.theta_c:
            self.theta_c = theta
            self.ng_c.reset()
            self.nc.reset()
            self.gain_c = None

    def _search_boundary(self) -> None:
        if self.searching:
            self._set_candidate(max(self.theta_c * self.step_factor, self.theta_max))
        ct = self.compression_throughput()
        if len(ct) >= 2:
            (cf1, v1), (cf2, v2) = sorted(ct.items(), key=lambda kv: kv[1], reverse=True)[:2]
            if v2 > 0 and abs(v1 - v2) / v2 < self.omega:
                self.searching = False
                self._set_candidate(min(cf1, cf2))

    def _decide(self, step: int) -> str:
        if step < self.window:
            return "min"
        if self.candidate_active and self.gain_c is not None and self.gain_c >= self.epsilon:
            return "candidate"
        if self.gain_min is not None and self.gain_min >= self.epsilon:
            return "min"
        return "dense"

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "ng": self.ng.state_dict(),
            "nmin": self.nmin.state_dict(),
            "ng_c": self.ng_c.state_dict(),
            "nc": self.nc.state_dict(),
            "theta_c": self.theta_c,
            "searching": self.searching,
            "ct": {cf: list(v) for cf, v in self.ct.items()},
            "branch": self.branch,
            "gain_min": self.gain_min,
            "gain_c": self.gain_c,
            "used": dict(self._used),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        for meter, name in ((self.ng, "ng"), (self.nmin, "nmin"), (self.ng_c, "ng_c"), (self.nc, "nc")):
            meter.load_state_dict(s[name])
        self.theta_c = float(s["theta_c"])
        self.searching = bool(s["searching"])
        self.ct = {float(cf): list(v) for cf, v in s["ct"].items()}
        self.branch = check_choice("branch", s["branch"], BRANCHES)
        self.gain_min, self.gain_c = s["gain_min"], s["gain_c"]
        self._used = {int(k): tuple(v) for k, v in s["used"].items()}
