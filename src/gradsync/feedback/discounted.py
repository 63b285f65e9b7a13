"""COVAP's discounted error feedback (Meng, Sun & Li 2023, arXiv 2311.04499, "improved EF").

Standard error feedback (Stich et al. 2018; Karimireddy et al. 2019) keeps the unsent part of the
gradient, ``e <- (e + g) - C(e + g)``. COVAP multiplies the residual by a discount ``lambda_t <= 1``
before the new gradient is added, ``x = lambda_t * e + g``, so residuals that waited up to K-1 steps
are damped early in training; ``lambda_t = min(1, lam0 + 0.1 * t / D)`` ramps to 1 (standard EF).
Constants of the reference code: ``lam0 = 0.5, D = 50`` when K <= 8, ``lam0 = 0.2, D = 100`` otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from ..validation import check_float, check_int


def default_ramp(ratio: int) -> tuple[float, int]:
    """``(lam0, D)`` of the reference code for compression ratio ``ratio`` (K)."""
    return (0.5, 50) if ratio <= 8 else (0.2, 100)


class DiscountedErrorFeedback:
    """Per-bucket residual memory with COVAP's discount ramp.

    Args:
        lam0: initial discount in [0, 1].
        ramp_steps: D > 0; the discount grows by 0.1 every D steps until it reaches 1.

    Residuals are float tensors ``[numel]`` keyed by bucket index, in the units of the local
    (not yet averaged) gradient.
    """

    def __init__(self, lam0: float = 0.5, ramp_steps: int = 50):
        self.lam0 = check_float("lam0", lam0, 0.0, 1.0)
        self.ramp_steps = check_int("ramp_steps", ramp_steps, 1)
        self.residuals: dict[int, torch.Tensor] = {}

    def discount(self, step: int) -> float:
        """``lambda_t = min(1, lam0 + 0.1 * step / D)`` (COVAP §"improved EF"); ``step`` counts
        compressed iterations from 0."""
        return min(1.0, self.lam0 + 0.1 * step / self.ramp_steps)

    def add(self, key: int, grad: torch.Tensor, step: int) -> torch.Tensor:
        """Return ``x = lambda_step * e_key + grad`` (a new tensor; ``grad`` is not modified)."""
        e = self.residuals.get(key)
        if e is None or e.numel() != grad.numel():
            return grad.clone()
        lam = self.discount(step)
        return torch.add(grad, e, alpha=lam) if lam != 1.0 else grad + e

    def store(self, key: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` (what was not sent this step) for bucket ``key``."""
        self.residuals[key] = residual

    def total(self) -> torch.Tensor:
        """Sum of all residual elements (float64 scalar), for mass-conservation checks."""
        if not self.residuals:
            return torch.zeros((), dtype=torch.float64)
        return sum(e.double().sum() for e in self.residuals.values())

    def state_dict(self) -> dict[str, Any]:
        return {"lam0": self.lam0, "ramp_steps": self.ramp_steps,
                "residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lam0 = float(state["lam0"])
        self.ramp_steps = int(state["ramp_steps"])
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
