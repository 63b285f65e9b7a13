"""gradsync: fast gradient synchronisation for data-parallel PyTorch training.

Algorithms (COVAP, GraVAC, DeAR, OSCAR) are built on ``torch.distributed`` only and plug into
``DistributedDataParallel`` as communication hooks (``ddp.register_comm_hook(state, hook)``).
"""

__version__ = "0.1.0"
