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
      let the memory move residuals between buckets: on a mismatch, all residual buckets are set
      aside as they are (:attr:`stale`) and each new bucket gathers its parameters' residuals from
      them by name, so no residual mass is lost;
    * other layouts (parameter shapes) or a size mismatch: the residual is dropped with a warning and
      treated as zero.

    This is the one per-parameter residual store of the project: the same name -> (bucket, offset)
    index (:meth:`index`) serves that re-bucketing and COVAP's remapped buckets, which keep residuals
    where the recorded buckets put them (its send schedule is defined on those buckets) and reach
    them by name (:meth:`read`, :meth:`write`).

    Attributes:
        residuals: key -> 1-D float32 residual of that bucket.
        layouts: key -> layout of that bucket (as passed to :meth:`compensate`, or recorded by the
            caller, e.g. COVAP's start-up layout).
        stale: residual buckets set aside at a layout change, ``(residuals, layouts)`` as above,
            whose parameters the new buckets have not taken yet.

    Raises:
        ValueError: if ``beta`` or ``gamma`` is out of range.
    """

    def __init__(self, beta: Any = 1.0, gamma: float = 1.0):
        self.beta = beta if callable(beta) else check_float("beta", beta, 0.0, 1.0)
        self.gamma = check_float("gamma", gamma, 0.0, None, low_inclusive=False)
        self.residuals: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, Any] = {}
        self.stale: tuple[dict[int, torch.Tensor], dict[int, Any]] = ({}, {})

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
                self._set_aside()
            else:
                logger.warning(
                    "residual for key %s (%d elements) does not match the tensor (%d elements) or its layout: "
                    "dropped",
                    key, e.numel(), g.numel(),
                )
                del self.residuals[key]
            e = None
        if e is None and self.stale[0] and _is_named(layout):
            e = self._take_stale(layout, g.numel(), g.device)
        if layout is not None:
            self.layouts[key] = layout
        x = g.to(torch.float32, copy=True) if self.gamma == 1.0 else g.to(torch.float32) * self.gamma
        if e is not None:
            if e.device != x.device:  # e.g. residuals restored from a checkpoint on another device
                e = e.to(x.device)
            x.add_(e, alpha=self.beta(step) if callable(self.beta) else self.beta)
        return x

    def _set_aside(self) -> None:
        """Move every residual bucket (with its layout) to :attr:`stale`."""
        for k in list(self.residuals):
            self._add_stale(self.residuals.pop(k), self.layouts.pop(k))
        self.layouts.clear()

    def _add_stale(self, e: torch.Tensor, layout: Any) -> None:
        key = max(self.stale[0], default=-1) + 1
        self.stale[0][key], self.stale[1][key] = e, layout

    def _take_stale(self, layout: Any, numel: int, device: torch.device) -> torch.Tensor | None:
        """The residual of a new bucket ``layout`` gathered by name from :attr:`stale` (1-D float32,
        zero where a parameter has none); the stale buckets give those parameters up."""
        if sum(n for _, n in layout) != numel:
            return None
        stale_res, stale_lay = self.stale
        found = _read(stale_res, stale_lay, layout)
        parts = [torch.zeros(n, dtype=torch.float32, device=device) if e is None
                 else e.to(device=device, dtype=torch.float32, copy=True)
                 for e, (_, n) in zip(found, layout)]
        missing = [name for e, (name, _) in zip(found, layout) if e is None]
        if missing:
            logger.warning("no residual for parameters %s: treated as zero", ", ".join(missing))
        taken = {name for name, _ in layout}
        for k in list(stale_lay):
            rest = tuple(item for item in stale_lay[k] if item[0] not in taken)
            if len(rest) == len(stale_lay[k]):
                continue
            if rest:  # keep the parameters no new bucket has taken yet (a new tensor: snapshots hold the old)
                stale_res[k] = torch.cat(_read(stale_res, stale_lay, rest))
                stale_lay[k] = rest
            else:
                del stale_res[k], stale_lay[k]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=device)

    def index(self) -> dict[str, tuple[int, int, int]]:
        """Parameter name -> ``(key, offset, numel)`` of its residual in :attr:`residuals`, from the
        named items of :attr:`layouts`."""
        return _index(self.layouts)

    def read(self, layout: Any) -> list[torch.Tensor | None]:
        """Per parameter of the named ``layout``: a view of its float32 residual in the bucket
        :attr:`layouts` puts it in (found by name), or ``None`` when that bucket holds no residual."""
        return _read(self.residuals, self.layouts, layout)

    def write(self, layout: Any, x: torch.Tensor, copy_on_write: Any = None) -> None:
        """Store ``x`` (1-D float32, the parameters of the named ``layout`` in its order) as those
        parameters' residuals in the buckets :attr:`layouts` puts them in; a bucket without a
        residual starts at zero. ``copy_on_write(residuals, key)`` (e.g.
        :meth:`~gradsync.feedback.finite.FiniteGuard.copy_on_write`) returns the bucket tensor to
        write into, so a snapshot keeps the original; default: a copy at every call.

        Raises:
            KeyError: if a parameter of ``layout`` is in no recorded bucket.
        """
        where = self.index()
        copied: set[int] = set()
        cur = 0
        for name, n in layout:
            k, off, _ = where[name]
            if k not in self.residuals:
                self.residuals[k] = torch.zeros(sum(layout_numels(self.layouts[k])), dtype=torch.float32,
                                                device=x.device)
                copied.add(k)
            elif copy_on_write is not None:
                copy_on_write(self.residuals, k)
            elif k not in copied:
                self.residuals[k] = self.residuals[k].clone()
                copied.add(k)
            self.residuals[k][off:off + n] = x[cur:cur + n]
            cur += n

    def update(self, key: int, x: torch.Tensor, decompressed: torch.Tensor) -> None:
        """Store ``e[key] = x - decompressed`` (1-D, same size; kept as float32)."""
        self.residuals[key] = (x - decompressed).to(torch.float32)

    def store(self, key: int, residual: torch.Tensor) -> None:
        """Keep ``residual`` (1-D: what was not sent this step) as ``e[key]``, as float32."""
        self.residuals[key] = residual.to(torch.float32)

    def snapshot(self) -> tuple[dict, ...]:
        """The memory's contents for :meth:`restore` (references: every method replaces residual
        tensors instead of writing into them; :meth:`write` copies first)."""
        return dict(self.residuals), dict(self.layouts), dict(self.stale[0]), dict(self.stale[1])

    def restore(self, saved: tuple[dict, ...]) -> None:
        """Put back what :meth:`snapshot` returned (the same dicts, so aliases of :attr:`layouts` stay valid)."""
        for d, old in zip((self.residuals, self.layouts, *self.stale), saved):
            d.clear()
            d.update(old)

    def total(self) -> torch.Tensor:
        """Sum of all residual elements (float64 scalar on the CPU), for mass-conservation checks."""
        tensors = list(self.residuals.values()) + list(self.stale[0].values())
        total = torch.zeros((), dtype=torch.float64, device="cpu")
        for e in tensors:
            total += e.double().sum().cpu()
        return total

    def clear(self, key: int | None = None) -> None:
        """Forget the residual of ``key`` (or all residuals)."""
        if key is None:
            self.residuals.clear()
            self.layouts.clear()
            for d in self.stale:
                d.clear()
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
        tensors = list(self.residuals.values()) + list(self.stale[0].values())
        return float(sum(float(e.double().pow(2).sum()) for e in tensors) ** 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta": self.beta.state_dict() if callable(self.beta) else self.beta,
            "gamma": self.gamma,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "layouts": dict(self.layouts),
            "stale": {"residuals": {k: v.clone() for k, v in self.stale[0].items()},
                      "layouts": dict(self.stale[1])},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if callable(self.beta):
            self.beta.load_state_dict(state["beta"])
        else:
            self.beta = check_float("beta", state["beta"], 0.0, 1.0)
        self.gamma = check_float("gamma", state["gamma"], 0.0, None, low_inclusive=False)
        self.clear()  # in place: aliases of the dicts stay valid
        self.residuals.update({int(k): v.clone() for k, v in state["residuals"].items()})
        self.layouts.update({int(k): v for k, v in state.get("layouts", {}).items()})
        stale = state.get("stale", {"residuals": {}, "layouts": {}})
        self.stale[0].update({int(k): v.clone() for k, v in stale["residuals"].items()})
        self.stale[1].update({int(k): v for k, v in stale["layouts"].items()})
        # checkpoints before the one store: a "pool" of per-parameter residuals, one stale bucket each
        for name, v in state.get("pool", {}).items():
            self._add_stale(v.clone(), ((name, v.numel()),))

    def __setstate__(self, d: dict[str, Any]) -> None:
        pool = d.pop("_pool", {})  # pickled before the one store: per-parameter residuals
        self.__dict__.update(d)
        if "stale" not in d:
            self.stale = ({}, {})
        for name, v in pool.items():
            self._add_stale(v, ((name, v.numel()),))


def _is_named(layout: Any) -> bool:
    return (
        isinstance(layout, tuple)
        and len(layout) > 0
        and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) for item in layout)
    )


def layout_numels(layout: Any) -> list[int]:
    """Element counts of the parameters in a bucket layout (named or shape tuples)."""
    out = []
    for item in layout:
        if len(item) == 2 and isinstance(item[0], str):
            out.append(int(item[1]))
        else:
            size = 1
            for d in item:
                size *= int(d)
            out.append(size)
    return out


def _index(layouts: dict[int, Any]) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> ``(key, offset, numel)`` over the named items of ``layouts``."""
    out = {}
    for k, layout in layouts.items():
        off = 0
        for item, n in zip(layout, layout_numels(layout)):
            if _is_named((item,)):
                out[item[0]] = (k, off, n)
            off += n
    return out


def _read(residuals: dict[int, torch.Tensor], layouts: dict[int, Any], layout: Any) -> list[torch.Tensor | None]:
    """Per parameter of the named ``layout``: a view of its residual in ``residuals`` (placed by
    ``layouts``), or ``None`` where there is none of that size."""
    where = _index(layouts)
    out = []
    for name, n in layout:
        hit = where.get(name)
        e = residuals.get(hit[0]) if hit is not None and hit[2] == n else None
        out.append(None if e is None else e[hit[1]:hit[1] + n])
    return out


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
