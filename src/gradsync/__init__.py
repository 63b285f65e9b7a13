"""gradsync: fast gradient synchronisation for data-parallel PyTorch training.

Algorithms (COVAP, GraVAC, DeAR, OSCAR and a compressor library) are built on ``torch.distributed``
only. Communication-hook algorithms plug into ``DistributedDataParallel``
(``ddp.register_comm_hook(*gradsync.algorithms.build_hook(name, ...))``); :func:`wrap` builds either
kind around a bare module.

Layers, top to bottom: a module imports only from its own layer or a lower one, never upward
(``tests/test_layers.py`` reads this table and checks every import, also those inside functions)::

    cli, __main__, __init__               command line; the package root (wrap)
    bench, integrations                   side-by-side benchmarks; Lightning / Accelerate
    train                                 training loop, checkpoints, launcher of local ranks
    profiler                              CCR, per-bucket timings, traces of an algorithm on a workload
    workloads, launch, cluster            models + datasets; forked local ranks; emulated hosts
    algorithms                            one protocol (algorithms.protocol), hooks, DeAR's pipeline
    tuning, coding, feedback, sim         fusion tuner; ASC entropy coding; error feedback; cost model
    comm                                  collectives over torch.distributed, DDP bucket sizes
    compressors                           pure tensor -> payload -> tensor transforms
    options, validation, extras, report   typed options, argument checks, optional imports, tables

The profiler sits above algorithms (it measures one), so algorithms take DDP's bucket sizes from
``comm.buckets``; comm and feedback may use compressors, which communicate nothing.
"""

__version__ = "0.1.0"


def register_auto(ddp, optimizer, batches, loss_fn, job_steps=None, online=False, recheck_every=0):
    """``--algorithm auto`` in a torchrun script: measure, choose and register the hook on ``ddp``
    (:func:`gradsync.profiler.auto.register_auto`, which documents the arguments, returns and errors).
    With ``online=True`` the choice is made on the job's own first steps instead of copies of the model
    (:func:`gradsync.profiler.online.register_online_auto`): returns ``(state, None)``; ``state.choice`` names
    the setting once ``state.phase == "settled"``; ``recheck_every`` > 0 then re-checks a lossy choice every that many
    steps and escalates it where its quality degrades (:attr:`gradsync.profiler.online.OnlinePlan.recheck_every`).

    Raises:
        ValueError: as the functions above; for ``recheck_every`` > 0 without ``online``.
    """
    from .integrations.auto import online_options

    online, recheck_every = online_options({"online": online, "recheck_every": recheck_every})
    if online:
        from .profiler.online import register_online_auto

        return register_online_auto(ddp, optimizer, batches, loss_fn, job_steps, recheck_every), None
    from .profiler.auto import register_auto as _register_auto

    return _register_auto(ddp, optimizer, batches, loss_fn, job_steps)


def wrap(model, optimizer, algorithm: str = "dear", process_group=None, bucket_cap_mb: float = 25.0, scaler=None,
         **options):
    """Wrap the bare module ``model`` for data-parallel training with ``algorithm``.

    * communication-hook algorithms (``allreduce``, ``covap``, ``topk``, ...): returns a
      ``DistributedDataParallel`` (buckets of ``bucket_cap_mb`` MB) with the hook registered; its state
      is ``ddp.gradsync_state`` (``stats()``, ``state_dict()``); keep calling ``optimizer.step()``.
    * ``dear`` / ``dear-covap``: returns a :class:`gradsync.algorithms.dear.DeAR` wrapper; call
      ``wrapper.step()`` instead of ``optimizer.step()`` and ``wrapper.flush()`` before evaluation.
    * ``local-sgd`` / ``diloco``: returns a :class:`~gradsync.algorithms.periodic.base.PeriodicWrapper` (local
      steps, a sync every ``period`` steps); call ``wrapper.step()`` (optionally ``wrapper.step(scaler)``)
      instead of ``optimizer.step()``; ``wrapper.state_dict()`` holds this rank's model, optimizer and
      the algorithm's state.

    ``options`` are the algorithm's (``gradsync.algorithms.REGISTRY[algorithm].options``). ``scaler``:
    the ``torch.amp.GradScaler`` of fp16 mixed precision, if any; DeAR-pipeline algorithms need it
    here (they unscale before their filter, so dear-covap's residuals stay in unscaled units) and
    then take ``wrapper.step(scaler)`` with the same one; hook algorithms do not use it (call
    ``scaler.step(optimizer)`` as with plain DDP).

    Raises:
        ValueError: for an unknown ``algorithm``, an option it does not take or out of range,
            ``ratio="auto"`` for ``dear-covap`` (a hook's ``auto`` calibrates itself; DeAR's does not), a
            ``model`` that is already wrapped (``DistributedDataParallel`` or DeAR), or a ``scaler``
            that is not a ``torch.amp.GradScaler`` or ``None``.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from .algorithms import build
    from .algorithms.synchroniser import BuildContext, HookSynchroniser

    if isinstance(model, DistributedDataParallel):
        raise ValueError("model is already a DistributedDataParallel; pass the bare module (ddp.module) to "
                         "gradsync.wrap, which builds DDP itself")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else None
    ctx = BuildContext(model=model, make_optimizer=lambda params: optimizer, process_group=process_group,
                       bucket_cap_mb=bucket_cap_mb, device=device, scaler=scaler)
    sync = build(algorithm, ctx, options)
    if not isinstance(sync, HookSynchroniser) and sync.needs_ccr:
        sync.close()
        raise ValueError(f"ratio='auto' of {algorithm} needs the measured communication-to-computation ratio, "
                         "which the DeAR pipeline does not measure by itself: pass a fixed ratio (e.g. ratio=2), "
                         "or let gradsync train/bench measure it (--ratio auto there)")
    if isinstance(sync, HookSynchroniser):
        sync.wrapper.gradsync_state = sync.state
    return sync.wrapper
