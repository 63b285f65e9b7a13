"""A step whose aggregated gradient is not finite changes no state (shared by every hook with error
feedback or a controller).

The project's invariant (design.md): *a non-finite aggregated gradient changes no state: residuals,
controllers and counters stay as they were, so the optimizer's skip (GradScaler) costs exactly one
step, as with DDP.* With error feedback an inf in one rank's gradient can sit in an element that this
step does not send: the aggregated gradient is then finite, no rank skips, and the residual keeps
``inf`` (or ``inf - inf = NaN``) for ever. So the decision must be taken on a value every rank shares.

:class:`FiniteGuard` does it per iteration, with one host read per step:

* :meth:`~FiniteGuard.begin` (every bucket; acts at the first one of an iteration) keeps a snapshot
  of the algorithm's state, taken by a callable the algorithm passes (references to tensors the
  algorithm replaces, copies of those it writes in place);
* :meth:`~FiniteGuard.check` folds "all finite" of local tensors (compensated inputs, residuals,
  narrowed values) into one device-side bool, without a host sync;
* :meth:`~FiniteGuard.local_element` is that flag as one element (0 finite, NaN otherwise) that the
  iteration's last collective carries, so its sum over ranks is the global verdict; where the last
  bucket sends nothing of its own, :meth:`~FiniteGuard.launch_verdict` all-reduces it alone (issued
  from the hook body, never from a callback);
* :meth:`~FiniteGuard.track` / :meth:`~FiniteGuard.finish`: the last bucket's future completes
  after every bucket of the iteration; then the verdict and every aggregated bucket (identical on
  every rank, so an fp16 sum that overflowed counts too) are folded into one flag, and a non-finite
  result restores the snapshot and fills the last bucket with NaN, so every rank's GradScaler skips.

Where the flag lives on an accelerator (CUDA: NCCL's futures complete once the collectives are
enqueued, so the last bucket's callback runs while the GPU still computes), reading it there would be
a host synchronisation inside the last bucket's hook on every compressed step. There the decision is
deferred (:meth:`~FiniteGuard.conclude`): the NaN fill is done on the device from the flag
(``masked_fill_``), the flag is copied to pinned host memory without blocking, and the snapshot is
restored by :meth:`~FiniteGuard.settle`, which every reader of the state calls first (the next
iteration's first bucket and ``begin``, ``state_dict``, ``stats``, ``observe_step``: see
:class:`~gradsync.algorithms.protocol.Algorithm`), by when the copy is long done. On the CPU the flag
is read at once, as before (no device to wait for).

Algorithms whose aggregated values already carry any local inf to every rank (PowerSGD's factors,
OSCAR's all-reduced scale, count-sketch tables) need no extra element: they only track their outputs
(:meth:`~FiniteGuard.agree`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm.futures import then

NAN = float("nan")


class FiniteGuard:
    """Per-iteration finite check agreed by every rank, with rollback of the algorithm's state.

    Attributes:
        rollbacks: steps whose aggregated result was not finite (state restored), int.
    """

    #: ``None``: defer reading the agreed flag where it lives on an accelerator (see the module
    #: docstring); ``True``/``False`` force deferring or not (tests set it on an instance).
    lazy: bool | None = None

    def __init__(self) -> None:
        self.rollbacks = 0
        self._pending: tuple[Any, Any, Callable[[Any], None]] | None = None
        self._reset(None)

    def _reset(self, iteration: int | None) -> None:
        self._iteration = iteration
        self._saved: Any = None
        self._local: torch.Tensor | None = None
        self._agreed: torch.Tensor | None = None
        self._futures: list[torch.futures.Future] = []
        self._written: set[tuple[int, Any]] = set()

    def begin(self, iteration: int, snapshot: Callable[[], Any]) -> None:
        """Start iteration ``iteration`` (idempotent: only the first call of an iteration acts) and
        keep ``snapshot()``, what :meth:`finish`'s ``restore`` receives if the step is rolled back."""
        if self._iteration != iteration:
            self.settle()  # a deferred rollback of the previous iteration comes before its snapshot
            self._reset(iteration)
            self._saved = snapshot()

    def copy_on_write(self, d: dict, key: Any) -> torch.Tensor:
        """``d[key]`` made safe to modify in place this iteration: replaced by a copy at the first
        call of the iteration (the snapshot keeps the original). ``key`` must be in ``d``."""
        tag = (id(d), key)
        if tag not in self._written:
            d[key] = d[key].clone()
            self._written.add(tag)
        return d[key]

    @staticmethod
    def _fold(flag: torch.Tensor | None, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        for t in tensors:
            ok = torch.isfinite(t).all()
            flag = ok if flag is None else flag & ok
        return flag

    def check(self, *tensors: torch.Tensor) -> None:
        """Fold "every element finite" of this rank's ``tensors`` (any shape, floating) into the
        iteration's local flag (device-side, no host sync)."""
        self._local = self._fold(self._local, tensors)

    def agree(self, *tensors: torch.Tensor) -> None:
        """As :meth:`check` for values identical on every rank (aggregated results): they need no
        vote."""
        self._agreed = self._fold(self._agreed, tensors)

    def local_element(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[1]`` tensor of ``dtype`` on ``device``: 0 if every :meth:`check` of this iteration was
        finite, NaN otherwise; summed over ranks it is the verdict (NaN if any rank saw a non-finite
        value)."""
        if self._local is None:
            return torch.zeros(1, dtype=dtype, device=device)
        return torch.where(self._local.to(device), 0.0, NAN).to(dtype).reshape(1)

    def launch_verdict(self, group: Any, device: torch.device,
                       counter: Callable[..., Any] | None = None) -> torch.futures.Future:
        """All-reduce (SUM) :meth:`local_element` alone (float32, 4 bytes; ``counter(t)`` records
        it); issue it from a hook body. Returns a future of the ``[1]`` verdict."""
        t = self.local_element(torch.float32, device)
        if counter is not None:
            counter(t)
        return then(dist.all_reduce(t, group=group, async_op=True).get_future(), lambda _: t)

    def track(self, fut: torch.futures.Future) -> torch.futures.Future:
        """Remember a bucket's future (its value: the aggregated bucket, identical on every rank) to
        check at :meth:`finish`; returns ``fut``."""
        self._futures.append(fut)
        return fut

    def finish(self, last: torch.futures.Future, verdict: torch.futures.Future | torch.Tensor | None,
               restore: Callable[[Any], None]) -> torch.futures.Future:
        """The last bucket's future: completes once ``last``, every tracked future and ``verdict``
        (a future or tensor from :meth:`local_element` summed over ranks; ``None``: outputs only)
        have; then :meth:`conclude` runs (no collective there) and the future holds ``last``'s
        tensor, filled with NaN when the step was rolled back."""
        pending = verdict is not None and not isinstance(verdict, torch.Tensor)  # a future (torch._C.Future too)
        futures = self._futures + [last] + ([verdict] if pending else [])
        self._futures = []

        def done(_: Any) -> torch.Tensor:
            for f in futures:
                value = f.value()
                self.agree(*(value if isinstance(value, (list, tuple)) else [value]))
            if isinstance(verdict, torch.Tensor):
                self.agree(verdict)
            out = last.value()
            out = out[0] if isinstance(out, (list, tuple)) else out
            self.conclude(restore, out)
            return out

        return then(torch.futures.collect_all(futures), done)

    def conclude(self, restore: Callable[[Any], None], last: torch.Tensor | None = None) -> bool | None:
        """Decide the iteration from its agreed flag: if it is not finite, ``restore`` the snapshot,
        count a rollback and fill ``last`` (the last bucket) with NaN. Call it once per iteration on
        every rank, after every collective.

        On the CPU the flag is read now; returns True when the step was finite. Where the flag lives
        on an accelerator (or with :attr:`lazy` set) it is not read (no host synchronisation): ``last``
        is filled on the device, the rollback waits for :meth:`settle`, and ``None`` is returned."""
        flag = self._agreed
        if flag is None:
            self._reset(None)
            return True
        if self.lazy if self.lazy is not None else flag.device.type != "cpu":
            if last is not None:
                last.masked_fill_(~flag.to(last.device), NAN)
            self._pending = (_read_later(flag), self._saved, restore)
            self._reset(None)
            return None
        ok = bool(flag)
        if not ok:
            if last is not None:
                last.fill_(NAN)
            self.rollback(restore)
        self._reset(None)  # the next begin() snapshots again, also after a load_state_dict
        return ok

    def settle(self) -> bool | None:
        """Apply a decision :meth:`conclude` deferred: read the flag (its copy to host memory was
        started then, so this waits for nothing newer) and, if the step was not finite, restore its
        snapshot and count the rollback. Returns whether that step was finite, or ``None`` when no
        decision was pending. Cheap when none is: call it before anything reads the state."""
        if self._pending is None:
            return None
        (value, event), saved, restore = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        ok = bool(value)
        if not ok:
            restore(saved)
            self.rollbacks += 1
        return ok

    def rollback(self, restore: Callable[[Any], None]) -> None:
        """``restore`` the iteration's snapshot now (for a caller that knows by other means that the
        step is skipped on every rank, e.g. DeAR's all-reduced found-inf) and count a rollback; a
        no-op when no iteration was begun since the last decision."""
        self.settle()
        if self._iteration is not None:
            restore(self._saved)
            self.rollbacks += 1
        self._reset(None)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        return {"rollbacks": self.rollbacks}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.rollbacks = d.get("rollbacks", 0)
        self._pending = None
        self._reset(None)


def _read_later(flag: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``(host value, event)`` of a 0-d flag: on CUDA a non-blocking copy into pinned memory and
    the event after it (wait for the event, then read the copy); elsewhere the flag itself."""
    if flag.device.type != "cuda":
        return flag, None
    host = torch.empty((), dtype=flag.dtype, device="cpu", pin_memory=True)
    host.copy_(flag, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event
