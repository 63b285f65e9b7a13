"""Registration of ``dear``: DeAR's decoupled reduce-scatter / all-gather pipeline (Zhang et al., "DeAR:
Accelerating Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445),
see :class:`~gradsync.algorithms.dear.DeAR`."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import Options, option
from .spec import wrapper_algorithm

MAX_FUSION_MB = 1e6


@dataclass(frozen=True)
class DearOptions(Options):
    """Options of ``dear``."""

    OWNER = "dear"
    fusion_mb: float | str = option(25.0, "DeAR tensor-fusion threshold, or 'auto' (Bayesian optimisation over "
                                    "1-256 MB)", low=0.0, high=MAX_FUSION_MB, low_open=True, units="MB")


SPEC = wrapper_algorithm("dear", "DeAR: reduce-scatter during backward, all-gather during the next forward, tensor "
                         "fusion tuned online (Zhang et al., arXiv 2302.12445)", DearOptions)
