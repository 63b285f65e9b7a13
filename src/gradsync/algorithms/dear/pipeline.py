"""DeAR's pipeline: :class:`DeAR` builds the fusion groups, hooks and process groups, ends each iteration
in :meth:`DeAR.step` and holds the public API. Its parts: :mod:`.arguments` (argument checks),
:mod:`.backward` (reduce-scatter), :mod:`.forward` (all-gather and lazy update), :mod:`.amp` (loss
scaling, clipping), :mod:`.buffers` (module buffers), :mod:`.guard` (placeholder gradient, optimizer
guard), :mod:`.communicator` (process groups, ring or native), :mod:`.timing` (wait timers). Source and
semantics: :mod:`gradsync.algorithms.dear`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...tuning.fusion import FusionTuner
from ...validation import check_float
from ..base import counter_stats, init_counters
from ..protocol import Algorithm
from .amp import LossScaling, check_scaler, record_found_inf
from .arguments import check_arguments, optimizer_group_of, tuner_for
from .backward import GradFilter, ReduceScatterStage
from .buffers import BufferSync, flatten
from .communicator import Communicator
from .forward import AllGatherStage
from .groups import MAX_FUSION_MB, FusionGroup, build_groups, trainable_modules
from .guard import OptimizerGuard
from .timing import MAX_TIMING_EVENTS, WaitTimers


class DeAR(ReduceScatterStage, AllGatherStage, LossScaling, BufferSync, OptimizerGuard, WaitTimers):
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

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group: dist.ProcessGroup | None = None,
        fusion_mb: float | str = 25.0,
        *,
        broadcast_buffers: bool = True,
        max_allgathers: int | str = "auto",
        grad_filter: GradFilter | None = None,
        tune_trials: int = 10,
        tune_window: int = 5,
        tune_warmup: int | None = None,
        seed: int = 0,
        timeout: timedelta | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        reduce_scatter: str = "auto",
    ):
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

        # ---- process groups: one for reduce-scatter, one for all-gather ----
        self.comm = Communicator(process_group, timeout, reduce_scatter, max_allgathers)
        if self._tuner is not None:
            self._tuner.process_group = self.rs_group

        # ---- counters ----
        init_counters(self)
        self.rs_wait_seconds = 0.0
        self.ag_wait_seconds = 0.0
        self.buffer_seconds = 0.0
        # on CUDA the waits and the filter are timed by events on the current stream, read lazily:
        # [(counter name, start event, end event)]
        self._cuda_timing = self._device.type == "cuda"
        self._timing_events: list[tuple[str, Any, Any]] = []
        self.steps_skipped = 0  # optimizer steps skipped by the loss scaler (inf/nan gradients)
        # rank 0's buffers (broadcast by step() or at construction) for the training forwards until
        # the next backward: [(buffers, flat copy)]
        self._staged_buffers: list[tuple[list[torch.Tensor], torch.Tensor]] | None = None

        # ---- pipeline state ----
        self._groups: list[FusionGroup] = []
        self._module_group: dict[int, int] = {}
        self._param_loc: dict[int, tuple[int, int]] = {}
        self._next_launch = -1  # highest group index not launched yet in this backward
        self._pending = False  # an update from the last step() is not fully applied yet
        self._next_apply = 0
        self._next_ag = 0
        self._ag_inflight = 0  # all-gathers launched and not yet waited for
        self._hparams: list[dict[str, Any]] = []
        self._no_sync = False
        self._reduced = False  # this iteration's reduce-scatters are done and averaged
        self._scaler: torch.amp.GradScaler | None = grad_scaler
        self._filtered_scaled = False  # the grad_filter ran while no GradScaler was known
        self._inv_scale: torch.Tensor | None = None  # 1 / scale used by the hooks this iteration
        self._found_inf: torch.Tensor | None = None  # (1,) float32 on the device: local, then global
        self._found_inf_global = False  # _found_inf was all-reduced
        self._build_groups(self.fusion_mb)

        # ---- initial state from rank 0, as DDP ----
        self._broadcast(list(model.parameters()) + list(model.buffers()), process_group)
        self._stage_buffers(flatten(list(model.buffers())))  # copies: the first forward starts here

        # ---- hooks ----
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._root_pre_hook, prepend=True))
        for m in model.modules():  # loading buffers (e.g. a checkpoint) makes step()'s broadcast stale
            self._handles.append(m.register_load_state_dict_pre_hook(self._drop_staged_buffers))
        for m, _ in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._module_pre_hook))
        for _, ps in self._modules:
            for p in ps:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        self._guard_optimizer()

    # ------------------------------------------------------------------ grouping (tensor fusion)
    def _build_groups(self, fusion_mb: float) -> None:
        """Apply any pending update, then cut the fusion groups with threshold ``fusion_mb`` (MB)."""
        self.flush()
        self.fusion_mb = float(fusion_mb)
        layout = build_groups(self._modules, self.fusion_mb, self.world_size, self._user_group_of)
        self._groups = layout.groups
        self._module_group = layout.module_group
        self._param_loc = layout.param_loc
        self._next_launch = len(self._groups) - 1

    def _mid_iteration(self) -> bool:
        return self._reduced or any(g.launched or g.n_ready for g in self._groups)

    def set_fusion_mb(self, fusion_mb: float) -> None:
        """Apply any pending update (:meth:`flush`), then regroup with a new threshold (MB).

        Call it on every rank at the same point, between ``step()`` and the next forward (no
        reduce-scatter may be in flight). Results are unchanged by regrouping.

        Raises:
            ValueError: if ``fusion_mb`` is not in (0, 1e6].
            RuntimeError: if called between a backward pass and ``step()``.
        """
        fusion_mb = check_float("fusion_mb", fusion_mb, 0.0, MAX_FUSION_MB, low_inclusive=False)
        if self._mid_iteration():
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
        self._adopt_scaler(scaler)
        scaler = self._scaler
        self._finish_reduce()
        skip = False
        if scaler is not None and scaler.is_enabled():
            self._unscale(scaler)
            found = self._found_inf
            record_found_inf(scaler, self.optimizer, found)
            scaler.update()
            skip = bool(found.item() > 0)
        self._reduced = False
        self._inv_scale = None
        self._found_inf = None
        self._found_inf_global = False
        self.iteration += 1
        if skip:
            self.steps_skipped += 1
            self.filter_state.rollback()  # a skipped step changes no filter state (residuals)
            self._drop_placeholders()
            for g in self._groups:
                g.sel = g.c_in = g.c_shard = g.c_out = None
        else:
            # hyper-parameters as they are now (before any scheduler.step() of this iteration)
            self._hparams = [
                {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in pg.items() if k != "params"}
                for pg in self.optimizer.param_groups
            ]
            # the update is applied later, but it is this iteration's optimizer step for a scheduler
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            self._pending = True
            self._next_apply = 0
            self._next_ag = 0
        # the next forward's buffer broadcast, every iteration (never decided by local state), while
        # the link is idle (every reduce-scatter is done); the buffers are written at that forward
        if self.broadcast_buffers and self.world_size > 1:
            self._stage_buffers(self._broadcast_buffers(self.rs_group))
        if not skip:
            self._launch_next_ag()
        if self._timing_events:
            self._read_timings(wait=len(self._timing_events) > MAX_TIMING_EVENTS)
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
        self._apply_through(len(self._groups) - 1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients: ``optimizer.zero_grad(set_to_none)`` (DeAR's placeholders become ``None``)."""
        self._drop_placeholders()
        self._opt_zero_grad(set_to_none=set_to_none)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``model(*args, **kwargs)``."""
        return self.model(*args, **kwargs)

    @property
    def num_groups(self) -> int:
        """Number of fusion groups (buckets) in use."""
        return len(self._groups)

    def group_sizes(self) -> list[int]:
        """Gradient elements per fusion group, in group (forward) order."""
        return [g.numel for g in self._groups]

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
        self._read_timings(wait=True)
        out: dict[str, Any] = {
            **counter_stats(self),
            "rs_wait_seconds": self.rs_wait_seconds,
            "ag_wait_seconds": self.ag_wait_seconds,
            "buffer_broadcast_seconds": self.buffer_seconds,
            "steps_skipped": self.steps_skipped,
            "reduce_scatter": self.reduce_scatter,
            "fusion_mb": self.fusion_mb,
            "num_groups": len(self._groups),
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
        if self._mid_iteration():
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
            self.sync_buffers()

    def remove_hooks(self) -> None:
        """Flush, then remove every hook and the optimizer guard; the model then trains as a plain
        local module with its optimizer."""
        self.flush()
        self._drop_placeholders()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.comm.close()
        self._unguard_optimizer()

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
