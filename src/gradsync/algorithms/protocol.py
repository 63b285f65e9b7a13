"""The one protocol of a gradsync algorithm's state, with defaults.

An algorithm is a :class:`Algorithm` object plus the way it reaches the gradients: a DDP
communication hook (the state is a :class:`~gradsync.algorithms.base.HookState`, registered with
``ddp.register_comm_hook(state, hook)``) or DeAR's pipeline (the object is DeAR's ``grad_filter``,
e.g. :class:`~gradsync.algorithms.dear.CovapGradFilter`, or the plain :class:`Algorithm` for
``dear``). The :class:`~gradsync.algorithms.synchroniser.Synchroniser` that runs it calls only the
methods below, never probes for attributes; an algorithm overrides what it has.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .recorded_layout import LAYOUT_KEY, call_in_recorded_layout, restore_layout, saved_layout
from .state_io import from_safe, to_safe


class Algorithm:
    """Defaults of the algorithm protocol: no settings from the CCR, nothing to log, report, save or
    release, no recorded bucket layout, the parameters' dtype on the wire."""

    #: True when the algorithm chooses a setting from the measured CCR (then :meth:`calibrate` is called).
    needs_ccr: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every subclass's own ``state_dict`` returns the weights-only loadable form
        (:func:`~gradsync.algorithms.state_io.to_safe`) and its ``load_state_dict`` accepts it
        (:func:`~gradsync.algorithms.state_io.from_safe` first): one safe form for every algorithm,
        whatever it keeps (numpy generators, arrays), for every entry point that saves it. A hook
        state's DDP bucket layout, recorded by :func:`settling_hook`, travels with it
        (:mod:`~gradsync.algorithms.recorded_layout`)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__
        if "state_dict" in own and not getattr(own["state_dict"], "_gradsync_safe", False):
            cls.state_dict = _safe_state_dict(own["state_dict"])
        if "load_state_dict" in own and not getattr(own["load_state_dict"], "_gradsync_safe", False):
            cls.load_state_dict = _safe_load_state_dict(own["load_state_dict"])
        # the readers of the state apply a decision the finite guard deferred first (:meth:`settle`)
        for name in ("stats", "observe_step", "close"):
            if name in own and not getattr(own[name], "_gradsync_settles", False):
                setattr(cls, name, _settled(own[name]))

    def settle(self) -> None:
        """Apply what the algorithm deferred to avoid a host synchronisation in the hook (the finite
        guard's rollback of a non-finite step whose flag lives on an accelerator,
        :meth:`~gradsync.feedback.finite.FiniteGuard.settle`). Called before every read of the state:
        ``state_dict``, ``stats``, ``observe_step``, ``close`` and the first bucket of each iteration
        (registered hooks). Default: nothing deferred."""

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype the algorithm puts on the wire when it casts (COVAP's ``cast``), for timing the
        CCR in that dtype; ``None``: the parameters' dtype."""
        return None

    def calibrate(self, ccr: float) -> dict[str, Any]:
        """Receive the all-reduced communication-to-computation ratio (dense all-reduce seconds /
        backward seconds, identical on every rank); return what was chosen from it (default ``{}``)."""
        return {}

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """Receive the finished step's wall-clock ``seconds`` and this rank's ``samples`` (every rank,
        every step); return per-step figures worth logging (default ``{}``)."""
        return {}

    def bucket_numels(self) -> Optional[list[int]]:
        """Elements per bucket of the layout the algorithm recorded (COVAP), in reduction order, or
        ``None`` (default) when it keeps none: the runner's own bucket sizes apply."""
        return None

    def skip_start(self) -> None:
        """Compress from the next iteration on, for a state that joins a DDP whose buckets were already
        rebuilt (the start-up probe's copies), where the algorithm's dense start iterations exist only
        for that rebuild. Default: keep them (COVAP records its bucket layout in them)."""

    def rollback(self) -> None:
        """Undo this iteration's state changes: called on every rank when the step is skipped
        (GradScaler found inf/nan, all-reduced) by runners that decide it after the algorithm ran
        (DeAR's pipeline). Default: nothing to undo."""

    def stats(self) -> dict[str, Any]:
        """Cumulative statistics of this rank (default ``{}``)."""
        return {}

    def config(self) -> dict[str, Any]:
        """Configuration fields that must be identical on every rank (default ``{}``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state (default ``{}``)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result (default: nothing)."""

    def close(self) -> None:
        """Release what the algorithm attached (hooks, threads) at the end of training; the object
        stays readable (:meth:`stats`). Default: nothing."""


def _safe_state_dict(fn: Any) -> Any:
    @functools.wraps(fn)
    def state_dict(self: Any) -> dict[str, Any]:
        self.settle()
        out = fn(self)
        layout = saved_layout(self)
        if layout is not None and isinstance(out, dict):
            out = {**out, LAYOUT_KEY: layout}
        return to_safe(out, f"{type(self).__name__}.state_dict()")

    state_dict._gradsync_safe = True  # type: ignore[attr-defined]
    return state_dict


def _safe_load_state_dict(fn: Any) -> Any:
    @functools.wraps(fn)
    def load_state_dict(self: Any, state: dict[str, Any]) -> None:
        state = from_safe(state)
        if isinstance(state, dict) and LAYOUT_KEY in state:
            state = dict(state)
            restore_layout(self, state.pop(LAYOUT_KEY))
        return fn(self, state)

    load_state_dict._gradsync_safe = True  # type: ignore[attr-defined]
    return load_state_dict


def _settled(fn: Any) -> Any:
    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.settle()
        return fn(self, *args, **kwargs)

    method._gradsync_settles = True  # type: ignore[attr-defined]
    return method


def settling_hook(hook: Any, model: Optional[torch.nn.Module] = None) -> Any:
    """``hook`` (a DDP communication hook of an :class:`Algorithm` state) calling ``state.settle()``
    at the first bucket of each iteration, so a decision the state deferred in the previous
    iteration is applied before this one reads the state (also on paths that take no snapshot: dense
    steps, a dense tail). With the ``model`` DDP wraps, it also records DDP's bucket layout (saved
    with the state) and runs the first iteration after a restore in it, before a fresh DDP's bucket
    rebuild (:mod:`~gradsync.algorithms.recorded_layout`), so a resumed run repeats the uninterrupted
    one. Keeps the hook's signature and annotations (DDP checks them)."""
    from ..feedback.residual import parameter_names

    names = parameter_names(model) if model is not None else None

    @functools.wraps(hook)
    def settled(state: Any, bucket: Any) -> Any:
        if bucket.index() == 0:
            state.settle()
        if names:
            return call_in_recorded_layout(hook, state, bucket, names)
        return hook(state, bucket)

    return settled
