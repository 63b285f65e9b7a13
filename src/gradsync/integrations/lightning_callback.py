"""The Lightning callback :class:`GradsyncHook`; import it from :mod:`gradsync.integrations.lightning`
(which first makes torchvision importable beside this torch: Lightning imports it through
torchmetrics). Usage and semantics: :mod:`gradsync.integrations.lightning`."""


from __future__ import annotations

from typing import Any

from ..extras import require

pl = require("lightning.pytorch", "gradsync.integrations.lightning")
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402

from . import build_state_and_hook, find_ddp, gather_hook_state, load_hook_state  # noqa: E402


class GradsyncHook(Callback):
    """Register gradsync algorithm ``algorithm`` as the DDP communication hook of a Lightning fit.

    Args:
        algorithm: a gradsync communication-hook algorithm (``covap``, ``topk``, ``powersgd``, ...; see
            ``gradsync.algorithms.REGISTRY``). DeAR is not a hook and is refused.
        process_group: group of the hook's collectives (``None`` = the default group Lightning set up).
        options: the algorithm's options, e.g. ``ratio=4`` (COVAP's K, integer in [1, 32], or
            ``"auto"``: calibrated by the hook from its own first iterations, then adapted),
            ``density=0.01`` (top-k). Validated when the fit starts (``setup``), on every rank.

    Attributes:
        state: the hook state of the current fit (``stats()``: ``wire_bytes``, ``dense_wire_bytes``,
            ``payload_bytes`` in bytes, ``compression_ratio``, ``iteration``...), or ``None`` before the fit starts and in a
            single-process run (nothing to synchronise, no hook).

    Raises:
        ValueError: (in ``setup``) for an unknown algorithm or options out of range; (in
            ``load_state_dict``/``on_fit_start``) for a checkpoint of another algorithm or world size;
            if ``DDPStrategy(ddp_comm_hook=...)`` is also given.
        RuntimeError: (in ``on_fit_start``) if the strategy runs several processes but does not wrap
            the model in ``DistributedDataParallel`` (FSDP, DeepSpeed: they have no DDP hooks).
    """

    def __init__(self, algorithm: str = "covap", process_group: Any = None, **options: Any):
        self.algorithm = algorithm
        self.process_group = process_group
        self.options = dict(options)
        self.state: Any = None
        self._hook: Any = None
        self._registered = False
        self._pending: dict[str, Any] | None = None

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
        if trainer.world_size > 1:
            self.state, self._hook = build_state_and_hook(
                self.algorithm, process_group=self.process_group, model=pl_module, **self.options)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register the hook on ``trainer.strategy.model`` and load a restored state into it."""
        if self.state is None:
            if trainer.world_size == 1:
                rank_zero_warn("GradsyncHook: single-process run, nothing to synchronise; no hook registered")
                self._pending = None
                return
            raise RuntimeError("GradsyncHook.setup was not called with stage='fit' before on_fit_start")
        ddp = find_ddp(trainer.strategy.model)
        if ddp is None:
            raise RuntimeError(
                f"GradsyncHook needs a strategy that wraps the model in DistributedDataParallel ('ddp', "
                f"'ddp_spawn', DDPStrategy); {type(trainer.strategy).__name__} wraps it in "
                f"{type(trainer.strategy.model).__name__}")
        if getattr(trainer.strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError("DDPStrategy(ddp_comm_hook=...) and GradsyncHook both set a DDP communication hook; "
                             "pass the algorithm to GradsyncHook only")
        ddp.register_comm_hook(self.state, self._hook)
        self._registered = True
        self._apply_pending(trainer)

    def _apply_pending(self, trainer: pl.Trainer) -> None:
        if self._pending is not None and self._registered:
            payload, self._pending = self._pending, None
            load_hook_state(self.algorithm, self.state, payload, device=trainer.strategy.root_device)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's hook state, gathered on rank 0 (a collective: called on all ranks by
        ``trainer.save_checkpoint``, as Lightning requires); ``{}`` before a hook is registered."""
        if self.state is None or not self._registered:
            return {}
        return gather_hook_state(self.algorithm, self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the checkpoint's hook state until the hook is registered (``on_fit_start``): Lightning
        restores callbacks before ``DDPStrategy.setup`` has moved the model to its device."""
        if not state_dict:
            return
        if state_dict.get("algorithm") != self.algorithm:
            raise ValueError(f"checkpoint holds gradsync hook state of algorithm {state_dict.get('algorithm')!r}; "
                             f"GradsyncHook uses {self.algorithm!r}")
        self._pending = state_dict

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load a checkpoint restored after ``on_fit_start`` (strategies with
        ``restore_checkpoint_after_setup``); runs before the first training step."""
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

