"""COVAP's discount schedule for error feedback (Meng, Sun & Li 2023, arXiv 2311.04499, "improved EF").

Standard error feedback (Stich et al. 2018; Karimireddy et al. 2019) keeps the unsent part of the
gradient, ``e <- (e + g) - C(e + g)``. COVAP multiplies the residual by a discount ``lambda_t <= 1``
before the new gradient is added, ``x = lambda_t * e + g``, so residuals that waited up to K-1 steps
are damped early in training; ``lambda_t = min(1, lam0 + 0.1 * t / D)`` ramps to 1 (standard EF).
Constants of the reference code: ``lam0 = 0.5, D = 50`` when K <= 8, ``lam0 = 0.2, D = 100`` otherwise.

The schedule is the ``beta`` of :class:`~gradsync.feedback.residual.ResidualMemory`, the one residual
memory every algorithm uses.
"""

from __future__ import annotations

from typing import Any

from ..validation import check_float, check_int


def default_ramp(ratio: int) -> tuple[float, int]:
    """``(lam0, D)`` of the reference code for compression ratio ``ratio`` (K)."""
    return (0.5, 50) if ratio <= 8 else (0.2, 100)


class CovapDiscount:
    """``lambda_t = min(1, lam0 + 0.1 * t / D)``, ``t`` counting compressed iterations from 0.

    Args:
        lam0: initial discount in [0, 1].
        ramp_steps: D >= 1; the discount grows by 0.1 every D steps until it reaches 1.

    Raises:
        ValueError: for arguments outside those ranges.
    """

    def __init__(self, lam0: float = 0.5, ramp_steps: int = 50):
        self.lam0 = check_float("lam0", lam0, 0.0, 1.0)
        self.ramp_steps = check_int("ramp_steps", ramp_steps, 1)

    def __call__(self, step: int) -> float:
        return min(1.0, self.lam0 + 0.1 * step / self.ramp_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"lam0": self.lam0, "ramp_steps": self.ramp_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam0 = check_float("lam0", state["lam0"], 0.0, 1.0)
        self.ramp_steps = check_int("ramp_steps", state["ramp_steps"], 1)
