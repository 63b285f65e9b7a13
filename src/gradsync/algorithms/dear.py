"""DeAR: reduce-scatter in backward, all-gather in the next forward, with tensor fusion.

Source: Lin Zhang, Shaohuai Shi, Xiaowen Chu, Wei Wang, Bo Li, Chengjian Liu, "DeAR: Accelerating
Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445 (Sec. 3:
decoupling all-reduce into reduce-scatter + all-gather and pipelining them with back-propagation and
the next feed-forward; Sec. 4: tensor fusion and its Bayesian-optimisation tuning). The code is
written from the paper's description, not copied.

This module is the *pipeline* (hooks, collective scheduling, optimizer application, clipping and
loss scaling); which parameters are fused into which group is decided in
:mod:`gradsync.algorithms.dear_groups`.

How one iteration runs (world size ``P``):

* **Tensor fusion.** Modules owning trainable parameters are cut into fusion groups (buckets) of
  consecutive modules by a byte threshold (:func:`~gradsync.algorithms.dear_groups.cut_modules`).
  Group ``k`` owns a flat gradient buffer of the parameters' dtype: gradients, one "used" flag per
  parameter, zero padding up to a multiple of ``P`` elements.
* **Backward (wait-free back-propagation).** A post-accumulate-grad hook copies each gradient into its
  group's buffer and replaces ``p.grad`` by a placeholder (see "Misuse" below). When every parameter
  of a group is ready, an asynchronous reduce-scatter (sum) of the buffer is launched on the
  reduce-scatter process group: ``dist.reduce_scatter_tensor`` where the backend has a real one
  (NCCL), a bandwidth-optimal point-to-point ring on Gloo (whose ``reduce_scatter_tensor`` costs a
  whole all-reduce), run by one worker thread in launch order. Groups are launched in descending group
  order (the order gradients normally become ready), the same on every rank; a ready group waits until
  all later groups were launched.
* **step()** launches the groups not launched yet (parameters that got no gradient on this rank
  contribute zeros), waits for all reduce-scatters, divides the shards by ``P`` (average, as DDP),
  optionally unscales / clips them (:meth:`DeAR.clip_grad_norm_`, ``step(scaler)``) and launches the
  all-gather of group 0 on a separate all-gather process group, so reduce-scatters and all-gathers
  can run concurrently. It does no optimizer math.
* **Next forward.** A forward-pre hook on each module of group ``k`` waits for the all-gather of every
  group up to ``k`` not applied yet, launches the next group's all-gather, and applies the update of
  the group: the averaged gradient becomes ``p.grad``, the user's optimizer runs on that group's
  parameters only, and ``p.grad`` is cleared. So the update of iteration ``t`` is applied lazily, layer
  group by layer group, just before the layers are used in forward ``t + 1``. Whether updates are
  applied in a forward depends on the *root* module's mode (``model.training``) and on grad mode, never
  on a submodule's own ``training`` flag (a frozen BatchNorm in eval mode is still updated in order).

Differences from the reference code, all needed for "DeAR reproduces DDP + the same optimizer":

* Any per-parameter optimizer works (SGD, Adam, AdamW, RMSprop, ...; not LBFGS): the user's optimizer
  object is stepped once per group with its ``param_groups`` temporarily narrowed to the group's
  parameters and with the hyper-parameters it had at ``step()``, so learning-rate schedulers that
  change ``optimizer.param_groups[i]["lr"]`` (or momentum, betas) after ``step()`` take effect
  exactly as under DDP, and ``optimizer.state_dict()`` keeps DDP's format.
* A parameter that got no gradient on *any* rank is left with ``p.grad = None`` (so the optimizer
  skips it), as DDP does: the used flags travel with the gradients. A parameter used on some ranks
  only gets the average with zeros from the others, as in DDP. A group whose modules are never
  called in the next forward is applied at the latest in the following ``step()`` or :meth:`DeAR.flush`.
* Gradient clipping (:meth:`DeAR.clip_grad_norm_`) and loss scaling (``step(scaler)``) work on the
  reduced shards: each rank holds ``1/P`` of every averaged gradient after the reduce-scatter, so the
  global norm is one all-reduce of a scalar, and the clipped / unscaled shards are what is
  all-gathered (the "all-reduce = reduce-scatter + all-gather" decomposition of Sec. 3).
* Gradient accumulation: :meth:`DeAR.no_sync` (as ``DistributedDataParallel.no_sync``).
* Module buffers (BatchNorm statistics) take rank 0's values at the start of the training forward,
  as DDP's ``broadcast_buffers=True``, with one broadcast per iteration issued in ``step()``, before
  the all-gathers (buffers do not change between the end of backward and the next forward, and a
  broadcast issued at the next forward would queue behind the all-gathers on the link: measured on 2
  emulated hosts at 20 Mbit/s, 20-65 ms per iteration). A forward never issues a collective for the
  buffers, so forwards that only some ranks run between ``step()`` and the next training forward
  (logging, sampling, evaluation on rank 0) cannot desynchronise the ranks. The semantics: every
  training forward (grad enabled, root module in training mode) from ``step()`` until the next
  backward starts from rank 0's buffers as of ``step()`` (the first one from those broadcast when
  the wrapper was built); buffer changes made by other forwards in between (a training-mode forward
  under ``no_grad`` updates BatchNorm statistics) are therefore replaced there, on every rank
  (under DDP a forward through ``ddp.module`` on rank 0 would be broadcast instead; call
  :meth:`DeAR.sync_buffers` on every rank after such forwards to keep rank 0's). A state dict
  loaded into the model between iterations keeps the loaded buffers (load the same one on every
  rank, or call :meth:`DeAR.sync_buffers`; :meth:`DeAR.load_state_dict` does). Training
  forwards after a backward and before ``step()`` (:meth:`DeAR.no_sync` micro-batches) keep the
  local buffers, as DDP, which does not broadcast after a ``no_sync`` forward. A forward run on
  some ranks only should be under ``torch.no_grad()`` or in eval mode: a grad-enabled
  training-mode forward applies the pending update, and with ``max_allgathers`` below the number of
  groups (NCCL's default 1) that waits for all-gathers the other ranks launch in their next forward.
  Parameters and buffers are broadcast from rank 0 when the wrapper is built.
* All collectives are launched from hook bodies or ``step()`` on the Python thread (never from
  ``Future`` callbacks), in an order identical on every rank.

Misuse that raises instead of being silently ignored: from a parameter's backward hook until DeAR
applies the averaged gradient, ``p.grad`` is a storage-less placeholder tensor of the right shape,
dtype and device; any computation on it (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``,
``GradScaler.unscale_`` / ``GradScaler.step``, reading its values, a second backward pass that would
accumulate into it) raises ``RuntimeError`` naming the DeAR method to use. ``optimizer.step()`` on the
wrapped optimizer raises ``RuntimeError`` too. Not detectable: reading only metadata (``p.grad is
None``, ``.shape``, ``.dtype``); clipping *after* the next forward applied the update (``p.grad`` is
``None`` then, so torch's clip returns a zero norm and does nothing); clipping the local, accumulated
gradients inside :meth:`DeAR.no_sync` (they are real local tensors there, as under DDP).

Limitations: a parameter used in a forward through a module other than its owner (e.g.
``F.linear(x, self.child.weight)`` in the parent) before its owner runs sees the not-yet-updated value;
``optimizer.add_param_group`` after wrapping is not seen; trainable parameters that the optimizer does
not hold, or that have ``requires_grad=False`` when the wrapper is built, are not synchronised.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import all_gather_flat, reduce_scatter_flat
from ..comm.ring import ring_reduce_scatter_tensor
from ..tuning.fusion import FusionTuner
from ..validation import check_choice, check_float, check_int
from .base import count_bytes, count_dense, counter_stats, init_counters
from .dear_groups import MB, FusionGroup, build_groups, trainable_modules

MAX_FUSION_MB = 1_000_000.0
REDUCE_SCATTER_CHOICES = ("auto", "ring", "native")
#: ``max_allgathers`` value meaning "every group's all-gather at once"
ALL_ALLGATHERS = 1_000_000
#: CUDA timing event pairs kept unread before ``step()`` waits for them
MAX_TIMING_EVENTS = 4096

__all__ = ["MAX_FUSION_MB", "MB", "DeAR", "GradFilter", "StridedShard"]

#: ``grad_filter(flat, step, group) -> None | bool | Tensor | StridedShard``; see :class:`DeAR`.
GradFilter = Callable[[torch.Tensor, int, int], Any]

_Group = FusionGroup  # backward-compatible name

_MISUSE = (
    "DeAR holds this gradient in its fusion buffer (p.grad is a placeholder until DeAR applies the "
    "averaged update in the next forward). Use DeAR.clip_grad_norm_() instead of "
    "torch.nn.utils.clip_grad_norm_/clip_grad_value_, DeAR.step(scaler) instead of "
    "GradScaler.unscale_/step(optimizer) or optimizer.step(), DeAR.zero_grad() to clear gradients, "
    "and DeAR.no_sync() to accumulate gradients over several backward passes"
)


class _DeARGradPlaceholder(torch.Tensor):
    """Storage-less stand-in for ``p.grad`` while DeAR owns the gradient: any computation on it raises.

    Zeroing it (``zero_``/``_foreach_zero_``, what ``zero_grad(set_to_none=False)`` does) is allowed
    and does nothing: the local gradient it stands for was already consumed by DeAR.
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> _DeARGradPlaceholder:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name.startswith("zero_") and args and isinstance(args[0], _DeARGradPlaceholder):
            return args[0]
        if name.startswith("_foreach_zero_") and args:
            real = [t for t in args[0] if not isinstance(t, _DeARGradPlaceholder)]
            if real:
                torch._foreach_zero_(real)
            return None
        if name.startswith(("detach_", "requires_grad_")):
            return args[0]
        raise RuntimeError(f"{_MISUSE} (attempted {func} on p.grad)")

    def __repr__(self) -> str:  # printing must not raise
        return f"DeARGradPlaceholder(shape={tuple(self.shape)}, dtype={self.dtype})"


