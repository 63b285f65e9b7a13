"""The Hugging Face ``TrainerCallback`` :class:`GradsyncCallback`; import it from
:mod:`gradsync.integrations.transformers` (which first makes torchvision importable beside this torch:
Transformers' image utilities import it). Usage and semantics: :mod:`gradsync.integrations.transformers`."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from ..extras import require
from ..options import AUTO_ONLINE
from . import AUTO, _world, build_state_and_hook, check_hook_algorithm, gather_hook_state, load_hook_state
from .auto import (
    AutoChoice, agree_auto_entry, announce_auto, build_auto,
    check_auto_options, choose_auto_on_batches, entry_of, known_steps, online_auto_state, online_options, preserved_rng,
    recorded_auto_entry, to_device)

transformers = require("transformers", "gradsync.integrations.transformers")
from transformers import TrainerCallback  # noqa: E402

#: File the hook state is written to inside each ``checkpoint-N/`` folder (by rank 0).
HOOK_STATE_FILE = "gradsync_hook_state.pt"


def _unwrap(module: Any) -> Any:
    """``module`` without ``torch.compile``'s ``OptimizedModule`` wrappers (``_orig_mod``)."""
    while hasattr(module, "_orig_mod"):
        module = module._orig_mod
    return module


class GradsyncCallback(TrainerCallback):
    """Register gradsync algorithm ``algorithm`` as the DDP communication hook of a ``Trainer`` run.

    Args:
        algorithm: a gradsync communication-hook algorithm (``covap``, ``topk``, ``powersgd``, ...; see
            ``gradsync.algorithms.REGISTRY``). DeAR (``dear``, ``dear-covap``) replaces DDP and is refused.
            ``"auto"``: measure on the job in ``on_train_begin`` and register the hook chosen (see
            :mod:`gradsync.integrations.transformers`); the choice is kept in ``checkpoint-N/`` and a
            resumed run takes it without measuring. ``GradsyncCallback("auto", online=True)``: decide on
            the run's own first steps instead (:mod:`gradsync.profiler.online`; ``state`` is the
            :class:`~gradsync.profiler.online.OnlineAutoState`, ``state.choice`` once settled); the decision
            is kept with the winner's state and a resumed run restores it (or measures again from a
            checkpoint written before it). With it, ``recheck_every=N`` re-checks a lossy choice every N steps
            and escalates it where its quality degrades (:attr:`~gradsync.profiler.online.OnlinePlan.recheck_every`).
        process_group: group of the hook's collectives (``None`` = the default group the ``Trainer``
            set up).
        options: the algorithm's options, e.g. ``ratio=4`` (COVAP's K, integer in [1, 32], or
            ``"auto"``: calibrated by the hook from its own first iterations, then adapted),
            ``density=0.01`` (top-k). Validated on every rank in ``on_train_begin``.

    Attributes:
        state: the hook state of the current ``train()`` (``stats()``: ``wire_bytes``,
            ``dense_wire_bytes`` and ``payload_bytes`` in bytes, ``compression_ratio``, ``iteration``
            (optimizer steps the hook ran); ``state_dict()``), or ``None`` before training and in a
            single-process run (nothing to synchronise; a warning is issued, no hook).
        auto: with ``"auto"``, the :class:`~gradsync.integrations.auto.AutoChoice` of the current ``train()``
            (``entry`` registered, ``decision``, ``source``), set in ``on_train_begin``; else ``None``.
        decision: ``auto.decision``: the :class:`~gradsync.profiler.auto.AutoDecision` measured
            (``None`` where nothing was measured: a fixed algorithm, or a resumed choice).

    Raises:
        ValueError: (at construction) for an unknown or DeAR algorithm, or options given with
            ``"auto"`` (but ``online``); with ``online=True``, for a checkpoint that is no online decision; (in ``on_train_begin``) for options out of range, an FSDP/DeepSpeed run, or a
            resumed run whose hook state only some ranks found; with ``"auto"`` (every rank) for a
            checkpoint of a fixed algorithm, ranks whose checkpoints recorded different choices, no
            optimizer or training batch, or batches the model returns no loss for; (at the first step
            of a resumed run) for hook state of another algorithm or world size.
        RuntimeError: (in ``on_step_end`` of the first step) if several processes run but no
            ``DistributedDataParallel`` ran the model's forward; from PyTorch, if the DDP model
            already has a communication hook (a second ``train()`` on the same ``Trainer``).
    """

    def __init__(self, algorithm: str = "covap", process_group: Any = None, **options: Any):
        self.online, self.recheck_every = online_options(options) if algorithm == AUTO else (False, 0)
        if algorithm == AUTO:
            check_auto_options(options)
        else:
            check_hook_algorithm(algorithm)
        self.algorithm = algorithm
        self.process_group = process_group
        self.options = dict(options)
        self.state: Any = None
        self._hook: Any = None
        self._model: Any = None
        self._ddp: DistributedDataParallel | None = None
        self._device: torch.device | None = None
        self._finder: Any = None          # handle of the global forward pre-hook
        self._pending: dict[str, Any] | None = None
        self.auto: AutoChoice | None = None
        self._read_from: str | None = None

    @property
    def decision(self) -> Any:
        """The :class:`~gradsync.profiler.auto.AutoDecision` auto measured in this run, or ``None``."""
        return self.auto.decision if self.auto is not None else None

    # -- training lifecycle --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Build the hook state (after the ``Trainer`` wrapped the model, before the first step) and
        wait for the wrapper's first forward to register it; read the hook state of a resumed run."""
        self._close()
        self.state, self._hook, self._ddp, self._pending = None, None, None, None
        self.auto = None
        _, world = _world()
        if world == 1:
            warnings.warn("GradsyncCallback: single-process run, nothing to synchronise; no hook registered",
                          stacklevel=2)
            return
        if args.deepspeed or args.fsdp:
            raise ValueError(f"GradsyncCallback needs DistributedDataParallel; this run uses "
                             f"{'DeepSpeed' if args.deepspeed else 'FSDP'}, which has no DDP communication hooks")
        if model is None:
            raise ValueError("GradsyncCallback.on_train_begin needs the model (the Trainer passes model=...)")
        self._model, self._device = _unwrap(model), args.device
        if self.algorithm == AUTO:
            self._choose(args, state, world, kwargs.get("optimizer"), kwargs.get("train_dataloader"))
        else:
            self.state, self._hook = build_state_and_hook(
                self.algorithm, process_group=self.process_group, model=self._model, **self.options)
            if state.global_step > 0:
                self._pending = self._read_checkpoint(args, state.global_step, world)
        self._finder = register_module_forward_pre_hook(self._on_forward)

    def _choose(self, args, state, world: int, optimizer: Any, train_dataloader: Any) -> None:
        """``"auto"``: every rank takes the choice its checkpoint recorded (a resumed run), or measures
        (a collective) on its first training batches; then builds the chosen hook's state."""
        self._read_from = None
        pending = self._read_checkpoint(args, state.global_step, world) if state.global_step > 0 else None
        if self.online:
            self._plan_online(args, state, optimizer, train_dataloader, pending)
            return
        recorded, problem = recorded_auto_entry(pending)
        entry = agree_auto_entry(recorded, problem)
        if entry is not None:
            self.auto, self._pending = AutoChoice(entry, None, str(self._read_from)), pending
        else:
            if optimizer is None:
                raise ValueError("GradsyncCallback('auto') needs the Trainer's optimizer (on_train_begin's optimizer=)")
            bucket_cap_mb = args.ddp_bucket_cap_mb if args.ddp_bucket_cap_mb is not None else 25.0  # DDP's default
            device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
            self._model.train()            # as the Trainer's training_step sets it
            with preserved_rng(device):
                batches = _first_batches(train_dataloader, device)
                self.auto = choose_auto_on_batches(self._model, batches, _model_loss, optimizer, bucket_cap_mb,
                                                   process_group=self.process_group, workload="transformers",
                                                   job_steps=known_steps(state.max_steps))
        announce_auto(self.auto)
        self.state, self._hook = build_auto(self.auto, process_group=self.process_group, model=self._model)

    def _plan_online(self, args, state, optimizer: Any, train_dataloader: Any, pending: dict[str, Any] | None) -> None:
        """``online=True``: the start-up measurements (a collective) and the online hook's state, registered at
        the wrapper's first forward like any other; a restored decision is loaded then. Only a checkpoint of an
        online decision is taken (every rank read the same step's payload)."""
        from ..profiler.online import online_auto_hook

        if optimizer is None:
            raise ValueError("GradsyncCallback('auto') needs the Trainer's optimizer (on_train_begin's optimizer=)")
        bucket_cap_mb = args.ddp_bucket_cap_mb if args.ddp_bucket_cap_mb is not None else 25.0  # DDP's default
        device = next((p.device for p in self._model.parameters()), torch.device("cpu"))
        self._model.train()
        self.state = online_auto_state(self._model, _first_batches(train_dataloader, device), _model_loss, optimizer,
                                       bucket_cap_mb, pending, f"GradsyncCallback('auto', online=True) ({self._read_from})",
                                       process_group=self.process_group, workload="transformers",
                                       job_steps=known_steps(state.max_steps), recheck_every=self.recheck_every)
        self._hook, self._pending = online_auto_hook, pending

    @property
    def _payload_algorithm(self) -> str:
        return AUTO_ONLINE if self.online else self.algorithm

    def _on_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        if not isinstance(module, DistributedDataParallel) or _unwrap(module.module) is not self._model:
            return
        self._finder.remove()
        self._finder = None
        module.register_comm_hook(self.state, self._hook)
        self._ddp = module
        if self._pending is not None:
            payload, self._pending = self._pending, None
            load_hook_state(self._payload_algorithm, self.state, payload, device=self._device,
                            auto_entry=entry_of(self.auto))

    def on_step_end(self, args, state, control, **kwargs):
        """After the first optimizer step: fail if no DDP forward registered the hook."""
        if self.state is not None and self._ddp is None:
            raise RuntimeError(
                "GradsyncCallback: several processes run but no DistributedDataParallel ran the model's "
                "forward during the first training step; gradsync hooks need DDP (on CPU: torchrun with "
                "TrainingArguments(use_cpu=True))")

    def on_train_end(self, args, state, control, **kwargs):
        """Remove what the state hooked onto the model (COVAP's timing forward hook) and the global
        forward pre-hook if it never fired; ``state`` stays readable (``stats()``)."""
        self._close()

    def _close(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        if self.state is not None and hasattr(self.state, "close"):
            self.state.close()

    # -- checkpoints ---------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        """Gather every rank's hook state on rank 0 (a collective: the ``Trainer`` calls ``on_save``
        on all ranks) and write it to ``output_dir/checkpoint-N/`` beside the ``Trainer``'s files."""
        if self.state is None or self._ddp is None:
            return
        payload = gather_hook_state(self._payload_algorithm, self.state, auto_entry=entry_of(self.auto))
        if payload["ranks"] is not None:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save({**payload, "global_step": state.global_step}, os.path.join(folder, HOOK_STATE_FILE))

    def _read_checkpoint(self, args, global_step: int, world: int) -> dict[str, Any] | None:
        """The hook state of step ``global_step`` that every rank found, or ``None`` (with a warning)
        where no rank found it; all ranks agree (one ``all_gather_object``), so they all load it or
        all start fresh and send the same collectives."""
        payload, tried = None, []
        for folder in (args.resume_from_checkpoint, os.path.join(args.output_dir, f"checkpoint-{global_step}")):
            if not isinstance(folder, str):
                continue
            path = os.path.join(folder, HOOK_STATE_FILE)
            tried.append(path)
            if os.path.isfile(path):
                candidate = torch.load(path, map_location="cpu", weights_only=True)
                if candidate.get("global_step") == global_step:
                    payload, self._read_from = candidate, path
                    break
        found: list[Any] = [None] * world
        dist.all_gather_object(found, payload is not None)
        if all(found):
            return payload
        if any(found):
            raise ValueError(f"GradsyncCallback: the gradsync hook state of global step {global_step} was found on "
                             f"ranks {[r for r, f in enumerate(found) if f]} only (looked for {', '.join(tried)}); "
                             "every rank must read the same checkpoint (a shared file system)")
        warnings.warn(f"GradsyncCallback: resumed at global step {global_step} but found no gradsync hook state of "
                      f"that step (looked for {', '.join(tried)}); the hook starts with a fresh state "
                      "(zero error-feedback residuals, dense warm-up)", stacklevel=3)
        return None

    def stats(self) -> dict[str, Any]:
        """``state.stats()`` of the current run (``{}`` when no hook is registered)."""
        return self.state.stats() if self.state is not None else {}


