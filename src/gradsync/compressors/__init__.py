"""Gradient compressors, registered by name.

>>> from gradsync.compressors import make_compressor
>>> c = make_compressor("topk", density=0.01)
>>> payload, ctx = c.compress(torch.randn(1000))        # doctest: +SKIP
>>> dense = c.decompress(payload, ctx)                  # doctest: +SKIP

Names: ``none``, ``fp16``, ``bf16``, ``topk``, ``randomk``, ``dgc``, ``redsync``, ``qsgd``,
``signsgd``, plus any compressor module added later that registers itself (``countsketch``).
"""

from __future__ import annotations

import importlib
from typing import Any

from gradsync.compressors.base import Compressor, Ctx, Payload, SparseCompressor
from gradsync.compressors.cast import BF16Compressor, CastCompressor, FP16Compressor, IdentityCompressor
from gradsync.compressors.dgc import DGCCompressor
from gradsync.compressors.qsgd import QSGDCompressor
from gradsync.compressors.randomk import RandomKCompressor
from gradsync.compressors.redsync import RedSyncCompressor
from gradsync.compressors.signsgd import SignSGDCompressor
from gradsync.compressors.topk import TopKCompressor

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        IdentityCompressor,
        FP16Compressor,
        BF16Compressor,
        TopKCompressor,
        RandomKCompressor,
        DGCCompressor,
        RedSyncCompressor,
        QSGDCompressor,
        SignSGDCompressor,
    )
}

# Optional modules owned elsewhere: registered when present, tolerated when absent or incompatible.
_OPTIONAL = ("countsketch",)


def register_compressor(cls: type[Compressor], name: str | None = None) -> type[Compressor]:
    """Register ``cls`` under ``name`` (default ``cls.name``); usable as a class decorator."""
    COMPRESSORS[name or cls.name] = cls
    return cls


def _load_optional() -> None:
    for mod_name in _OPTIONAL:
        if mod_name in COMPRESSORS:
            continue
        try:
            mod = importlib.import_module(f"gradsync.compressors.{mod_name}")
        except ImportError:
            continue
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, Compressor)
                and obj.__module__ == mod.__name__
                and getattr(obj, "name", None)
                and obj.name not in COMPRESSORS
            ):
                COMPRESSORS[obj.name] = obj


def available_compressors() -> list[str]:
    """Sorted registry names."""
    _load_optional()
    return sorted(COMPRESSORS)


def make_compressor(name: str, **kwargs: Any) -> Compressor:
    """Build the compressor registered as ``name`` with constructor ``kwargs``.

    Raises:
        ValueError: if ``name`` is unknown (the message lists the known names) or an argument is
            out of range.
    """
    _load_optional()
    if name not in COMPRESSORS:
        raise ValueError(f"compressor must be one of {', '.join(sorted(COMPRESSORS))}; got {name!r}")
    return COMPRESSORS[name](**kwargs)


__all__ = [
    "COMPRESSORS",
    "BF16Compressor",
    "CastCompressor",
    "Compressor",
    "Ctx",
    "DGCCompressor",
    "FP16Compressor",
    "IdentityCompressor",
    "Payload",
    "QSGDCompressor",
    "RandomKCompressor",
    "RedSyncCompressor",
    "SignSGDCompressor",
    "SparseCompressor",
    "TopKCompressor",
    "available_compressors",
    "make_compressor",
    "register_compressor",
]
