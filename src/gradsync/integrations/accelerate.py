"""Accelerate integration: register a gradsync hook on the model ``accelerator.prepare`` returns.

Usage::

    from accelerate import Accelerator
    from gradsync.integrations.accelerate import HookCheckpoint, register_hook

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = register_hook(model, "covap", ratio=4)      # before the first backward
    accelerator.register_for_checkpointing(HookCheckpoint(state, "covap", accelerator.device))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            optimizer.step(); optimizer.zero_grad()
    print(state.stats())

Why not ``DistributedDataParallelKwargs(comm_hook=...)``: Accelerate 1.x accepts only its
``DDPCommunicationHookType`` values there (no, fp16, bf16, batched PowerSGD) and gives no way to pass
a hook function with its state, so a gradsync hook cannot go through it. ``register_comm_hook`` on the
prepared ``DistributedDataParallel`` is PyTorch's documented API and works on CPU (Gloo) and GPU (NCCL).

Gradient accumulation: inside ``accelerator.accumulate(model)`` Accelerate runs the non-final
micro-batches under ``model.no_sync()``; DDP then calls no hook, so the hook (and its ``iteration``
counter) runs once per optimizer step on the accumulated gradient.

Launching two CPU processes (Accelerate 1.15): ``accelerate launch --cpu --num_processes 2 script.py``
starts ONE process (``--cpu`` selects a single-process CPU run; multi-CPU launches need MPI), and
``--multi_gpu --cpu`` is refused. What works on a CPU-only machine: ``accelerate launch --multi_gpu
--num_processes 2 script.py`` or ``torchrun --nproc-per-node 2 script.py``, with the script creating
``Accelerator(cpu=True)`` (e.g. ``cpu=not torch.cuda.is_available()``): then Accelerate runs MULTI_CPU
on Gloo and wraps the model in DDP. Without ``cpu=True`` both launchers start 2 processes that
Accelerate treats as single-process runs (``num_processes == 1``, no DDP, no gradient
synchronisation); :func:`register_hook` raises ``ValueError`` for that case.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import build_state_and_hook, find_ddp, gather_hook_state, load_hook_state


def register_hook(model: Any, algorithm: str = "covap", process_group: dist.ProcessGroup | None = None,
                  **options: Any) -> Any:
    """Register gradsync algorithm ``algorithm`` as the communication hook of a prepared model.

    Call it on every rank, after ``accelerator.prepare(model)`` and before the first backward.

    Args:
        model: what ``accelerator.prepare`` returned: a ``DistributedDataParallel`` (optionally under
            ``torch.compile``) in a multi-process run, the plain module in a single-process one.
        algorithm: a gradsync communication-hook algorithm (``covap``, ``topk``, ...; see
            ``gradsync.algorithms.REGISTRY``); DeAR is not a hook and is refused.
        process_group: group of the hook's collectives (``None`` = the default group).
        options: the algorithm's options, e.g. ``ratio=4`` (COVAP's K, integer in [1, 32], or
            ``"auto"``: the hook calibrates K from its own first iterations and keeps adapting it;
            see :func:`gradsync.integrations.build_state_and_hook`).

    Returns:
        The hook state (``stats()``: ``wire_bytes``, ``dense_wire_bytes`` and ``payload_bytes`` in bytes,
        ``compression_ratio``, ``iteration``; ``state_dict()``), or ``None`` in a single-process run
        (nothing to synchronise; a warning is issued).

    Raises:
        ValueError: for an unknown or DeAR algorithm or options out of range; if ``model`` is not a
            ``DistributedDataParallel`` although several processes run (FSDP, DeepSpeed).
        RuntimeError: from PyTorch, if the model already has a communication hook.
    """
    ddp = find_ddp(model)
    if ddp is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            import warnings

            warnings.warn("register_hook: single-process run, nothing to synchronise; no hook registered",
                          stacklevel=2)
            return None
        raise ValueError(
            f"model must be the DistributedDataParallel returned by accelerator.prepare, since "
            f"{world} processes run; got {type(model).__name__}. On a machine without CUDA create "
            f"Accelerator(cpu=True): otherwise Accelerate treats each process as a single-process run and "
            f"does not synchronise gradients at all. FSDP and DeepSpeed have no DDP communication hooks.")
    state, hook = build_state_and_hook(algorithm, process_group=process_group, model=ddp.module, **options)
    ddp.register_comm_hook(state, hook)
    return state


class HookCheckpoint:
    """Adapter for ``accelerator.register_for_checkpointing``: saves every rank's hook state.

    Accelerate writes a registered object's ``state_dict()`` from the main process only, but the
    hook state (COVAP's error-feedback residuals) differs between ranks, so ``state_dict`` gathers all
    ranks' states on rank 0 (a collective: ``accelerator.save_state`` must run on every rank, as
    Accelerate requires) and ``load_state_dict`` loads this rank's entry, moving tensors to ``device``.

    Args:
        state: the state :func:`register_hook` returned.
        algorithm: its algorithm name (a checkpoint of another algorithm is refused).
        device: the model's device (``accelerator.device``); Accelerate loads custom state on the CPU.

    Raises:
        ValueError: (``load_state_dict``) for a checkpoint of another algorithm or world size.
    """

    def __init__(self, state: Any, algorithm: str, device: torch.device | str | None = None):
        if state is None:
            raise ValueError("state must be the hook state register_hook returned; got None "
                             "(a single-process run has no hook to checkpoint)")
        self.state = state
        self.algorithm = algorithm
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return gather_hook_state(self.algorithm, self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_hook_state(self.algorithm, self.state, state_dict, device=self.device)


__all__ = ["register_hook", "HookCheckpoint"]