def _model_loss(module: Any, batch: Any, index: int) -> torch.Tensor:
    """The loss a Transformers model returns for a Trainer batch: ``module(**batch).loss``."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"GradsyncCallback('auto') measures with model(**batch).loss; the Trainer's batches are "
                         f"{type(batch).__name__}, not mappings")
    out = module(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else (out[0] if isinstance(out, (tuple, list)) else None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("GradsyncCallback('auto') measures with model(**batch).loss, and the model returned no loss "
                         "for the Trainer's batches (do they hold labels?)")
    return loss


def _first_batches(train_dataloader: Any, device: torch.device) -> list[Any]:
    """This rank's first :data:`~gradsync.profiler.probe.QUALITY_STEPS` training batches (fewer where the
    loader has fewer), on ``device``: drawn from the DataLoader under Accelerate's prepared loader
    (``base_dataloader``, this rank's shard), so the prepared loader's epoch, iteration count and
    end-of-data bookkeeping stay as the Trainer left them."""
    from ..profiler.probe import QUALITY_STEPS

    if train_dataloader is None:
        raise ValueError("GradsyncCallback('auto') needs the Trainer's train dataloader (on_train_begin's "
                         "train_dataloader=)")
    loader = iter(getattr(train_dataloader, "base_dataloader", train_dataloader))
    batches = []
    for _ in range(QUALITY_STEPS):
        try:
            batches.append(to_device(next(loader), device))
        except StopIteration:
            break
    del loader
    if not batches:
        raise ValueError("GradsyncCallback('auto') needs at least one training batch to measure on; "
                         "the loader is empty")
    return batches


__all__ = ["GradsyncCallback", "HOOK_STATE_FILE"]
