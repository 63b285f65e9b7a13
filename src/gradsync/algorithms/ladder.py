"""A compressed setting that escalates when its measured quality degrades (GraVAC's controller over a
ladder of settings; Tyagi & Sharma 2023, arXiv 2305.12201, §3.3: lower the compression when the
compression gain falls below a threshold).

The ``ladder`` hook runs one rung at a time, starting at ``start``: PowerSGD (overlapped with backward)
at rank r, then 2r, ... up to 16, then the fp16 cast, then dense all-reduce; any other start goes to
fp16, then dense. Every ``check_every`` iterations ``window`` consecutive steps (one by default) run under a
:class:`~gradsync.algorithms.meter.QualityMeter`: the buckets are also all-reduced densely, and the
relative error of the rung's aggregate against the dense one (on ``reference_fraction`` of each gradient
tensor's elements, the same on every rank), with the gradient noise of the same steps
(each rank's own gradient against the dense average), is all-reduced at the first bucket after the window, so
every rank takes the same decision. ``--algorithm auto --auto-probe online`` with ``--auto-recheck-every`` hands
its settled choice to a ladder that starts on the chosen hook's own state
(:class:`~gradsync.profiler.online.OnlineAutoState`). Where the error exceeds ``max_error_to_noise`` times the average's
noise (:func:`~gradsync.algorithms.meter.error_to_noise`, the unit of the start-up quality model,
:mod:`gradsync.profiler.quality_model`) the next rung takes over from that step on (its error-feedback
residual starts at zero). This replaces a dense tail fixed in advance with
one the job's own gradients call for: late in a schedule a rank-r approximation stops capturing the
gradient.

Switches are printed on rank 0, reported in :meth:`LadderState.stats` (``rung``, ``switches``) and per
step (``ladder_rung``, ``ladder_error``), counted in the wire bytes (every rung's collectives and the
meter's dense all-reduces), and kept in :meth:`LadderState.state_dict`.
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..comm.collectives import collective_device
from ..options import Options, option
from .base import ADDITIVE_COUNTERS, HookState
from .meter import LOCAL_GRADIENT, REFERENCE_FRACTION, QualityMeter, error_to_noise, metered_hook, relative_errors
from .spec import hook_algorithm

#: The quality model's strictest limit (gradsync.profiler.quality_model.FITTED.limit(), the adaptive optimizers'; the
#: ladder does not know the optimizer, and escalating early costs speed, not quality; the profiler sits above the
#: algorithms, so the number is repeated here and a test keeps the two equal).
DEFAULT_MAX_ERROR_TO_NOISE = 0.153


@dataclass(frozen=True)
class LadderOptions(Options):
    """Options of ``ladder``."""

    OWNER = "ladder"
    start: str = option("powersgd-overlap/matrix_approximation_rank=4",
                        "the first rung, a --algorithms entry with / for : (a hook that works on DDP's buckets)")
    check_every: int = option(50, "iterations between quality checks", low=1, high=1_000_000, units="iterations")
    max_error_to_noise: float = option(
        DEFAULT_MAX_ERROR_TO_NOISE, "escalate when the measured relative error exceeds this many times the dense "
        "average's gradient noise", low=0.0, high=100.0, low_open=True)
    reference_fraction: float = option(
        REFERENCE_FRACTION, "share of each gradient tensor's elements a check all-reduces densely and compares "
        "(the start-up probe's)", low=0.0, high=1.0, low_open=True)
    window: int = option(1, "consecutive steps each check measures (at most check_every)", low=1, high=1_000_000,
                         units="iterations")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.window, self.check_every)


def check_window(window: int, check_every: int) -> None:
    """Raise ``ValueError`` unless ``window`` (steps each check measures) is in [1, ``check_every``]."""
    if not 1 <= window <= check_every:
        raise ValueError(f"ladder.window must be an integer in [1, check_every={check_every}], got {window}")


def rungs(start: str) -> list[str]:
    """The ladder from ``start`` (an entry, ``:`` or ``/`` between its items): PowerSGD ranks doubling
    up to 16, then ``fp16``, then ``allreduce``.

    Raises:
        ValueError: for an unknown or non-hook algorithm, bad options, or an algorithm that needs DDP
            built with one bucket (torch's ``powersgd``: use ``powersgd-overlap``).
    """
    from . import REGISTRY, parse_entry

    entry = start.replace("/", ":")
    name, options = parse_entry(entry)
    spec = REGISTRY[name]
    if spec.make_hook is None or spec.single_bucket:
        raise ValueError(f"start must be a communication hook that works on DDP's buckets; {name!r} is not "
                         f"(for PowerSGD use powersgd-overlap)")
    out = [entry]
    if name == "powersgd-overlap":
        r = int(options.get("matrix_approximation_rank", 2))
        while r < 16:
            r = min(16, 2 * r)
            out.append(f"powersgd-overlap:matrix_approximation_rank={r}")
    for tail in ("fp16", "allreduce"):
        if tail not in out:
            out.append(tail)
    return out


class LadderState(HookState):
    """State of :func:`ladder_hook`.

    Args:
        start, check_every, max_error_to_noise, reference_fraction, window: see :class:`LadderOptions`.
        model: the module DDP wraps (passed to each rung's builder).
        process_group: the group of every collective.
        seed: the rungs' seed.
        first: ``(state, hook)`` of ``start`` already training the job, to run as the first rung (it keeps its
            error feedback and factors); None: a new one is built.

    Raises:
        ValueError: for a bad ``start`` (see :func:`rungs`), or ``window`` outside [1, ``check_every``].
    """

    def __init__(self, start: str, check_every: int = 50, max_error_to_noise: float = DEFAULT_MAX_ERROR_TO_NOISE,
                 reference_fraction: float = REFERENCE_FRACTION, model: Any = None,
                 process_group: Optional[dist.ProcessGroup] = None, seed: int = 0, window: int = 1,
                 first: Optional[tuple] = None):
        super().__init__(process_group)
        self.rungs = rungs(start)
        check_window(window, check_every)
        self.check_every, self.max_error_to_noise, self.window = check_every, max_error_to_noise, window
        self.model, self.seed = model, seed
        self.index = 0
        self.switches: list[dict[str, Any]] = []
        self.retired: dict[str, float] = {}
        self.last_error: Optional[float] = None
        self.last_noise: Optional[float] = None
        self._pending_check = False
        self._in_step = False
        self.meter = QualityMeter([first, LOCAL_GRADIENT] if first is not None else self._meter_hooks(0), primary=0,
                                  process_group=process_group, sample_fraction=reference_fraction, seed=seed)

    def _meter_hooks(self, index: int) -> list:
        """The meter's hooks at rung ``index``: the rung's (the primary) and the rank's own gradient (the
        noise)."""
        from . import REGISTRY, BuildContext, make_options, parse_entry

        name, options = parse_entry(self.rungs[index])
        ctx = BuildContext(model=self.model, make_optimizer=None, process_group=self.process_group, seed=self.seed)
        return [REGISTRY[name].make_hook(make_options(name, options), ctx), LOCAL_GRADIENT]

    def checks(self, iteration: int) -> bool:
        """Whether ``iteration`` is measured: the first ``window`` of every ``check_every`` iterations, from
        ``check_every`` on."""
        return iteration >= self.check_every and iteration % self.check_every < self.window

    @property
    def current(self) -> str:
        """The rung in use (an ``--algorithms`` entry)."""
        return self.rungs[self.index]

    def _decide(self) -> None:
        """All-reduce the last check's sums (from the hook body: the same collective on every rank) and
        escalate above ``max_error_to_noise`` times the average's gradient noise."""
        sums = self.meter.sums().to(collective_device(self.process_group))
        dist.all_reduce(sums, group=self.process_group)
        self.count_collective(sums)
        world = dist.get_world_size(self.process_group)
        self.last_error, self.last_noise = relative_errors(sums / world)
        self.meter.reset()
        if not (math.isfinite(self.last_error) and math.isfinite(self.last_noise)):
            return  # the checked step's gradient held an inf or a NaN (AMP skips that step): no decision from it
        ratio = error_to_noise(self.last_error, self.last_noise, max(world, 2))
        if ratio > self.max_error_to_noise and self.index + 1 < len(self.rungs):
            old = self.current
            inner = self.meter.hooks[0][0]
            for key, value in inner.stats().items():
                if key in ADDITIVE_COUNTERS:
                    self.retired[key] = self.retired.get(key, 0) + value
            inner.close()
            self.index += 1
            self.meter.hooks = self._meter_hooks(self.index)
            self.switches.append({"iteration": self.iteration, "from": old, "to": self.current,
                                  "error": self.last_error, "noise": self.last_noise, "ratio": ratio})
            if not dist.is_initialized() or dist.get_rank(self.process_group) == 0:
                print(f"ladder: iteration {self.iteration}: relative error {self.last_error:.3f} = {ratio:.2f} x the "
                      f"gradient noise > {self.max_error_to_noise:g}: {old} -> {self.current}", flush=True)

    # -- the protocol ------------------------------------------------------------------------------
    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        out = {"ladder_rung": float(self.index)}
        if self.last_error is not None:
            out["ladder_error"] = self.last_error
            out["ladder_noise"] = self.last_noise
        return out

    def stats(self) -> dict[str, Any]:
        inner = self.meter.hooks[0][0].stats()
        out = dict(super().stats())
        for key in ADDITIVE_COUNTERS:
            out[key] = out[key] + self.retired.get(key, 0) + inner.get(key, 0)
        out["wire_bytes"] += self.meter.dense_wire_bytes
        from .base import compression_ratio

        out["compression_ratio"] = compression_ratio(out["dense_wire_bytes"], out["wire_bytes"])
        out.update(rung=self.current, switches=len(self.switches))
        return out

    def config(self) -> dict[str, Any]:
        return {"algorithm": "ladder", "rungs": list(self.rungs), "check_every": self.check_every,
                "max_error_to_noise": self.max_error_to_noise, "reference_fraction": self.meter.sample_fraction,
                "window": self.window}

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "index": self.index, "switches": list(self.switches),
                "retired": dict(self.retired), "last_error": self.last_error, "last_noise": self.last_noise,
                "meter_dense_wire_bytes": self.meter.dense_wire_bytes, "pending_check": self._pending_check,
                "meter_sampled_buckets": self.meter.sampled_buckets,
                # a check measured in the last step is decided at the next step's first bucket: its sums
                "meter_sums": self.meter.sums().cpu() if self._pending_check else None,
                "inner": self.meter.hooks[0][0].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        index = int(state["index"])
        if index != self.index:
            self.meter.hooks[0][0].close()
            self.index = index
            self.meter.hooks = self._meter_hooks(index)
        self.switches = list(state["switches"])
        self.retired = dict(state["retired"])
        self.last_error, self.last_noise = state["last_error"], state.get("last_noise")
        self.meter.dense_wire_bytes = float(state["meter_dense_wire_bytes"])
        self.meter.sampled_buckets = int(state.get("meter_sampled_buckets", 0))
        self._pending_check = bool(state["pending_check"])
        self.meter.reset()
        sums = state.get("meter_sums")
        if self._pending_check and sums is not None and len(sums) == len(self.meter.hooks):
            self.meter.error_sq = [row[0].clone() for row in sums]
            self.meter.reference_sq = [row[1].clone() for row in sums]
        self.meter.hooks[0][0].load_state_dict(state["inner"])

    def close(self) -> None:
        self.meter.hooks[0][0].close()


def ladder_hook(state: LadderState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The current rung's hook on ``bucket``; on a checked iteration (:meth:`LadderState.checks`) under the
    quality meter (one more dense all-reduce of a sample of the bucket); at the first bucket after a check's
    last step, the decision (one all-reduce of four float64 numbers)."""
    if not state._in_step:
        state._in_step = True
        if state._pending_check:
            state._pending_check = False
            state._decide()
        state.meter.on = state.checks(state.iteration)
    fut = metered_hook(state.meter, bucket)
    state.end_bucket_of(bucket.buffer(), bucket.is_last())
    if bucket.is_last():
        state._in_step = False
        # the iteration counter has moved on: the check ends when the next iteration is not measured
        state._pending_check = state.meter.on and not state.checks(state.iteration)
    return fut


SPEC = hook_algorithm(
    "ladder", "a compressed setting that escalates (PowerSGD rank x2, fp16, dense) when its error against dense, "
    "measured every N steps, exceeds a limit in units of the gradient noise (GraVAC's controller, Tyagi & Sharma "
    "2023, arXiv 2305.12201)",
    LadderOptions,
    lambda opts, ctx: (LadderState(opts.start, opts.check_every, opts.max_error_to_noise, opts.reference_fraction,
                                   model=ctx.model, process_group=ctx.process_group, seed=ctx.seed,
                                   window=opts.window), ladder_hook))

#: the algorithms this module registers
SPECS = (SPEC,)
