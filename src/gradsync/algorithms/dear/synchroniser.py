"""DeAR behind the :class:`~gradsync.algorithms.synchroniser.Synchroniser` protocol that train, bench
and profile drive, and :func:`wrapper_algorithm`, the spec of a DeAR-pipeline algorithm."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...options import Options
from ..protocol import Algorithm
from ..spec import AlgorithmSpec
from ..state_io import from_safe, map_tensors, module_device
from ..synchroniser import BuildContext, LossFn, Synchroniser, _Common
from .pipeline import DeAR


class DeARSynchroniser(_Common):
    """A :class:`~gradsync.algorithms.dear.DeAR` wrapper, optionally with a ``grad_filter`` that is the
    algorithm (:class:`~gradsync.algorithms.protocol.Algorithm`: ``needs_ccr``, ``calibrate``,
    ``observe_step``, ``stats``, ``config``, ``close``); without one the protocol's defaults."""

    def __init__(self, name: str, ctx: BuildContext, fusion_mb: float | str, grad_filter: Any = None):
        self.name = name
        self.module = ctx.model
        self.optimizer = ctx.make_optimizer(ctx.model.parameters())
        self.wrapper = DeAR(ctx.model, self.optimizer, process_group=ctx.process_group, fusion_mb=fusion_mb,
                            grad_filter=grad_filter, seed=ctx.seed, grad_scaler=ctx.scaler)
        self.grad_filter = grad_filter
        self.algorithm = grad_filter if grad_filter is not None else Algorithm()
        if grad_filter is not None:
            grad_filter.bind(self.wrapper)

    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        """:meth:`DeAR.step <gradsync.algorithms.dear.DeAR.step>` (with ``scaler``: unscale, skip on
        inf/nan on every rank, update the scale)."""
        self.wrapper.step(scaler)

    def clip_grad_norm_(self, max_norm: float, scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """:meth:`DeAR.clip_grad_norm_ <gradsync.algorithms.dear.DeAR.clip_grad_norm_>`: the exact
        global norm over the reduced shards (unscaled first with ``scaler``)."""
        if scaler is not None:
            self.wrapper.unscale_(scaler)
        return self.wrapper.clip_grad_norm_(max_norm)

    def zero_grad(self) -> None:
        self.wrapper.zero_grad(set_to_none=True)

    def flush(self) -> None:
        """Apply the pending update so ``module`` holds the current parameters."""
        self.wrapper.flush()

    def warm_up(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> None:
        """DeAR has no bucket rebuild: nothing to warm up."""

    def bucket_numels(self) -> list[int]:
        """Elements per DeAR fusion group."""
        return list(self.wrapper.group_sizes())

    def stats(self) -> dict[str, Any]:
        return {**self.wrapper.stats(), **self.algorithm.stats()}

    def config(self) -> dict[str, Any]:
        return {**self.wrapper.config(), "algorithm": self.name, **self.algorithm.config()}

    def state_dict(self) -> dict[str, Any]:
        """DeAR's own state (``{"dear": ...}``: iteration, fusion threshold, tuner, the filter's
        residuals), flushed first. The model and the optimizer are the caller's to save, as with a
        hook algorithm (a checkpoint holds them once); ``self.wrapper.state_dict()`` has all three."""
        return {"dear": self.wrapper.state_dict()["dear"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """DeAR's ``load_state_dict`` of a :meth:`state_dict`, the model and optimizer already loaded
        by the caller; a state that holds them too (checkpoints written before they were left out)
        loads them as well, through torch's loaders, which place them. The filter's state is moved
        to the module's device first, as a hook's state is
        (:func:`~gradsync.algorithms.state_io.load_state`)."""
        device = module_device(self.module)
        dear = state.get("dear")
        if device is not None and isinstance(dear, dict) and dear.get("grad_filter") is not None:
            moved = map_tensors(from_safe(dear["grad_filter"]), lambda t: t.to(device))
            state = {**state, "dear": {**dear, "grad_filter": moved}}
        self.wrapper.load_state_dict(state)

    def close(self) -> None:
        """Remove DeAR's hooks and destroy its two process groups (collective)."""
        self.wrapper.remove_hooks()
        self.wrapper.comm.destroy()
        self.algorithm.close()


def wrapper_algorithm(name: str, summary: str, options: type[Options],
                      make_filter: Callable[[Any, BuildContext], Any] | None = None) -> AlgorithmSpec:
    """Spec of a DeAR-pipeline algorithm: ``options.fusion_mb`` is DeAR's fusion threshold and
    ``make_filter(options, ctx)`` an optional ``grad_filter``."""

    def build(opts: Any, ctx: BuildContext) -> Synchroniser:
        grad_filter = make_filter(opts, ctx) if make_filter is not None else None
        return DeARSynchroniser(name, ctx, opts.fusion_mb, grad_filter)

    return AlgorithmSpec(name, summary, options, build)
