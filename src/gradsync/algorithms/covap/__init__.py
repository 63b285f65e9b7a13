"""COVAP: overlapping-aware gradient compression with a coarse-grained filter.

Source: Lin Meng, Yuzhong Sun, Weimin Li, "Near-Linear Scaling Data Parallel Training with
Overlapping-Aware Gradient Compression", arXiv 2311.04499 (2023), §3; the reference code calls it
OGC. Its error-feedback aliasing bugs are not reproduced: this module implements the stated intent.

The filter is deterministic: it depends only on the iteration number and the static bucket layout,
so every rank selects the same elements and a plain all-reduce still works.

* Tensor sharding: with ``m`` the median bucket numel, bucket ``b`` of numel ``n_b`` is cut into
  ``c_b = 1`` interleaved shards if ``floor(n_b / m - 0.3) <= 0``, else ``min(floor(n_b/m - 0.3) + 1, K)``;
  shard ``s`` holds elements ``s, s + c_b, s + 2 c_b, ...``.
* Round-robin schedule: shard ``s`` of bucket ``b`` has global id ``G = sum_{b'<b} c_b' + s`` and is
  sent at iteration ``t`` iff ``(G + t) mod K == 0``, so each element is sent once every K iterations
  and at most one shard of a bucket is sent per iteration. A bucket with no selected shard launches no
  collective (DDP receives an already-completed future of zeros), except the last bucket, which
  all-reduces the iteration's finite vote (:class:`~gradsync.feedback.finite.FiniteGuard`, 4 bytes);
  when it sends, the vote is one more element of its shard. A non-finite step keeps the residuals
  as they were and gives NaN to every rank, so GradScaler skips it once, as with DDP.
* Discounted error feedback: ``x = lambda_t e + g`` (:class:`~gradsync.feedback.discounted.CovapDiscount`
  as the schedule of a :class:`~gradsync.feedback.residual.ResidualMemory`); the selected shard of ``x``
  is all-reduced (averaged), everything unsent stays in ``e``. Unsent positions have zero gradient this
  step; momentum and weight decay still apply (a deliberate choice, as in the reference code).
* K from the CCR: with ``ratio="auto"`` K = ceil(CCR) in [1, ``max_ratio``]; ``max_ratio`` defaults
  to 2 there (:data:`~gradsync.compressors.covap_shards.AUTO_MAX_RATIO`; not in the paper): a K that
  hides the communication cost dense quality on every seed measured, so time to quality favours
  K <= 2. ``gradsync train`` and ``bench`` measure the communication-to-computation ratio before
  training and call :meth:`CovapFilter.calibrate`; wherever else the hook runs (``build_hook``, ``gradsync.wrap``, the
  integrations) it calibrates itself from its own first iterations: it times the backward pass and
  its collectives (the dense start-up all-reduces and K = 1 iterations, :mod:`.adapt`), and at
  iteration ``max(start_iter, 1 + AUTO_CALIBRATION_STEPS)`` every rank takes the same K from one
  all-reduce issued in the hook body. ``auto`` then keeps following the network every
  ``adapt_every`` (default :data:`AUTO_ADAPT_EVERY`) steps.
* A dense tail (``dense_from``, not in the paper): from that iteration on K = 1, so every element
  goes out each step and the error-feedback residual is flushed into the first of them; the
  compressed start buys speed, the dense end the final quality (decided by the iteration counter,
  identical on every rank, kept across a restore).
* Compression starts at ``start_iter`` (default 2), after DDP's bucket rebuild, like PowerSGD's
  ``start_powerSGD_iter``; the bucket layout is recorded during the dense iterations before it. A
  state restored from a checkpoint into a fresh DDP does not wait for DDP to rebuild its
  buckets: each parameter is found by name in the recorded layout and compressed exactly as it would
  have been there, so a resumed run continues the uninterrupted one.

The package: :mod:`.filter` (:class:`CovapFilter`: sharding, schedule, K and the residual memory,
the one object shared by the DDP hook and DeAR's pipeline, :mod:`gradsync.algorithms.dear.covap`),
:mod:`.state` (:class:`CovapState`: the hook's state, recorded layouts, calibration), :mod:`.hook`
(:func:`covap_hook`: the per-bucket launch and scatter-back), :mod:`.adapt` (timing and K
adaptation); the options and the registration are here.

Compressor -> memory -> communicator: the shard plan (:class:`~gradsync.compressors.covap_shards.CovapPlan`)
plays the compressor and a :class:`~gradsync.feedback.residual.ResidualMemory` with
:class:`~gradsync.feedback.discounted.CovapDiscount` the memory, but the exchange does not go through
:func:`gradsync.comm.sparse.communicate`: the payload is a strided slice that the receiver writes back
into ``buf[s::c]`` (no index, no decompression), a dropped bucket launches no collective at all, and
the last bucket's all-reduce carries the finite vote as one more element; so the hook keeps one launch
and scatter-back path of its own (:func:`.hook._send`, also used for remapped buckets).
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from ...compressors.cast import CASTS
from ...compressors.covap_shards import MAX_RATIO, CovapPlan
from ...options import Options, option
from ..spec import hook_algorithm
from .filter import CovapFilter, narrow
from .hook import covap_hook
from .state import AUTO_ADAPT_EVERY, AUTO_CALIBRATION_STEPS, CovapState

__all__ = ["AUTO_ADAPT_EVERY", "AUTO_CALIBRATION_STEPS", "SPEC", "SPECS", "CovapFilter", "CovapOptions", "CovapPlan",
           "CovapState", "covap_hook", "narrow"]


@dataclass(frozen=True)
class CovapOptions(Options):
    """Options of ``covap``."""

    OWNER = "covap"
    ratio: Union[int, str] = option(3, "COVAP compression ratio K: each gradient element is sent once every "
                                    "K iterations; 'auto' sets K = ceil(measured CCR), at most max_ratio",
                                    low=1, high=MAX_RATIO)
    adapt_every: Optional[int] = option(None, "re-choose K from the hook's own timing of its collectives every "
                                        "this many steps (0: K fixed; default 20 with ratio 'auto', else 0)",
                                        low=0, high=1_000_000, units="steps")
    cast: Optional[str] = option(None, "send the selected shard as fp16 or bf16 (rounding error kept in the "
                                 "error-feedback residual); default: the bucket's dtype", choices=CASTS)
    max_ratio: Optional[int] = option(None, "largest K that 'auto' and adapt_every may choose (a large K hides "
                                      "the communication but costs accuracy per step); default 2 with ratio "
                                      "'auto' (K >= 3 missed dense quality on every seed measured), else 32",
                                      low=1, high=MAX_RATIO)
    dense_from: int = option(0, "from this iteration on K = 1: every element is sent each step (with cast, "
                             "torch's fp16/bf16 hook) and the residual is flushed into it, so the end of "
                             "training runs at dense quality; 0: never", low=0, high=100_000_000,
                             units="iterations")



def _make_hook(opts: CovapOptions, ctx: Any) -> Tuple[CovapState, Any]:
    return CovapState(ratio=opts.ratio, process_group=ctx.process_group, model=ctx.model,
                      adapt_every=opts.adapt_every, cast=opts.cast, max_ratio=opts.max_ratio,
                      dense_from=opts.dense_from), covap_hook


SPEC = hook_algorithm("covap", "COVAP coarse-grained filter, K from the measured CCR, discounted error feedback "
                      "(Meng, Sun & Li, arXiv 2311.04499)", CovapOptions, _make_hook)

#: the algorithms this package registers
SPECS = (SPEC,)
