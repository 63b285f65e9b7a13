"""The one protocol every gradsync algorithm presents to train, bench, profile and integrations.

A :class:`Synchroniser` owns the data-parallel model and the optimizer step. Two implementations
cover the hook algorithms and DeAR: :class:`HookSynchroniser` (``DistributedDataParallel`` + a
communication hook, the optimizer stepped as usual) and
:class:`~gradsync.algorithms.dear.synchroniser.DeARSynchroniser` (DeAR's decoupled reduce-scatter /
all-gather pipeline, which applies the optimizer itself); the periodic algorithms bring their own. Callers never branch on the algorithm's name.
What is specific to an algorithm sits behind one protocol with defaults,
:class:`~gradsync.algorithms.protocol.Algorithm` (``sync.algorithm``: the hook's state, or DeAR's
``grad_filter``), which the synchronisers call without probing for attributes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
from torch import nn

from ..compressors.cast import CAST_DTYPES
from .protocol import Algorithm
from .state_io import load_state, module_device

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
        scaler: the ``torch.amp.GradScaler`` the training step will use (fp16 AMP), else ``None``:
            DeAR-pipeline algorithms unscale with it before their ``grad_filter`` (dear-covap's
            residuals stay in unscaled units) and refuse another one at ``step``.
    """

    model: nn.Module
    make_optimizer: OptimizerFactory
    process_group: Any = None
    bucket_cap_mb: float = 25.0
    device: torch.device | None = None
    seed: int = 0
    batch_size: int = 1
    steps_per_epoch: int = 0
    scaler: Optional[torch.amp.GradScaler] = None


@dataclass
class Precision:
    """Mixed precision and clipping of a training step, as a DDP user writes them.

    Attributes:
        autocast_dtype: ``torch.bfloat16`` or ``torch.float16`` to run the forward pass and loss
            under ``torch.autocast`` on the model's device type; ``None`` for full precision.
        scaler: a ``torch.amp.GradScaler`` (fp16): the loss is scaled before backward, gradients are
            unscaled before clipping, a step with inf/nan gradients is skipped on every rank and the
            scale is updated after the step; ``None`` without loss scaling.
        clip_grad_norm: clip the averaged gradients to this global 2-norm (as
            ``torch.nn.utils.clip_grad_norm_`` after DDP's reduction); ``None`` for no clipping.
    """

    autocast_dtype: Optional[torch.dtype] = None
    scaler: Optional[torch.amp.GradScaler] = None
    clip_grad_norm: Optional[float] = None

    @classmethod
    def from_names(cls, amp: str, clip_grad_norm: Optional[float], device: torch.device) -> "Precision":
        """``amp`` is ``"off"``, ``"bf16"`` or ``"fp16"`` (fp16 adds a GradScaler on ``device``'s type).

        Raises:
            ValueError: if ``amp`` is another string or ``clip_grad_norm`` is not positive.
        """
        dtypes = {"off": None, **CAST_DTYPES}
        if amp not in dtypes:
            raise ValueError(f"amp must be one of {', '.join(dtypes)}, got {amp!r}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0, got {clip_grad_norm}")
        scaler = torch.amp.GradScaler(device.type) if amp == "fp16" else None
        return cls(dtypes[amp], scaler, clip_grad_norm)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """``torch.autocast`` on ``device``'s type with :attr:`autocast_dtype` (a no-op context without)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)


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
    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> None: ...
    def clip_grad_norm_(self, max_norm: float, scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor: ...
    def zero_grad(self) -> None: ...
    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                   precision: Optional[Precision] = None) -> torch.Tensor: ...
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

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                   precision: Optional[Precision] = None) -> torch.Tensor:
        """One iteration: clear gradients, forward (under autocast with ``precision``), backward of
        the (scaled) loss (gradients synchronised by the algorithm), optional clipping of the
        averaged gradients, optimizer step (skipped on every rank when a GradScaler found inf/nan).
        Returns the unscaled loss (0-d tensor)."""
        precision = precision or Precision()
        self.zero_grad()
        device = x.device
        with precision.autocast(device):
            loss = loss_fn(self(x), y)
        scaler = precision.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if precision.clip_grad_norm is not None:
            self.clip_grad_norm_(precision.clip_grad_norm, scaler)
        self.step(scaler)
        return loss

    def clip_grad_norm_(self, max_norm: float, scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """``scaler.unscale_(optimizer)`` (with ``scaler``), then ``torch.nn.utils.clip_grad_norm_``
        over the module's parameters: the gradients the optimizer steps with (DDP's averaged ones, or a
        periodic algorithm's local ones). Returns the total 2-norm before clipping (0-d tensor)."""
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    @property
    def needs_ccr(self) -> bool:
        """True when the algorithm chooses a setting from the measured CCR (COVAP's ``ratio=auto``)."""
        return self.algorithm.needs_ccr

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Give the all-reduced communication-to-computation ratio (dense all-reduce seconds /
        backward seconds, identical on every rank); returns what the algorithm chose from it."""
        return self.algorithm.calibrate(ccr)

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """Report the wall-clock ``seconds`` and ``samples`` of the step that just finished (every
        rank, every step); returns per-step figures to log (e.g. GraVAC's compression factor)."""
        return self.algorithm.observe_step(seconds, samples)

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype the algorithm puts on the wire when it casts (COVAP's ``cast``), for timing the
        CCR in that dtype; ``None``: the parameters' dtype."""
        return self.algorithm.wire_dtype


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
        self.state = self.algorithm = state
        self.wrapper.register_comm_hook(state, hook)
        self.optimizer = ctx.make_optimizer(self.wrapper.parameters())

    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        """``optimizer.step()``, or with ``scaler`` ``scaler.step(optimizer); scaler.update()``."""
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

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
        """Elements per DDP bucket, in reduction order (after the rebuild): the layout the hook
        recorded when it keeps one (:meth:`Algorithm.bucket_numels`, COVAP), else DDP's rebuilt
        bucket sizes."""
        from ..comm.buckets import ddp_bucket_numels

        recorded = self.state.bucket_numels()
        return recorded if recorded is not None else ddp_bucket_numels(self.wrapper)

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def config(self) -> dict[str, Any]:
        return self.state.config()

    def state_dict(self) -> dict[str, Any]:
        """The hook state's ``state_dict()`` (weights-only loadable, as every algorithm's)."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (read on the CPU) into the hook state, every tensor moved to
        the module's device first (:func:`~gradsync.algorithms.state_io.load_state`)."""
        load_state(self.state, state, module_device(self.module))

    def close(self) -> None:
        """The state's :meth:`~gradsync.algorithms.protocol.Algorithm.close` (COVAP removes its
        forward hook); DDP's reducer goes with the wrapper."""
        self.state.close()
