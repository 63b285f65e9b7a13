"""Thin integrations of gradsync's DDP communication hooks with training frameworks.

* :mod:`gradsync.integrations.lightning`: :class:`~gradsync.integrations.lightning.GradsyncHook`, a
  Lightning ``Callback`` that registers the hook on the ``DistributedDataParallel`` model built by
  ``DDPStrategy`` and keeps the hook state in Lightning's checkpoint.
* :mod:`gradsync.integrations.accelerate`: :func:`~gradsync.integrations.accelerate.register_hook` for
  the model returned by ``accelerator.prepare`` and
  :class:`~gradsync.integrations.accelerate.HookCheckpoint` for ``accelerator.register_for_checkpointing``.
* :mod:`gradsync.integrations.transformers`: :class:`~gradsync.integrations.transformers.GradsyncCallback`,
  a Hugging Face ``TrainerCallback`` that registers the hook on the ``Trainer``'s DDP model and keeps
  the hook state in its ``checkpoint-N/`` folders.

Neither framework's own option registers a gradsync hook reliably: Lightning 2.6's
``DDPStrategy(ddp_comm_hook=...)`` registers it only when the root device is CUDA (nothing on CPU), and
Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only its built-in hook types.
Both integrations therefore call ``ddp.register_comm_hook(state, hook)`` themselves on the wrapped
model (PyTorch's documented API), which works on CPU (Gloo) and GPU (NCCL) alike.

The helpers in this module are framework-independent: :func:`build_state_and_hook` is the one place
the integrations build an algorithm, :func:`find_ddp` unwraps a framework's model, and
:func:`gather_hook_state` / :func:`load_hook_state` move the per-rank hook state (error-feedback
residuals differ between ranks) through a checkpoint that only rank 0 writes.

``algorithm="auto"`` (every integration): :mod:`gradsync.integrations.auto`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..options import AUTO

#: Version of the checkpoint payload written by :func:`gather_hook_state`.
PAYLOAD_FORMAT = 1


def build_state_and_hook(algorithm: str, process_group: dist.ProcessGroup | None = None,
                         model: torch.nn.Module | None = None, **options: Any) -> tuple[Any, Callable]:
    """Build gradsync algorithm ``algorithm``'s ``(state, hook)`` pair for ``ddp.register_comm_hook``.

    Args:
        algorithm: a communication-hook algorithm of :data:`gradsync.algorithms.REGISTRY` (``covap``,
            ``topk``, ...). DeAR (``dear``, ``dear-covap``) replaces DDP and is not a hook.
        process_group: group of the hook's collectives (``None`` = default group).
        model: the module DDP wraps (not the DDP wrapper); some algorithms read its layers.
        options: the algorithm's options (``ratio=4`` for COVAP, ``density=0.01`` for top-k, ...).
            COVAP's ``ratio="auto"`` works here as in ``gradsync train``: the hook times its own first
            iterations, every rank takes K = ceil(CCR) (at most ``max_ratio``, 2 by default) from one
            all-reduce at iteration 4, and K keeps following the network every ``adapt_every`` (default
            20) steps.

    Raises:
        ValueError: for an unknown or DeAR ``algorithm``, or options out of range.
    """
    from ..algorithms import build_hook

    check_hook_algorithm(algorithm)
    return build_hook(algorithm, process_group=process_group, model=model, **options)


def check_hook_algorithm(algorithm: str) -> None:
    """Raise ``ValueError`` unless ``algorithm`` is a communication-hook algorithm of
    :data:`gradsync.algorithms.REGISTRY` (unknown names and DeAR, which replaces DDP, are refused)."""
    from ..algorithms import get

    if get(algorithm).make_hook is None:
        raise ValueError(
            f"algorithm must be a DDP communication-hook algorithm; {algorithm!r} replaces DDP: use "
            "gradsync.wrap(model, optimizer, algorithm) in a loop that owns the optimizer step "
            "(Lightning manual optimization, or a plain Accelerate loop without accelerator.prepare(model))")


def import_torchvision_first() -> None:
    """Import torchvision through :func:`gradsync.workloads.vision.torchvision_models` where it is
    installed, before a framework that imports it (torchmetrics under Lightning, Transformers' image
    utilities) does: the CUDA-built torchvision wheel beside a CPU-only torch fails with
    ``operator torchvision::nms does not exist`` unless its operator schemas are defined first.
    Does nothing where torchvision is not installed."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        from ..workloads.vision import torchvision_models

        torchvision_models()


