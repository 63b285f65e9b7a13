"""Lightning integration: a ``Callback`` that puts a gradsync hook on ``DDPStrategy``'s model.

Usage (any accelerator; ``strategy="ddp"``, ``"ddp_spawn"`` or a ``DDPStrategy``)::

    from gradsync.integrations.lightning import GradsyncHook

    hook = GradsyncHook("covap", ratio=4)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[hook])
    trainer.fit(model, train_loader)
    print(hook.state.stats())          # wire_bytes, dense_wire_bytes, payload_bytes, compression_ratio, ...

Why a callback and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning 2.6's ``DDPStrategy`` registers
``ddp_comm_hook`` only when the root device is CUDA; on CPU it registers nothing and the run silently
trains with plain all-reduce. The callback calls ``register_comm_hook`` on
``trainer.strategy.model`` (the ``DistributedDataParallel`` wrapper) in ``on_fit_start``, which Lightning
runs after ``DDPStrategy.setup`` has wrapped the model and before the first training step, whatever
the device.

Checkpoints: the callback's ``state_dict`` gathers every rank's hook state (COVAP's error-feedback
residuals differ between ranks) into the checkpoint rank 0 writes, under
``checkpoint["callbacks"]["GradsyncHook"]``; ``trainer.fit(ckpt_path=...)`` hands it back to
``load_state_dict``, and the callback loads each rank's entry into the freshly built state in
``on_fit_start``, after the model has been moved to its device and before training resumes (or in
``on_train_start``, for strategies that restore after ``on_fit_start``). Resuming needs the same world
size and algorithm.

``GradsyncHook("auto")``: in ``on_train_start`` (after the strategy wrapped the model and the
training data exist, before the first step) every rank measures on the job
(:func:`gradsync.integrations.auto.choose_auto`: ``training_step``'s loss on copies of the module, detached
from the Trainer, on this rank's first 8 batches of ``trainer.train_dataloader``, with copies of the
first optimizer) and registers the chosen hook (``hook.auto``: the
:class:`~gradsync.integrations.auto.AutoChoice`; ``hook.decision``: the measured
:class:`~gradsync.profiler.auto.AutoDecision`); rank 0 prints the choice and what measuring cost. The
choice goes into the checkpoint with the hook state; ``trainer.fit(ckpt_path=...)`` takes it without
measuring (every rank raises ``ValueError`` if the ranks' checkpoints recorded different choices).
``GradsyncHook("auto", online=True)`` decides on the fit's own first steps instead
(:mod:`gradsync.profiler.online`): ``on_train_start`` takes only the start-up measurements and registers the
online hook (``hook.state``, ``hook.state.choice`` once settled); the checkpoint keeps the decision with the
winner's state, and a resumed fit restores it (a checkpoint written before the decision: measures again).

Each ``trainer.fit`` builds a fresh hook state (Lightning wraps the model in a new DDP per fit), unless
it resumes from a checkpoint; what a state hooked onto the module (COVAP's timing forward hook) is
removed when the fit ends (``teardown``), so fitting the same module again does not stack hooks.
"""

from __future__ import annotations

from typing import Any

from . import framework_attribute

__all__ = ["GradsyncHook"]  # noqa: F822 (provided by the module __getattr__ below)


def __getattr__(name: str) -> Any:
    """``GradsyncHook`` at first use (PEP 562), so importing this module has no side effect: first
    make torchvision importable beside this torch (torchmetrics, imported by Lightning, imports it),
    then import Lightning and the callback (:func:`gradsync.integrations.framework_attribute`).

    Raises:
        ImportError: if Lightning is not installed (naming ``pip install 'gradsync[integrations]'``).
    """
    if name != "GradsyncHook":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = framework_attribute("lightning_callback", __name__, name)
    return value
