"""Registration of ``dear`` (DeAR's decoupled reduce-scatter / all-gather pipeline, Zhang et al., "DeAR:
Accelerating Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445,
see :class:`~gradsync.algorithms.dear.DeAR`) and ``dear-covap`` (COVAP's filter inside it,
:class:`~gradsync.algorithms.dear.CovapGradFilter`): their options and specs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...compressors.cast import CASTS
from ...compressors.covap_shards import MAX_RATIO
from ...options import Options, option
from .covap import CovapGradFilter
from .groups import MAX_FUSION_MB
from .synchroniser import wrapper_algorithm


@dataclass(frozen=True)
class DearOptions(Options):
    """Options of ``dear``."""

    OWNER = "dear"
    fusion_mb: float | str = option(25.0, "DeAR tensor-fusion threshold, or 'auto' (Bayesian optimisation over "
                                    "1-256 MB)", low=0.0, high=MAX_FUSION_MB, low_open=True, units="MB")


SPEC = wrapper_algorithm("dear", "DeAR: reduce-scatter during backward, all-gather during the next forward, tensor "
                         "fusion tuned online (Zhang et al., arXiv 2302.12445)", DearOptions)


@dataclass(frozen=True)
class DearCovapOptions(DearOptions):
    """Options of ``dear-covap``."""

    OWNER = "dear-covap"
    ratio: int | str = option(3, "COVAP compression ratio K: each gradient element is sent once every K iterations; "
                              "'auto' sets K = ceil(measured CCR), at most max_ratio", low=1, high=MAX_RATIO)
    max_ratio: Optional[int] = option(None, "largest K that 'auto' may choose; default 2 with ratio 'auto' "
                                      "(K >= 3 missed dense quality on every seed measured), else 32",
                                      low=1, high=MAX_RATIO)
    cast: Optional[str] = option(None, "reduce-scatter and all-gather the selected shards as fp16 or bf16 "
                                 "(rounding error kept in the error-feedback residual); default: the parameters' "
                                 "dtype", choices=CASTS)


COVAP_SPEC = wrapper_algorithm("dear-covap", "COVAP's filter inside DeAR's pipeline: only the selected shards are "
                         "reduce-scattered and all-gathered (gradsync)", DearCovapOptions,
                         lambda opts, ctx: CovapGradFilter(opts.ratio, opts.max_ratio, opts.cast))

#: both registered names
SPECS = (SPEC, COVAP_SPEC)