def framework_attribute(module: str, public: str, name: str) -> Any:
    """Attribute ``name`` of the framework-specific module ``module`` (e.g. ``lightning_callback``),
    imported at first use by the public module ``public``'s ``__getattr__`` (PEP 562), so importing
    ``public`` has no side effect; torchvision is made importable first
    (:func:`import_torchvision_first`), then the module imports its framework.

    Raises:
        AttributeError: for a ``name`` the module does not define.
        ImportError: if the framework is not installed (naming ``pip install 'gradsync[integrations]'``).
    """
    import importlib

    import_torchvision_first()
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
    if value is None:
        raise AttributeError(f"module {public!r} has no attribute {name!r}")
    return value


def find_ddp(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` inside ``model``: ``model`` itself, or the module under
    ``torch.compile``'s ``OptimizedModule`` (``_orig_mod``) wrappers; ``None`` if there is none."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        seen += 1
    return None


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_hook_state(algorithm: str, state: Any, auto_entry: str | None = None) -> dict[str, Any]:
    """Collect every rank's ``state.state_dict()`` on rank 0 for a checkpoint that rank 0 writes.

    A collective on the default group: every rank must call it (Lightning's ``trainer.save_checkpoint``
    and Accelerate's ``save_state`` are called on all ranks). Tensors are copied to the CPU; the
    state is in its weights-only loadable form (every algorithm's ``state_dict()`` is), so the
    payload reads back with ``torch.load(weights_only=True)``.

    Args:
        algorithm: the integration's algorithm (``"auto"`` for a choice made by :func:`choose_auto`).
        state: the registered hook state.
        auto_entry: with ``algorithm="auto"``, the entry auto chose (``AutoChoice.entry``), kept in the
            payload so that a resumed run takes it without measuring again.

    Returns:
        ``{"format": 1, "algorithm": str, "world_size": W, "ranks": [state_dict of rank 0..W-1]}`` on
        rank 0 (plus ``"auto_entry": str`` where ``auto_entry`` is given); on the other ranks
        ``"ranks"`` is ``None`` (their copy is not written).
    """
    from ..algorithms.state_io import map_tensors

    rank, world = _world()
    local = map_tensors(state.state_dict(), lambda t: t.detach().to("cpu", copy=True))
    if world == 1:
        ranks: list[Any] | None = [local]
    else:
        ranks = [None] * world if rank == 0 else None
        dist.gather_object(local, ranks, dst=0)
    payload = {"format": PAYLOAD_FORMAT, "algorithm": algorithm, "world_size": world, "ranks": ranks}
    if auto_entry is not None:
        payload["auto_entry"] = auto_entry
    return payload


def load_hook_state(algorithm: str, state: Any, payload: dict[str, Any],
                    device: torch.device | str | None = None, auto_entry: str | None = None) -> None:
    """Load this rank's entry of a :func:`gather_hook_state` payload into ``state``.

    Args:
        algorithm: the algorithm ``state`` belongs to; must be the one the payload was saved from.
        state: the hook state to restore (``load_state_dict`` is called on it).
        payload: the dict :func:`gather_hook_state` returned on rank 0.
        device: device the state's tensors (residuals) are moved to: the model's device
            (:func:`gradsync.algorithms.state_io.load_state`, as ``gradsync train`` loads).
        auto_entry: with ``algorithm="auto"``, the entry ``state`` was built from; must be the
            payload's ``"auto_entry"``.

    Raises:
        ValueError: if the payload is of another format or algorithm (or auto entry), was written by a
            rank other than 0, or holds a different number of ranks (error-feedback residuals belong
            to one rank each and cannot be redistributed).
    """
    if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
        raise ValueError(f"payload must be a gradsync hook-state payload of format {PAYLOAD_FORMAT}; got "
                         f"{type(payload).__name__} with format {getattr(payload, 'get', lambda k: None)('format')!r}")
    if payload["algorithm"] != algorithm:
        raise ValueError(f"checkpoint holds gradsync hook state of algorithm {payload['algorithm']!r}; "
                         f"this run uses {algorithm!r}")
    if auto_entry is not None and payload.get("auto_entry") != auto_entry:
        raise ValueError(f"checkpoint holds the gradsync hook state of auto's choice {payload.get('auto_entry')!r}; "
                         f"this run's hook is {auto_entry!r}")
    rank, world = _world()
    if payload["world_size"] != world:
        raise ValueError(
            f"checkpoint holds gradsync hook state of {payload['world_size']} ranks; this run has {world}: "
            "per-rank error-feedback residuals cannot be redistributed to another world size")
    if payload["ranks"] is None:
        raise ValueError("checkpoint was written by a rank other than 0 and holds no gradsync hook state; "
                         "load the checkpoint rank 0 wrote")
    from ..algorithms.state_io import load_state

    load_state(state, payload["ranks"][rank], device)


__all__ = ["AUTO", "PAYLOAD_FORMAT", "build_state_and_hook", "check_hook_algorithm", "find_ddp", "framework_attribute",
           "gather_hook_state", "import_torchvision_first", "load_hook_state"]
