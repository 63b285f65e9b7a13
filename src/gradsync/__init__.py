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
    from .algorithms import DEAR_ALGORITHMS, wrap_ddp, wrap_dear

    if algorithm in DEAR_ALGORITHMS:
        return wrap_dear(model, optimizer, algorithm, process_group, **options)
    ddp, state = wrap_ddp(model, algorithm, process_group, **options)
    ddp.gradsync_state = state
    return ddp
