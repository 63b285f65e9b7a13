"""Integer quantisation of OSCAR: level choice, stochastic rounding and the wire dtype of the sums.

A bucket ``x`` (float32, error feedback already added) with shared scale ``s = max_r max|x_r|``
(all-reduced MAX, identical on every rank) is mapped to ints ``q`` in ``[-L, L]`` with step ``s / L``;
the sum over P ranks then lies in ``[-P L, P L]``. Stochastic rounding ``floor(y + u)``,
``u ~ U[0, 1)``, is unbiased (as in QSGD: Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD:
Communication-Efficient SGD via Gradient Quantization and Encoding", arXiv:1610.02132, §3.1).
"""

import torch

__all__ = ["default_levels", "quantise", "stochastic_round", "wire_dtype"]

#: largest magnitude an int8 sum holds
INT8_MAX = 127


def default_levels(world_size: int) -> int:
    """Levels per sign ``L = max(1, 127 // world_size)``: the largest L whose sums over
    ``world_size`` ranks still fit int8 on the wire.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return max(1, INT8_MAX // world_size)


def wire_dtype(max_abs: int) -> torch.dtype:
    """Narrowest Gloo all-reduce dtype that sums integers in ``[-max_abs, max_abs]`` exactly:
    int8 up to 127, float16 up to 2048 (every partial sum is an integer <= 2048, exact in fp16),
    else int32. Gloo's all-reduce refuses int16 (measured on torch 2.13)."""
    if max_abs <= INT8_MAX:
        return torch.int8
    if max_abs <= 2048:
        return torch.float16
    return torch.int32


def stochastic_round(y: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding ``floor(y + u)``, ``u ~ U[0, 1)``.

    Args:
        y: float tensor (any shape).
        generator: torch random generator (``None`` = global).

    Returns:
        int32 tensor of ``y``'s shape with ``E[result] = y`` and ``|result - y| < 1``.
    """
    u = torch.rand(y.shape, generator=generator, dtype=y.dtype)
    return torch.floor(y + u).to(torch.int32)


def quantise(
    x: torch.Tensor,
    step: float,
    levels: int,
    rounding: str,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to ints in ``[-levels, levels]`` with step ``step``.

    Args:
        x: ``(n,)`` float32 tensor.
        step: quantisation step (``scale / levels``), > 0.
        levels: L, the largest magnitude of the result.
        rounding: ``"stochastic"`` (unbiased, uses ``generator``) or ``"nearest"``.
        generator: random stream of the stochastic rounding (ignored for ``"nearest"``).

    Returns:
        ``(q, err)``: ``q`` int32 ``(n,)`` clamped to ``[-levels, levels]``, and the float32 remainder
        ``err = x - q * step`` (what error feedback carries to the next step).

    Raises:
        ValueError: if ``rounding`` is not one of the two modes.
    """
    if rounding == "stochastic":
        q = stochastic_round(x / step, generator).clamp_(-levels, levels)
    elif rounding == "nearest":
        q = torch.round(x / step).to(torch.int32).clamp_(-levels, levels)
    else:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', got {rounding!r}")
    err = x - q.to(torch.float32) * step
    return q, err
