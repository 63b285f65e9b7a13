"""Bayesian optimisation of the tensor-fusion threshold (MB), identical on every rank.

Source: DeAR, Zhang, Shi, Chu, Wang, Li, Liu, "DeAR: Accelerating Distributed Deep Learning with
Fine-Grained All-Reduce Pipelining", arXiv 2302.12445, Sec. 4 (tensor fusion tuned with Bayesian
optimisation); restated from the reference code (``dopt_rsag_bo``, ``tuner.py``).

Protocol (what the reference code does, with the differences noted):

* The threshold is searched in [``low_mb``, ``high_mb``] (default 1–256 MB) with the
  ``bayesian-optimization`` package (Gaussian process, expected improvement with ``xi=0.1``, no random
  initial points: the first trial is the initial threshold). Difference: the search variable is
  ``log2(MB)``, not MB, so that small thresholds (which suit small models) are reachable; the bounds
  are the same.
* Each trial runs ``window`` iterations (``window`` intervals between consecutive calls of
  :meth:`FusionTuner.observe`); the first interval is discarded as warm-up (it contains the regrouping
  itself) and the mean of the others is the trial's iteration time. The ``warmup`` calls before the
  first trial are ignored entirely.
* Only rank 0 runs the optimiser. At the end of each trial it proposes the next threshold and
  broadcasts ``[next_mb, measured_seconds]`` (``dist.broadcast`` of a float64 tensor of shape ``(2,)`` on
  the group's collective device: CUDA for NCCL, CPU for Gloo)
  so every rank regroups to the same value at the same iteration and keeps the same history.
* After ``trials`` trials the threshold with the lowest measured iteration time is kept
  (:attr:`FusionTuner.best_mb`) and tuning stops.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm.collectives import collective_device
from ..extras import require
from ..validation import check_float, check_int

LOW_MB = 1.0
HIGH_MB = 256.0


@dataclass(frozen=True)
class TrialRecord:
    """One finished trial: the threshold (MB, 2**20 bytes) and rank 0's mean iteration time (s)."""

    fusion_mb: float
    seconds: float


