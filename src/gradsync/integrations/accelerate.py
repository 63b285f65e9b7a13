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

``algorithm="auto"``: measure on the job and register the hook chosen
(:func:`gradsync.profiler.auto.resolve_auto` on every rank: a collective; every rank gets the same
choice). Accelerate has no training step to call, so the loop's optimizer, this rank's first training
batches as ``(inputs, targets)`` and the loss are passed in; the returned
:class:`~gradsync.integrations.auto.AutoChoice` goes to :class:`HookCheckpoint`, so the choice is saved
with the hook state, and a resumed run passes ``resume=`` the folder it loads, takes the recorded
choice and measures nothing::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    it = iter(loader)
    batches = [next(it) for _ in range(8)]   # this rank's (x, y) batches, on accelerator.device
    state, choice = register_hook(model, "auto", optimizer=optimizer, batches=batches, loss_fn=F.cross_entropy,
                                  resume=None)           # resume="ckpt" (the folder load_state reads)
    accelerator.register_for_checkpointing(HookCheckpoint(state, "auto", accelerator.device, auto=choice))
    # accelerator.load_state("ckpt")                     # on resume, after register_for_checkpointing
    print(choice.entry, choice.decision)                 # rank 0 also printed one line: choice, reason, seconds

With ``online=True`` the choice is made on the job's own first steps instead of copies of the model
(:func:`gradsync.profiler.online.register_online_auto`): ``register_hook`` returns ``(state, None)``, the
:class:`~gradsync.profiler.online.OnlineAutoState` that meters and races the candidates on the loop's
steps and then keeps training with the winner (``state.choice`` once ``state.phase == "settled"``).
``HookCheckpoint(state, "auto", accelerator.device)`` saves the decision with the winner's state; a
resumed run registers the same way and ``accelerator.load_state`` restores it (a checkpoint written
before the decision makes the resumed run measure again from its step)::

    state, _ = register_hook(model, "auto", optimizer=optimizer, batches=batches, loss_fn=F.cross_entropy,
                             job_steps=steps, online=True)   # steps: the loop's optimizer steps
    accelerator.register_for_checkpointing(HookCheckpoint(state, "auto", accelerator.device))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..options import AUTO_ONLINE
from . import AUTO, PAYLOAD_FORMAT, build_state_and_hook, find_ddp, gather_hook_state, load_hook_state
from .auto import (AutoChoice, agree_auto_entry, announce_auto, build_auto, choose_auto, entry_of, online_options,
                   recorded_auto_entry)

