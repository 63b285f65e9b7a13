"""Periodic synchronisation: ``local-sgd`` and ``diloco``, which replace DDP's per-step gradient
reduction by local optimizer steps and a synchronisation every ``period`` steps (issue 33).

:mod:`.base` holds what both share (the step counter that alone decides when the ranks sync, the
byte counters, :class:`~gradsync.algorithms.periodic.base.PeriodicWrapper`, which
:func:`gradsync.wrap` returns, and the Synchroniser ``gradsync train`` and ``bench`` drive);
:mod:`.local_sgd` averages the parameters (Lin et al., ICLR 2020, with torch's ``average_parameters``);
:mod:`.diloco` takes an outer Nesterov step on the averaged parameter deltas (Douillard et al., arXiv
2311.08105), optionally by fragments synced at staggered steps (Streaming DiLoCo, arXiv 2501.18512) and
with 16-bit outer gradients on the wire. Between syncs no collective runs and each rank's model is its
own; the ranks agree again right after each sync (with fragments: a fragment's parameters right after
that fragment's sync). :mod:`.torchft_peer` registers ``torchft-diloco``, torchft 0.2.0's own DiLoCo run
as a measured peer of ``diloco`` (the ``torchft`` extra).
"""

from .base import PeriodicAlgorithm, PeriodicSynchroniser, PeriodicWrapper
from .diloco import DiLoCo, DiLoCoOptions
from .diloco import SPEC as DILOCO_SPEC
from .local_sgd import LocalSGD, LocalSGDOptions
from .local_sgd import SPEC as LOCAL_SGD_SPEC
from .torchft_peer import SPEC as TORCHFT_DILOCO_SPEC
from .torchft_peer import TorchftDiLoCo, TorchftDiLoCoOptions

#: the registered names (torchft-diloco imports torchft only when it is built)
SPECS = (LOCAL_SGD_SPEC, DILOCO_SPEC, TORCHFT_DILOCO_SPEC)

__all__ = ["DILOCO_SPEC", "LOCAL_SGD_SPEC", "SPECS", "TORCHFT_DILOCO_SPEC", "DiLoCo", "DiLoCoOptions", "LocalSGD",
           "LocalSGDOptions", "PeriodicAlgorithm", "PeriodicSynchroniser", "PeriodicWrapper", "TorchftDiLoCo",
           "TorchftDiLoCoOptions"]
