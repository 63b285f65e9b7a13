"""Hugging Face Transformers integration: a ``TrainerCallback`` that puts a gradsync hook on the
``DistributedDataParallel`` model the ``Trainer`` trains.

Usage (launched with ``torchrun --nproc-per-node N script.py``; on CPU pass ``use_cpu=True``)::

    from transformers import Trainer, TrainingArguments
    from gradsync.integrations.transformers import GradsyncCallback

    sync = GradsyncCallback("covap", ratio=4)
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data, callbacks=[sync])
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True)
    print(sync.stats())                  # wire_bytes, dense_wire_bytes, payload_bytes, compression_ratio, ...

How the hook gets onto the model: the ``Trainer`` (Transformers 5.x) wraps the model in
``DistributedDataParallel`` through ``accelerator.prepare`` just before ``on_train_begin``, but hands
callbacks only the unwrapped model. The callback therefore builds the hook state in ``on_train_begin``
and adds a global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``,
PyTorch's public API) that waits for the first forward of a ``DistributedDataParallel`` whose module is
that model, calls ``ddp.register_comm_hook(state, hook)`` on it (before its first backward) and removes
itself. Evaluation forwards of the unwrapped model are ignored. Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only its built-in hook types, so it cannot be
used (see :mod:`gradsync.integrations.accelerate`).

Checkpoints: in ``on_save`` (called on every rank after the ``Trainer`` wrote ``checkpoint-N/``) every
rank's hook state (COVAP's error-feedback residuals differ between ranks) is gathered on rank 0
(:func:`~gradsync.integrations.gather_hook_state`) and written to ``checkpoint-N/gradsync_hook_state.pt``
(:data:`HOOK_STATE_FILE`). When ``trainer.train(resume_from_checkpoint=...)`` resumes at global step N,
the callback reads that file from ``args.resume_from_checkpoint`` if it is set, else from
``args.output_dir/checkpoint-N`` (which is where ``resume_from_checkpoint=True`` and the default layout
point), and every rank loads its own entry once the hook is registered. Callbacks are not told the
path ``train`` was given, so a checkpoint outside ``output_dir`` needs
``TrainingArguments(resume_from_checkpoint=path)``; a resume that finds no hook state (e.g. from a
checkpoint written without the callback) warns and starts with a fresh state; the ranks agree on
which (a hook state that only some ranks can read is a ``ValueError``). Resuming needs the same
algorithm and world size (``ValueError`` otherwise).

``GradsyncCallback("auto")``: in ``on_train_begin`` every rank measures on the job
(:func:`gradsync.integrations.auto.choose_auto`: ``model(**batch).loss`` on copies of the model, on this
rank's first 8 batches of the Trainer's train dataloader, with copies of its optimizer) and the chosen
hook is registered as above (``sync.auto``: the :class:`~gradsync.integrations.auto.AutoChoice`;
``sync.decision``: the measured :class:`~gradsync.profiler.auto.AutoDecision`); rank 0 prints the choice
and what measuring cost. The choice is written with the hook state to ``checkpoint-N/``; a resumed run
takes it without measuring (every rank raises ``ValueError`` if the ranks read different choices).
``GradsyncCallback("auto", online=True)`` decides on the run's own first steps instead
(:mod:`gradsync.profiler.online`): ``on_train_begin`` takes only the start-up measurements, the online hook is
registered as above (``sync.state.choice`` once settled), and ``checkpoint-N/`` keeps the decision with the
winner's state for a resumed run (a checkpoint written before the decision: it measures again).

Gradient accumulation: the ``Trainer`` runs the non-final micro-batches under ``no_sync``; DDP calls
no hook there, so the hook (and its ``iteration`` counter) runs once per optimizer step.

Limits: one ``train()`` per ``Trainer`` (DDP accepts one communication hook per wrapper; resume with a
new ``Trainer``, as above). FSDP and DeepSpeed have no DDP communication hooks and are refused.
"""

from __future__ import annotations

from typing import Any

from . import framework_attribute

__all__ = ["GradsyncCallback", "HOOK_STATE_FILE"]  # noqa: F822 (provided by the module __getattr__ below)


def __getattr__(name: str) -> Any:
    """``GradsyncCallback`` and ``HOOK_STATE_FILE`` at first use (PEP 562), so importing this module has
    no side effect: first make torchvision importable beside this torch, then import Transformers and
    the callback (:func:`gradsync.integrations.framework_attribute`).

    Raises:
        ImportError: if Transformers is not installed (naming ``pip install 'gradsync[integrations]'``).
    """
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = framework_attribute("transformers_callback", __name__, name)
    return value
