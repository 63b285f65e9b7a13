"""DeAR: reduce-scatter in backward, all-gather in the next forward, with tensor fusion.

Source: Lin Zhang, Shaohuai Shi, Xiaowen Chu, Wei Wang, Bo Li, Chengjian Liu, "Decoupling the
All-Reduce Primitive for Accelerating Distributed Deep Learning", arXiv 2302.12445 (Sec. 3: decoupling
all-reduce into reduce-scatter + all-gather and pipelining them with back-propagation and the next
feed-forward; Sec. 4: tensor fusion and its Bayesian-optimisation tuning). Restated from
``shared/specs/algorithms.md`` §3; the code is written from the description, not copied.

How one iteration runs (world size ``P``):

* **Tensor fusion.** Modules that own trainable parameters directly are taken in registration order
  (taken as forward order; a parameter shared by several modules belongs to the first owner) and cut
  into *fusion groups* (buckets) of consecutive modules: the next module joins the group while the
  group is empty or ``group_bytes + module_bytes < fusion_mb * 2**20``. Group ``k`` owns a flat
  gradient buffer of the parameters' dtype holding its gradients, one "used" flag per parameter, and
  zero padding up to a multiple of ``P`` elements.
* **Backward (wait-free back-propagation).** A post-accumulate-grad hook copies each gradient into its
  group's buffer. When every parameter of a group is ready, an asynchronous
  ``dist.reduce_scatter_tensor`` (sum) of the buffer is launched on the reduce-scatter process group.
  Groups are launched in descending group order (the order gradients normally become ready), the same
  on every rank; a ready group waits until all later groups were launched.
* **step()** launches the groups not launched yet (parameters that got no gradient on this rank
  contribute zeros), waits for all reduce-scatters, divides the shards by ``P`` (average, as DDP) and
  launches the all-gather of group 0 on a separate all-gather process group (``dist.new_group``), so
  reduce-scatters and all-gathers can run concurrently. It does no optimizer math.
* **Next forward.** A forward-pre hook on each module of group ``k`` waits for the all-gather of every
  group up to ``k`` not applied yet, launches the next group's all-gather, and applies the update of
  the group: the averaged gradient becomes ``p.grad``, the user's optimizer runs on that group's
  parameters only, and ``p.grad`` is cleared. So the update of iteration ``t`` is applied lazily, layer
  group by layer group, just before the layers are used in forward ``t + 1``.

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
* Module buffers (BatchNorm statistics) are broadcast from rank 0 at the start of every training
  forward, as DDP's ``broadcast_buffers=True``; parameters and buffers are broadcast from rank 0 when
  the wrapper is built.
* All collectives are launched from hook bodies or ``step()`` on the Python thread (never from
  ``Future`` callbacks), in an order identical on every rank.

Limitations: gradient accumulation over several backward passes per ``step()`` is refused (a second
backward raises ``RuntimeError``); gradient clipping on ``p.grad`` is not possible (gradients are
averaged only in the next forward); a parameter used in a forward through a module other than its
owner (e.g. ``F.linear(x, self.child.weight)`` in the parent) before its owner runs sees the
not-yet-updated value; ``optimizer.add_param_group`` after wrapping is not seen; trainable parameters
that the optimizer does not hold are not synchronised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import all_gather_flat, reduce_scatter_flat
from ..tuning.fusion import FusionTuner
from .base import counter_stats, init_counters
from ..validation import check_float, check_int

MB = 2**20
MAX_FUSION_MB = 1_000_000.0

#: ``grad_filter(flat, step, group) -> None | bool | Tensor | StridedShard``; see :class:`DeAR`.
GradFilter = Callable[[torch.Tensor, int, int], Any]


@dataclass(frozen=True)
class StridedShard:
    """A ``grad_filter`` result asking DeAR to reduce-scatter / all-gather only the elements
    ``flat[start::stride]`` of a group, whose values to send are ``values`` (1-D, same dtype,
    ``len(range(start, numel, stride))`` elements). The other positions get a zero averaged
    gradient. Only this compact tensor (plus the used flags and padding) is communicated."""

    start: int
    stride: int
    values: torch.Tensor


@dataclass
class _Group:
    """One fusion group (bucket) and its per-iteration state."""

    index: int
    modules: list[nn.Module]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # gradient elements (without flags and padding)
    grad_buf: torch.Tensor  # (padded,) reduce-scatter input: grads | used flags | zero padding
    shard: torch.Tensor  # (padded / P,) reduce-scatter output, all-gather input
    gathered: torch.Tensor  # (padded,) all-gather output: averaged grads | averaged flags | padding
    opt_groups: list[tuple[int, list[nn.Parameter]]]  # (user param-group index, params)
    ready: list[bool] = field(default_factory=list)
    n_ready: int = 0
    launched: bool = False
    skipped: bool = False
    rs_work: Any = None
    ag_work: Any = None
    sel: StridedShard | None = None  # this iteration's strided selection (grad_filter)
    c_in: Any = None  # compact reduce-scatter input / shard / all-gather output for ``sel``
    c_shard: Any = None
    c_out: Any = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.grad_buf.element_size()


class DeAR:
    """Data-parallel training with DeAR's decoupled reduce-scatter / all-gather pipeline.

    Use it in place of ``DistributedDataParallel`` + ``optimizer.step()``::

        dear = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for x, y in loader:
            dear.zero_grad()
            loss_fn(model(x), y).backward()   # or dear(x)
            dear.step()                        # not optimizer.step()
            scheduler.step()                   # optional, on the user's optimizer
        dear.flush()                           # apply the last update (also before evaluation)

    After :meth:`flush` the parameters equal those of DDP + the same optimizer (within float
    tolerance). Building the wrapper is collective: every process of the default group must call it
    (``dist.new_group`` is called twice), in the same order as other ``new_group`` calls.

    Args:
        model: the module to train (parameters on one device; CPU with Gloo, or CUDA with NCCL).
        optimizer: a ``torch.optim.Optimizer`` over (a subset of) ``model``'s parameters whose update
            of a parameter depends only on that parameter's gradient and state (every ``torch.optim``
            optimizer except ``LBFGS``).
        process_group: the data-parallel group (``None`` = default group). Two new groups with the
            same ranks are created for reduce-scatter and all-gather.
        fusion_mb: tensor-fusion threshold in MB (2**20 bytes), in (0, 1e6] (default 25.0, as DeAR;
            a tiny value puts each module in its own group, "DeAR w/o TF"), or ``"auto"`` to tune it
            online with :class:`~gradsync.tuning.fusion.FusionTuner` (starts at 25 MB, searches 1-256 MB).
        broadcast_buffers: broadcast module buffers from rank 0 at the start of each training forward
            (default ``True``, as DDP).
        max_allgathers: all-gathers kept in flight during the next forward, >= 1 (default 1, as DeAR:
            waiting for group ``k``'s all-gather launches group ``k + 1``'s). A large value launches
            every group's all-gather in ``step()``, so they run back to back behind the forward.
        grad_filter: optional compression filter called as ``grad_filter(flat, step, group)`` on each
            group before its reduce-scatter, where ``flat`` is the group's flat gradient (1-D view of
            ``numel`` elements, the parameters' dtype, parameter order), ``step`` the iteration
            (:attr:`iteration`) and ``group`` the group index. It may modify ``flat`` in place and
            return ``None``/``True``, return a tensor of the same shape to send instead, or return
            ``False`` to send nothing for this group this iteration (the group then gets a zero
            averaged gradient; the decision must be identical on every rank), or return a
            :class:`StridedShard` to communicate only ``flat[start::stride]`` (the size must be
            identical on every rank). Its run time is added to
            ``compress_seconds``.
        tune_trials, tune_window, tune_warmup: :class:`FusionTuner` settings for ``fusion_mb="auto"``
            (trials, iterations per trial, iterations ignored before the first trial).
        seed: seed of the tuner's optimiser.
        timeout: timeout of the two new process groups (default: the timeout of ``process_group``).

    Raises:
        ValueError: on a bad argument (wrong types, ``fusion_mb`` out of range or not ``"auto"``,
            tuner settings out of range, LBFGS, optimizer parameters that are not in ``model``, no
            trainable parameter, a module owning parameters of several dtypes).
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
        max_allgathers: int = 1,
        grad_filter: GradFilter | None = None,
        tune_trials: int = 10,
        tune_window: int = 5,
        tune_warmup: int | None = None,
        seed: int = 0,
        timeout: timedelta | None = None,
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
        self.max_allgathers = check_int("max_allgathers", max_allgathers, 1, 1_000_000)
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

        # ---- modules in forward (registration) order, parameters to their first owner ----
        seen: set[int] = set()
        self._modules: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for m in model.modules():
            own = []
            for p in m.parameters(recurse=False):
                if id(p) in seen or not p.requires_grad or id(p) not in opt_params:
                    continue
                seen.add(id(p))
                own.append(p)
            if own:
                self._modules.append((m, own))
        if not self._modules:
            raise ValueError("model has no trainable parameter held by the optimizer")
        self._user_group_of = {id(p): opt_params[id(p)] for _, ps in self._modules for p in ps}

        # ---- process groups: one for reduce-scatter, one for all-gather ----
        ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
        if timeout is None:
            timeout = _group_timeout(process_group)
        self.rs_group = dist.new_group(ranks, timeout=timeout)
        self.ag_group = dist.new_group(ranks, timeout=timeout)
        if self._tuner is not None:
            self._tuner.process_group = self.rs_group

        # ---- counters ----
        init_counters(self)
        self.rs_wait_seconds = 0.0
        self.ag_wait_seconds = 0.0
        self.buffer_seconds = 0.0

        # ---- pipeline state ----
        self._groups: list[_Group] = []
        self._module_group: dict[int, int] = {}
        self._param_loc: dict[int, tuple[int, int]] = {}
        self._next_launch = -1  # highest group index not launched yet in this backward
        self._pending = False  # an update from the last step() is not fully applied yet
        self._next_apply = 0
        self._next_ag = 0
        self._ag_inflight = 0  # all-gathers launched and not yet waited for
        self._hparams: list[dict[str, Any]] = []
        self._build_groups(self.fusion_mb)

        # ---- initial state from rank 0, as DDP ----
        self._broadcast(list(model.parameters()) + list(model.buffers()), process_group)

        # ---- hooks ----
        self._handles: list[Any] = []
        self._handles.append(model.register_forward_pre_hook(self._root_pre_hook, prepend=True))
        for m, _ in self._modules:
            self._handles.append(m.register_forward_pre_hook(self._module_pre_hook))
        for _, ps in self._modules:
            for p in ps:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook))

    # ------------------------------------------------------------------ grouping (tensor fusion)
    def _build_groups(self, fusion_mb: float) -> None:
        limit = fusion_mb * MB
        cuts: list[list[tuple[nn.Module, list[nn.Parameter]]]] = []
        cur: list[tuple[nn.Module, list[nn.Parameter]]] = []
        cur_bytes = 0
        dtype = None
        for m, ps in self._modules:
            mbytes = sum(p.numel() * p.element_size() for p in ps)
            mdtypes = {p.dtype for p in ps}
            if len(mdtypes) > 1:
                raise ValueError(f"module {type(m).__name__} owns parameters of several dtypes")
            mdtype = ps[0].dtype
            if cur and (cur_bytes + mbytes >= limit or mdtype != dtype):
                cuts.append(cur)
                cur, cur_bytes = [], 0
            cur.append((m, ps))
            cur_bytes += mbytes
            dtype = mdtype
        if cur:
            cuts.append(cur)

        P = self.world_size
        self._groups = []
        self._module_group = {}
        self._param_loc = {}
        for k, members in enumerate(cuts):
            params = [p for _, ps in members for p in ps]
            offsets, off = [], 0
            for p in params:
                offsets.append(off)
                off += p.numel()
            numel = off
            padded = -(-(numel + len(params)) // P) * P
            ref = params[0]
            grad_buf = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
            by_user: dict[int, list[nn.Parameter]] = {}
            for p in params:
                by_user.setdefault(self._user_group_of[id(p)], []).append(p)
            g = _Group(
                index=k,
                modules=[m for m, _ in members],
                params=params,
                offsets=offsets,
                numel=numel,
                grad_buf=grad_buf,
                shard=torch.zeros(padded // P, dtype=ref.dtype, device=ref.device),
                gathered=torch.zeros(padded, dtype=ref.dtype, device=ref.device),
                opt_groups=sorted(by_user.items()),
                ready=[False] * len(params),
            )
            self._groups.append(g)
            for m, _ in members:
                self._module_group[id(m)] = k
            for slot, p in enumerate(params):
                self._param_loc[id(p)] = (k, slot)
        self._next_launch = len(self._groups) - 1

    def set_fusion_mb(self, fusion_mb: float) -> None:
        """Apply any pending update (:meth:`flush`), then regroup with a new threshold (MB).

        Call it on every rank at the same point, between ``step()`` and the next forward (no
        reduce-scatter may be in flight). Results are unchanged by regrouping.

        Raises:
            ValueError: if ``fusion_mb`` is not in (0, 1e6].
            RuntimeError: if called between a backward pass and ``step()``.
        """
        fusion_mb = check_float("fusion_mb", fusion_mb, 0.0, MAX_FUSION_MB, low_inclusive=False)
        if any(g.launched or g.n_ready for g in self._groups):
            raise RuntimeError("set_fusion_mb must be called after step(), not during an iteration")
        self.flush()
        self.fusion_mb = float(fusion_mb)
        self._build_groups(self.fusion_mb)

    # ------------------------------------------------------------------ backward: reduce-scatter
    def _grad_hook(self, p: torch.Tensor) -> None:
        k, slot = self._param_loc[id(p)]
        g = self._groups[k]
        if g.ready[slot] or g.launched:
            raise RuntimeError(
                "DeAR: a second backward pass before step(); gradient accumulation is not supported"
            )
        if p.grad is None:
            return
        if p.grad.is_sparse:
            raise RuntimeError("DeAR does not support sparse gradients")
        off = g.offsets[slot]
        g.grad_buf[off:off + p.numel()].copy_(p.grad.reshape(-1))
        g.grad_buf[g.numel + slot] = 1.0
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

    def _launch_rs(self, g: _Group) -> None:
        for slot, ok in enumerate(g.ready):  # params without a gradient on this rank send zeros
            if not ok:
                off = g.offsets[slot]
                g.grad_buf[off:off + g.params[slot].numel()].zero_()
                g.grad_buf[g.numel + slot] = 0.0
        g.launched = True
        g.skipped = False
        self.dense_bytes += g.nbytes
        if self.grad_filter is not None:
            t0 = time.perf_counter()
            flat = g.grad_buf[: g.numel]
            out = self.grad_filter(flat, self.iteration, g.index)
            g.sel = None
            if out is False:
                g.skipped = True
            elif isinstance(out, StridedShard):
                self._compact(g, out)
            elif isinstance(out, torch.Tensor):
                if out.shape != flat.shape:
                    raise RuntimeError(
                        f"grad_filter returned shape {tuple(out.shape)}, expected {tuple(flat.shape)}"
                    )
                flat.copy_(out)
            self.compress_seconds += time.perf_counter() - t0
            if g.skipped:
                self.buckets_skipped += 1
                return
        src, dst = (g.c_in, g.c_shard) if g.sel is not None else (g.grad_buf, g.shard)
        g.rs_work = reduce_scatter_flat(dst, src, group=self.rs_group, async_op=True)
        self.collectives += 1
        self.bytes_sent += src.numel() * src.element_size()

    def _compact(self, g: _Group, sel: StridedShard) -> None:
        """Pack ``sel.values`` and the used flags into compact buffers padded to a multiple of P."""
        m = len(range(sel.start, g.numel, sel.stride))
        if sel.values.shape != (m,):
            raise RuntimeError(f"StridedShard.values has shape {tuple(sel.values.shape)}, expected ({m},)")
        n_flags = len(g.params)
        padded = -(-(m + n_flags) // self.world_size) * self.world_size
        g.c_in = g.grad_buf.new_zeros(padded)
        g.c_in[:m] = sel.values
        g.c_in[m:m + n_flags] = g.grad_buf[g.numel:g.numel + n_flags]
        g.c_shard = g.grad_buf.new_zeros(padded // self.world_size)
        g.c_out = g.grad_buf.new_zeros(padded)
        g.sel = sel

    # ------------------------------------------------------------------ step: wait, start all-gather
    def step(self) -> None:
        """End the iteration: launch missing reduce-scatters, wait for all, start the all-gathers.

        Also applies any part of the previous update not applied in this iteration's forward, and
        (with ``fusion_mb="auto"``) runs the tuner, regrouping when it asks to (after applying the
        update synchronously, so no collective is in flight). Does no optimizer math otherwise: the
        update is applied in the next forward, or by :meth:`flush`. Collective: every rank must call it.
        """
        self._apply_through(len(self._groups) - 1)  # leftovers of the previous update
        while self._next_launch >= 0:  # finalisation: same order on every rank
            self._launch_rs(self._groups[self._next_launch])
            self._next_launch -= 1
        t0 = time.perf_counter()
        for g in reversed(self._groups):
            if g.rs_work is not None:
                g.rs_work.wait()
                g.rs_work = None
        self.rs_wait_seconds += time.perf_counter() - t0
        for g in self._groups:
            if g.skipped:
                g.gathered.zero_()
                g.gathered[g.numel: g.numel + len(g.params)] = 1.0
            else:
                (g.c_shard if g.sel is not None else g.shard).div_(self.world_size)
            g.ready = [False] * len(g.params)
            g.n_ready = 0
            g.launched = False
        self._next_launch = len(self._groups) - 1
        # hyper-parameters as they are now (before any scheduler.step() of this iteration)
        self._hparams = [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in pg.items() if k != "params"}
            for pg in self.optimizer.param_groups
        ]
        # the update is applied later, but it is this iteration's optimizer step for a scheduler
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        self.iteration += 1
        self._pending = True
        self._next_apply = 0
        self._next_ag = 0
        self._launch_next_ag()
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
            self.collectives += 1
            self.bytes_sent += src.numel() * src.element_size()
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

    def _apply(self, g: _Group) -> None:
        if g.ag_work is not None:
            t0 = time.perf_counter()
            g.ag_work.wait()
            self.ag_wait_seconds += time.perf_counter() - t0
            g.ag_work = None
            self._ag_inflight -= 1
        self._launch_next_ag()
        if g.sel is not None:  # expand the compact all-gather result; unsent positions are zero
            m, n_flags = len(range(g.sel.start, g.numel, g.sel.stride)), len(g.params)
            g.gathered.zero_()
            g.gathered[g.sel.start:g.numel:g.sel.stride] = g.c_out[:m]
            g.gathered[g.numel:g.numel + n_flags] = g.c_out[m:m + n_flags]
            g.sel = g.c_in = g.c_shard = g.c_out = None
        flags = g.gathered[g.numel: g.numel + len(g.params)].tolist()
        with torch.no_grad():
            for slot, p in enumerate(g.params):
                if flags[slot] > 0:
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
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = saved
        for p in g.params:
            p.grad = None

    def _module_pre_hook(self, module: nn.Module, args: Any) -> None:
        if self._pending and torch.is_grad_enabled() and module.training:
            self._apply_through(self._module_group[id(module)])

    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if self.broadcast_buffers and self.world_size > 1 and torch.is_grad_enabled() and module.training:
            bufs = list(self.model.buffers())
            if bufs:
                t0 = time.perf_counter()
                # the reduce-scatter group is idle between step() and the next backward
                self._broadcast(bufs, self.rs_group)
                self.buffer_seconds += time.perf_counter() - t0

    def _broadcast(self, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        """Coalesced synchronous broadcast from the group's rank 0, one flat tensor per dtype."""
        by_dtype: dict[Any, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for ts in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                dist.broadcast(flat, group=group, group_src=0)
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

    # ------------------------------------------------------------------ public helpers
    def flush(self) -> None:
        """Apply the pending update of the last ``step()`` now (waits for its all-gathers).

        Call it before evaluation, checkpointing and at the end of training; afterwards the
        parameters equal those of DDP + the same optimizer after the same number of steps. Cheap
        when nothing is pending. Every rank must call it (it waits for collectives).
        """
        self._apply_through(len(self._groups) - 1)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

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

        Keys: ``iteration``; ``bytes_sent`` (bytes of the tensors handed to reduce-scatter and
        all-gather: the padded group buffer plus its shard per group and iteration); ``dense_bytes``
        (gradient bytes, what one dense all-reduce per group would hand over); ``collectives``
        (reduce-scatters + all-gathers); ``buckets_skipped`` (groups the ``grad_filter`` did not
        send); ``compress_seconds`` (s in ``grad_filter``); ``compression_ratio`` (dense_bytes /
        bytes_sent; below 1 without a filter because of the all-gather shard and padding);
        ``rs_wait_seconds`` and ``ag_wait_seconds`` (s blocked in ``.wait()`` of reduce-scatters and
        all-gathers: exposed communication); ``buffer_broadcast_seconds`` (s broadcasting buffers);
        ``fusion_mb`` (threshold in use, MB); ``num_groups``; with ``fusion_mb="auto"`` also
        ``tuning`` (:meth:`FusionTuner.report`).
        """
        out: dict[str, Any] = {
            **counter_stats(self),
            "rs_wait_seconds": self.rs_wait_seconds,
            "ag_wait_seconds": self.ag_wait_seconds,
            "buffer_broadcast_seconds": self.buffer_seconds,
            "fusion_mb": self.fusion_mb,
            "num_groups": len(self._groups),
        }
        if self._tuner is not None:
            out["tuning"] = self._tuner.report()
        return out

    def config(self) -> dict[str, Any]:
        """Configuration fields that must be identical on every rank."""
        return {"algorithm": "dear", "fusion_mb": "auto" if self.auto else self.fusion_mb,
                "broadcast_buffers": self.broadcast_buffers}

    def state_dict(self) -> dict[str, Any]:
        """Flush, then return ``{"model", "optimizer", "dear"}`` (the optimizer's own state_dict, in
        DDP's format; ``"dear"`` holds the iteration, the threshold and the tuner state)."""
        self.flush()
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dear": {
                "iteration": self.iteration,
                "fusion_mb": self.fusion_mb,
                "tuner": None if self._tuner is None else self._tuner.state_dict(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` on every rank, between iterations (after ``step()`` or
        before the first forward). A pending update is applied first and then overwritten; the groups
        are rebuilt with the saved threshold.

        Raises:
            RuntimeError: if called between a backward pass and ``step()``.
        """
        if any(g.launched or g.n_ready for g in self._groups):
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

    def remove_hooks(self) -> None:
        """Flush, then remove every hook; the model then trains as a plain local module."""
        self.flush()
        for h in self._handles:
            h.remove()
        self._handles = []


def _group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout of ``group``'s CPU backend, or ``None`` (torch's default) if unknown."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        return None
