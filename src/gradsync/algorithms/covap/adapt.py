"""COVAP's ratio K following the network: per-step timing of the hook's own collectives and the
rule that re-matches K to the communication-to-computation ratio (CCR) during training.

COVAP (Meng, Sun & Li, arXiv 2311.04499, §3) picks K = ceil(CCR) once, from a dense all-reduce
timed before training. When the link rate changes during a run, that K no longer hides the
communication behind the backward pass. Here the hook times what it already does:

* :class:`CommTimer` records, per step, the backward time (end of the module's forward, or the
  first bucket's hook call when no module is known, to the last bucket's hook call: seconds), the
  busy time of the step's collectives (union of the intervals from each ``all_reduce`` launch to its
  future's completion, seconds; the completion is stamped in the future's callback, which issues
  nothing), the *exposed* communication (last completion minus the last bucket's hook call, >= 0,
  seconds) and the gradient elements handed to collectives against the bucket elements. On the CPU
  the stamps are :func:`time.perf_counter` readings. On CUDA the host runs ahead of the device and
  NCCL completes a collective's future when it is enqueued, so host clocks would read ~0 for the
  communication: each stamp is a CUDA timing event recorded on the current stream (in the
  completion callback that stream waits for the collective), and the elapsed times are read once
  per step, at the next step boundary (no host synchronisation per bucket).
* :class:`RatioAdapter` sums the steps of a window of ``adapt_every`` steps and, at a step boundary
  (the first hook call of a step, in the hook body, synchronously), all-reduces the window's
  estimates with MAX on every rank, so every rank takes the same decision at the same step. The
  dense-equivalent all-reduce time is the busy time scaled by ``dense elements / sent elements``
  (the compressed all-reduce carries about 1/K of the gradient), and the CCR estimate is that over
  the backward time (median over the window's steps): the quantity the start-up choice K = ceil(CCR) is made from
  (:func:`~gradsync.compressors.covap_shards.ratio_for_ccr`). K moves to ceil(CCR) only when the
  estimate leaves the band ``[(K - 1)(1 - h), K(1 + h)]`` (hysteresis ``h``), so measurement noise
  near a boundary does not flap K.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import astuple, dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...compressors.covap_shards import MAX_RATIO, ratio_for_ccr
from ...validation import check_float, check_int


@dataclass(frozen=True)
class StepTiming:
    """One step as the hook saw it.

    Attributes:
        backward_s: backward compute seconds seen by the hook (see :class:`CommTimer`).
        comm_s: seconds during which at least one of the step's collectives was in flight.
        exposed_s: seconds from the last bucket's hook call to the last collective's completion
            (communication not hidden behind the backward pass, including the hook's own work on
            the last bucket before its launch), >= 0.
        sent_elements: gradient elements handed to collectives this step.
        dense_elements: elements of all the step's buckets (what dense all-reduce would send).
    """

    backward_s: float
    comm_s: float
    exposed_s: float
    sent_elements: int
    dense_elements: int


Stamp = Any  # float seconds (time.perf_counter) on the CPU, a torch.cuda.Event on CUDA


class CommTimer:
    """Per-step stamps of a DDP hook's buckets and collectives (this rank only).

    The hook calls :meth:`bucket_ready` at each bucket's hook call, :meth:`launched` when it hands
    a tensor to a collective and :meth:`completed` when the collective's future completes (in its
    callback); :meth:`forward_done` may be registered as a forward hook of the module so the
    backward time starts at the end of the forward pass. :meth:`finish_step` closes the step at the
    next step boundary, when DDP has waited for all of the step's futures. Tests replace this class
    (``CovapState(timer=...)``) to feed chosen timings.

    Clock: :func:`time.perf_counter` for CPU buckets; for CUDA buckets (the device of the last
    :meth:`bucket_ready`) each stamp is a ``torch.cuda.Event(enable_timing=True)`` recorded on the
    current stream, converted to seconds in :meth:`finish_step` (which waits for the step's events:
    once per step, at the next step boundary, when they have normally completed long before).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._device: Optional[torch.device] = None
        self._reset()
        self._forward_end: Optional[Stamp] = None

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("_lock")
        if self._device is not None and self._device.type == "cuda":  # events do not pickle: drop the open step
            d.update(_first=None, _start=None, _last_ready=None, _intervals=[], _sent=0, _dense=0, _forward_end=None)
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        d.setdefault("_device", None)
        d.setdefault("_start", d.get("_first"))
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def _reset(self) -> None:
        self._first: Optional[Stamp] = None
        self._start: Optional[Stamp] = None
        self._last_ready: Optional[Stamp] = None
        self._intervals: list[list[Any]] = []
        self._sent = 0
        self._dense = 0

    def discard_step(self) -> None:
        """Forget the open step (a restored state starts with a fresh window)."""
        with self._lock:
            self._reset()
        self._forward_end = None

    def _stamp(self, device: Optional[torch.device] = None) -> Stamp:
        device = self._device if device is None else device
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    def forward_done(self, module: Any = None, *_: Any) -> None:
        """Forward hook (``module.register_forward_hook(timer.forward_done)``): backward starts now."""
        param = next(module.parameters(), None) if isinstance(module, torch.nn.Module) else None
        self._forward_end = self._stamp(param.device if param is not None else None)

    def bucket_ready(self, numel: int, device: Optional[torch.device] = None) -> None:
        """A bucket of ``numel`` elements (on ``device``: default the CPU clock) reached the hook."""
        if device is not None:
            self._device = device
        now = self._stamp()
        if self._first is None:
            self._first = now
            # the forward that preceded this backward (if one was seen since the last step) starts it
            self._start = self._forward_end if self._forward_end is not None else now
            self._forward_end = None
        self._last_ready = now
        self._dense += int(numel)

    def launched(self, numel: int) -> int:
        """A collective carrying ``numel`` elements was launched; returns its id for :meth:`completed`."""
        now = self._stamp()
        with self._lock:
            self._intervals.append([now, None])
            self._sent += int(numel)
            return len(self._intervals) - 1

    def completed(self, ident: int) -> None:
        """The collective ``ident`` completed (called from its future's callback: records a stamp only)."""
        now = self._stamp()
        with self._lock:
            if ident < len(self._intervals):
                self._intervals[ident][1] = now

    def finish_step(self) -> Optional[StepTiming]:
        """The timing of the step recorded since the last call (``None`` if no bucket was seen), and
        start a new one."""
        return self._timing(reset=True)

    def peek_step(self) -> Optional[StepTiming]:
        """What :meth:`finish_step` would return now, leaving the step open."""
        return self._timing(reset=False)

    def _timing(self, reset: bool) -> Optional[StepTiming]:
        if self._first is None:
            return None
        with self._lock:
            done = [(a, b) for a, b in self._intervals if b is not None]  # drop unfinished ones
            sent, dense = self._sent, self._dense
            start, last = self._start, self._last_ready
            if reset:
                self._reset()
        start, last, *flat = _seconds([start, last, *(t for ab in done for t in ab)])
        spans = sorted(zip(flat[0::2], flat[1::2]))
        busy, cur_a, cur_b, last_end = 0.0, None, None, last
        for a, b in spans:
            last_end = max(last_end, b)
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    busy += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            busy += cur_b - cur_a
        return StepTiming(backward_s=max(0.0, last - start), comm_s=busy, exposed_s=max(0.0, last_end - last),
                          sent_elements=sent, dense_elements=dense)


