"""OSCAR (compression-aware gradient splitting, reconstructed) and a count-sketch baseline as DDP hooks.

Modules:

- :mod:`.quantiser`: level choice, stochastic rounding, wire dtype of integer sums.
- :mod:`.bucket_worker`: the ordered background worker that runs each bucket's multi-collective
  reduction in bucket order, and the shared hook body (dense warm-up, then ``state.reduce``).
- :mod:`.countsketch`: :class:`CountSketchState` / :func:`countsketch_hook` (FetchSGD,
  Sketched-SGD).
- :mod:`.splitting`: :class:`OscarState` (``oscar-sw``, ``oscar-asc``) / :func:`oscar_hook`.
- :mod:`.coded_part`: ``oscar-asc``'s part B through the entropy-coded ring, chunks cut by coded size.

Not through compressor -> memory -> communicator (:mod:`gradsync.comm.sparse`): one bucket's reduction
is a chain of dependent collectives (the MAX of the scale, the sketch table, the exact values at the
recovered coordinates, a coded ring whose chunk bounds come from the previous aggregate), run in
bucket order on a background worker, with the error feedback updated between them (quantisation
error, unrecovered sketch mass); the one-payload, one-exchange interface cannot express it.

OSCAR-SW and OSCAR with ASC (:mod:`.splitting`), reconstructed.

Source: Majhi, Laskar, Muzahid, Kim (2026), "Compression-Aware Gradient Splitting for Collective
Communications in Distributed Training". **No paper text or code is public: this is a reconstruction**
from the abstract and related work (count sketch: Charikar, Chen, Farach-Colton, ICALP 2002;
Sketched-SGD: Ivkin et al., arXiv:1903.04488; FetchSGD: Rothchild et al., arXiv:2007.07682; Atalanta:
Delmas Lascorz et al., ASPLOS'24). Names and defaults are placeholders until the paper can be read.

Pipeline per DDP bucket (flat float buffer ``g`` of ``n`` elements, world size P, ``levels`` = L):

1. ``x = g + e`` (error feedback); ``scale = all_reduce_MAX(max|x|)`` (4 bytes), identical on every
   rank; ``q = stochastic_round(x / scale * L)`` in ``[-L, L]`` (independent per-rank random
   streams; ``rounding="nearest"`` rounds deterministically); ``e = x - q * scale / L``. Default
   ``L = 127 // P`` so every partial sum fits int8 (:mod:`.quantiser`).
2. Split (OSCAR-SW) by the previous iteration's *aggregated* zero mask ``Z = (agg_{t-1} == 0)``, the
   same on every rank: part A = positions in Z ("probably zero"), part B = the others. Before any
   aggregate exists (and with ``sketch=False``) A is empty.
3. Part A: every rank count-sketches its ints ``q[A]`` at their bucket coordinates with shared hashes
   (``rows x cols`` float32, ``rows * cols ~ sketch_ratio * |A|``, or ``* n`` with
   ``sketch_basis="bucket"``); one ``all_reduce(SUM)`` of the table;
   heavy hitters = candidates of A whose median estimate rounds to a non-zero int, at most
   ``k = ceil(heavy_fraction * cols)`` by magnitude. With ``exact_recovery`` (default, Sketched-SGD's
   second round) the exact ints at the recovered coordinates are all-reduced (k int32), so recovered
   values are exact; otherwise the rounded estimates are used. Every rank's ``q`` at unrecovered
   coordinates goes back into its error feedback.
4. Part B: ``oscar-sw`` all-reduces ``q[B]`` densely (int8 when ``P * L <= 127``, float16 up to
   2048, else int32: see :func:`.quantiser.wire_dtype`);
   ``oscar-asc`` reduces it with :func:`gradsync.comm.ring.ring_all_reduce_coded`, entropy-coding every
   hop with ASC (:class:`gradsync.coding.asc.ASCRingCoder`), over chunks cut by
   :func:`gradsync.comm.ring.balanced_bounds` from the estimated coded bits of each element (its
   previous aggregate value under the shared all-gather model) or by ``equal_bounds``.
5. ``grad = agg * scale / L / P``; ``Z_t = (agg == 0)`` minus the coordinates of A whose shared
   sketch estimate rounds to non-zero but that were not recovered (``drain_flagged``): they are
   probably non-zero, so they go to part B next iteration instead of accumulating in error feedback.

Error feedback conserves mass: on every rank ``x = delivered + e``, and the sum over ranks of the
delivered parts is exactly what is returned times P.

During the first ``start_iter`` iterations (default 2, while DDP rebuilds its buckets) the hook does a
plain dense all-reduce.

The reductions run on the state's ordered bucket worker (:mod:`.bucket_worker`), in bucket order.

Statistics (``stats()``): the common counters of :func:`gradsync.algorithms.base.counter_stats`, with
``wire_bytes`` the bytes this rank put on the wire over all iterations, warm-up included (ring
point-to-point bytes exactly as sent, 8-byte headers included; an all-reduce of B bytes counted as
``2 (P-1) / P * B``, as a ring all-reduce sends: :func:`gradsync.comm.collectives.wire_bytes`);
the other byte and time figures cover the compressed iterations only:
``wire_bytes_per_step`` (wire bytes of the compressed iterations / their number),
``wire_bytes_last_step`` (the last completed iteration),
``encode_seconds`` / ``decode_seconds`` (ASC callbacks), ``coding_seconds`` (their sum),
``coding_seconds_per_step`` (per compressed iteration), ``coding_seconds_per_hop`` (encode + decode
seconds per coded ring message this rank sent: every hop's payload is encoded once, by its sender or,
on all-gather hops, by the chunk's owner, and decoded once by its receiver),
``coding_ns_per_element`` (the same per element carried on those hops), ``coded_hops``,
``coded_elements``, ``coded_bytes`` (payload + 8-byte length headers of the coded hops; part of
``wire_bytes``), ``coded_bits_per_element`` (``8 * coded_bytes / coded_elements``; all of these are 0
or NaN for ``oscar-sw``), ``compress_seconds`` (all local work),
``ring_balance`` (mean over buckets of max/mean bytes over this rank's reduce-scatter steps; it
mostly shows that later steps carry wider partial sums, not chunk imbalance),
``ring_balance_global`` (only with ``global_balance=True``: mean over buckets and ring steps of
max/mean bytes across ranks, the figure that sets lock-step idle time; costs one extra small
all-gather per bucket), ``sketch_rel_error``
(mean relative L2 error of the rounded sketch estimates at recovered coordinates, measured with
``exact_recovery``), ``sketch_unrecovered_fraction`` (mean share of the local L1 mass of part A sent
back to error feedback), ``probable_zero_fraction`` (mean |A| / n). Means over nothing are NaN.
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
