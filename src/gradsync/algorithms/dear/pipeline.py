"""DeAR's pipeline: :class:`DeAR` holds the public API, its :class:`~.communicator.Communicator`, its
tuner and its collaborators (:class:`~.parts.Parts`: :mod:`.backward` reduce-scatter stage, :mod:`.forward`
all-gather stage, :mod:`.amp` loss scaling and clipping, :mod:`.buffers` module buffers, :mod:`.guard`
optimizer guard, :mod:`.timing` wait timers, sharing one :mod:`.state`), and cuts the fusion groups
(:mod:`.groups`). Argument checks: :mod:`.arguments`. Source and semantics: :mod:`gradsync.algorithms.dear`."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...tuning.fusion import FusionTuner
from ...validation import check_float
from ..base import counter_stats
from ..protocol import Algorithm
from .amp import check_clip, check_scaler, clip_shards
from .arguments import check_arguments, optimizer_group_of, tuner_for
from .backward import GradFilter
from .buffers import broadcast_into, flatten
from .communicator import Communicator
from .groups import MAX_FUSION_MB, build_groups, trainable_modules
from .parts import build_parts
from .state import Counters, counter_property


class DeAR:
    """Data-parallel training with DeAR's decoupled reduce-scatter / all-gather pipeline.

    Use it in place of ``DistributedDataParallel`` + ``optimizer.step()``::

        dear = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for x, y in loader:
            dear.zero_grad()
            loss_fn(model(x), y).backward()   # or dear(x)
            dear.clip_grad_norm_(1.0)          # optional, instead of torch.nn.utils.clip_grad_norm_
            dear.step()                        # not optimizer.step()
            scheduler.step()                   # optional, on the user's optimizer
        dear.flush()                           # apply the last update (also before evaluation)

    Mixed precision with a ``torch.amp.GradScaler`` (pass it at construction so the gradients are
    unscaled before any ``grad_filter`` sees them; required with a ``grad_filter``)::

        dear = DeAR(model, opt, grad_scaler=scaler)
        scaler.scale(loss).backward()
        dear.clip_grad_norm_(1.0)              # unscales first, like scaler.unscale_(opt) + clip
        dear.step(scaler)                      # = scaler.step(opt) + scaler.update()

    After :meth:`flush` the parameters equal those of DDP + the same optimizer (within float
    tolerance). Building the wrapper is collective: every process of the default group must call it
    (``dist.new_group`` is called twice), in the same order as other ``new_group`` calls.

    Args:
        model: the module to train (parameters on one device; CPU with Gloo, or CUDA with NCCL;
            float32, float16 or bfloat16 parameters: gradients are communicated in the parameters'
            dtype, like DDP).
        optimizer: a ``torch.optim.Optimizer`` over (a subset of) ``model``'s parameters whose update
            of a parameter depends only on that parameter's gradient and state (every ``torch.optim``
            optimizer except ``LBFGS``). Its ``step`` and ``zero_grad`` are wrapped: ``step()`` raises
            ``RuntimeError`` (use :meth:`step`) until :meth:`remove_hooks`.
        process_group: the data-parallel group (``None`` = default group). Two new groups with the
            same ranks are created for reduce-scatter and all-gather.
        fusion_mb: tensor-fusion threshold in MB (2**20 bytes), in (0, 1e6] (default 25.0, as DeAR;
            a tiny value puts each module in its own group, "DeAR w/o TF"), or ``"auto"`` to tune it
            online with :class:`~gradsync.tuning.fusion.FusionTuner` (starts at 25 MB, searches 1-256 MB).
        broadcast_buffers: give every training forward rank 0's module buffers (default ``True``, as
            DDP): broadcast once per iteration in ``step()``, never at a forward (see "Module
            buffers" above and :meth:`sync_buffers`).
        max_allgathers: all-gathers kept in flight during the next forward, >= 1, or ``"auto"``
            (default: 1 as DeAR - waiting for group ``k``'s all-gather launches group ``k + 1``'s -
            except on Gloo, where every group's all-gather is launched in ``step()`` so they run
            back to back behind the forward).
        grad_filter: optional compression filter called on each group before its reduce-scatter
            (e.g. ``CovapGradFilter``); what it receives and may return, and how its state is saved
            and rolled back, is the contract of :data:`~gradsync.algorithms.dear.backward.GradFilter`.
        tune_trials, tune_window, tune_warmup: :class:`FusionTuner` settings for ``fusion_mb="auto"``
            (trials, iterations per trial, iterations ignored before the first trial).
        seed: seed of the tuner's optimiser.
        timeout: timeout of the two new process groups (default: the timeout of ``process_group``).
        grad_scaler: optional ``torch.amp.GradScaler`` used for every iteration (see :meth:`step`).
            Required with a ``grad_filter`` under loss scaling, so the filter (and its residuals) sees
            unscaled gradients from the first iteration. Without a ``grad_filter`` it may also be
            given first to :meth:`step` / :meth:`unscale_` (it is then remembered).
        reduce_scatter: ``"native"`` (``dist.reduce_scatter_tensor``), ``"ring"`` (a bandwidth-optimal
            ring on point-to-point operations, :func:`gradsync.comm.ring.ring_reduce_scatter_tensor`,
            run on one worker thread that takes the groups in launch order, so every rank issues the
            same sequence on the reduce-scatter group) or ``"auto"`` (default: ``"ring"`` when the
            reduce-scatter group's backend is Gloo, whose ``reduce_scatter_tensor`` costs a whole
            all-reduce; ``"native"`` otherwise, e.g. NCCL).

    Raises:
        ValueError: on a bad argument (wrong types, ``fusion_mb`` out of range or not ``"auto"``,
            tuner settings out of range, LBFGS, optimizer parameters that are not in ``model``, no
            trainable parameter, a module owning parameters of several dtypes, a ``grad_scaler`` that
            is not a ``torch.amp.GradScaler``).
        ImportError: with ``fusion_mb="auto"`` if ``bayesian-optimization`` is not installed.
        RuntimeError: if ``torch.distributed`` is not initialised.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 process_group: dist.ProcessGroup | None = None, fusion_mb: float | str = 25.0, *,
                 broadcast_buffers: bool = True, max_allgathers: int | str = "auto",
                 grad_filter: GradFilter | None = None, tune_trials: int = 10, tune_window: int = 5,
                 tune_warmup: int | None = None, seed: int = 0, timeout: timedelta | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None, reduce_scatter: str = "auto"):
        # ---- argument checks (before any collective) ----
        fusion_mb, reduce_scatter, max_allgathers = check_arguments(
            model, optimizer, fusion_mb, grad_filter, broadcast_buffers, grad_scaler, reduce_scatter, max_allgathers)
        self.auto = fusion_mb == "auto"
        self._tuner: FusionTuner | None = tuner_for(fusion_mb, tune_trials, tune_window, tune_warmup, seed)
        if self._tuner is not None:
            fusion_mb = self._tuner.current_mb
        opt_params = optimizer_group_of(model, optimizer)
        self._modules = trainable_modules(model, opt_params)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building DeAR")

        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.grad_filter = grad_filter
        #: the filter's state under the algorithm protocol (a plain callable has none)
        self.filter_state = grad_filter if isinstance(grad_filter, Algorithm) else Algorithm()
        self.fusion_mb = float(fusion_mb)
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._user_group_of = {id(p): opt_params[id(p)] for _, ps in self._modules for p in ps}
        self._device = self._modules[0][1][0].device
        params = [p for _, ps in self._modules for p in ps]

        # ---- process groups (one for reduce-scatter, one for all-gather), collaborators, fusion groups ----
        self.comm = Communicator(process_group, timeout, reduce_scatter, max_allgathers)
        if self._tuner is not None:
            self._tuner.process_group = self.rs_group
        self._parts = build_parts(model, optimizer, params, self.comm, grad_filter, grad_scaler, broadcast_buffers,
                                  self.rank, self.world_size)
        self._state = self._parts.state
        self._build_groups(self.fusion_mb)

        # ---- initial state from rank 0, as DDP; hooks ----
        broadcast_into(list(model.parameters()) + list(model.buffers()), process_group)
        self._parts.buffers.stage(flatten(list(model.buffers())))  # copies: the first forward starts here
        self._handles = self._parts.register_hooks(model, self._modules)

    # ------------------------------------------------------------------ grouping (tensor fusion)
    def _build_groups(self, fusion_mb: float) -> None:
        """Apply any pending update, then cut the fusion groups with threshold ``fusion_mb`` (MB)."""
        self.flush()
        self.fusion_mb = float(fusion_mb)
        self._state.set_layout(build_groups(self._modules, self.fusion_mb, self.world_size, self._user_group_of))

    def set_fusion_mb(self, fusion_mb: float) -> None:
        """Apply any pending update (:meth:`flush`), then regroup with a new threshold (MB).

        Call it on every rank at the same point, between ``step()`` and the next forward (no
        reduce-scatter may be in flight). Results are unchanged by regrouping.

        Raises:
            ValueError: if ``fusion_mb`` is not in (0, 1e6].
            RuntimeError: if called between a backward pass and ``step()``.
        """
        fusion_mb = check_float("fusion_mb", fusion_mb, 0.0, MAX_FUSION_MB, low_inclusive=False)
        if self._state.mid_iteration():
            raise RuntimeError("set_fusion_mb must be called after step(), not during an iteration")
        self._build_groups(fusion_mb)

    # ------------------------------------------------------------------ step: wait, start all-gather
    def step(self, scaler: torch.amp.GradScaler | None = None) -> None:
        """End the iteration: launch missing reduce-scatters, wait for all, start the all-gathers.

        Also applies any part of the previous update not applied in this iteration's forward, and
        (with ``fusion_mb="auto"``) runs the tuner, regrouping when it asks to (after applying the
        update synchronously, so no collective is in flight). Does no optimizer math otherwise: the
        update is applied in the next forward, or by :meth:`flush`. Collective: every rank must call it.

        With a ``torch.amp.GradScaler`` (``scaler``, else the one given at construction or to an
        earlier call) it does what ``scaler.step(optimizer); scaler.update()`` do under DDP: the
        averaged gradients are unscaled (if :meth:`unscale_` / :meth:`clip_grad_norm_` did not
        already), and if any rank found inf/nan the update of this iteration is skipped on every
        rank (counted in ``steps_skipped``); then the scale is updated (backoff or growth). Do not
        call ``scaler.update()`` yourself afterwards.

        Raises:
            ValueError: if ``scaler`` is not a ``torch.amp.GradScaler`` or ``None``, is not the
                GradScaler in use (given at construction or earlier), or comes after a
                ``grad_filter`` already saw loss-scaled gradients (pass it at construction).
        """
        check_scaler("scaler", scaler)
        self._parts.amp.adopt(scaler)
        self._parts.end_iteration(self.optimizer, self.filter_state)
        if self._tuner is not None:
            new_mb = self._tuner.observe()
            if new_mb is not None:
                self._build_groups(new_mb)

    # ------------------------------------------------------------------ public helpers
    def flush(self) -> None:
        """Apply the pending update of the last ``step()`` now (waits for its all-gathers).

        Call it before evaluation, checkpointing and at the end of training; afterwards the
        parameters equal those of DDP + the same optimizer after the same number of steps. Cheap
        when nothing is pending. Every rank must call it (it waits for collectives).
        """
        self._parts.ag.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: ``optimizer.zero_grad(set_to_none)`` (DeAR's placeholders become ``None``)."""
        self._parts.guard.zero_grad(set_to_none)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``model(*args, **kwargs)``."""
        return self.model(*args, **kwargs)

    @property
    def num_groups(self) -> int:
        """Number of fusion groups (buckets) in use."""
        return len(self._state.groups)

    def group_sizes(self) -> list[int]:
        """Gradient elements per fusion group, in group (forward) order."""
        return [g.numel for g in self._state.groups]

    @property
    def tuner(self) -> FusionTuner | None:
        """The fusion tuner (``fusion_mb="auto"``), else ``None``."""
        return self._tuner

    def stats(self) -> dict[str, Any]:
        """Cumulative counters of this rank (divide by ``iteration`` for per-iteration figures).

        Keys: ``iteration``; ``payload_bytes`` (bytes of the tensors handed to reduce-scatter and
        all-gather: the padded group buffer plus its shard per group and iteration); ``wire_bytes``
        (``(P-1)/P`` of the padded buffer for the reduce-scatter plus ``(P-1)`` shards for the
        all-gather, i.e. ``2 (P-1)/P`` of the padded buffer: the traffic of a ring all-reduce of it;
        see :func:`gradsync.comm.collectives.wire_bytes`); ``dense_payload_bytes`` and
        ``dense_wire_bytes`` (gradient bytes of the groups without used flags and padding, and the
        ring all-reduce wire bytes of them); ``collectives`` (reduce-scatters + all-gathers);
        ``buckets_skipped`` (groups the ``grad_filter`` did not send); ``compress_seconds`` (s in
        ``grad_filter``); ``compression_ratio`` (dense_wire_bytes / wire_bytes: 1.0 up to the used
        flags and the padding to a multiple of P, ``numel / padded`` per group, without a filter);
        the buffer broadcasts (``broadcast_buffers``) and the scalar all-reduces of ``unscale_`` /
        ``clip_grad_norm_`` are not counted (DDP's are not visible to the hook algorithms either);
        ``rs_wait_seconds`` and ``ag_wait_seconds`` (s blocked in ``.wait()`` of reduce-scatters and
        all-gathers: exposed communication; on CUDA the time the current stream stalls there,
        measured with CUDA events, as are ``compress_seconds`` and the buffer broadcasts: reading
        them here synchronises with the device); ``buffer_broadcast_seconds`` (s broadcasting buffers);
        ``steps_skipped`` (updates skipped by the GradScaler on inf/nan); ``reduce_scatter``
        (``"ring"`` or ``"native"``); ``fusion_mb`` (threshold in
        use, MB); ``num_groups``; with ``fusion_mb="auto"`` also ``tuning`` (:meth:`FusionTuner.report`).
        """
        self._parts.timers.read(wait=True)
        c = self._parts.counters
        out: dict[str, Any] = {
            **counter_stats(c),
            "rs_wait_seconds": c.rs_wait_seconds,
            "ag_wait_seconds": c.ag_wait_seconds,
            "buffer_broadcast_seconds": c.buffer_seconds,
            "steps_skipped": c.steps_skipped,
            "reduce_scatter": self.reduce_scatter,
            "fusion_mb": self.fusion_mb,
            "num_groups": len(self._state.groups),
        }
        if self._tuner is not None:
            out["tuning"] = self._tuner.report()
        return out

    def config(self) -> dict[str, Any]:
        """Configuration fields that must be identical on every rank."""
        return {"algorithm": "dear", "fusion_mb": "auto" if self.auto else self.fusion_mb,
                "broadcast_buffers": self.broadcast_buffers, "reduce_scatter": self.reduce_scatter}

    def state_dict(self) -> dict[str, Any]:
        """Flush, then return ``{"model", "optimizer", "dear"}`` (the optimizer's own state_dict, in
        DDP's format; ``"dear"`` holds the iteration, the threshold, the tuner state and the
        :attr:`filter_state`'s ``state_dict()``, e.g. COVAP's error-feedback residuals). The
        GradScaler's state is the caller's (``scaler.state_dict()``)."""
        self.flush()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dear": {
                "iteration": self.iteration,
                "fusion_mb": self.fusion_mb,
                "tuner": None if self._tuner is None else self._tuner.state_dict(),
                "grad_filter": self.filter_state.state_dict(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` on every rank, between iterations (after ``step()`` or
        before the first forward). A pending update is applied first and then overwritten; the groups
        are rebuilt with the saved threshold; the :attr:`filter_state` is restored when the saved
        state has one; with ``broadcast_buffers`` every rank then takes rank 0's
        loaded buffers (:meth:`sync_buffers`), as the next training forward would under DDP.
        ``"model"`` and ``"optimizer"`` may be left out by a caller that loads them itself
        (``gradsync train``'s checkpoints hold them once, beside the algorithm state).

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if self._state.mid_iteration():
            raise RuntimeError("load_state_dict must be called between iterations")
        self.flush()
        if "model" in state:  # absent where the caller restores model and optimizer itself
            self.model.load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        d = state["dear"]
        self.iteration = int(d["iteration"])
        if self._tuner is not None and d.get("tuner") is not None:
            self._tuner.load_state_dict(d["tuner"])
        self._build_groups(d["fusion_mb"])
        if d.get("grad_filter"):  # None or {}: saved without filter state
            self.filter_state.load_state_dict(d["grad_filter"])
        if self.broadcast_buffers:  # per-rank checkpoints hold each rank's own statistics
            self._parts.buffers.sync()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally, as ``DistributedDataParallel.no_sync``.

        Backward passes inside the context only accumulate into ``p.grad`` (no communication); the
        first backward pass outside it adds its gradients and synchronises the sum, which the next
        :meth:`step` averages over ranks. Usage::

            with dear.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(dear(x), y).backward()
            loss_fn(dear(*micro_batches[-1]), ...).backward()
            dear.step()
        """
        return self._parts.rs.no_sync()

    def unscale_(self, scaler: torch.amp.GradScaler) -> None:
        """Finish this iteration's reduction and divide the averaged gradients by the loss scale.

        The counterpart of ``scaler.unscale_(optimizer)``: call it (or pass ``grad_scaler`` at
        construction) before :meth:`clip_grad_norm_` when the loss was scaled. Non-finite values are
        detected on every rank's shards and the flag is all-reduced (MAX) over the group, so every
        rank skips the same steps. Idempotent within an iteration; remembers ``scaler`` for later
        iterations. Collective: every rank must call it.

        Raises:
            ValueError: if ``scaler`` is not a ``torch.amp.GradScaler``, is not the GradScaler in use
                (given at construction or earlier), or comes after a ``grad_filter`` already saw
                loss-scaled gradients (pass it at construction).
            RuntimeError: if the scaler has no scale yet (``scaler.scale(loss)`` was not called).
        """
        check_scaler("scaler", scaler, allow_none=False)
        self._parts.amp.adopt(scaler)
        if scaler.is_enabled():  # a disabled scaler leaves the reduction to step()
            self._parts.finish_reduce()
        self._parts.amp.unscale(scaler)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their global norm, like DDP + ``torch.nn.utils.clip_grad_norm_``.

        Call it after ``backward()`` and before :meth:`step`. It finishes this iteration's
        reduce-scatters, computes ``||g||_p`` over all averaged gradients (each rank holds ``1/P`` of
        them: local sums of ``|g|^p``, or the local max for ``p = inf``, are all-reduced), and
        multiplies every gradient by ``min(1, max_norm / (total + 1e-6))`` before the all-gather.
        With a known GradScaler (``grad_scaler=`` or an earlier :meth:`unscale_` / ``step(scaler)``)
        the gradients are unscaled first. Collective: every rank must call it.

        Args:
            max_norm: maximum norm, finite and >= 0.
            norm_type: ``p`` of the p-norm, > 0 (``float("inf")`` for the max norm).

        Returns:
            the total norm before clipping, a 0-d tensor on the parameters' device (float32 for
            float32/float16/bfloat16 gradients; computed in float32); inf/nan when gradients are
            not finite (the step is then skipped by ``step(scaler)``, as with torch).

        Raises:
            ValueError: for ``max_norm`` or ``norm_type`` out of range.
        """
        max_norm, norm_type = check_clip(max_norm, norm_type)
        self._parts.finish_reduce()
        if self._parts.amp.scaler is not None:
            self._parts.amp.unscale(self._parts.amp.scaler)
        shards = [g.shard_grads(self.rank, self.world_size) for g in self._state.groups if not g.skipped]
        return clip_shards(shards, max_norm, norm_type, self.rs_group, self._device)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (given at construction or to :meth:`step` / :meth:`unscale_`)."""
        return self._parts.amp.scaler

    def sync_buffers(self) -> None:
        """Give every rank rank 0's current module buffers now, and make them the ones the next
        training forward starts from (see "Module buffers" in :mod:`gradsync.algorithms.dear`).

        Call it on every rank, between iterations (after ``step()``), after forwards that changed the
        buffers since ``step()`` and whose changes should be kept, e.g. a BatchNorm recalibration pass
        under ``no_grad``. One coalesced broadcast per buffer dtype; nothing on one rank.

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if self._state.mid_iteration():
            raise RuntimeError("sync_buffers must be called between iterations (after step())")
        self._parts.buffers.sync()

    def remove_hooks(self) -> None:
        """Flush, then remove every hook and the optimizer guard; the model then trains as a plain
        local module with its optimizer."""
        self.flush()
        self._parts.guard.drop_placeholders()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.comm.close()
        self._parts.guard.remove()

    # ------------------------------------------------------------------ communicator
    @property
    def rs_group(self) -> dist.ProcessGroup:
        """The reduce-scatter process group (also used for the scalar all-reduces and buffer broadcasts)."""
        return self.comm.rs_group

    @property
    def ag_group(self) -> dist.ProcessGroup:
        """The all-gather process group."""
        return self.comm.ag_group

    @property
    def reduce_scatter(self) -> str:
        """``"ring"`` or ``"native"``."""
        return self.comm.reduce_scatter

    @property
    def max_allgathers(self) -> int:
        """All-gathers kept in flight during the next forward."""
        return self.comm.max_allgathers


for _name in vars(Counters()):  # the counters stay attributes of the wrapper (dear.iteration, ...)
    setattr(DeAR, _name, counter_property(_name))
del _name
