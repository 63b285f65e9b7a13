"""The compute profile of one training iteration: the simulator's input, the profiler's output.

A :class:`Profile` records, for one model on one worker, the forward, backward and optimizer compute
times and, for every DDP gradient bucket (in DDP reduction order), its size and the time after the
start of backward at which it becomes ready (:func:`gradsync.profiler.profile.record_profile`
measures it; :mod:`gradsync.sim.engine` replays it).

Profile JSON schema (``"gradsync-profile/1"``, written by ``gradsync profile``)::

    {"schema": "gradsync-profile/1", "model": "resnet18-fmnist", "batch_size": 64, "dtype_bytes": 4,
     "forward_s": 0.010, "backward_s": 0.030, "optimizer_s": 0.002,
     "buckets": [{"index": 0, "numel": 123456, "ready_s": 0.012}, ...]}

``ready_s`` is seconds after backward start (clamped to ``backward_s`` when it exceeds it by at most
10 %, as medians over iterations can); buckets are listed in DDP reduction order. A bucket may
carry an optional ``"shapes"`` list (parameter shapes, e.g. ``[[64, 3, 3, 3], [64]]``) which
:class:`gradsync.sim.plans.PowerSGDPlan` uses for exact matrix sizes; other top-level keys are kept in
``Profile.meta``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradsync.validation import check_float, check_int

SCHEMA = "gradsync-profile/1"

__all__ = ["SCHEMA", "Profile", "ProfileBucket", "load_profile", "synthetic_profile"]


@dataclass(frozen=True)
class ProfileBucket:
    """One DDP gradient bucket: ``numel`` elements, ready ``ready_s`` seconds after backward start.

    ``shapes`` (optional) lists the shapes of the parameters in the bucket; their sizes sum to numel.
    """

    index: int
    numel: int
    ready_s: float
    shapes: tuple[tuple[int, ...], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "numel": self.numel, "ready_s": self.ready_s}
        if self.shapes is not None:
            d["shapes"] = [list(s) for s in self.shapes]
        return d


@dataclass(frozen=True)
class Profile(Mapping[str, Any]):
    """A per-worker compute profile of one training iteration (see the module docstring for the
    schema).

    Times are seconds, ``dtype_bytes`` is the gradient element size in bytes (4 for fp32);
    ``buckets`` are in DDP reduction order. Build with :func:`load_profile` / :meth:`load`
    (validates) or :func:`synthetic_profile`; write with :meth:`save`.

    The profile is also a read-only mapping with the keys of its JSON form (``prof["forward_s"]``,
    ``prof["buckets"][0]["numel"]``, ``dict(prof)``), so code written for the profile dict keeps
    working; ``json.dump`` needs :meth:`to_dict`.
    """

    model: str
    batch_size: int
    dtype_bytes: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: tuple[ProfileBucket, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compute_s(self) -> float:
        """Compute-only iteration time in seconds: forward + backward + optimizer."""
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def total_numel(self) -> int:
        """Number of gradient elements over all buckets."""
        return sum(b.numel for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        """Gradient size in bytes (``total_numel * dtype_bytes``)."""
        return self.total_numel * self.dtype_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (schema ``gradsync-profile/1``); ``meta`` keys are written back."""
        d: dict[str, Any] = dict(self.meta)
        d.update(
            {
                "schema": SCHEMA,
                "model": self.model,
                "batch_size": self.batch_size,
                "dtype_bytes": self.dtype_bytes,
                "forward_s": self.forward_s,
                "backward_s": self.backward_s,
                "optimizer_s": self.optimizer_s,
                "buckets": [b.to_dict() for b in self.buckets],
            }
        )
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None, indent: int | None = 1) -> str:
        """Serialise to JSON; also write it to ``path`` when given. Returns the JSON text."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    # -- JSON ------------------------------------------------------------------------------------
    @classmethod
    def load(cls, source: str | os.PathLike[str] | Mapping[str, Any] | Profile) -> Profile:
        """:func:`load_profile`: read and validate a JSON file path, a dict or a profile."""
        return load_profile(source)

    def save(self, path: str | os.PathLike[str], indent: int | None = 1) -> str:
        """Write the profile as JSON to ``path``; returns the path as a string."""
        self.to_json(path, indent)
        return os.fspath(path)

    # -- derived profiles ------------------------------------------------------------------------
    def with_meta(self, **extra: Any) -> Profile:
        """A copy with ``extra`` added to :attr:`meta` (e.g. ``ccr={...}``).

        Raises:
            ValueError: if a key is one of the schema's own keys.
        """
        clash = sorted(set(extra) & set(_REQUIRED))
        if clash:
            raise ValueError(f"meta keys must not be schema keys, got {', '.join(clash)}")
        return dataclasses.replace(self, meta={**self.meta, **extra})

    def scale_compute(self, factor: float) -> Profile:
        """A copy with ``forward_s``, ``backward_s``, ``optimizer_s`` and every ``ready_s`` multiplied
        by ``factor`` (> 0), e.g. to model a device ``1 / factor`` times faster.

        Raises:
            ValueError: if ``factor`` is not a finite number > 0.
        """
        k = check_float("factor", factor, 0.0, None, low_inclusive=False)
        return dataclasses.replace(
            self, forward_s=self.forward_s * k, backward_s=self.backward_s * k,
            optimizer_s=self.optimizer_s * k,
            buckets=tuple(dataclasses.replace(b, ready_s=b.ready_s * k) for b in self.buckets))

    # -- read-only mapping over the JSON form -----------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


_REQUIRED = ("schema", "model", "batch_size", "dtype_bytes", "forward_s", "backward_s",
             "optimizer_s", "buckets")


def load_profile(source: str | os.PathLike[str] | Mapping[str, Any] | Profile) -> Profile:
    """Load and validate a profile from a JSON file path, a dict, or a :class:`Profile`.

    Raises:
        ValueError: wrong or missing ``schema``, a missing key, a value of the wrong type or out of
            range (the message names the key, e.g. ``buckets[3].ready_s``), duplicate bucket
            indices, ``ready_s`` more than 10 % later than ``backward_s``, or ``shapes`` not summing to ``numel``.
        FileNotFoundError: if a path does not exist.
    """
    if isinstance(source, Profile):
        return source
    if isinstance(source, (str, os.PathLike)):
        with open(source, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"profile {os.fspath(source)!r} is not valid JSON: {exc}") from None
    elif isinstance(source, Mapping):
        data = source
    else:
        raise ValueError(
            f"profile must be a path, a dict or a Profile, got {type(source).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ValueError("profile JSON must be an object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"profile is missing key(s): {', '.join(missing)}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"profile schema must be {SCHEMA!r}, got {data['schema']!r}")
    model = data["model"]
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string, got {model!r}")
    batch_size = check_int("batch_size", data["batch_size"], 1)
    dtype_bytes = check_int("dtype_bytes", data["dtype_bytes"], 1, 16)
    forward_s = check_float("forward_s", data["forward_s"], 0.0)
    backward_s = check_float("backward_s", data["backward_s"], 0.0)
    optimizer_s = check_float("optimizer_s", data["optimizer_s"], 0.0)
    raw = data["buckets"]
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or len(raw) == 0:
        raise ValueError("buckets must be a non-empty list")
    buckets = []
    seen: set[int] = set()
    # ready_s and backward_s are usually medians over several iterations, so the last bucket's
    # ready time may exceed backward_s slightly: up to 10 % (+1 us) is clamped, more is an error.
    tol = 1e-6 + 0.1 * backward_s
    for i, b in enumerate(raw):
        if not isinstance(b, Mapping):
            raise ValueError(f"buckets[{i}] must be an object")
        for k in ("index", "numel", "ready_s"):
            if k not in b:
                raise ValueError(f"buckets[{i}] is missing key {k!r}")
        idx = check_int(f"buckets[{i}].index", b["index"], 0)
        if idx in seen:
            raise ValueError(f"buckets[{i}].index {idx} is duplicated")
        seen.add(idx)
        numel = check_int(f"buckets[{i}].numel", b["numel"], 1)
        ready = check_float(f"buckets[{i}].ready_s", b["ready_s"], 0.0, backward_s + tol)
        shapes = None
        if b.get("shapes") is not None:
            shapes = _check_shapes(f"buckets[{i}].shapes", b["shapes"], numel)
        buckets.append(ProfileBucket(idx, numel, min(ready, backward_s), shapes))
    meta = {k: v for k, v in data.items() if k not in _REQUIRED}
    return Profile(model, batch_size, dtype_bytes, forward_s, backward_s, optimizer_s,
                   tuple(buckets), meta)


def _check_shapes(name: str, shapes: Any, numel: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(shapes, Sequence) or isinstance(shapes, (str, bytes)):
        raise ValueError(f"{name} must be a list of shapes")
    out = []
    for j, s in enumerate(shapes):
        if not isinstance(s, Sequence) or isinstance(s, (str, bytes)):
            raise ValueError(f"{name}[{j}] must be a list of positive integers")
        out.append(tuple(check_int(f"{name}[{j}]", d, 1) for d in s))
    total = sum(math.prod(s) for s in out)
    if total != numel:
        raise ValueError(f"{name} sum to {total} elements but numel is {numel}")
    return tuple(out)


def synthetic_profile(
    bucket_numels: Sequence[int],
    forward_s: float,
    backward_s: float,
    optimizer_s: float = 0.0,
    *,
    ready_s: Sequence[float] | None = None,
    model: str = "synthetic",
    batch_size: int = 1,
    dtype_bytes: int = 4,
) -> Profile:
    """Build a validated profile from bucket sizes (DDP reduction order).

    Without ``ready_s``, bucket ``i`` is ready when the backward pass has done the fraction
    ``sum(numel[:i+1]) / sum(numel)`` of ``backward_s`` (compute proportional to parameters).

    Raises:
        ValueError: as :func:`load_profile`, or if ``ready_s`` has the wrong length.
    """
    numels = [check_int(f"bucket_numels[{i}]", n, 1) for i, n in enumerate(bucket_numels)]
    if not numels:
        raise ValueError("bucket_numels must be non-empty")
    if ready_s is None:
        cum = np.cumsum(numels) / float(sum(numels))
        bw = check_float("backward_s", backward_s, 0.0)
        ready = [float(c) * bw for c in cum]
    else:
        if len(ready_s) != len(numels):
            raise ValueError(
                f"ready_s must have one entry per bucket ({len(numels)}), got {len(ready_s)}"
            )
        ready = list(ready_s)
    return load_profile(
        {
            "schema": SCHEMA, "model": model, "batch_size": batch_size,
            "dtype_bytes": dtype_bytes, "forward_s": forward_s, "backward_s": backward_s,
            "optimizer_s": optimizer_s,
            "buckets": [{"index": i, "numel": n, "ready_s": r}
                        for i, (n, r) in enumerate(zip(numels, ready))],
        }
    )