def _seconds(stamps: list[Stamp]) -> list[float]:
    """Stamps as seconds on one clock: floats as they are; CUDA events (waited for) as seconds after
    the first one (the step's start, recorded before every other stamp of the step)."""
    if not stamps or not isinstance(stamps[0], torch.cuda.Event):
        return [float(s) for s in stamps]
    for s in stamps:
        s.synchronize()
    ref = stamps[0]
    return [ref.elapsed_time(s) / 1e3 for s in stamps]


class RatioAdapter:
    """Re-choose COVAP's K every ``adapt_every`` steps from the steps' :class:`StepTiming`.

    Args:
        adapt_every: window length in steps (>= 1; 0: never due, for a state that only calibrates
            K once from its start-up window, :meth:`step_boundary` with ``initial=True``).
        hysteresis: ``h`` in [0, 1): K changes only when the CCR estimate leaves
            ``[(K - 1)(1 - h), K (1 + h)]``.
        max_ratio: largest K (32, COVAP's limit).

    Attributes:
        last: figures of the last decision (``ccr``: the CCR estimate, ``exposed_s``,
            ``comm_s``, ``backward_s``: per-step means over the window, MAX over ranks), empty before.
        changes: number of times K changed.

    Raises:
        ValueError: for arguments outside those ranges.
    """

    def __init__(self, adapt_every: int, hysteresis: float = 0.25, max_ratio: int = MAX_RATIO):
        self.adapt_every = check_int("adapt_every", adapt_every, 0)
        self.hysteresis = check_float("hysteresis", hysteresis, 0.0, 1.0, high_inclusive=False)
        self.max_ratio = check_int("max_ratio", max_ratio, 1, MAX_RATIO)
        self.window: list[StepTiming] = []
        self.last: dict[str, float] = {}
        self.changes = 0

    def observe(self, timing: Optional[StepTiming]) -> None:
        """Add one compressed step to the window."""
        if timing is not None:
            self.window.append(timing)

    def due(self, steps_since_start: int) -> bool:
        """True at the step boundaries where every rank re-chooses K (a multiple of ``adapt_every``
        compressed steps; identical on every rank since it depends on the step counter only)."""
        return self.adapt_every > 0 and steps_since_start > 0 and steps_since_start % self.adapt_every == 0

    def estimate(self) -> torch.Tensor:
        """This rank's window figures ``[ccr, exposed_s, comm_s, backward_s]`` (float64): ``ccr`` is
        the median over the window's steps that sent something of ``comm_s * dense / sent /
        backward_s`` (the median, so one stalled step does not move K), -1 when no step sent or had
        a backward time (no information); the others are per-step means."""
        per_step = sorted(w.comm_s * w.dense_elements / w.sent_elements / w.backward_s
                          for w in self.window if w.sent_elements > 0 and w.backward_s > 0)
        ccr = statistics.median(per_step) if per_step else -1.0
        n = max(len(self.window), 1)
        return torch.tensor([ccr, sum(w.exposed_s for w in self.window) / n,
                             sum(w.comm_s for w in self.window) / n,
                             sum(w.backward_s for w in self.window) / n], dtype=torch.float64, device="cpu")

    def decide(self, ratio: int, ccr: float, initial: bool = False) -> int:
        """The K to use given the current ``ratio`` and the (all-reduced) CCR estimate ``ccr``:
        ceil(ccr) clipped to [1, max_ratio] when ``ccr`` is outside the hysteresis band (or
        ``initial``: the first choice, from the start-up window, has no band), else ``ratio``. A
        negative ``ccr`` (no information) keeps ``ratio``."""
        if not ccr >= 0:
            return ratio
        h = self.hysteresis
        if initial or ccr > ratio * (1 + h) or ccr < (ratio - 1) * (1 - h):
            return ratio_for_ccr(ccr, self.max_ratio)
        return ratio

    def step_boundary(self, ratio: int, group: Optional[dist.ProcessGroup], device: torch.device,
                      initial: bool = False) -> int:
        """Collective (every rank, same step): one MAX all-reduce of the window figures, giving
        every rank the same numbers: the *minimum* over ranks of the CCR estimate and busy time (sent
        negated) and the maximum of the exposed and backward times; clear the window and return the
        K every rank switches to now. A window without information (no step sent anything, as
        when K exceeds the number of shards and the window is shorter than K) is kept and extended
        to the next decision.

        Why the minimum for the busy time: a collective completes only when the last rank joins
        it, so the interval an early rank measures includes its wait for the others (rank skew, a
        straggler's compute), not only the network; the rank that joined last measures the
        network. (The start-up CCR avoids skew with a barrier before each timed all-reduce and can
        take the MAX.)"""
        local = self.estimate()
        no_info = not local[0] >= 0
        est = torch.tensor([float("-inf") if no_info else -float(local[0]), -float(local[2]), float(local[1]),
                            float(local[3])], dtype=torch.float64, device=device)
        dist.all_reduce(est, op=dist.ReduceOp.MAX, group=group)
        neg_ccr, neg_comm, exposed, back = (float(v) for v in est.cpu())
        ccr = -neg_ccr if neg_ccr != float("-inf") else -1.0
        comm = -neg_comm
        if ccr >= 0:  # a window in which no step sent (K above the number of shards) carries on
            self.window.clear()
        new = self.decide(ratio, ccr, initial)
        self.last = {"ccr": ccr, "exposed_s": exposed, "comm_s": comm, "backward_s": back}
        if new != ratio:
            self.changes += 1
        return new

    def state_dict(self) -> dict[str, Any]:
        """Settings, the decision counter, the last figures and the current window (each step as
        the tuple of its :class:`StepTiming` fields), so a resumed run takes its next decision
        from the same steps as the uninterrupted one."""
        return {"adapt_every": self.adapt_every, "hysteresis": self.hysteresis, "changes": self.changes,
                "last": dict(self.last), "window": [astuple(w) for w in self.window]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (one saved before the window was kept restores an empty window)."""
        self.changes = int(state.get("changes", 0))
        self.last = dict(state.get("last", {}))
        self.window = [StepTiming(*w) for w in state.get("window", [])]
