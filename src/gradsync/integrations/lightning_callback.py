"""The Lightning callback :class:`GradsyncHook`; import it from :mod:`gradsync.integrations.lightning`
(which first makes torchvision importable beside this torch: Lightning imports it through
torchmetrics). Usage and semantics: :mod:`gradsync.integrations.lightning`."""


from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ..extras import require
from ..options import AUTO_ONLINE

pl = require("lightning.pytorch", "gradsync.integrations.lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402

from . import AUTO, build_state_and_hook, find_ddp, gather_hook_state, load_hook_state  # noqa: E402
from .auto import (  # noqa: E402
    AutoChoice, agree_auto_entry, announce_auto, build_auto,
    check_auto_options, choose_auto_on_batches, entry_of, known_steps, online_auto_state, online_options, preserved_rng,
    recorded_auto_entry)


class GradsyncHook(Callback):
    """Register gradsync algorithm ``algorithm`` as the DDP communication hook of a Lightning fit.

    Args:
        algorithm: a gradsync communication-hook algorithm (``covap``, ``topk``, ``powersgd``, ...; see
            ``gradsync.algorithms.REGISTRY``). DeAR is not a hook and is refused. ``"auto"``: measure on
            the job and register the hook chosen (see the module docstring: ``on_train_start`` runs
            ``training_step`` on copies of the module on this rank's first 8 training batches; the
            choice is kept in the checkpoint, and a resumed fit takes it without measuring).
            ``GradsyncHook("auto", online=True)``: decide on the fit's own first steps instead
            (:mod:`gradsync.profiler.online`; ``state`` is the
            :class:`~gradsync.profiler.online.OnlineAutoState`, ``state.choice`` once it has settled); the
            checkpoint keeps the decision with the winner's state, and a resumed fit restores it (or, from a
            checkpoint written before the decision, measures again from the saved step). With it,
            ``recheck_every=N`` re-checks a lossy choice every N steps and escalates it where its quality degrades
            (:attr:`~gradsync.profiler.online.OnlinePlan.recheck_every`).
        process_group: group of the hook's collectives (``None`` = the default group Lightning set up).
        options: the algorithm's options, e.g. ``ratio=4`` (COVAP's K, integer in [1, 32], or
            ``"auto"``: calibrated by the hook from its own first iterations, then adapted),
            ``density=0.01`` (top-k). Validated when the fit starts (``setup``), on every rank.

    Attributes:
        state: the hook state of the current fit (``stats()``: ``wire_bytes``, ``dense_wire_bytes``,
            ``payload_bytes`` in bytes, ``compression_ratio``, ``iteration``...), or ``None`` before the fit starts and in a
            single-process run (nothing to synchronise, no hook); with ``"auto"``, ``None`` until
            ``on_train_start`` has chosen.
        auto: with ``"auto"``, the :class:`~gradsync.integrations.auto.AutoChoice` of the current fit (``entry``
            registered, ``decision``, ``source``); ``None`` before ``on_train_start`` and otherwise.
        decision: ``auto.decision``: the :class:`~gradsync.profiler.auto.AutoDecision` measured
            (``None`` where nothing was measured: a fixed algorithm, or a resumed choice).

    Raises:
        ValueError: (at construction) for options given with ``"auto"`` (but ``online``); (in ``setup``) for an unknown
            algorithm or options out of range; (in ``load_state_dict``/``on_fit_start``) for a
            checkpoint of another algorithm or world size; if ``DDPStrategy(ddp_comm_hook=...)`` is also
            given; with ``"auto"`` (in ``on_train_start``, on every rank) for manual optimization, no
            optimizer or no training batch, a checkpoint of a fixed algorithm, or ranks whose
            checkpoints recorded different choices.
        RuntimeError: (in ``on_fit_start``) if the strategy runs several processes but does not wrap
            the model in ``DistributedDataParallel`` (FSDP, DeepSpeed: they have no DDP hooks).
    """

    def __init__(self, algorithm: str = "covap", process_group: Any = None, **options: Any):
        self.online, self.recheck_every = online_options(options) if algorithm == AUTO else (False, 0)
        if algorithm == AUTO:
            check_auto_options(options)
        self.algorithm = algorithm
        self.process_group = process_group
        self.options = dict(options)
        self.state: Any = None
        self.auto: AutoChoice | None = None
        self._hook: Any = None
        self._registered = False
        self._pending: dict[str, Any] | None = None
        self._ddp: Any = None

    @property
    def decision(self) -> Any:
        """The :class:`~gradsync.profiler.auto.AutoDecision` auto measured in this fit, or ``None``."""
        return self.auto.decision if self.auto is not None else None

    @property
    def state_key(self) -> str:
        # Fixed key, so a checkpoint of another algorithm is found and refused instead of ignored.
        return "GradsyncHook"

    # -- fit lifecycle -------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Build the hook state (``stage == "fit"`` only): runs on every rank after the process group
        exists and before DDP wraps ``pl_module``, so bad options fail before any training."""
        if stage != "fit":
            return
        self.state, self._hook, self._registered = None, None, False
        self.auto, self._ddp = None, None
        if self.algorithm == AUTO:
            return                         # chosen in on_train_start, once batches exist
        if trainer.world_size > 1:
            self.state, self._hook = build_state_and_hook(
                self.algorithm, process_group=self.process_group, model=pl_module, **self.options)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hook on ``trainer.strategy.model`` and load a restored state into it (with
        ``"auto"``: only check the strategy; the hook is chosen and registered in ``on_train_start``)."""
        if self.algorithm == AUTO:
            if trainer.world_size == 1:
                rank_zero_warn("GradsyncHook: single-process run, nothing to synchronise; no hook registered")
                self._pending = None
                return
            if not pl_module.automatic_optimization:
                raise ValueError("GradsyncHook('auto') measures training_step's loss with its own optimizer steps; "
                                 "it needs automatic optimization (give a fixed algorithm with manual optimization)")
            self._ddp = self._find_ddp(trainer)
            return
        if self.state is None:
            if trainer.world_size == 1:
                rank_zero_warn("GradsyncHook: single-process run, nothing to synchronise; no hook registered")
                self._pending = None
                return
            raise RuntimeError("GradsyncHook.setup was not called with stage='fit' before on_fit_start")
        ddp = self._find_ddp(trainer)
        ddp.register_comm_hook(self.state, self._hook)
        self._registered = True
        self._apply_pending(trainer)

    def _find_ddp(self, trainer: pl.Trainer) -> Any:
        ddp = find_ddp(trainer.strategy.model)
        if ddp is None:
            raise RuntimeError(
                f"GradsyncHook needs a strategy that wraps the model in DistributedDataParallel ('ddp', "
                f"'ddp_spawn', DDPStrategy); {type(trainer.strategy).__name__} wraps it in "
                f"{type(trainer.strategy.model).__name__}")
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError("DDPStrategy(ddp_comm_hook=...) and GradsyncHook both set a DDP communication hook; "
                             "pass the algorithm to GradsyncHook only")
        return ddp

    def _apply_pending(self, trainer: pl.Trainer) -> None:
        if self._pending is not None and self._registered:
            payload, self._pending = self._pending, None
            load_hook_state(self.algorithm, self.state, payload, device=trainer.strategy.root_device,
                            auto_entry=entry_of(self.auto))

    def _choose(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``"auto"``: every rank takes the choice its checkpoint recorded, or measures (a collective),
        then registers the chosen hook on the DDP model."""
        if self.online:
            self._register_online(trainer, pl_module)
            return
        recorded, problem = recorded_auto_entry(self._pending)
        entry = agree_auto_entry(recorded, problem)
        if entry is not None:
            self.auto = AutoChoice(entry, None, str(trainer.ckpt_path))
        else:
            self._pending = None
            if not trainer.optimizers:
                raise ValueError("GradsyncHook('auto') needs the optimizer configure_optimizers returns; there is none")
            with preserved_rng(trainer.strategy.root_device), warnings.catch_warnings():
                # the probes' copies of the module are not attached to the Trainer: self.log() logs nothing
                warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
                self.auto = choose_auto_on_batches(
                    pl_module, _first_batches(trainer), _training_step_loss, trainer.optimizers[0],
                    self._ddp.bucket_bytes_cap / 2 ** 20, process_group=self.process_group, workload="lightning",
                    job_steps=known_steps(trainer.estimated_stepping_batches))
        announce_auto(self.auto)
        self.state, self._hook = build_auto(self.auto, process_group=self.process_group, model=pl_module)
        self._ddp.register_comm_hook(self.state, self._hook)
        self._registered = True

    def _register_online(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``online=True``: the start-up measurements (a collective), the online hook registered on the DDP
        model, then a restored decision loaded into it. Every rank reads the same checkpoint file, so a payload
        of anything but an online decision is refused alike on every rank."""
        from ..profiler.online import online_auto_hook

        pending, self._pending = self._pending, None
        if not trainer.optimizers:
            raise ValueError("GradsyncHook('auto') needs the optimizer configure_optimizers returns; there is none")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
            self.state = online_auto_state(
                pl_module, _first_batches(trainer), _training_step_loss, trainer.optimizers[0],
                self._ddp.bucket_bytes_cap / 2 ** 20, pending or None, "GradsyncHook('auto', online=True)",
                process_group=self.process_group, workload="lightning",
                job_steps=known_steps(trainer.estimated_stepping_batches), recheck_every=self.recheck_every)
        self._hook = online_auto_hook
        self._ddp.register_comm_hook(self.state, self._hook)
        self._registered = True
        if pending:
            load_hook_state(AUTO_ONLINE, self.state, pending, device=trainer.strategy.root_device)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's hook state, gathered on rank 0 (a collective: called on all ranks by
        ``trainer.save_checkpoint``, as Lightning requires); ``{}`` before a hook is registered."""
        if self.state is None or not self._registered:
            return {}
        if self.online:
            return gather_hook_state(AUTO_ONLINE, self.state)
        return gather_hook_state(self.algorithm, self.state, auto_entry=entry_of(self.auto))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the checkpoint's hook state until the hook is registered (``on_fit_start``): Lightning
        restores callbacks before ``DDPStrategy.setup`` has moved the model to its device."""
        if not state_dict:
            return
        if self.algorithm == AUTO:     # checked in on_train_start, where all ranks compare their records
            self._pending = state_dict
            return
        if state_dict.get("algorithm") != self.algorithm:
            raise ValueError(f"checkpoint holds gradsync hook state of algorithm {state_dict.get('algorithm')!r}; "
                             f"GradsyncHook uses {self.algorithm!r}")
        self._pending = state_dict

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load a checkpoint restored after ``on_fit_start`` (strategies with
        ``restore_checkpoint_after_setup``); runs before the first training step. With ``"auto"``:
        choose (the recorded choice, or measure), register the hook, then load its restored state."""
        if self.algorithm == AUTO and self._ddp is not None and not self._registered:
            self._choose(trainer, pl_module)
        self._apply_pending(trainer)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """At the end of a fit (also one that failed): remove what the state hooked onto
        ``pl_module`` (COVAP's forward hook for its timing), so fitting the same module again adds
        no second hook. The state stays readable (``stats()``)."""
        if stage == "fit" and self.state is not None:
            self.state.close()

    def stats(self) -> dict[str, Any]:
        """``state.stats()`` of the current fit (``{}`` when no hook is registered)."""
        return self.state.stats() if self.state is not None else {}


def _training_step_loss(module: pl.LightningModule, batch: Any, index: int) -> torch.Tensor:
    """The loss ``module.training_step`` returns for ``batch`` (a tensor, or a dict's ``"loss"``), called
    as Lightning's fit loop calls it (``batch_idx`` where its signature takes one)."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2):
        out = module.training_step(batch, index)
    else:
        out = module.training_step(batch)
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        raise ValueError("GradsyncHook('auto') measures with training_step's loss: training_step must return a "
                         f"0-d tensor or a dict with one under 'loss'; got {type(out).__name__}")
    return out


def _first_batches(trainer: pl.Trainer) -> list[Any]:
    """This rank's first :data:`~gradsync.profiler.probe.QUALITY_STEPS` training batches (fewer where the
    loader has fewer), on the module's device through the strategy's batch-transfer hooks."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from ..profiler.probe import QUALITY_STEPS

    if trainer.train_dataloader is None:
        raise ValueError("GradsyncHook('auto') needs the fit's training batches; the Trainer has no train dataloader")
    loader = iter(CombinedLoader(trainer.train_dataloader, "max_size_cycle"))
    batches = []
    for _ in range(QUALITY_STEPS):
        try:
            batch, _, _ = next(loader)
        except StopIteration:
            break
        batches.append(trainer.strategy.batch_to_device(batch))
    del loader
    if not batches:
        raise ValueError("GradsyncHook('auto') needs at least one training batch to measure on; the loader is empty")
    return batches