class FusionTuner:
    """Tunes a tensor-fusion threshold online; call :meth:`observe` once per iteration on every rank.

    Args:
        initial_mb: threshold of the first trial, MB (2**20 bytes); must lie in the bounds.
        low_mb, high_mb: search bounds, MB, ``0 < low_mb < high_mb`` (default 1 and 256).
        trials: number of trials including the initial one, in [1, 1000] (default 10, as DeAR).
        window: iterations per trial, in [2, 10000]; the first interval of each trial is discarded.
        warmup: calls ignored before the first trial, in [0, 10**6] (default: ``window``).
        xi: exploration parameter of expected improvement, >= 0 (default 0.1, as DeAR).
        seed: random seed of the optimiser on rank 0.
        process_group: group used for the broadcast (``None`` = default group). The broadcast runs
            synchronously inside :meth:`observe` at the end of each trial, so the caller must call it
            where no other collective of that group is in flight.

    Raises:
        ValueError: if an argument is out of range (the message names it and the allowed range).
        ImportError: if the ``bayesian-optimization`` package is not installed.

    Attributes:
        current_mb: threshold now in use, MB.
        history: finished trials, in order (identical on every rank).
        best_mb: the kept threshold once :attr:`done`, else ``None``.
        done: whether tuning has finished.
    """

    def __init__(
        self,
        initial_mb: float = 25.0,
        low_mb: float = LOW_MB,
        high_mb: float = HIGH_MB,
        trials: int = 10,
        window: int = 5,
        warmup: int | None = None,
        xi: float = 0.1,
        seed: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ):
        self.low_mb = check_float("low_mb", low_mb, 0.0, None, low_inclusive=False)
        self.high_mb = check_float("high_mb", high_mb, self.low_mb, None, low_inclusive=False)
        self.current_mb = check_float("initial_mb", initial_mb, self.low_mb, self.high_mb)
        self.trials = check_int("trials", trials, 1, 1000)
        self.window = check_int("window", window, 2, 10_000)
        self.warmup = self.window if warmup is None else check_int("warmup", warmup, 0, 10**6)
        self.xi = check_float("xi", xi, 0.0, None)
        self.seed = check_int("seed", seed, 0, 2**32 - 1)
        self.process_group = process_group
        require("bayes_opt", "fusion tuning (fusion_mb='auto')")  # on every rank now, not mid-training
        self.history: list[TrialRecord] = []
        self.best_mb: float | None = None
        self.done = False
        self._warmup_left = self.warmup
        self._stamps: list[float] = []
        self._optimizer: Any = None  # bayes_opt.BayesianOptimization, rank 0 only

    # -- rank / collective helpers -------------------------------------------------------------
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _is_proposer(self) -> bool:
        return not self._distributed() or dist.get_rank(self.process_group) == 0

    def _bo(self):
        if self._optimizer is None:
            from bayes_opt import BayesianOptimization, acquisition

            self._optimizer = BayesianOptimization(
                f=None,
                pbounds={"log2_mb": (math.log2(self.low_mb), math.log2(self.high_mb))},
                acquisition_function=acquisition.ExpectedImprovement(xi=self.xi),
                random_state=self.seed,
                verbose=0,
                allow_duplicate_points=True,
            )
            for rec in self.history:
                self._register(rec)
        return self._optimizer

    def _register(self, rec: TrialRecord) -> None:
        self._optimizer.register(params={"log2_mb": math.log2(rec.fusion_mb)}, target=-rec.seconds)

    # -- the per-iteration call ----------------------------------------------------------------
    def observe(self, now: float | None = None) -> float | None:
        """Record one iteration boundary; return a new threshold (MB) to regroup to, else ``None``.

        Must be called once per iteration on every rank of ``process_group`` at the same point of
        the iteration (for example in ``step()`` after the reduce-scatters were waited for). At the
        end of a trial it runs one ``dist.broadcast`` on ``process_group`` (a collective). Returns
        ``None`` while a trial is running, after tuning has finished, or when the next threshold
        equals :attr:`current_mb`.

        Args:
            now: timestamp in seconds (default ``time.perf_counter()``).
        """
        if self.done:
            return None
        now = time.perf_counter() if now is None else float(now)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            if self._warmup_left > 0:
                return None
            self._stamps = [now]
            return None
        if not self._stamps:
            self._stamps = [now]
            return None
        self._stamps.append(now)
        if len(self._stamps) < self.window + 1:
            return None
        intervals = [b - a for a, b in zip(self._stamps, self._stamps[1:])]
        measured = sum(intervals[1:]) / len(intervals[1:])
        device = collective_device(self.process_group) if self._distributed() else torch.device("cpu")
        values = self._propose(measured) if self._is_proposer() else (0.0, 0.0)
        payload = torch.tensor(values, dtype=torch.float64, device=device)
        if self._distributed():
            dist.broadcast(payload, group=self.process_group, group_src=0)
        next_mb, seconds = payload.tolist()
        rec = TrialRecord(self.current_mb, seconds)
        self.history.append(rec)
        if len(self.history) >= self.trials:
            self.done = True
            next_mb = min(self.history, key=lambda r: r.seconds).fusion_mb
            self.best_mb = next_mb
        self._stamps = [now]
        changed = next_mb != self.current_mb
        self.current_mb = next_mb
        return next_mb if changed else None

    def _propose(self, measured: float) -> tuple[float, float]:
        """Rank 0: register the finished trial and return ``(next_mb, measured)``."""
        bo = self._bo()
        self._register(TrialRecord(self.current_mb, measured))
        if len(self.history) + 1 >= self.trials:
            return self.current_mb, measured  # last trial: the caller picks the best
        x = float(bo.suggest()["log2_mb"])
        mb = round(min(max(2.0**x, self.low_mb), self.high_mb), 3)
        return mb, measured

    # -- reporting and checkpoints ---------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """``{"done", "current_mb", "best_mb", "trials": [{"fusion_mb", "seconds"}, ...]}``."""
        return {
            "done": self.done,
            "current_mb": self.current_mb,
            "best_mb": self.best_mb,
            "trials": [{"fusion_mb": r.fusion_mb, "seconds": r.seconds} for r in self.history],
        }

    def state_dict(self) -> dict[str, Any]:
        """Picklable state; a restored tuner redoes the warm-up, then continues the trials."""
        return {
            "current_mb": self.current_mb,
            "history": [(r.fusion_mb, r.seconds) for r in self.history],
            "best_mb": self.best_mb,
            "done": self.done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_mb = float(state["current_mb"])
        self.history = [TrialRecord(float(mb), float(s)) for mb, s in state["history"]]
        self.best_mb = None if state["best_mb"] is None else float(state["best_mb"])
        self.done = bool(state["done"])
        self._optimizer = None  # rebuilt from the history on rank 0 when next needed
        self._warmup_left = self.warmup
        self._stamps = []
