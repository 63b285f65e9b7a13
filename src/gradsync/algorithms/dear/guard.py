"""DeAR's guard against using ``p.grad`` or ``optimizer.step()`` while DeAR owns the gradients.

From a parameter's backward hook until DeAR applies the averaged gradient in the next forward,
``p.grad`` is a storage-less :class:`DeARGradPlaceholder`: any computation on it raises
``RuntimeError`` naming the DeAR method to use (zeroing it is allowed and does nothing). The wrapped
optimizer's ``step`` raises while guarded and its ``zero_grad`` drops the placeholders
(:class:`OptimizerGuard`, a base of :class:`~gradsync.algorithms.dear.DeAR`).
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
    """Wraps ``optimizer.step`` / ``optimizer.zero_grad`` of a DeAR wrapper.

    Uses the host's ``optimizer`` and ``_modules`` (``[(module, [trainable params])]``); sets
    ``_opt_step`` / ``_opt_zero_grad`` (the unwrapped methods DeAR calls) and ``_guard_on``.
    """

    optimizer: torch.optim.Optimizer
    _modules: list[tuple[Any, list[torch.Tensor]]]

    def _guard_optimizer(self) -> None:
        """Wrap ``optimizer.step`` (raises while guarded) and ``optimizer.zero_grad`` (drops placeholders).

        Both are bound methods on the instance, so an LR scheduler built later can wrap them again
        (it needs ``step.__func__``)."""
        opt = self.optimizer
        self._opt_step = opt.step  # what DeAR calls per group (class method or a scheduler's wrapper)
        self._opt_zero_grad = opt.zero_grad
        self._saved_opt_attrs = {k: opt.__dict__[k] for k in ("step", "zero_grad") if k in opt.__dict__}
        self._guard_on = True
        dear = self

        def step(_opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if dear._guard_on:
                raise RuntimeError(
                    "optimizer.step() on an optimizer wrapped by DeAR: call DeAR.step() (with a "
                    "GradScaler: DeAR.step(scaler), not scaler.step(optimizer)); DeAR applies the "
                    "averaged update itself in the next forward"
                )
            return dear._opt_step(*args, **kwargs)

        def zero_grad(_opt: torch.optim.Optimizer, set_to_none: bool = True) -> None:
            dear._drop_placeholders()
            dear._opt_zero_grad(set_to_none=set_to_none)

        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]
        opt.zero_grad = types.MethodType(zero_grad, opt)  # type: ignore[method-assign]

    def _drop_placeholders(self) -> None:
        for _, ps in self._modules:
            for p in ps:
                if is_placeholder(p.grad):
                    p.grad = None


    def _unguard_optimizer(self) -> None:
        """Undo :meth:`_guard_optimizer` (unless a later wrapper, e.g. a scheduler's, replaced it)."""
        self._guard_on = False
        opt = self.optimizer
        prefix = OptimizerGuard._guard_optimizer.__qualname__ + "."
        for name in ("step", "zero_grad"):
            cur = opt.__dict__.get(name)
            if isinstance(cur, types.MethodType) and cur.__self__ is opt and cur.__func__.__qualname__.startswith(
                    prefix):
                if name in self._saved_opt_attrs:
                    setattr(opt, name, self._saved_opt_attrs[name])
                else:
                    delattr(opt, name)
