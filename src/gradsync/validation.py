"""Argument checks that raise ``ValueError`` naming the argument and the allowed range."""

from __future__ import annotations

import math
from typing import Any, Iterable


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high]``.

    Raises:
        ValueError: if ``value`` is not an integer (bools are refused) or lies outside the range;
            the message names ``name`` and the allowed range.
    """
    if isinstance(value, bool) or not isinstance(value, (int,)) and not (
        isinstance(value, float) and value.is_integer()
    ):
        raise ValueError(f"{name} must be an integer in {_range(low, high)}, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer in {_range(low, high)}, got {value}")
    return value


def check_dense_from(value: Any, start_iter: int) -> int:
    """A hook's ``dense_from`` (the iteration its dense tail starts) as an int: 0 (no tail) or an
    iteration >= ``start_iter`` (the tail starts after the dense start-up iterations).

    Raises:
        ValueError: naming ``dense_from`` for a non-integer, a negative value or one in [1, start_iter).
    """
    value = check_int("dense_from", value, 0)
    if 0 < value < start_iter:
        raise ValueError(f"dense_from must be 0 or an iteration >= start_iter ({start_iter}); got {value}")
    return value


def check_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """Return ``value`` as a finite float in the given interval.

    Raises:
        ValueError: if ``value`` is not a finite real number inside the interval; the message names
            ``name`` and the allowed interval.
    """
    lo_b = "[" if low_inclusive else "("
    hi_b = "]" if high_inclusive else ")"
    allowed = f"{lo_b}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi_b}"
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number in {allowed}, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number in {allowed}, got {value!r}")
    if low is not None and (f < low or (f == low and not low_inclusive)):
        raise ValueError(f"{name} must be in {allowed}, got {f}")
    if high is not None and (f > high or (f == high and not high_inclusive)):
        raise ValueError(f"{name} must be in {allowed}, got {f}")
    return f


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming ``name`` and listing the allowed choices.
    """
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def _range(low: int | None, high: int | None) -> str:
    return f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
