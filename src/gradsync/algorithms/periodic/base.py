"""What ``local-sgd`` and ``diloco`` share: local optimizer steps, a synchronisation every ``period``
steps decided from the step counter alone, the wrapper :func:`gradsync.wrap` returns and the
:class:`~gradsync.algorithms.synchroniser.Synchroniser` ``gradsync train`` and ``bench`` drive.

One iteration (world size ``P``, ``H = period``):

* forward and backward run on the bare module: no collective, no gradient reduction;
* ``step()`` applies the job's optimizer (the *inner* optimizer) to this rank's own gradients, then
  advances the step counter ``t``; when ``t % H == 0`` (:meth:`PeriodicAlgorithm.due`) the subclass
  synchronises (:meth:`PeriodicAlgorithm.sync`): one all-reduce of the trainable parameters
  (``local-sgd``) or of their outer gradient (``diloco``), and of the module's floating-point buffers
  (BatchNorm running statistics are averaged); ``diloco`` with ``fragments > 1`` syncs one fragment
  at ``fragments`` staggered steps per period instead. ``t`` counts every ``step()`` call, also one a
  GradScaler skipped on this rank, so every rank syncs at the same steps.

Bytes are counted as every algorithm's (:func:`~gradsync.algorithms.base.counter_stats`): a sync adds a
ring all-reduce of the flat tensor, ``2 (P-1)/P x n`` bytes on the wire; the steps between add
nothing. The dense reference (``dense_wire_bytes``) is what DDP would all-reduce at every step: the
trainable parameters' gradient bytes, so ``compression_ratio`` is about ``H x`` gradient bytes over
parameter-plus-buffer bytes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..base import count_bytes, count_dense, counter_stats, init_counters
from ..protocol import Algorithm
from ..state_io import load_state, module_device
from ..synchroniser import BuildContext, LossFn, _Common


def _group_rank0(process_group: Any) -> int:
    """Global rank of rank 0 of ``process_group`` (the broadcast source)."""
    return 0 if process_group is None else dist.get_global_rank(process_group, 0)


def broadcast_module(module: nn.Module, process_group: Any = None) -> None:
    """Give every rank rank 0's parameters and buffers (in place; collective): one broadcast per
    dtype of a flat copy, as DDP does when it is built."""
    tensors = [t.data for t in (*module.parameters(), *module.buffers())]
    src = _group_rank0(process_group)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=process_group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class PeriodicAlgorithm(Algorithm):
    """Base of the periodic algorithms: the step counter, the sync decision, the byte counters and
    the module's averaged buffers.

    Args:
        module: the model, already on its device; its trainable parameters (``requires_grad`` when
            built) and floating-point buffers are what a sync touches; integer buffers (BatchNorm's
            ``num_batches_tracked``) are left as they are (every rank counts the same forwards).
        period: ``H >= 1``, inner steps between syncs.
        process_group: the data-parallel group (``None`` = default group).

    Attributes:
        step: inner steps completed (identical on every rank).
        syncs: synchronisations done.

    Raises:
        ValueError: if ``period`` is not an integer >= 1.
    """

    def __init__(self, module: nn.Module, period: int, process_group: Any = None):
        if isinstance(period, bool) or int(period) != period or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        self.module = module
        self.period = int(period)
        self.process_group = process_group
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.step = 0
        self.syncs = 0
        init_counters(self)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in self.params)

    def check_fragments(self, owner: str, fragments: Any) -> int:
        """``fragments`` as an int, checked against this model and period (shared by ``diloco`` and
        ``torchft-diloco``).

        Raises:
            ValueError: ``"<owner>.fragments must be an integer in [1, min(period, trainable parameter
                tensors) = M], got ..."`` when it is not.
        """
        most = min(self.period, len(self.params))
        if isinstance(fragments, bool) or int(fragments) != fragments or not 1 <= fragments <= most:
            raise ValueError(f"{owner}.fragments must be an integer in [1, min(period, trainable parameter tensors) "
                             f"= {most}], got {fragments!r}")
        return int(fragments)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def numel(self) -> int:
        """Elements all-reduced per sync (trainable parameters + floating buffers)."""
        return sum(t.numel() for t in (*self.params, *self.buffers))

    def after_inner_step(self) -> bool:
        """Advance the step counter after the inner optimizer step (every rank, every step, also a
        step the GradScaler skipped) and synchronise when it is a multiple of ``period``. Returns
        whether this step synchronised."""
        self.step += 1
        self.iteration = self.step
        count_dense(self, self._grad_bytes, self.world_size)
        if not self.due(self.step):
            return False
        self.sync()
        self.syncs += 1
        return True

    def due(self, step: int) -> bool:
        """Whether the ranks synchronise after inner step ``step`` (counted from 1): ``step % period ==
        0`` (a pure function of the step counter, the same on every rank)."""
        return step % self.period == 0

    def sync(self) -> None:
        """Synchronise the ranks (collective, every rank at the same step); subclasses define it."""
        raise NotImplementedError

    def count_allreduce(self, flat: torch.Tensor) -> None:
        """Count one all-reduce of ``flat`` (any shape and dtype) on this rank."""
        count_bytes(self, flat.numel() * flat.element_size(), "allreduce", self.world_size)

    def stats(self) -> dict[str, Any]:
        """:func:`~gradsync.algorithms.base.counter_stats` (``iteration`` = inner steps) plus ``syncs``
        and ``period``."""
        return {**counter_stats(self), "syncs": self.syncs, "period": self.period}

    def config(self) -> dict[str, Any]:
        return {"period": self.period, "synced_numel": self.numel()}

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "syncs"}`` (ints); subclasses add their own tensors."""
        return {"step": self.step, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = self.iteration = int(state["step"])
        self.syncs = int(state["syncs"])


class PeriodicWrapper:
    """What :func:`gradsync.wrap` returns for ``local-sgd`` and ``diloco``: the bare module (forward
    with ``wrapper(x)``), the job's optimizer stepped by :meth:`step`, the algorithm in
    :attr:`algorithm`. Use it as DeAR's wrapper: ``wrapper.zero_grad(); loss_fn(wrapper(x),
    y).backward(); wrapper.step()``; never ``optimizer.step()`` alone (the step would not be counted,
    and the ranks would sync at different steps).

    Args:
        module: the model (parameters and buffers broadcast from rank 0 by the algorithm's builder).
        optimizer: the inner optimizer over ``module``'s parameters.
        algorithm: a :class:`PeriodicAlgorithm` over ``module``.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, algorithm: PeriodicAlgorithm):
        self.module = module
        self.optimizer = optimizer
        self.algorithm = algorithm

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> bool:
        """The inner optimizer step on this rank's own gradients (with ``scaler``:
        ``scaler.step(optimizer); scaler.update()``, which skips a step with inf/nan gradients on
        this rank only), then :meth:`PeriodicAlgorithm.after_inner_step` (collective at every
        ``period``-th call). Returns whether the ranks synchronised."""
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()
        return self.algorithm.after_inner_step()

    def flush(self) -> None:
        """Nothing to do: ``module`` holds this rank's current parameters (between syncs they differ
        across ranks; no collective is issued here; an overlapped ``diloco`` sync in flight is applied at
        its own step, not here)."""

    def stats(self) -> dict[str, Any]:
        return self.algorithm.stats()

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer", "algorithm"}``: this rank's module and inner optimizer state dicts
        and the algorithm's (weights-only loadable; between syncs each rank's model is its own)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "algorithm": self.algorithm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` of the same rank (model, inner optimizer, then the algorithm's
        state with its tensors moved to the module's device)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_state(self.algorithm, state["algorithm"], module_device(self.module))

    def close(self) -> None:
        self.algorithm.close()


class PeriodicSynchroniser(_Common):
    """The :class:`~gradsync.algorithms.synchroniser.Synchroniser` of a periodic algorithm (what
    ``gradsync train`` and ``bench`` drive): a :class:`PeriodicWrapper` around ``ctx.model`` and
    ``ctx.make_optimizer(ctx.model.parameters())``.

    Args:
        name: the registered name.
        ctx: the build context (``ctx.scaler`` is not needed: the scaler is given to :meth:`step`).
        algorithm: the :class:`PeriodicAlgorithm` built on ``ctx.model``.

    Clipping (the base's ``clip_grad_norm_``) acts on this rank's own gradients: local steps have no
    averaged gradient.
    """

    def __init__(self, name: str, ctx: BuildContext, algorithm: PeriodicAlgorithm):
        self.name = name
        self.module = ctx.model
        self.optimizer = ctx.make_optimizer(ctx.model.parameters())
        self.algorithm = algorithm
        self.wrapper = PeriodicWrapper(ctx.model, self.optimizer, algorithm)

    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> None:
        """:meth:`PeriodicWrapper.step`."""
        self.wrapper.step(scaler)

    def zero_grad(self) -> None:
        self.wrapper.zero_grad(set_to_none=True)

    def flush(self) -> None:
        """Nothing pending (see :meth:`PeriodicWrapper.flush`)."""

    def warm_up(self, batches: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn) -> None:
        """No buckets to rebuild: nothing to warm up."""

    def bucket_numels(self) -> list[int]:
        """One "bucket": the flat tensor a sync all-reduces (elements)."""
        return [self.algorithm.numel()]

    def stats(self) -> dict[str, Any]:
        return self.algorithm.stats()

    def config(self) -> dict[str, Any]:
        return {"algorithm": self.name, **self.algorithm.config()}

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's ``state_dict()`` (weights-only loadable); the model and the inner optimizer
        are the caller's to save, as with a hook algorithm."""
        return self.algorithm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (read on the CPU), every tensor moved to the module's device
        (:func:`~gradsync.algorithms.state_io.load_state`); load the model first."""
        load_state(self.algorithm, state, module_device(self.module))

    def close(self) -> None:
        self.algorithm.close()
