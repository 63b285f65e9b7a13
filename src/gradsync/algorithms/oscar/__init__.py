"""OSCAR (compression-aware gradient splitting, reconstructed) and a count-sketch baseline as DDP hooks.

Modules:

- :mod:`.quantiser`: level choice, stochastic rounding, wire dtype of integer sums.
- :mod:`.bucket_worker`: the ordered background worker that runs each bucket's multi-collective
  reduction in bucket order, and the shared hook body (dense warm-up, then ``state.reduce``).
- :mod:`.countsketch`: :class:`CountSketchState` / :func:`countsketch_hook` (FetchSGD,
  Sketched-SGD).
- :mod:`.splitting`: :class:`OscarState` (``oscar-sw``, ``oscar-asc``) / :func:`oscar_hook`.
"""

from ..spec import NoOptions, hook_algorithm
from .countsketch import CountSketchState, countsketch_hook
from .quantiser import default_levels, quantise, stochastic_round, wire_dtype
from .splitting import OscarASCState, OscarState, OscarSWState, oscar_hook, split_by_mask

__all__ = [
    "ALGORITHMS",
    "SPECS",
    "CountSketchState",
    "OscarASCState",
    "OscarSWState",
    "OscarState",
    "countsketch_hook",
    "default_levels",
    "oscar_hook",
    "quantise",
    "split_by_mask",
    "stochastic_round",
    "wire_dtype",
]

#: name -> (state class, hook).
ALGORITHMS = {
    "oscar-sw": (OscarSWState, oscar_hook),
    "oscar-asc": (OscarASCState, oscar_hook),
    "countsketch": (CountSketchState, countsketch_hook),
}


def _oscar(state_cls: type, hook: object) -> object:
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
