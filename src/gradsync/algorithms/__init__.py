"""Registry of gradsync algorithms by name.

Each entry builds a ``(state, hook)`` pair for ``ddp.register_comm_hook(state, hook)`` from keyword
options (the CLI passes its parsed arguments); unknown names raise ``ValueError`` listing the
registered ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from .allreduce import AllReduceState, FP16State, allreduce_hook, fp16_hook
from .base import HookState
from .compressed import CompressedState, compressed_hook
from .covap import CovapPlan, CovapState, covap_hook
from .gravac import GravacState, gravac_hook
from .oscar import CountSketchState, OscarASCState, OscarSWState, countsketch_hook, oscar_hook
from .powersgd import PowerSGDHookState, powersgd_hook

Hook = Callable[[Any, dist.GradBucket], Any]


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: ``build(process_group=None, model=None, **options)`` returns
    ``(state, hook)``; ``single_bucket`` asks the caller to build DDP with one bucket."""

    name: str
    summary: str
    build: Callable[..., tuple[HookState, Hook]]
    single_bucket: bool = False


def _covap(process_group=None, ratio: int | str = 3, **_: Any):
    # "auto" starts at K=1; the training loop measures the CCR and calls set_ratio before compressing.
    k = 1 if ratio == "auto" else int(ratio)
    return CovapState(ratio=k, process_group=process_group), covap_hook


def _compressed(name: str, **fixed: Any):
    """Builder for ``CompressedState(name)``; ``density`` is passed to sparsifiers only."""

    def build(process_group=None, model=None, density: float = 0.01, error_feedback: bool = True,
              levels: int = 127, steps_per_epoch: int = 0, **_: Any):
        kwargs: dict[str, Any] = dict(fixed)
        if name in ("topk", "randomk", "dgc", "redsync"):
            kwargs["density"] = density
        if name == "dgc":
            kwargs["warmup_steps"] = steps_per_epoch
        if name == "qsgd":
            kwargs["levels"] = levels
        state = CompressedState(name, error_feedback=error_feedback, process_group=process_group,
                                model=model, **kwargs)
        return state, compressed_hook

    return build


def _gravac(process_group=None, model=None, compressor: str = "topk", batch_size: int = 1,
            steps_per_epoch: int = 200, search_interval: int | None = None, gain_floor: float = 0.75,
            plateau_tolerance: float = 0.05, **_: Any):
    # The reference code searches once per epoch; a quarter epoch lets short runs explore 10x..10,000x.
    interval = search_interval or max(1, steps_per_epoch // 4)
    state = GravacState(compressor=compressor, batch_size=batch_size, process_group=process_group,
                        search_interval=interval, epsilon=gain_floor, omega=plateau_tolerance, model=model)
    return state, gravac_hook


def _oscar(state_cls, hook):
    def build(process_group=None, seed: int = 0, **_: Any):
        return state_cls(process_group=process_group, seed=seed), hook

    return build


def _powersgd(process_group=None, rank: int = 2, seed: int = 0, **_: Any):
    return PowerSGDHookState(rank=rank, process_group=process_group, seed=seed), powersgd_hook


REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("allreduce", "dense all-reduce, bitwise equal to DDP's default",
                  lambda process_group=None, **_: (AllReduceState(process_group), allreduce_hook)),
        Algorithm("fp16", "torch's fp16_compress_hook (cast to float16, all-reduce)",
                  lambda process_group=None, **_: (FP16State(process_group), fp16_hook)),
        Algorithm("covap", "COVAP coarse-grained filter + discounted error feedback (arXiv 2311.04499)",
                  _covap),
        Algorithm("powersgd", "torch's PowerSGD hook, rank --rank, error feedback (Vogels et al. 2019); "
                  "one DDP bucket on Gloo", _powersgd, single_bucket=True),
        Algorithm("topk", "top-k sparsification, --density, sparse all-gather (Aji & Heafield 2017)",
                  _compressed("topk")),
        Algorithm("randomk", "random-k with a seed shared by all ranks, all-reduce", _compressed("randomk")),
        Algorithm("dgc", "DGC sampled threshold with density warm-up (Lin et al. 2018)", _compressed("dgc")),
        Algorithm("redsync", "RedSync threshold binary search (Fang et al. 2019)", _compressed("redsync")),
        Algorithm("qsgd", "QSGD stochastic quantisation, --levels (Alistarh et al. 2017)", _compressed("qsgd")),
        Algorithm("signsgd", "EF-SignSGD scaled sign (Karimireddy et al. 2019)", _compressed("signsgd")),
        Algorithm("bf16", "cast to bfloat16, all-reduce", _compressed("bf16")),
        Algorithm("gravac", "GraVAC adaptive compression factor, --compressor (Tyagi & Swany 2023)", _gravac),
        Algorithm("oscar-sw", "OSCAR split by the aggregated zero mask, count sketch + dense int8 (reconstructed)",
                  _oscar(OscarSWState, oscar_hook)),
        Algorithm("oscar-asc", "OSCAR-SW with a balanced-chunk ring and ASC entropy coding (reconstructed)",
                  _oscar(OscarASCState, oscar_hook)),
        Algorithm("countsketch", "count-sketch compression with heavy-hitter recovery (Sketched-SGD/FetchSGD)",
                  _oscar(CountSketchState, countsketch_hook)),
    )
}