def _is_placeholder(t: Any) -> bool:
    return isinstance(t, _DeARGradPlaceholder)


@dataclass(frozen=True)
class StridedShard:
    """A ``grad_filter`` result asking DeAR to reduce-scatter / all-gather only the elements
    ``flat[start::stride]`` of a group, whose values to send are ``values`` (1-D,
    ``len(range(start, numel, stride))`` elements, the group's dtype or a narrower floating dtype
    such as float16 to communicate in). The other positions get a zero averaged gradient. Only this
    compact tensor (plus the used flags and padding, in ``values``' dtype) is communicated.
    ``averaged``: ``values`` are already divided by the world size (a narrow wire dtype whose sum
    must not overflow, as torch's ``fp16_compress_hook`` divides first); the used flags are then
    divided too and the reduced sum is not divided again."""

    start: int
    stride: int
    values: torch.Tensor
    averaged: bool = False


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
            back to back behind the forward; measured on 2 emulated hosts at 20 Mbit/s, 3 runs:
            199-207 ms per iteration against 214-227 ms with 1, DDP 200-212 ms).
        grad_filter: optional compression filter called as ``grad_filter(flat, step, group)`` on each
            group before its reduce-scatter, where ``flat`` is the group's flat gradient (1-D view of
            ``numel`` elements, the parameters' dtype, parameter order; already multiplied by
            ``1 / scale`` when a ``grad_scaler`` is known, and with non-finite values replaced by 0 -
            the step is then skipped on every rank), ``step`` the iteration (:attr:`iteration`) and
            ``group`` the group index. It may modify ``flat`` in place and
            return ``None``/``True``, return a tensor of the same shape to send instead, or return
            ``False`` to send nothing for this group this iteration (the group then gets a zero
            averaged gradient; the decision must be identical on every rank), or return a
            :class:`StridedShard` to communicate only ``flat[start::stride]`` (the size must be
            identical on every rank). Its run time is added to ``compress_seconds``. If it has
            ``state_dict()`` / ``load_state_dict()``, its state is saved and restored with DeAR's.
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
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("optimizer must be a per-parameter optimizer; LBFGS is not supported by DeAR")
        self.auto = isinstance(fusion_mb, str)
        if self.auto and fusion_mb != "auto":
            raise ValueError(f"fusion_mb must be a number in (0, {MAX_FUSION_MB}] or 'auto', got {fusion_mb!r}")
        if not self.auto:
            fusion_mb = check_float("fusion_mb", fusion_mb, 0.0, MAX_FUSION_MB, low_inclusive=False)
        if grad_filter is not None and not callable(grad_filter):
            raise ValueError(f"grad_filter must be callable or None, got {type(grad_filter).__name__}")
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")
        _check_scaler("grad_scaler", grad_scaler)
        reduce_scatter = check_choice("reduce_scatter", reduce_scatter, REDUCE_SCATTER_CHOICES)
        if max_allgathers != "auto":
            max_allgathers = check_int("max_allgathers", max_allgathers, 1, ALL_ALLGATHERS)
        tune_trials = check_int("tune_trials", tune_trials, 1, 1000)
        tune_window = check_int("tune_window", tune_window, 2, 10_000)
        if tune_warmup is not None:
            tune_warmup = check_int("tune_warmup", tune_warmup, 0, 10**6)
        seed = check_int("seed", seed, 0, 2**32 - 1)
        self._tuner: FusionTuner | None = None
        if self.auto:
            self._tuner = FusionTuner(initial_mb=25.0, trials=tune_trials, window=tune_window,
                                      warmup=tune_warmup, seed=seed)
            fusion_mb = self._tuner.current_mb
        model_params = {id(p) for p in model.parameters()}
        opt_params: dict[int, int] = {}
        for gi, pg in enumerate(optimizer.param_groups):
            for p in pg["params"]:
                if id(p) not in model_params:
                    raise ValueError("optimizer holds a parameter that is not in model")
                opt_params[id(p)] = gi
        self._modules = trainable_modules(model, opt_params)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before building DeAR")

        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.grad_filter = grad_filter
        self.fusion_mb = float(fusion_mb)
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._user_group_of = {id(p): opt_params[id(p)] for _, ps in self._modules for p in ps}
        self._device = self._modules[0][1][0].device

        # ---- process groups: one for reduce-scatter, one for all-gather ----
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        if timeout is None:
            timeout = _group_timeout(process_group)
        self.rs_group = dist.new_group(ranks, timeout=timeout)
        self.ag_group = dist.new_group(ranks, timeout=timeout)
        if self._tuner is not None:
            self._tuner.process_group = self.rs_group
        if reduce_scatter == "auto":
            reduce_scatter = "ring" if dist.get_backend(self.rs_group) == "gloo" else "native"
        self.reduce_scatter = reduce_scatter
        if max_allgathers == "auto":
            max_allgathers = ALL_ALLGATHERS if dist.get_backend(self.ag_group) == "gloo" else 1
        self.max_allgathers = max_allgathers
        # ring reduce-scatters run here, one at a time, in launch (= bucket) order
        self._ring_worker: concurrent.futures.ThreadPoolExecutor | None = None

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
        self._stage_buffers(_flatten(list(model.buffers())))  # copies: the first forward starts here

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

    # ------------------------------------------------------------------ optimizer guard
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
                if _is_placeholder(p.grad):
                    p.grad = None

    # ------------------------------------------------------------------ grouping (tensor fusion)
    def _build_groups(self, fusion_mb: float) -> None:
        layout = build_groups(self._modules, fusion_mb, self.world_size, self._user_group_of)
        self._groups = layout.groups
        self._module_group = layout.module_group
        self._param_loc = layout.param_loc
        self._next_launch = len(self._groups) - 1

    @contextlib.contextmanager
    def _timed(self, counter: str) -> Iterator[None]:
        """Add the duration of the block to the float attribute ``counter`` (seconds). On CPU: wall
        clock. On CUDA: the time the current stream takes to pass the block's work (for a
        ``.wait()``, how long the stream stalls on the collective: exposed communication), from a
        pair of CUDA events read later by :meth:`_read_timings` (no host sync here)."""
        if not self._cuda_timing:
            t0 = time.perf_counter()
            yield
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)
            return
        stream = torch.cuda.current_stream(self._device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._timing_events.append((counter, start, end))

    def _read_timings(self, wait: bool) -> None:
        """Add the elapsed time of recorded CUDA event pairs to their counters: all of them
        (``wait``, synchronising on the last) or those already completed (no host sync)."""
        done = 0
        for counter, start, end in self._timing_events:
            if not wait and not end.query():
                break
            end.synchronize()
            setattr(self, counter, getattr(self, counter) + start.elapsed_time(end) / 1e3)
            done += 1
        del self._timing_events[:done]

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
        self.flush()
        self.fusion_mb = float(fusion_mb)
        self._build_groups(self.fusion_mb)

    # ------------------------------------------------------------------ backward: reduce-scatter
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
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
        old = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = old

    def _grad_hook(self, p: torch.Tensor) -> None:
        self._staged_buffers = None  # a backward started: later forwards keep their local buffers
        if self._no_sync:
            return
        k, slot = self._param_loc[id(p)]
        g = self._groups[k]
        if g.ready[slot] or g.launched or self._reduced:
            raise RuntimeError(
                "DeAR: a second backward pass before step(); accumulate gradients with DeAR.no_sync()"
            )
        if p.grad is None or _is_placeholder(p.grad):
            return
        if p.grad.is_sparse:
            raise RuntimeError("DeAR does not support sparse gradients")
        off = g.offsets[slot]
        g.grad_buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
        g.grad_buf[g.numel + slot] = 1.0
        p.grad = _DeARGradPlaceholder(p)  # the local gradient is consumed; misuse now raises
        g.ready[slot] = True
        g.n_ready += 1
        if g.n_ready == len(g.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch >= 0 and self._groups[self._next_launch].n_ready == len(
            self._groups[self._next_launch].params
        ):
            self._launch_rs(self._groups[self._next_launch])
            self._next_launch -= 1

    def _hook_unscale(self, g: FusionGroup, flat: torch.Tensor) -> None:
        """With a known GradScaler: ``flat *= 1/scale`` and record non-finite values (no host sync)."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled() or scaler._scale is None:
            return
        if self._inv_scale is None:  # once per iteration, as GradScaler.unscale_
            self._inv_scale = scaler._scale.double().reciprocal().float().to(g.grad_buf.device)
            self._found_inf = torch.zeros(1, dtype=torch.float32, device=g.grad_buf.device)
        torch._amp_foreach_non_finite_check_and_unscale_([flat], self._found_inf, self._inv_scale)
        if self.grad_filter is not None:  # keep inf/nan out of the filter's residuals
            flat.nan_to_num_(0.0, 0.0, 0.0)
        g.unscaled = True

    def _launch_rs(self, g: FusionGroup) -> None:
        for slot, ok in enumerate(g.ready):  # params without a gradient on this rank send zeros
            if not ok:
                off = g.offsets[slot]
                g.grad_buf[off:off + g.params[slot].numel()].zero_()
                g.grad_buf[g.numel + slot] = 0.0
        g.launched = True
        g.all_used = all(g.ready)
        g.skipped = False
        g.unscaled = False
        g.sel = None
        count_dense(self, g.nbytes, self.world_size)
        self._hook_unscale(g, g.grad_buf[: g.numel])
        if self.grad_filter is not None:
            self._filtered_scaled |= self._scaler is None
            with self._timed("compress_seconds"):
                self._run_filter(g)
            if g.skipped:
                self.buckets_skipped += 1
                return
        src, dst = (g.c_in, g.c_shard) if g.sel is not None else (g.grad_buf, g.shard)
        if self.reduce_scatter == "ring" and self.world_size > 1:
            if self._ring_worker is None:
                self._ring_worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dear-ring")
            g.rs_work = _FutureWork(self._ring_worker.submit(ring_reduce_scatter_tensor, dst, src, self.rs_group))
        else:
            g.rs_work = reduce_scatter_flat(dst, src, group=self.rs_group, async_op=True)
        count_bytes(self, src.numel() * src.element_size(), "reduce_scatter", self.world_size)

    def _run_filter(self, g: FusionGroup) -> None:
        """Call the ``grad_filter`` on ``g``'s flat gradient and apply its answer to ``g``."""
        flat = g.grad_buf[: g.numel]
        out = self.grad_filter(flat, self.iteration, g.index)
        if out is False:
            g.skipped = True
        elif isinstance(out, StridedShard):
            self._compact(g, out)
        elif isinstance(out, torch.Tensor):
            if out.shape != flat.shape:
                raise RuntimeError(f"grad_filter returned shape {tuple(out.shape)}, expected {tuple(flat.shape)}")
            flat.copy_(out)

    def _compact(self, g: FusionGroup, sel: StridedShard) -> None:
        """Pack ``sel.values`` and the used flags into compact buffers padded to a multiple of P."""
        m = len(range(sel.start, g.numel, sel.stride))
        if sel.values.shape != (m,):
            raise RuntimeError(f"StridedShard.values has shape {tuple(sel.values.shape)}, expected ({m},)")
        n_flags = len(g.params)
        if not sel.values.is_floating_point():
            raise RuntimeError(f"StridedShard.values must be floating point, got {sel.values.dtype}")
        padded = -(-(m + n_flags) // self.world_size) * self.world_size
        wire, dev = sel.values.dtype, g.grad_buf.device
        g.c_in = torch.zeros(padded, dtype=wire, device=dev)
        g.c_in[:m] = sel.values
        g.c_in[m:m + n_flags] = g.grad_buf[g.numel:g.numel + n_flags]
        if sel.averaged:
            g.c_in[m:m + n_flags].div_(self.world_size)
        g.c_shard = torch.zeros(padded // self.world_size, dtype=wire, device=dev)
        g.c_out = torch.zeros(padded, dtype=wire, device=dev)
        g.sel = sel

    def _finish_reduce(self) -> None:
        """Launch the missing reduce-scatters, wait for all, average the shards (idempotent)."""
        if self._reduced:
            return
        self._apply_through(len(self._groups) - 1)  # leftovers of the previous update
        while self._next_launch >= 0:  # finalisation: same order on every rank
            self._launch_rs(self._groups[self._next_launch])
            self._next_launch -= 1
        with self._timed("rs_wait_seconds"):
            for g in reversed(self._groups):
                if g.rs_work is not None:
                    g.rs_work.wait()
                    g.rs_work = None
        for g in self._groups:
            if g.skipped:
                g.gathered.zero_()
                g.gathered[g.numel: g.numel + len(g.params)] = 1.0
            elif g.sel is None:
                g.shard.div_(self.world_size)
            elif not g.sel.averaged:
                g.c_shard.div_(self.world_size)
            g.ready = [False] * len(g.params)
            g.n_ready = 0
            g.launched = False
        self._next_launch = len(self._groups) - 1
        self._reduced = True

    def _live_shards(self) -> list[torch.Tensor]:
        """This rank's averaged gradient values of every sent group (views; may be empty)."""
        return [g.shard_grads(self.rank, self.world_size) for g in self._groups if not g.skipped]

    # ------------------------------------------------------------------ loss scaling and clipping
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
        _check_scaler("scaler", scaler, allow_none=False)
        self._adopt_scaler(scaler)
        self._unscale(scaler)

    def _adopt_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Remember ``scaler`` (a ``step``/``unscale_`` argument) as the one in use, or raise if it
        conflicts with the known one or comes too late for the ``grad_filter``."""
        if scaler is None or scaler is self._scaler:
            return
        if self._scaler is not None:
            raise ValueError("scaler must be the GradScaler DeAR uses (given at construction as grad_scaler, or "
                             "to an earlier step()/unscale_()) or None; got a different GradScaler")
        if self._filtered_scaled and scaler.is_enabled():
            raise ValueError(
                "scaler: the grad_filter (e.g. dear-covap's error-feedback residuals) already saw this run's "
                "gradients without a GradScaler, i.e. in loss-scaled units; pass the scaler when building "
                "DeAR (DeAR(..., grad_scaler=scaler), gradsync.wrap(..., scaler=scaler)) instead of only to "
                "step()/unscale_()/clip_grad_norm_()")
        self._scaler = scaler

    def _unscale(self, scaler: torch.amp.GradScaler) -> None:
        if not scaler.is_enabled():
            return
        self._finish_reduce()
        if self._found_inf_global:
            return
        if scaler._scale is None:
            raise RuntimeError("GradScaler has no scale yet: call scaler.scale(loss).backward() first")
        dev = self._device
        inv = scaler._scale.double().reciprocal().float().to(dev)
        found = self._found_inf if self._found_inf is not None else torch.zeros(1, device=dev)
        for g in self._groups:
            if g.skipped or g.unscaled:
                continue
            view = g.shard_grads(self.rank, self.world_size)
            if view.numel():
                torch._amp_foreach_non_finite_check_and_unscale_([view], found, inv)
            g.unscaled = True
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.rs_group)
        self._found_inf = found
        self._found_inf_global = True

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
        max_norm = check_float("max_norm", max_norm, 0.0, None)
        if not (isinstance(norm_type, (int, float)) and not isinstance(norm_type, bool)
                and float(norm_type) == math.inf):
            norm_type = check_float("norm_type", norm_type, 0.0, None, low_inclusive=False)
        norm_type = float(norm_type)
        if self._scaler is not None:
            self._unscale(self._scaler)
        self._finish_reduce()
        shards = self._live_shards()
        dev = self._device
        if norm_type == math.inf:
            local = torch.zeros((), dtype=torch.float32, device=dev)
            for s in shards:
                if s.numel():
                    local = torch.maximum(local, s.detach().abs().max().float())
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.rs_group)
            total = local
        else:
            local = torch.zeros((), dtype=torch.float32, device=dev)
            for s in shards:
                if s.numel():
                    local = local + torch.linalg.vector_norm(s, norm_type, dtype=torch.float32) ** norm_type
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.rs_group)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in shards:
            if s.numel():
                s.mul_(coef.to(s.dtype))
        return total

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
        _check_scaler("scaler", scaler)
        self._adopt_scaler(scaler)
        scaler = self._scaler
        self._finish_reduce()
        skip = False
        if scaler is not None and scaler.is_enabled():
            self._unscale(scaler)
            found = self._found_inf
            _record_found_inf(scaler, self.optimizer, found)
            scaler.update()
            skip = bool(found.item() > 0)
        self._reduced = False
        self._inv_scale = None
        self._found_inf = None
        self._found_inf_global = False
        self.iteration += 1
        if skip:
            self.steps_skipped += 1
            if hasattr(self.grad_filter, "rollback"):  # a skipped step changes no filter state (residuals)
                self.grad_filter.rollback()
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
                self.flush()
                self.fusion_mb = float(new_mb)
                self._build_groups(self.fusion_mb)

    def _launch_next_ag(self) -> None:
        """Launch all-gathers in group order until ``max_allgathers`` are in flight."""
        while self._ag_inflight < self.max_allgathers:
            while self._next_ag < len(self._groups) and self._groups[self._next_ag].skipped:
                self._next_ag += 1
            if self._next_ag >= len(self._groups):
                return
            g = self._groups[self._next_ag]
            out, src = (g.c_out, g.c_shard) if g.sel is not None else (g.gathered, g.shard)
            g.ag_work = all_gather_flat(out, src, group=self.ag_group, async_op=True)
            count_bytes(self, src.numel() * src.element_size(), "allgather", self.world_size)  # src: the shard
            self._ag_inflight += 1
            self._next_ag += 1

    # ------------------------------------------------------------------ forward: apply updates
    def _apply_through(self, k: int) -> None:
        if not self._pending:
            return
        while self._next_apply <= k:
            self._apply(self._groups[self._next_apply])
            self._next_apply += 1
        if self._next_apply >= len(self._groups):
            self._pending = False

    def _apply(self, g: FusionGroup) -> None:
        if g.ag_work is not None:
            with self._timed("ag_wait_seconds"):
                g.ag_work.wait()
            g.ag_work = None
            self._ag_inflight -= 1
        self._launch_next_ag()
        if g.sel is not None:  # expand the compact all-gather result; unsent positions are zero
            m, n_flags = len(range(g.sel.start, g.numel, g.sel.stride)), len(g.params)
            g.gathered.zero_()
            g.gathered[g.sel.start:g.numel:g.sel.stride] = g.c_out[:m]
            g.gathered[g.numel:g.numel + n_flags] = g.c_out[m:m + n_flags]
            g.sel = g.c_in = g.c_shard = g.c_out = None
        used = self._used_flags(g)
        # local gradients accumulated meanwhile (no_sync micro-batches) survive the update
        kept = [None if _is_placeholder(p.grad) else p.grad for p in g.params]
        with torch.no_grad():
            for slot, p in enumerate(g.params):
                if used[slot]:
                    off = g.offsets[slot]
                    p.grad = g.gathered[off:off + p.numel()].view_as(p)
                else:
                    p.grad = None  # unused on every rank: the optimizer skips it, as under DDP
        subset = []
        for ui, ps in g.opt_groups:
            live = [p for p in ps if p.grad is not None]
            if live:
                subset.append({**self._hparams[ui], "params": live})
        if subset:
            saved = self.optimizer.param_groups
            self.optimizer.param_groups = subset
            try:
                self._opt_step()
            finally:
                self.optimizer.param_groups = saved
        for p, grad in zip(g.params, kept):
            p.grad = grad

    @staticmethod
    def _used_flags(g: FusionGroup) -> list[bool]:
        """Whether each parameter of ``g`` got a gradient on some rank. Read from the averaged used
        flags (a host sync on CUDA) only when a parameter got none on this rank: otherwise every
        flag is at least ``1 / P``."""
        if g.all_used or g.skipped:
            return [True] * len(g.params)
        return [f > 0 for f in g.gathered[g.numel: g.numel + len(g.params)].tolist()]

    def _module_pre_hook(self, module: nn.Module, args: Any) -> None:
        # the root's mode decides (a submodule in eval mode, e.g. frozen BatchNorm, is updated too)
        if self._pending and torch.is_grad_enabled() and self.model.training:
            self._apply_through(self._module_group[id(module)])

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        # no collective here: the buffers were broadcast in step() (or when the wrapper was built)
        if self._staged_buffers is not None and torch.is_grad_enabled() and module.training:
            _unflatten_into(self._staged_buffers)

    def _drop_staged_buffers(self, *_: Any) -> None:
        self._staged_buffers = None

    def _stage_buffers(self, staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
        """Keep ``staged`` (rank 0's buffers) for the training forwards until the next backward."""
        if self.broadcast_buffers and self.world_size > 1 and staged:
            self._staged_buffers = staged

    def _broadcast_buffers(self, group: dist.ProcessGroup | None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Rank 0's buffers, broadcast on ``group`` (the model's buffers are not written)."""
        buffers = list(self.model.buffers())
        if not buffers:
            return []
        with self._timed("buffer_seconds"):
            return self._broadcast_flat(buffers, group)

    def _broadcast(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        """Synchronous broadcast of ``tensors`` from the group's rank 0, in place."""
        _unflatten_into(self._broadcast_flat(tensors, group))

    @staticmethod
    def _broadcast_flat(tensors: list[torch.Tensor],
                        group: dist.ProcessGroup | None) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """Coalesced synchronous broadcast from the group's rank 0, one flat tensor per dtype and
        device: ``[(tensors, rank 0's values flattened)]``; ``tensors`` are not written."""
        out = _flatten(tensors)
        for _, flat in out:
            dist.broadcast(flat, group=group, group_src=0)
        return out

    # ------------------------------------------------------------------ public helpers
    def flush(self) -> None:
        """Apply the pending update of the last ``step()`` now (waits for its all-gathers).

        Call it before evaluation, checkpointing and at the end of training; afterwards the
        parameters equal those of DDP + the same optimizer after the same number of steps. Cheap
        when nothing is pending. Every rank must call it (it waits for collectives).
        """
        self._apply_through(len(self._groups) - 1)

    def sync_buffers(self) -> None:
        """Give every rank rank 0's current module buffers now, and make them the ones the next
        training forward starts from (see "Module buffers" in the module docstring).

        Call it on every rank, between iterations (after ``step()``), after forwards that changed the
        buffers since ``step()`` and whose changes should be kept, e.g. a BatchNorm recalibration pass
        under ``no_grad``. One coalesced broadcast per buffer dtype; nothing on one rank.

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if self._mid_iteration():
            raise RuntimeError("sync_buffers must be called between iterations (after step())")
        if self.world_size > 1:
            staged = self._broadcast_buffers(self.rs_group)
            _unflatten_into(staged)
            self._stage_buffers(staged)

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

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler in use (given at construction or to :meth:`step` / :meth:`unscale_`)."""
        return self._scaler

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
        DDP's format; ``"dear"`` holds the iteration, the threshold, the tuner state and, when the
        ``grad_filter`` has a ``state_dict()``, the filter's state, e.g. COVAP's error-feedback
        residuals). The GradScaler's state is the caller's (``scaler.state_dict()``)."""
        self.flush()
        filt = self.grad_filter
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dear": {
                "iteration": self.iteration,
                "fusion_mb": self.fusion_mb,
                "tuner": None if self._tuner is None else self._tuner.state_dict(),
                "grad_filter": filt.state_dict() if hasattr(filt, "state_dict") else None,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` on every rank, between iterations (after ``step()`` or
        before the first forward). A pending update is applied first and then overwritten; the groups
        are rebuilt with the saved threshold; the ``grad_filter``'s state is restored when both the
        saved state and the filter have one; with ``broadcast_buffers`` every rank then takes rank 0's
        loaded buffers (:meth:`sync_buffers`), as the next training forward would under DDP.

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if self._mid_iteration():
            raise RuntimeError("load_state_dict must be called between iterations")
        self.flush()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        d = state["dear"]
        self.iteration = int(d["iteration"])
        self.fusion_mb = float(d["fusion_mb"])
        if self._tuner is not None and d.get("tuner") is not None:
            self._tuner.load_state_dict(d["tuner"])
        self._build_groups(self.fusion_mb)
        if d.get("grad_filter") is not None and hasattr(self.grad_filter, "load_state_dict"):
            self.grad_filter.load_state_dict(d["grad_filter"])
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
        self._guard_on = False
        if self._ring_worker is not None:
            self._ring_worker.shutdown(wait=True)
            self._ring_worker = None
        opt = self.optimizer
        for name in ("step", "zero_grad"):
            cur = opt.__dict__.get(name)
            if isinstance(cur, types.MethodType) and cur.__self__ is opt and cur.__func__.__qualname__.startswith(
                    "DeAR._guard_optimizer"):
                if name in self._saved_opt_attrs:
                    setattr(opt, name, self._saved_opt_attrs[name])
                else:
                    delattr(opt, name)


def _flatten(tensors: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``[(tensors of one dtype and device, their values concatenated into a new 1-D tensor)]``."""
    by_dtype: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        return [(ts, torch.cat([t.detach().reshape(-1) for t in ts])) for ts in by_dtype.values()]


def _unflatten_into(staged: list[tuple[list[torch.Tensor], torch.Tensor]]) -> None:
    """Copy each flat tensor of :meth:`DeAR._broadcast_flat`'s result back into its tensors."""
    with torch.no_grad():
        for ts, flat in staged:
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()


class _FutureWork:
    """``.wait()`` for a reduce-scatter running on DeAR's ring worker thread (re-raises its error)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.result()
        return True


def _check_scaler(name: str, scaler: Any, allow_none: bool = True) -> None:
    if scaler is None and allow_none:
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"{name} must be a torch.amp.GradScaler{' or None' if allow_none else ''}, "
                         f"got {type(scaler).__name__}")


def _record_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer,
                      found_inf: torch.Tensor) -> None:
    """Record ``found_inf`` as ``scaler.step(optimizer)`` would, so ``scaler.update()`` backs off or grows."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.STEPPED


def _group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group``'s CPU backend, or ``None`` (torch's default) if unknown."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None
