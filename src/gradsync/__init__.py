"""gradsync: fast gradient synchronisation for data-parallel PyTorch training.

Algorithms (COVAP, GraVAC, DeAR, OSCAR) are built on ``torch.distributed`` only and plug into
``DistributedDataParallel`` as communication hooks (``ddp.register_comm_hook(state, hook)``).
"""

__version__ = "0.1.0"


def wrap(model, optimizer, algorithm: str = "dear", process_group=None, **options):
    """Wrap ``model`` for data-parallel training with ``algorithm``.

    * ``dear`` / ``dear-covap``: returns a :class:`gradsync.algorithms.dear.DeAR` wrapper; call
      ``wrapper.step()`` instead of ``optimizer.step()`` and ``wrapper.flush()`` before evaluation.
      Options: ``fusion_mb`` (MB or ``"auto"``), ``ratio`` (dear-covap's K), and DeAR's keywords.
    * any communication-hook algorithm (``allreduce``, ``covap``, ``topk``, ...): returns a
      ``DistributedDataParallel`` with the hook registered; its state is ``ddp.gradsync_state``
      (stats, ``state_dict``); keep calling ``optimizer.step()``. Option ``bucket_cap_mb`` goes to DDP,
      the others to the algorithm (see ``gradsync.algorithms.REGISTRY``).

    Raises:
        ValueError: for an unknown ``algorithm`` or options out of range.
    """
    from torch.nn.parallel import DistributedDataParallel

    from .algorithms import REGISTRY, build_hook

    if algorithm in ("dear", "dear-covap"):
        from .algorithms.dear import DeAR

        grad_filter = None
        ratio = options.pop("ratio", 3)
        if algorithm == "dear-covap":
            from .algorithms.dear_covap import CovapGradFilter

            grad_filter = CovapGradFilter(ratio)
        dear = DeAR(model, optimizer, process_group=process_group, grad_filter=grad_filter, **options)
        if grad_filter is not None:
            grad_filter.bind(dear)
        return dear
    if algorithm not in REGISTRY:
        known = sorted([*REGISTRY, "dear", "dear-covap"])
        raise ValueError(f"algorithm must be one of {', '.join(known)}; got {algorithm!r}")
    cap = options.pop("bucket_cap_mb", 25.0)
    ddp = DistributedDataParallel(model, process_group=process_group,
                                  bucket_cap_mb=1e4 if REGISTRY[algorithm].single_bucket else cap)
    state, hook = build_hook(algorithm, process_group=process_group, model=model, **options)
    ddp.register_comm_hook(state, hook)
    ddp.gradsync_state = state
    return ddp
