"""Standard error feedback (residual memory) for any compressor.

Source: Seide et al., "1-Bit Stochastic Gradient Descent ..." (Interspeech 2014) and Karimireddy et al.,
"Error Feedback Fixes SignSGD ..." (ICML 2019, Algorithm 1); GRACE's ``ResidualMemory``
(``x = beta * e + gamma * g``, ``e = x - decompress(compress(x))``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gradsync.compressors.base import Compressor, Ctx, Payload
from gradsync.validation import check_float

logger = logging.getLogger(__name__)


class ResidualMemory:
    """Residual memory keyed by a stable id (the DDP bucket index).

    ``compensate(g, key, step=t)`` returns ``x = beta_t * e[key] + gamma * g``; after compressing ``x``,
    ``update(key, x, decompressed)`` stores ``e[key] = x - decompressed`` (or ``store(key, r)`` stores a
    residual the caller computed). With beta = gamma = 1 the gradient mass is conserved: sum of
    applied (decompressed) updates + residual = sum of gradients.

    Args:
        beta: weight of the stored residual, in [0, 1] (1 = standard EF), or a discount schedule
            ``beta(step) -> float`` with ``state_dict``/``load_state_dict`` (COVAP's
            :class:`~gradsync.feedback.discounted.CovapDiscount`).
        gamma: weight of the new gradient, in (0, inf) (1 = standard EF).

    Bucket layouts change: DDP rebuilds its buckets after the first iteration, and a resumed run's
    fresh DDP starts with its first-iteration buckets (parameters in registration order, against the
    gradient-ready order after the rebuild). Pass the bucket's ``layout`` (:func:`bucket_layout`):

    * *named* layouts (``((param_name, numel), ...)``, from :func:`bucket_layout` with parameter names)
      let the memory move residuals between buckets: on a mismatch, all residuals are split per
      parameter and re-assembled in the new buckets' order, so no residual mass is lost;
    * other layouts (parameter shapes) or a size mismatch: the residual is dropped with a warning and
      treated as zero.

    Raises:
        ValueError: if ``beta`` or ``gamma`` is out of range.
    """

    def __init__(self, beta: Any = 1.0, gamma: float = 1.0):
        self.beta = beta if callable(beta) else check_float("beta", beta, 0.0, 1.0)
        self.gamma = check_float("gamma", gamma, 0.0, None, low_inclusive=False)
        self.residuals: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, Any] = {}
        self._pool: dict[str, torch.Tensor] = {}  # per-parameter residuals awaiting re-assembly

    def compensate(self, g: torch.Tensor, key: int, layout: Any = None, step: int = 0) -> torch.Tensor:
        """Return the new tensor ``beta * e[key] + gamma * g`` (1-D float32 on ``g``'s device; ``g``
        untouched). Residuals are kept in float32 whatever ``g``'s dtype (fp16/bf16 buckets included),
        so what a low-precision gradient cannot hold is not lost; a residual on another device (a
        checkpoint restored on the CPU) is moved to ``g``'s device.

        Args:
            g: 1-D gradient (any floating dtype; the result is float32).
            key: stable id (bucket index).
            layout: optional picklable description of what ``g`` holds (e.g. a tuple of parameter
                shapes); a residual saved under a different layout is dropped.
            step: the step given to a ``beta`` schedule (ignored for a constant ``beta``).
        """
        e = self.residuals.get(key)
        changed = layout is not None and self.layouts.get(key, layout) != layout
        if e is not None and (e.numel() != g.numel() or changed):
            if _is_named(layout) and all(_is_named(self.layouts.get(k)) for k in self.residuals):
                self._to_pool()
            else:
                logger.warning(
                    "residual for key %s (%d elements) does not match the tensor (%d elements) or its layout: "
                    "dropped",
                    key, e.numel(), g.numel(),
                )
                del self.residuals[key]
            e = None
        if e is None and self._pool and _is_named(layout):
            e = self._from_pool(layout, g.numel(), g.device)
        if layout is not None:
            self.layouts[key] = layout
        x = g.to(torch.float32, copy=True) if self.gamma == 1.0 else g.to(torch.float32) * self.gamma
        if e is not None:
            if e.device != x.device:  # e.g. residuals restored from a checkpoint on another device
                e = e.to(x.device)
            x.add_(e, alpha=self.beta(step) if callable(self.beta) else self.beta)
        return x

    def _to_pool(self) -> None:
        for k, e in self.residuals.items():
            off = 0
            for name, n in self.layouts[k]:
                self._pool[name] = e[off : off + n].clone()
                off += n
        self.residuals.clear()
        self.layouts.clear()

    def _from_pool(self, layout: Any, numel: int, device: torch.device) -> torch.Tensor | None:
        if sum(n for _, n in layout) != numel:
            return None
        parts, missing = [], []
        for name, n in layout:
            t = self._pool.pop(name, None)
            if t is None or t.numel() != n:
                missing.append(name)
                t = torch.zeros(n, dtype=torch.float32, device=device)
            parts.append(t.to(device=device, dtype=torch.float32))
        if missing:
            logger.warning("no residual for parameters %s: treated as zero", ", ".join(missing))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=device)

    def update(self, key: int, x: torch.Tensor, decompressed: torch.Tensor) -> None:
        """Store ``e[key] = x - decompressed`` (1-D, same size; kept as float32)."""
        self.residuals[key] = (x - decompressed).to(torch.float32)

    def store(self, key: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` (1-D: what was not sent this step) as ``e[key]``, as float32."""
        self.residuals[key] = residual.to(torch.float32)

    def snapshot(self) -> tuple[dict, dict, dict]:
        """The memory's contents for :meth:`restore` (references: every method replaces residual
        tensors instead of writing into them)."""
        return dict(self.residuals), dict(self.layouts), dict(self._pool)

    def restore(self, saved: tuple[dict, dict, dict]) -> None:
        """Put back what :meth:`snapshot` returned."""
        self.residuals, self.layouts, self._pool = (dict(d) for d in saved)

    def total(self) -> torch.Tensor:
        """Sum of all residual elements (float64 scalar on the CPU), for mass-conservation checks."""
        tensors = list(self.residuals.values()) + list(self._pool.values())
        total = torch.zeros((), dtype=torch.float64, device="cpu")
        for e in tensors:
            total += e.double().sum().cpu()
        return total

    def clear(self, key: int | None = None) -> None:
        """Forget the residual of ``key`` (or all residuals)."""
        if key is None:
            self.residuals.clear()
            self.layouts.clear()
            self._pool.clear()
        else:
            self.residuals.pop(key, None)
            self.layouts.pop(key, None)

    def compress(
        self,
        compressor: Compressor,
        g: torch.Tensor,
        key: int,
        step: int = 0,
        rank: int = 0,
        layout: Any = None,
        **kwargs: Any,
    ) -> tuple[Payload, Ctx, torch.Tensor]:
        """Error-compensated compression of ``g`` in one call.

        Returns:
            ``(payload, ctx, decompressed)`` where ``decompressed`` (1-D float32) is this rank's
            contribution as the others will see it; the residual is updated.
        """
        x = self.compensate(g, key, layout)
        payload, ctx = compressor.compress(x, step=step, key=key, rank=rank, **kwargs)
        dec = compressor.decompress(payload, ctx)
        self.update(key, x, dec)
        return payload, ctx, dec

    def residual_norm(self) -> float:
        """L2 norm of all residuals together (float)."""
        tensors = list(self.residuals.values()) + list(self._pool.values())
        return float(sum(float(e.double().pow(2).sum()) for e in tensors) ** 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta.state_dict() if callable(self.beta) else self.beta,
            "gamma": self.gamma,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "layouts": dict(self.layouts),
            "pool": {k: v.clone() for k, v in self._pool.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if callable(self.beta):
            self.beta.load_state_dict(state["beta"])
        else:
            self.beta = check_float("beta", state["beta"], 0.0, 1.0)
        self.gamma = check_float("gamma", state["gamma"], 0.0, None, low_inclusive=False)
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.layouts = {int(k): v for k, v in state.get("layouts", {}).items()}
        self._pool = {k: v.clone() for k, v in state.get("pool", {}).items()}


def _is_named(layout: Any) -> bool:
    return (
        isinstance(layout, tuple)
        and len(layout) > 0
        and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in layout)
    )


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``{id(parameter): name}`` for :func:`bucket_layout` (valid in this process only)."""
    return {id(p): name for name, p in model.named_parameters()}


def bucket_layout(bucket: Any, names: dict[int, str] | None = None) -> tuple:
    """Layout of a DDP ``GradBucket`` for :meth:`ResidualMemory.compensate`.

    Returns ``((name, numel), ...)`` in bucket order when ``names`` (from :func:`parameter_names`)
    knows every parameter of the bucket, else the tuple of the parameters' shapes.
    """
    params = bucket.parameters()
    if names and all(id(p) in names for p in params):
        return tuple((names[id(p)], p.numel()) for p in params)
    return tuple(tuple(p.shape) for p in params)
