"""DeAR's guard against using ``p.grad`` or ``optimizer.step()`` while DeAR owns the gradients.

From a parameter's backward hook until DeAR applies the averaged gradient in the next forward,
``p.grad`` is a storage-less :class:`DeARGradPlaceholder`: any computation on it raises
``RuntimeError`` naming the DeAR method to use (zeroing it is allowed and does nothing). The wrapped
optimizer's ``step`` raises while guarded and its ``zero_grad`` drops the placeholders
(:class:`OptimizerGuard`, held by :class:`~gradsync.algorithms.dear.DeAR`).
"""

from __future__ import annotations

import types
from typing import Any

import torch

_MISUSE = (
    "DeAR holds this gradient in its fusion buffer (p.grad is a placeholder until DeAR applies the "
    "averaged update in the next forward). Use DeAR.clip_grad_norm_() instead of "
    "torch.nn.utils.clip_grad_norm_/clip_grad_value_, DeAR.step(scaler) instead of "
    "GradScaler.unscale_/step(optimizer) or optimizer.step(), DeAR.zero_grad() to clear gradients, "
    "and DeAR.no_sync() to accumulate gradients over several backward passes"
)


class DeARGradPlaceholder(torch.Tensor):
    """Storage-less stand-in for ``p.grad`` while DeAR owns the gradient: any computation on it raises.

    Zeroing it (``zero_``/``_foreach_zero_``, what ``zero_grad(set_to_none=False)`` does) is allowed
    and does nothing: the local gradient it stands for was already consumed by DeAR.
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> DeARGradPlaceholder:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name.startswith("zero_") and args and isinstance(args[0], DeARGradPlaceholder):
            return args[0]
        if name.startswith("_foreach_zero_") and args:
            real = [t for t in args[0] if not isinstance(t, DeARGradPlaceholder)]
            if real:
                torch._foreach_zero_(real)
            return None
        if name.startswith(("detach_", "requires_grad_")):
            return args[0]
        raise RuntimeError(f"{_MISUSE} (attempted {func} on p.grad)")

    def __repr__(self) -> str:  # printing must not raise
        return f"DeARGradPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype})"


def is_placeholder(t: Any) -> bool:
    return isinstance(t, DeARGradPlaceholder)


class OptimizerGuard:
    """The user's optimizer as DeAR drives it: ``optimizer.step`` raises while guarded, and
    ``optimizer.zero_grad`` drops DeAR's placeholders first; DeAR steps it on one group's parameters
    at a time (:meth:`step_groups`).

    Args:
        optimizer: the user's ``torch.optim.Optimizer``.
        params: every parameter DeAR synchronises (whose ``p.grad`` may be a placeholder).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self._params = params
        self._guard_on = False
        self._opt_step: Any = None  # the methods DeAR calls (class methods or a scheduler's wrappers)
        self._opt_zero_grad: Any = None
        self._saved_opt_attrs: dict[str, Any] = {}

    def install(self) -> None:
        """Wrap ``optimizer.step`` (raises while guarded) and ``optimizer.zero_grad`` (drops placeholders).

        Both are bound methods on the instance, so an LR scheduler built later can wrap them again
        (it needs ``step.__func__``)."""
        opt = self.optimizer
        self._opt_step = opt.step
        self._opt_zero_grad = opt.zero_grad
        self._saved_opt_attrs = {k: opt.__dict__[k] for k in ("step", "zero_grad") if k in opt.__dict__}
        self._guard_on = True
        guard = self

        def step(_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if guard._guard_on:
                raise RuntimeError(
                    "optimizer.step() on an optimizer wrapped by DeAR: call DeAR.step() (with a "
                    "GradScaler: DeAR.step(scaler), not scaler.step(optimizer)); DeAR applies the "
                    "averaged update itself in the next forward"
                )
            return guard._opt_step(*args, **kwargs)

        def zero_grad(_opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            guard.zero_grad(set_to_none)

        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        opt.zero_grad = types.MethodType(zero_grad, opt)  # type: ignore[method-assign]

    def step_groups(self, param_groups: list[dict[str, Any]]) -> None:
        """Run the optimizer's own ``step()`` with ``optimizer.param_groups`` replaced by
        ``param_groups`` for the call (then restored)."""
        saved = self.optimizer.param_groups
        self.optimizer.param_groups = param_groups
        try:
            self._opt_step()
        finally:
            self.optimizer.param_groups = saved

    def mark_stepped(self) -> None:
        """Tell an LR scheduler that this iteration's optimizer step happened (DeAR applies it later)."""
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the placeholders, then the optimizer's own ``zero_grad(set_to_none)``."""
        self.drop_placeholders()
        self._opt_zero_grad(set_to_none=set_to_none)

    def drop_placeholders(self) -> None:
        """Set every placeholder ``p.grad`` to ``None``."""
        for p in self._params:
            if is_placeholder(p.grad):
                p.grad = None

    def remove(self) -> None:
        """Undo :meth:`install` (unless a later wrapper, e.g. a scheduler's, replaced it)."""
        self._guard_on = False
        opt = self.optimizer
        prefix = OptimizerGuard.install.__qualname__ + "."
        for name in ("step", "zero_grad"):
            cur = opt.__dict__.get(name)
            if isinstance(cur, types.MethodType) and cur.__self__ is opt and cur.__func__.__qualname__.startswith(
                    prefix):
                if name in self._saved_opt_attrs:
                    setattr(opt, name, self._saved_opt_attrs[name])
                else:
                    delattr(opt, name)