def register(algorithm: Algorithm) -> None:
    """Add an algorithm to the registry (later entries with the same name replace earlier ones)."""
    REGISTRY[algorithm.name] = algorithm


#: Algorithms that replace DDP instead of plugging into it as a communication hook.
DEAR_ALGORITHMS = ("dear", "dear-covap")


def _unknown(name: str) -> ValueError:
    known = sorted([*REGISTRY, *DEAR_ALGORITHMS])
    return ValueError(f"algorithm must be one of {', '.join(known)}; got {name!r}")


def bucket_cap_mb_for(name: str, bucket_cap_mb: float) -> float:
    """DDP bucket size for algorithm ``name``: one bucket (10 GB cap) where the algorithm needs it
    (torch's PowerSGD hook launches collectives from callbacks, safe on Gloo only with one bucket)."""
    return 1e4 if REGISTRY[name].single_bucket else bucket_cap_mb


def wrap_ddp(model: Any, name: str, process_group: dist.ProcessGroup | None = None,
             bucket_cap_mb: float = 25.0, device_ids: list[int] | None = None, **options: Any):
    """``DistributedDataParallel(model)`` with algorithm ``name``'s hook registered.

    Returns:
        ``(ddp, state)``.

    Raises:
        ValueError: for an unknown ``name`` or out-of-range options.
    """
    from torch.nn.parallel import DistributedDataParallel

    if name not in REGISTRY:
        raise _unknown(name)
    ddp = DistributedDataParallel(model, process_group=process_group, device_ids=device_ids,
                                  bucket_cap_mb=bucket_cap_mb_for(name, bucket_cap_mb))
    state, hook = build_hook(name, process_group=process_group, model=model, **options)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def wrap_dear(model: Any, optimizer: Any, name: str = "dear", process_group: dist.ProcessGroup | None = None,
              ratio: int | str = 3, **dear_options: Any):
    """A :class:`~gradsync.algorithms.dear.DeAR` wrapper; ``dear-covap`` adds COVAP's filter with
    ratio K (``"auto"`` starts at K = 1 until ``set_ratio``), reachable as ``wrapper.grad_filter``.

    Raises:
        ValueError: for an unknown ``name`` or bad DeAR options.
    """
    from .dear import DeAR
    from .dear_covap import CovapGradFilter

    if name not in DEAR_ALGORITHMS:
        raise _unknown(name)
    grad_filter = None
    if name == "dear-covap":
        grad_filter = CovapGradFilter(ratio=1 if ratio == "auto" else ratio)
    dear = DeAR(model, optimizer, process_group=process_group, grad_filter=grad_filter, **dear_options)
    if grad_filter is not None:
        grad_filter.bind(dear)
    return dear


def build_hook(name: str, process_group: dist.ProcessGroup | None = None, **options: Any):
    """Return ``(state, hook)`` for algorithm ``name`` with ``options``.

    Raises:
        ValueError: if ``name`` is not registered, or an option is out of range.
    """
    if name not in REGISTRY:
        raise ValueError(f"algorithm must be one of {', '.join(sorted(REGISTRY))}; got {name!r}")
    return REGISTRY[name].build(process_group=process_group, **options)


__all__ = ["REGISTRY", "DEAR_ALGORITHMS", "Algorithm", "register", "build_hook", "wrap_ddp", "wrap_dear",
           "bucket_cap_mb_for", "HookState", "AllReduceState",
           "FP16State", "CovapState", "CovapPlan", "CompressedState", "GravacState", "PowerSGDHookState",
           "allreduce_hook", "fp16_hook", "covap_hook", "compressed_hook", "gravac_hook", "powersgd_hook"]
