"""OSCAR (compression-aware gradient splitting, reconstructed) and a count-sketch baseline as DDP hooks.

Modules:

- :mod:`.quantiser`: level choice, stochastic rounding, wire dtype of integer sums.
- :mod:`.bucket_worker`: the ordered background worker that runs each bucket's multi-collective
  reduction in bucket order, and the shared hook body (dense warm-up, then ``state.reduce``).
- :mod:`.countsketch`: :class:`CountSketchState` / :func:`countsketch_hook` (FetchSGD,
  Sketched-SGD).
- :mod:`.splitting`: :class:`OscarState` (``oscar-sw``, ``oscar-asc``) / :func:`oscar_hook`.
"""

from .countsketch import CountSketchState, countsketch_hook
from .quantiser import default_levels, quantise, stochastic_round, wire_dtype
from .splitting import OscarASCState, OscarState, OscarSWState, oscar_hook, split_by_mask

__all__ = [
    "ALGORITHMS",
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

#: name -> (state class, hook) for the algorithm registry / CLI.
ALGORITHMS = {
    "oscar-sw": (OscarSWState, oscar_hook),
    "oscar-asc": (OscarASCState, oscar_hook),
    "countsketch": (CountSketchState, countsketch_hook),
}
