"""The one form in which algorithm state leaves and enters a process: weights-only loadable, and
moved to the model's device on load.

Every :class:`~gradsync.algorithms.protocol.Algorithm` returns its ``state_dict()`` in the *safe*
form of :func:`to_safe` (so ``torch.load(..., weights_only=True)``, torch's default, reads what
``torch.save(state.state_dict())`` wrote, whatever the algorithm keeps: torch's ``PowerSGDState``
holds a numpy ``RandomState``, OSCAR's ASC coders numpy arrays) and accepts either form in
``load_state_dict`` (:func:`from_safe` first); the protocol applies both conversions to every
subclass. :func:`load_state` is the one way a checkpoint's algorithm state is loaded by every entry
point (``gradsync train``'s synchronisers, the Lightning, Accelerate and Hugging Face integrations):
safe form undone, then every tensor moved to the model's device (checkpoints are read with
``map_location="cpu"``), then ``load_state_dict``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

_ND, _NS, _RS = "__gradsync_ndarray__", "__gradsync_npscalar__", "__gradsync_randomstate__"
_SAFE_LEAVES = (torch.Tensor, int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device,
                torch.Size)


def _map_dict(d: dict, fn: Callable[[Any, Any], Any]) -> dict:
    """``d`` with every value ``v`` replaced by ``fn(k, v)``; a dict subclass keeps its type and
    attributes (a module state_dict's ``_metadata``)."""
    if type(d) is dict:
        return {k: fn(k, v) for k, v in d.items()}
    out = copy.copy(d)
    for k, v in d.items():
        out[k] = fn(k, v)
    return out


def map_tree(obj: Any, leaf: Callable[[Any, str], Any], path: str = "payload") -> Any:
    """``obj`` with every leaf ``x`` (anything but a dict, a list or a tuple) replaced by
    ``leaf(x, path)``; ``path`` names the entry (``payload.algorithm.error[0]``). Dicts (subclasses
    keep their type and attributes), lists and tuples are rebuilt; leaves are not copied."""
    if isinstance(obj, dict):
        return _map_dict(obj, lambda k, v: map_tree(v, leaf, f"{path}.{k}"))
    if type(obj) in (list, tuple):
        return type(obj)(map_tree(v, leaf, f"{path}[{i}]") for i, v in enumerate(obj))
    return leaf(obj, path)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` in it replaced by ``fn(t)`` (:func:`map_tree`)."""
    return map_tree(obj, lambda x, _: fn(x) if isinstance(x, torch.Tensor) else x)


def _safe_leaf(obj: Any, path: str) -> Any:
    import numpy as np

    if isinstance(obj, _SAFE_LEAVES):
        return obj
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        return {_ND: torch.from_numpy(np.ascontiguousarray(obj)).clone()}
    if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
        return {_NS: torch.from_numpy(np.asarray(obj).reshape(1)).clone()}
    if isinstance(obj, np.random.RandomState):
        name, keys, pos, has_gauss, cached = obj.get_state()
        return {_RS: (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    raise TypeError(f"checkpoint: {path} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
                    "torch.load(weights_only=True) cannot read; store tensors, numbers, strings, lists, "
                    "tuples or dicts in state_dict()")


def to_safe(obj: Any, path: str = "payload") -> Any:
    """``obj`` with numpy arrays, numpy scalars and ``numpy.random.RandomState`` objects replaced by
    tagged dicts of tensors, so ``torch.load(weights_only=True)`` reads it; :func:`from_safe` undoes
    it. Idempotent: a safe ``obj`` comes back equal.

    Raises:
        TypeError: naming the entry (``payload.algorithm.x``) whose type ``weights_only`` loading
            rejects and that has no conversion (a custom class, an object array, ...).
    """
    return map_tree(obj, _safe_leaf, path)


def from_safe(obj: Any) -> Any:
    """Undo :func:`to_safe` (tagged tensors must be on the CPU); anything else comes back equal."""
    import numpy as np

    if isinstance(obj, dict):
        if len(obj) == 1:
            (key, value), = obj.items()
            if key == _ND:
                return value.numpy().copy()
            if key == _NS:
                return value.numpy()[0]
            if key == _RS:
                name, keys, pos, has_gauss, cached = value
                rs = np.random.RandomState()
                rs.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
                return rs
        return _map_dict(obj, lambda k, v: from_safe(v))
    if type(obj) in (list, tuple):
        return type(obj)(from_safe(v) for v in obj)
    return obj


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of ``module``'s first parameter (or buffer); ``None`` for a module with neither."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def load_state(algorithm: Any, state: dict[str, Any], device: torch.device | str | None) -> None:
    """Load ``state`` (an algorithm's ``state_dict()``, safe form or not, as read from a checkpoint)
    into ``algorithm``: the safe form undone, every tensor moved to ``device`` (the model's: the
    device its residuals and factors must live on; ``None`` leaves them where they are), then
    ``algorithm.load_state_dict``."""
    state = from_safe(state)
    if device is not None:
        state = map_tensors(state, lambda t: t.to(device))
    algorithm.load_state_dict(state)


__all__ = ["from_safe", "load_state", "map_tensors", "map_tree", "module_device", "to_safe"]
