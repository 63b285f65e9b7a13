"""DeAR's tensor fusion: module order, fusion groups, their sizes and flat buffers.

Source: Lin Zhang, Shaohuai Shi, Xiaowen Chu, Wei Wang, Bo Li, Chengjian Liu, "DeAR: Accelerating
Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445, Sec. 4 (tensor
fusion: consecutive layers are merged into one reduce-scatter / all-gather until a size threshold).

This module only decides *what* is communicated together; the pipeline that fills, reduces and
applies the buffers is :class:`gradsync.algorithms.dear.DeAR` (:mod:`.pipeline`).

* :func:`trainable_modules` lists the modules that own trainable parameters directly, in registration
  order (taken as forward order); a parameter shared by several modules belongs to its first owner.
* :func:`cut_modules` cuts that list into fusion groups of consecutive modules: the next module joins
  the group while the group is empty or ``group_bytes + module_bytes < fusion_mb * 2**20``, and a
  change of parameter dtype starts a new group.
* :func:`build_groups` allocates each group's flat buffers: ``numel`` gradient elements (parameter
  order), one "used" flag per parameter, and zero padding up to a multiple of the world size ``P``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MB = 2**20
#: largest tensor-fusion threshold ``fusion_mb`` accepted (MB)
MAX_FUSION_MB = 1_000_000.0

ModuleParams = tuple[nn.Module, list[nn.Parameter]]


@dataclass
class FusionGroup:
    """One fusion group (bucket): its layout, its flat buffers and its per-iteration pipeline state.

    Layout of ``grad_buf`` and ``gathered`` (``padded`` elements, the parameters' dtype and device):
    ``[0, numel)`` gradients in parameter order (parameter ``i`` at ``offsets[i]``), then
    ``len(params)`` used flags, then zeros up to ``padded`` (a multiple of ``P``). ``shard`` holds
    ``padded / P`` elements: rank ``r`` owns positions ``[r * padded / P, (r + 1) * padded / P)``.
    """

    index: int
    modules: list[nn.Module]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int  # gradient elements (without flags and padding)
    grad_buf: torch.Tensor  # (padded,) reduce-scatter input: grads | used flags | zero padding
    shard: torch.Tensor  # (padded / P,) reduce-scatter output, all-gather input
    gathered: torch.Tensor  # (padded,) all-gather output: averaged grads | averaged flags | padding
    opt_groups: list[tuple[int, list[nn.Parameter]]]  # (user param-group index, params)
    # ---- per-iteration state, owned by the pipeline ----
    ready: list[bool] = field(default_factory=list)
    n_ready: int = 0
    launched: bool = False
    all_used: bool = False  # every parameter had a gradient on this rank (so every used flag is > 0)
    skipped: bool = False
    unscaled: bool = False  # gradients already multiplied by 1 / loss scale before the reduce-scatter
    rs_work: Any = None
    ag_work: Any = None
    sel: Any = None  # this iteration's StridedShard (grad_filter), else None
    c_in: Any = None  # compact reduce-scatter input / shard / all-gather output for ``sel``
    c_shard: Any = None
    c_out: Any = None

    @property
    def nbytes(self) -> int:
        """Gradient bytes of the group (without flags and padding)."""
        return self.numel * self.grad_buf.element_size()

    @property
    def n_flags(self) -> int:
        return len(self.params)

    def sent_numel(self) -> int:
        """Gradient elements this iteration's reduce-scatter carries (``numel``, or the strided count)."""
        if self.sel is None:
            return self.numel
        return len(range(self.sel.start, self.numel, self.sel.stride))

    def shard_grads(self, rank: int, world_size: int) -> torch.Tensor:
        """View of this rank's reduce-scatter output that holds gradient values (no flags, no padding).

        Returns a 1-D view (possibly empty) of ``shard`` (or of the compact shard when a
        :class:`~gradsync.algorithms.dear.StridedShard` was sent) in the group's dtype.
        """
        src = self.c_shard if self.sel is not None else self.shard
        n = src.numel()
        lo = rank * n
        hi = min(lo + n, self.sent_numel())
        return src[: max(hi - lo, 0)]


def trainable_modules(model: nn.Module, opt_params: dict[int, int]) -> list[ModuleParams]:
    """Modules of ``model`` owning trainable parameters held by the optimizer, in registration order.

    Args:
        model: the module tree.
        opt_params: ``id(param) -> optimizer param-group index`` of the optimizer's parameters.

    Returns:
        ``[(module, [params it owns first])]``; parameters with ``requires_grad=False`` or not held
        by the optimizer are left out; a shared parameter goes to its first owner only.

    Raises:
        ValueError: if no module owns such a parameter, or a module owns parameters of several dtypes.
    """
    seen: set[int] = set()
    out: list[ModuleParams] = []
    for m in model.modules():
        own = []
        for p in m.parameters(recurse=False):
            if id(p) in seen or not p.requires_grad or id(p) not in opt_params:
                continue
            seen.add(id(p))
            own.append(p)
        if own:
            if len({p.dtype for p in own}) > 1:
                raise ValueError(f"module {type(m).__name__} owns parameters of several dtypes")
            out.append((m, own))
    if not out:
        raise ValueError("model has no trainable parameter held by the optimizer")
    return out


def cut_modules(modules: list[ModuleParams], fusion_mb: float) -> list[list[ModuleParams]]:
    """Cut ``modules`` into fusion groups of consecutive modules (threshold ``fusion_mb`` MB = 2**20 B).

    A module joins the current group while the group is empty or ``group_bytes + module_bytes <
    fusion_mb * 2**20`` and its parameters have the group's dtype. Deterministic, so every rank with
    the same model gets the same groups.
    """
    limit = fusion_mb * MB
    cuts: list[list[ModuleParams]] = []
    cur: list[ModuleParams] = []
    cur_bytes = 0
    dtype = None
    for m, ps in modules:
        mbytes = sum(p.numel() * p.element_size() for p in ps)
        mdtype = ps[0].dtype
        if cur and (cur_bytes + mbytes >= limit or mdtype != dtype):
            cuts.append(cur)
            cur, cur_bytes = [], 0
        cur.append((m, ps))
        cur_bytes += mbytes
        dtype = mdtype
    if cur:
        cuts.append(cur)
    return cuts


@dataclass
class FusionLayout:
    """Groups plus the look-up tables the pipeline's hooks need."""

    groups: list[FusionGroup]
    module_group: dict[int, int]  # id(module) -> group index
    param_loc: dict[int, tuple[int, int]]  # id(param) -> (group index, slot)


def build_groups(modules: list[ModuleParams], fusion_mb: float, world_size: int,
                 user_group_of: dict[int, int]) -> FusionLayout:
    """Allocate the flat buffers of the groups :func:`cut_modules` forms (see :class:`FusionGroup`).

    Args:
        modules: :func:`trainable_modules` output.
        fusion_mb: threshold in MB (2**20 bytes), > 0.
        world_size: ``P``; buffers are padded to a multiple of it.
        user_group_of: ``id(param) -> optimizer param-group index``.
    """
    P = world_size
    groups: list[FusionGroup] = []
    module_group: dict[int, int] = {}
    param_loc: dict[int, tuple[int, int]] = {}
    for k, members in enumerate(cut_modules(modules, fusion_mb)):
        params = [p for _, ps in members for p in ps]
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        numel = off
        padded = -(-(numel + len(params)) // P) * P
        ref = params[0]
        by_user: dict[int, list[nn.Parameter]] = {}
        for p in params:
            by_user.setdefault(user_group_of[id(p)], []).append(p)
        g = FusionGroup(
            index=k,
            modules=[m for m, _ in members],
            params=params,
            offsets=offsets,
            numel=numel,
            grad_buf=torch.zeros(padded, dtype=ref.dtype, device=ref.device),
            shard=torch.zeros(padded // P, dtype=ref.dtype, device=ref.device),
            gathered=torch.zeros(padded, dtype=ref.dtype, device=ref.device),
            opt_groups=sorted(by_user.items()),
            ready=[False] * len(params),
        )
        groups.append(g)
        for m, _ in members:
            module_group[id(m)] = k
        for slot, p in enumerate(params):
            param_loc[id(p)] = (k, slot)
    return FusionLayout(groups, module_group, param_loc)
