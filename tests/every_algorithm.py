"""Build every registered algorithm on the same small model (test helper).

``build_small(name)`` returns the Synchroniser of algorithm ``name`` on a 3-layer MLP (20 -> 64 ->
64 -> 10, 5.9 k parameters) with small DDP buckets (several per iteration), SGD with momentum and
weight decay, and options that make every algorithm compress from the first steps;
``batches(rank, n)`` the per-rank data (8 samples of 20 features, 10 classes).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

#: Options given to each algorithm that accepts them (so every one compresses). ``period`` (local-sgd,
#: diloco: steps between syncs) is 5: the callers' 5-step runs end on a sync, where the ranks must
#: agree (between syncs each rank's model is its own), and their 6- and 8-step runs checkpointed after
#: step 3 or 4 resume between syncs and sync once after the resume.
OPTIONS = {"ratio": 2, "density": 0.1, "error_feedback": True, "compressor": "topk", "levels": 127,
           "matrix_approximation_rank": 2, "search_interval": 2, "gain_floor": 0.75, "plateau_tolerance": 0.05,
           "fusion_mb": 0.01, "period": 5,
           # ladder: a limit below its default (0.997): rank 4's error, 0.51 x the gradient noise on the resume
           # matrix's model, escalates it to rank 8 at the first check, so a checkpoint holds a switch
           "max_error_to_noise": 0.3}


#: registered algorithms that run an optional library, and its import name: where it is not installed
#: the every-algorithm tests leave them out (``torchft-diloco``: torchft's DiLoCo, the ``torchft`` extra;
#: tests/test_torchft_peer.py tests it and skips then)
OPTIONAL_LIBRARY = {"torchft-diloco": "torchft"}


def installed_algorithms() -> list[str]:
    """Every registered algorithm name, sorted, except those whose :data:`OPTIONAL_LIBRARY` is not
    installed here."""
    from gradsync.algorithms import REGISTRY

    return sorted(n for n in REGISTRY
                  if n not in OPTIONAL_LIBRARY or importlib.util.find_spec(OPTIONAL_LIBRARY[n]) is not None)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def build_small(name: str, model: nn.Module | None = None, scaler: torch.amp.GradScaler | None = None):
    from gradsync.algorithms import REGISTRY, BuildContext, build

    ctx = BuildContext(model=model if model is not None else small_model(),
                       make_optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True,
                                                                weight_decay=5e-4),
                       bucket_cap_mb=0.01, seed=0, batch_size=8, steps_per_epoch=4, scaler=scaler)
    keys = REGISTRY[name].options.keys()
    return build(name, ctx, {k: v for k, v in OPTIONS.items() if k in keys})


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 20, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(n)]


def wrapped_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, w, hook: bool) -> dict:
    """What a ``gradsync.wrap`` job saves: a hook algorithm's model, optimizer and
    ``ddp.gradsync_state``; an algorithm that replaces DDP its wrapper's ``state_dict()``."""
    if hook:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": w.gradsync_state.state_dict()}
    return {"wrapper": w.state_dict()}


def load_wrapped(model: nn.Module, opt: torch.optim.Optimizer, w, hook: bool, saved: dict) -> None:
    """Load :func:`wrapped_checkpoint`'s result into a fresh model, optimizer and wrapper."""
    if hook:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        w.gradsync_state.load_state_dict(saved["state"])
    else:
        w.load_state_dict(saved["wrapper"])
