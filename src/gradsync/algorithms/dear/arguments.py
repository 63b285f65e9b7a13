"""The checks of :class:`~gradsync.algorithms.dear.pipeline.DeAR`'s arguments, run before any
collective so that a bad argument raises the same ``ValueError`` on every rank and starts nothing."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...tuning.fusion import FusionTuner
from ...validation import check_choice, check_float, check_int
from .amp import check_scaler
from .communicator import ALL_ALLGATHERS, REDUCE_SCATTER_CHOICES
from .groups import MAX_FUSION_MB

__all__ = ["check_arguments", "optimizer_group_of", "tuner_for"]


def check_arguments(model: Any, optimizer: Any, fusion_mb: Any, grad_filter: Any, broadcast_buffers: Any,
                    grad_scaler: Any, reduce_scatter: Any, max_allgathers: Any) -> tuple[float | str, str, int | str]:
    """Check DeAR's arguments (see its docstring for their meaning and ranges).

    Returns:
        ``(fusion_mb, reduce_scatter, max_allgathers)``: ``fusion_mb`` a float in (0, 1e6] MB or
        ``"auto"``; ``reduce_scatter`` one of ``auto``, ``native``, ``ring``; ``max_allgathers`` an
        int >= 1 or ``"auto"``.

    Raises:
        ValueError: naming the argument: a model that is not an ``nn.Module``, an optimizer that is
            not a ``torch.optim.Optimizer`` or is LBFGS, ``fusion_mb`` out of range and not
            ``"auto"``, a ``grad_filter`` that is not callable, a non-bool ``broadcast_buffers``, a
            ``grad_scaler`` that is not a ``torch.amp.GradScaler``, an unknown ``reduce_scatter``,
            ``max_allgathers`` out of range.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("optimizer must be a per-parameter optimizer; LBFGS is not supported by DeAR")
    if isinstance(fusion_mb, str):
        if fusion_mb != "auto":
            raise ValueError(f"fusion_mb must be a number in (0, {MAX_FUSION_MB}] or 'auto', got {fusion_mb!r}")
    else:
        fusion_mb = check_float("fusion_mb", fusion_mb, 0.0, MAX_FUSION_MB, low_inclusive=False)
    if grad_filter is not None and not callable(grad_filter):
        raise ValueError(f"grad_filter must be callable or None, got {type(grad_filter).__name__}")
    if not isinstance(broadcast_buffers, bool):
        raise ValueError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")
    check_scaler("grad_scaler", grad_scaler)
    reduce_scatter = check_choice("reduce_scatter", reduce_scatter, REDUCE_SCATTER_CHOICES)
    if max_allgathers != "auto":
        max_allgathers = check_int("max_allgathers", max_allgathers, 1, ALL_ALLGATHERS)
    return fusion_mb, reduce_scatter, max_allgathers


def tuner_for(fusion_mb: float | str, tune_trials: Any, tune_window: Any, tune_warmup: Any,
              seed: Any) -> FusionTuner | None:
    """The fusion-threshold tuner for ``fusion_mb="auto"`` (starting at 25 MB), else ``None``; the
    tuner settings are checked either way.

    Raises:
        ValueError: ``tune_trials`` not in [1, 1000], ``tune_window`` not in [2, 10000], ``tune_warmup``
            not ``None`` or in [0, 10**6], ``seed`` not in [0, 2**32 - 1].
        ImportError: with ``fusion_mb="auto"`` if ``bayesian-optimization`` is not installed.
    """
    tune_trials = check_int("tune_trials", tune_trials, 1, 1000)
    tune_window = check_int("tune_window", tune_window, 2, 10_000)
    if tune_warmup is not None:
        tune_warmup = check_int("tune_warmup", tune_warmup, 0, 10**6)
    seed = check_int("seed", seed, 0, 2**32 - 1)
    if fusion_mb != "auto":
        return None
    return FusionTuner(initial_mb=25.0, trials=tune_trials, window=tune_window, warmup=tune_warmup, seed=seed)


def optimizer_group_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``{id(parameter): index of its optimizer param group}`` for every parameter the optimizer holds.

    Raises:
        ValueError: if the optimizer holds a parameter that is not in ``model``.
    """
    model_params = {id(p) for p in model.parameters()}
    group_of: dict[int, int] = {}
    for gi, pg in enumerate(optimizer.param_groups):
        for p in pg["params"]:
            if id(p) not in model_params:
                raise ValueError("optimizer holds a parameter that is not in model")
            group_of[id(p)] = gi
    return group_of
