"""One handle over the two ways gradsync synchronises gradients: DDP + a communication hook, and
wrappers that need more than a hook (DeAR). The training loop and ``gradsync bench`` use only this."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..algorithms import DEAR_ALGORITHMS, wrap_ddp, wrap_dear

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


class DataParallel:
    """Data-parallel training of ``model`` with algorithm ``name``.

    Use: ``out = dp(x); loss.backward(); dp.step()``; ``dp.flush()`` before evaluation;
    ``dp.state.stats()`` for bytes and timings; ``dp.optimizer`` for LR schedulers.

    Args:
        name: a registered hook algorithm, ``dear`` or ``dear-covap``.
        model: the module, already on its device.
        make_optimizer: ``make_optimizer(params) -> Optimizer``.
        bucket_cap_mb: DDP bucket size (MB) for hook algorithms.
        fusion_mb: DeAR tensor-fusion threshold (MB) or ``"auto"``.
        options: algorithm options passed to the registry builder (``ratio``, ``density``, ...).

    Raises:
        ValueError: for an unknown ``name`` or out-of-range options.
    """

    def __init__(self, name: str, model: nn.Module, make_optimizer: OptimizerFactory,
                 bucket_cap_mb: float = 25.0, fusion_mb: float | str = 25.0, device: torch.device | None = None,
                 **options: Any):
        self.name = name
        self.module = model
        self.wrapper: Any
        if name in DEAR_ALGORITHMS:
            self.optimizer = make_optimizer(model.parameters())
            self.wrapper = wrap_dear(model, self.optimizer, name, fusion_mb=fusion_mb,
                                     ratio=options.get("ratio", 3), seed=options.get("seed", 0))
            self.state = self.wrapper
        else:
            self.wrapper, self.state = wrap_ddp(
                model, name, bucket_cap_mb=bucket_cap_mb,
                device_ids=[device.index] if device is not None and device.type == "cuda" else None, **options)
            self.optimizer = make_optimizer(self.wrapper.parameters())

    @property
    def grad_filter(self) -> Any:
        """DeAR's ``grad_filter`` (COVAP's for ``dear-covap``), else ``None``."""
        return getattr(self.wrapper, "grad_filter", None) if self.name in DEAR_ALGORITHMS else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.wrapper(x)

    def step(self) -> None:
        """The optimizer step of this iteration (DeAR applies it lazily in the next forward)."""
        # Looked up at call time: LR schedulers wrap ``optimizer.step`` after construction.
        if self.name in DEAR_ALGORITHMS:
            self.wrapper.step()
        else:
            self.optimizer.step()

    def train_step(self, x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """One training iteration: clear gradients, forward, backward (gradients synchronised by the
        algorithm), optimizer step. Returns the loss (a 0-d tensor)."""
        self.zero_grad()
        loss = loss_fn(self(x), y)
        loss.backward()
        self.step()
        return loss

    def zero_grad(self) -> None:
        if self.name in DEAR_ALGORITHMS:
            self.wrapper.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def flush(self) -> None:
        """Apply any pending update (DeAR) so ``module`` holds the current parameters."""
        if self.name in DEAR_ALGORITHMS:
            self.wrapper.flush()

    def warm_up(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Run one synchronised backward pass per batch and discard the gradients, so DDP rebuilds
        its buckets and hooks pass their dense start-up iterations (``start_iter`` = 2) before
        measured training starts. DeAR needs no warm-up; the call does nothing for it."""
        if self.name in DEAR_ALGORITHMS:
            return
        for x, y in batches:
            loss_fn(self.wrapper(x), y).backward()
        self.zero_grad()

    def bucket_numels(self) -> list[int]:
        """Numel per DDP bucket (after the rebuild) or per DeAR fusion group."""
        if self.name in DEAR_ALGORITHMS:
            return list(self.wrapper.group_sizes())
        from ..profiler.ccr import ddp_bucket_numels

        return ddp_bucket_numels(self.wrapper)

    def config(self) -> dict[str, Any]:
        """Fields every rank must agree on (algorithm, its options)."""
        extra = self.grad_filter.config() if self.grad_filter is not None else {}
        return {**self.state.config(), **extra}

    def covap_controller(self) -> Any:
        """The object whose ``set_ratio(K)`` sets COVAP's ratio (``covap`` or ``dear-covap``), else None."""
        from ..algorithms.covap import CovapState

        if isinstance(self.state, CovapState):
            return self.state
        return self.grad_filter


