"""Registration of OSCAR-SW, OSCAR-ASC and the count-sketch baseline (see :mod:`gradsync.algorithms.oscar`)."""

from __future__ import annotations

from typing import Any

from .oscar import CountSketchState, OscarASCState, OscarSWState, countsketch_hook, oscar_hook
from .spec import NoOptions, hook_algorithm


def _oscar(state_cls: Any, hook: Any) -> Any:
    return lambda opts, ctx: (state_cls(process_group=ctx.process_group, seed=ctx.seed), hook)


SPECS = (
    hook_algorithm("oscar-sw", "OSCAR: quantise, split by the aggregated zero mask, count-sketch the probable-zero "
                   "part, dense int8 all-reduce of the rest (Majhi et al. 2026, reconstructed)", NoOptions,
                   _oscar(OscarSWState, oscar_hook)),
    hook_algorithm("oscar-asc", "OSCAR-SW with a balanced-chunk ring and adaptive entropy coding (ASC) "
                   "(Majhi et al. 2026, reconstructed)", NoOptions, _oscar(OscarASCState, oscar_hook)),
    hook_algorithm("countsketch", "count-sketch compression with heavy-hitter recovery (Ivkin et al., NeurIPS 2019, "
                   "arXiv 1903.04488; Rothchild et al., ICML 2020, arXiv 2007.07682)", NoOptions,
                   _oscar(CountSketchState, countsketch_hook)),
)