#: The keyword arguments of ``register_hook(model, "auto", ...)``.
AUTO_ARGUMENTS = ("optimizer", "batches", "loss_fn", "resume", "job_steps", "online", "recheck_every")


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
            see :func:`gradsync.integrations.build_state_and_hook`). With ``algorithm="auto"``
            (measure on the job, then register the hook chosen; a collective: every rank, same
            arguments but its own batches), these keyword arguments instead:

            * ``optimizer``: the loop's optimizer (as ``prepare`` returned it); copies of its class
              with its constructor defaults train the probes.
            * ``batches``: this rank's first training batches, ``(inputs, targets)`` tensors on the
              model's device, different on every rank as in training; 8 are measured
              (:data:`gradsync.profiler.probe.QUALITY_STEPS`; fewer are cycled). The batch-size label is
              ``inputs``' leading dimension.
            * ``loss_fn``: ``loss_fn(model(inputs), targets) -> 0-d tensor``.
            * ``resume`` (optional): the folder ``accelerator.load_state`` will read; the choice it
              recorded is taken and nothing is measured (``optimizer``, ``batches`` and ``loss_fn`` are
              then not needed).
            * ``job_steps`` (optional): the loop's optimizer steps; given, measuring spends at most
              :data:`gradsync.profiler.auto.PROBE_SHARE` of the job's predicted time.
            * ``online`` (optional, default False): decide on the loop's own first steps
              (:func:`gradsync.profiler.online.register_online_auto`); ``resume`` is then not taken
              (``accelerator.load_state`` restores the decision).
            * ``recheck_every`` (optional, default 0: never; needs ``online``): re-check a lossy choice every that
              many steps and escalate it where its quality degrades
              (:attr:`gradsync.profiler.online.OnlinePlan.recheck_every`).

    Returns:
        The hook state (``stats()``: ``wire_bytes``, ``dense_wire_bytes`` and ``payload_bytes`` in bytes,
        ``compression_ratio``, ``iteration``; ``state_dict()``), or ``None`` in a single-process run
        (nothing to synchronise; a warning is issued). With ``"auto"``: ``(state, choice)``, ``choice``
        the :class:`~gradsync.integrations.auto.AutoChoice` (``entry`` registered; ``decision``: the
        :class:`~gradsync.profiler.auto.AutoDecision` measured, ``None`` on resume) for
        ``HookCheckpoint(state, "auto", device, auto=choice)``; ``(None, None)`` in a single-process
        run. Rank 0 prints one line: the choice, why, and what measuring cost in seconds. With
        ``online=True``: ``(state, None)``, ``state`` the :class:`~gradsync.profiler.online.OnlineAutoState`
        for ``HookCheckpoint(state, "auto", device)``; nothing is printed (``state.summary()`` once settled).

    Raises:
        ValueError: for an unknown or DeAR algorithm or options out of range; if ``model`` is not a
            ``DistributedDataParallel`` although several processes run (FSDP, DeepSpeed). With
            ``"auto"``: for an unknown keyword, a missing ``optimizer``/``batches``/``loss_fn`` without
            ``resume`` (with ``online=True``: at all), ``resume`` with ``online=True``, empty ``batches``,
            ``recheck_every`` out of [0, 1000000] or without ``online``;
            on every rank, for a ``resume`` folder without an ``auto`` hook state or ranks whose folders
            recorded different choices.
        RuntimeError: from PyTorch, if the model already has a communication hook.
    """
    ddp = find_ddp(model)
    if ddp is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            import warnings

            warnings.warn("register_hook: single-process run, nothing to synchronise; no hook registered",
                          stacklevel=2)
            return (None, None) if algorithm == AUTO else None
        raise ValueError(
            f"model must be the DistributedDataParallel returned by accelerator.prepare, since "
            f"{world} processes run; got {type(model).__name__}. On a machine without CUDA create "
            f"Accelerator(cpu=True): otherwise Accelerate treats each process as a single-process run and "
            f"does not synchronise gradients at all. FSDP and DeepSpeed have no DDP communication hooks.")
    if algorithm == AUTO:
        return _register_auto(ddp, process_group, options)
    state, hook = build_state_and_hook(algorithm, process_group=process_group, model=ddp.module, **options)
    ddp.register_comm_hook(state, hook)
    return state


def _register_auto(ddp: Any, process_group: dist.ProcessGroup | None, options: dict[str, Any]
                   ) -> tuple[Any, AutoChoice]:
    unknown = sorted(set(options) - set(AUTO_ARGUMENTS))
    if unknown:
        raise ValueError(f"register_hook(model, 'auto', ...) takes the keyword arguments {', '.join(AUTO_ARGUMENTS)}; "
                         f"got {', '.join(unknown)} (auto chooses the algorithm's options)")
    resume = options.get("resume")
    online, recheck_every = online_options({k: options[k] for k in ("online", "recheck_every") if k in options})
    if online and resume is not None:
        raise ValueError("register_hook(model, 'auto', ..., online=True) takes no resume=: register it as in the "
                         "first run and accelerator.load_state restores the decision")
    if resume is None:
        missing = [k for k in AUTO_ARGUMENTS[:3] if options.get(k) is None]
        if missing:
            raise ValueError(f"register_hook(model, 'auto', ...) measures on the job and needs {', '.join(missing)} "
                             "(or resume=the checkpoint folder, to take the choice it recorded)")
        if not list(options["batches"]):
            raise ValueError("register_hook(model, 'auto', ...) needs at least one (inputs, targets) batch")
        recorded, problem, source = None, None, None
        if online:
            from ..profiler.online import register_online_auto

            return register_online_auto(ddp, options["optimizer"], list(options["batches"]), options["loss_fn"],
                                        options.get("job_steps"), recheck_every), None
    else:
        recorded, problem, source = _recorded_choice(Path(resume))
    entry = agree_auto_entry(recorded, problem)
    if entry is not None:
        choice = AutoChoice(entry, None, str(source))
    else:
        choice = choose_auto(ddp.module, list(options["batches"]), options["loss_fn"], options["optimizer"],
                             ddp.bucket_bytes_cap / 2 ** 20, process_group=process_group, workload="accelerate",
                             job_steps=options.get("job_steps"))
    announce_auto(choice)
    state, hook = build_auto(choice, process_group=process_group, model=ddp.module)
    ddp.register_comm_hook(state, hook)
    return state, choice


def _recorded_choice(folder: Path) -> tuple[str | None, str | None, Path | None]:
    """``(entry, problem, file)``: the auto choice a :class:`HookCheckpoint` saved in an
    ``accelerator.save_state`` folder (Accelerate writes registered objects as
    ``custom_checkpoint_<i>.pkl``; files that are no weights-only gradsync payload are skipped)."""
    found = []
    for path in sorted(folder.glob("custom_checkpoint_*.pkl")):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:              # another registered object's state: not ours
            continue
        if isinstance(payload, dict) and payload.get("format") == PAYLOAD_FORMAT and "ranks" in payload:
            found.append((path, payload))
    autos = [(p, d) for p, d in found if d.get("algorithm") == AUTO]
    if len(autos) == 1:
        return (*recorded_auto_entry(autos[0][1]), autos[0][0])
    if autos:
        return None, f"{folder} holds {len(autos)} 'auto' hook states ({', '.join(p.name for p, _ in autos)})", None
    if found:
        return None, recorded_auto_entry(found[0][1])[1], found[0][0]
    return None, f"{folder} holds no gradsync hook state (custom_checkpoint_*.pkl of a HookCheckpoint)", None


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
        auto: with ``algorithm="auto"``, the :class:`~gradsync.integrations.auto.AutoChoice`
            ``register_hook`` returned: its ``entry`` is saved with the state (a resumed
            ``register_hook(..., resume=folder)`` reads it), and a checkpoint of another choice is refused.
            None for the :class:`~gradsync.profiler.online.OnlineAutoState` of ``online=True``, whose own
            ``state_dict`` holds its decision (saved as algorithm ``"auto-online"``).

    Raises:
        ValueError: for ``state`` ``None``, or ``auto`` given without ``algorithm="auto"`` or missing with
            it (but for an online state); (``load_state_dict``) for a checkpoint of another algorithm, auto
            choice or world size.
    """

    def __init__(self, state: Any, algorithm: str, device: torch.device | str | None = None,
                 auto: AutoChoice | None = None):
        if state is None:
            raise ValueError("state must be the hook state register_hook returned; got None "
                             "(a single-process run has no hook to checkpoint)")
        from ..profiler.online import OnlineAutoState

        online = isinstance(state, OnlineAutoState)
        if online:  # the decision is the state's own: algorithm "auto", no choice
            wrong = algorithm != AUTO or auto is not None
        else:  # a choice exactly with algorithm "auto"
            wrong = (algorithm == AUTO) != (auto is not None)
        if wrong:
            raise ValueError("HookCheckpoint(state, 'auto', device, auto=choice) takes the AutoChoice register_hook "
                             f"returned with algorithm 'auto' only (no choice for an online state); got algorithm "
                             f"{algorithm!r}, auto={auto!r}")
        self.state = state
        self.algorithm = AUTO_ONLINE if online else algorithm
        self.device = device
        self.auto = auto

    def state_dict(self) -> dict[str, Any]:
        return gather_hook_state(self.algorithm, self.state, auto_entry=entry_of(self.auto))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_hook_state(self.algorithm, self.state, state_dict, device=self.device, auto_entry=entry_of(self.auto))


__all__ = ["AUTO_ARGUMENTS", "register_hook", "HookCheckpoint"]
