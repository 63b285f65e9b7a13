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
from .covap import CovapPlan, CovapState, covap_hook

Hook = Callable[[Any, dist.GradBucket], Any]


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    build: Callable[..., tuple[HookState, Hook]]


def _covap(process_group=None, ratio: int | str = 3, **_: Any):
    # "auto" starts at K=1; the training loop measures the CCR and calls set_ratio before compressing.
    k = 1 if ratio == "auto" else int(ratio)
    return CovapState(ratio=k, process_group=process_group), covap_hook


REGISTRY: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("allreduce", "dense all-reduce, bitwise equal to DDP's default",
                  lambda process_group=None, **_: (AllReduceState(process_group), allreduce_hook)),
        Algorithm("fp16", "torch's fp16_compress_hook (cast to float16, all-reduce)",
                  lambda process_group=None, **_: (FP16State(process_group), fp16_hook)),
        Algorithm("covap", "COVAP coarse-grained filter + discounted error feedback (arXiv 2311.04499)",
                  _covap),
    )
}


def register(algorithm: Algorithm) -> None:
    """Add an algorithm to the registry (later entries with the same name replace earlier ones)."""
    REGISTRY[algorithm.name] = algorithm


def build_hook(name: str, process_group: dist.ProcessGroup | None = None, **options: Any):
    """Return ``(state, hook)`` for algorithm ``name`` with ``options``.

    Raises:
        ValueError: if ``name`` is not registered, or an option is out of range.
    """
    if name not in REGISTRY:
        raise ValueError(f"algorithm must be one of {', '.join(sorted(REGISTRY))}; got {name!r}")
    return REGISTRY[name].build(process_group=process_group, **options)


__all__ = ["REGISTRY", "Algorithm", "register", "build_hook", "HookState", "AllReduceState",
           "FP16State", "CovapState", "CovapPlan", "allreduce_hook", "fp16_hook", "covap_hook"]
