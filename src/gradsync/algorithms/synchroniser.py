"""The one protocol every gradsync algorithm presents to train, bench, profile and integrations.

A :class:`Synchroniser` owns the data-parallel model and the optimizer step. Two implementations
cover every algorithm: :class:`HookSynchroniser` (``DistributedDataParallel`` + a communication hook,
the optimizer stepped as usual) and :class:`DeARSynchroniser` (DeAR's decoupled reduce-scatter /
all-gather pipeline, which applies the optimizer itself). Callers never branch on the algorithm's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass
class BuildContext:
    """What a builder needs besides the algorithm's options.

    Attributes:
        model: the module to train, already on its device.
        make_optimizer: ``make_optimizer(params) -> Optimizer``.
        process_group: the data-parallel group (``None`` = default group).
        bucket_cap_mb: DDP bucket size (MB) for hook algorithms.
        device: the device of ``model`` (``cuda`` devices become DDP's ``device_ids``).
        seed: seed shared by every rank (random-k, sketches, PowerSGD, the fusion tuner).
        batch_size: samples per step on this rank.
        steps_per_epoch: optimizer steps per epoch (GraVAC's search interval, DGC's warm-up).
    """

    model: nn.Module
    make_optimizer: OptimizerFactory
    process_group: Any = None
    bucket_cap_mb: float = 25.0
    device: torch.device | None = None
    seed: int = 0
    batch_size: int = 1
    steps_per_epoch: int = 0


@runtime_checkable
class Synchroniser(Protocol):
    """Data-parallel training of ``module`` with one gradient-synchronisation algorithm.

    Use: ``loss = sync.train_step(x, y, loss_fn)``, or ``out = sync(x); loss.backward(); sync.step()``;
    ``sync.flush()`` before evaluation or checkpointing.
    """

    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor: ...
    def flush(self) -> None: ...
    def warm_up(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> None: ...
    def bucket_numels(self) -> list[int]: ...

    @property
    def needs_ccr(self) -> bool: ...
    def calibrate(self, ccr: float) -> dict[str, Any]: ...
    def observe_step(self, seconds: float, samples: int) -> dict[str, float]: ...
    def stats(self) -> dict[str, Any]: ...
    def config(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class _Common:
    """Behaviour shared by both synchronisers."""

    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(*args, **kwargs)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> torch.Tensor:
        """One iteration: clear gradients, forward, backward (gradients synchronised by the
        algorithm), optimizer step. Returns the loss (0-d tensor)."""
        self.zero_grad()
        loss = loss_fn(self(x), y)
        loss.backward()
        self.step()
        return loss

    @property
    def needs_ccr(self) -> bool:
        """True when the algorithm chooses a setting from the measured CCR (COVAP's ``ratio=auto``)."""
        return self._controller().needs_ccr

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Give the all-reduced communication-to-computation ratio (dense all-reduce seconds /
        backward seconds, identical on every rank); returns what the algorithm chose from it."""
        return self._controller().calibrate(ccr)

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """Report the wall-clock ``seconds`` and ``samples`` of the step that just finished (every
        rank, every step); returns per-step figures to log (e.g. GraVAC's compression factor)."""
        return self._controller().observe_step(seconds, samples)


class HookSynchroniser(_Common):
    """``DistributedDataParallel`` with a gradsync communication hook ``(state, hook)`` registered.

    Args:
        name: the algorithm's registered name.
        ctx: the :class:`BuildContext`.
        state, hook: the pair passed to ``ddp.register_comm_hook``.
        single_bucket: build DDP with one bucket (torch's PowerSGD hook on Gloo needs it).
    """

    def __init__(self, name: str, ctx: BuildContext, state: Any, hook: Callable, single_bucket: bool = False):
        from torch.nn.parallel import DistributedDataParallel

        self.name = name
        self.module = ctx.model
        device_ids = [ctx.device.index] if ctx.device is not None and ctx.device.type == "cuda" else None
        self.wrapper = DistributedDataParallel(ctx.model, process_group=ctx.process_group, device_ids=device_ids,
                                               bucket_cap_mb=1e4 if single_bucket else ctx.bucket_cap_mb)
        self.state = state
        self.wrapper.register_comm_hook(state, hook)
        self.optimizer = ctx.make_optimizer(self.wrapper.parameters())

    def _controller(self) -> Any:
        return self.state

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def flush(self) -> None:
        """Nothing is pending after a DDP step."""

    def warm_up(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> None:
        """One synchronised backward per batch, gradients discarded, so DDP rebuilds its buckets and
        the hook passes its dense start-up iterations before measured training starts."""
        for x, y in batches:
            loss_fn(self.wrapper(x), y).backward()
        self.zero_grad()

    def bucket_numels(self) -> list[int]:
        """Elements per DDP bucket, in reduction order (after the rebuild)."""
        from ..profiler.ccr import ddp_bucket_numels

        return ddp_bucket_numels(self.wrapper)

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def config(self) -> dict[str, Any]:
        return self.state.config()

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

    def close(self) -> None:
        """Nothing to release: DDP's reducer goes with the wrapper."""


class DeARSynchroniser(_Common):
    """A :class:`~gradsync.algorithms.dear.DeAR` wrapper, optionally with a ``grad_filter`` that also
    answers the controller calls (``needs_ccr``, ``calibrate``, ``observe_step``, ``config``)."""

    def __init__(self, name: str, ctx: BuildContext, fusion_mb: float | str, grad_filter: Any = None):
        from .dear import DeAR

        self.name = name
        self.module = ctx.model
        self.optimizer = ctx.make_optimizer(ctx.model.parameters())
        self.wrapper = DeAR(ctx.model, self.optimizer, process_group=ctx.process_group, fusion_mb=fusion_mb,
                            grad_filter=grad_filter, seed=ctx.seed)
        self.grad_filter = grad_filter
        if grad_filter is not None:
            grad_filter.bind(self.wrapper)

    def _controller(self) -> Any:
        return self.grad_filter if self.grad_filter is not None else _NoController()

    def step(self) -> None:
        self.wrapper.step()

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
        out = self.wrapper.stats()
        if self.grad_filter is not None:
            out.update(self.grad_filter.stats())
        return out

    def config(self) -> dict[str, Any]:
        extra = self.grad_filter.config() if self.grad_filter is not None else {}
        return {**self.wrapper.config(), "algorithm": self.name, **extra}

    def state_dict(self) -> dict[str, Any]:
        """DeAR's state: model, optimizer, iteration, fusion threshold and the filter's residuals."""
        return self.wrapper.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wrapper.load_state_dict(state)

    def close(self) -> None:
        """Remove DeAR's hooks and destroy its two process groups (collective)."""
        import torch.distributed as dist

        self.wrapper.remove_hooks()
        for g in (self.wrapper.rs_group, self.wrapper.ag_group):
            dist.destroy_process_group(g)


class _NoController:
    needs_ccr = False

    def calibrate(self, ccr: float) -> dict[str, Any]:
        return {}

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        return {}
