"""Generic compressed DDP communication hook: any compressor, optional error feedback, and the
communicator the compressor's aggregation asks for (GRACE's compressor/memory/communicator split on
torch's hook + State pattern: Xu et al., "GRACE: A Compressed Communication Framework for Distributed
Machine Learning", ICDCS 2021).

Example::

    >>> # xdoctest: +SKIP
    >>> from gradsync.compressors import make_compressor
    >>> from gradsync.algorithms.compressed import CompressedState, compressed_hook
    >>> state = CompressedState(make_compressor("topk", density=0.01), error_feedback=True)
    >>> ddp.register_comm_hook(state, compressed_hook)
    >>> loss.backward()            # DDP waits for the hook's futures
    >>> state.last_step            # {'iteration', 'wire_bytes', 'density', 'compress_seconds', ...}
"""

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradsync.algorithms.base import HookState
from gradsync.algorithms.spec import hook_algorithm
from gradsync.comm.collectives import dense_allreduce
from gradsync.comm.futures import then
from gradsync.options import Options, option
from gradsync.comm.sparse import communicate
from gradsync.compressors import Compressor, make_compressor
from gradsync.feedback.residual import ResidualMemory, bucket_layout, parameter_names
from gradsync.validation import check_int


class _StepTimer:
    """Adds elapsed seconds to the state's cumulative and per-step compression time."""

    def __init__(self, state: "CompressedState", step: dict[str, Any]):
        self.state, self.step = state, step

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        self.state.compress_seconds += dt
        self.step["compress_seconds"] += dt


class CompressedState(HookState):
    """State of :func:`compressed_hook`.

    Args:
        compressor: a :class:`~gradsync.compressors.Compressor` or a registry name (then built with
            ``compressor_kwargs``).
        error_feedback: keep a :class:`~gradsync.feedback.residual.ResidualMemory` keyed by bucket index.
        start_iter: number of first iterations synchronised with dense all-reduce (>= 0). DDP rebuilds
            its buckets after the first iteration, so compressing (and keying residuals by bucket index)
            from iteration 2 on avoids stale keys, as torch PowerSGD's ``start_powerSGD_iter`` does.
        process_group: group the collectives run on (``None`` = default group).
        model: the module DDP wraps (optional, see :meth:`bind`).
        compressor_kwargs: constructor arguments when ``compressor`` is a name.

    Attributes:
        last_step: statistics of the most recent step whose last bucket was processed (complete once
            ``backward()`` has returned): ``iteration``, ``wire_bytes`` and ``payload_bytes`` (bytes
            this rank put on the network / handed to collectives, as in :meth:`HookState.stats`),
            ``dense_wire_bytes`` (ring all-reduce wire bytes of the uncompressed buckets), ``density`` (fraction of
            gradient elements carried by the payloads, 1.0 on dense steps), ``compress_seconds``
            (compression + decompression seconds on this rank), ``compressed`` (bool).

    Raises:
        ValueError: for an unknown compressor name or out-of-range arguments.
    """

    def __init__(
        self,
        compressor: Compressor | str,
        error_feedback: bool = False,
        start_iter: int = 2,
        process_group: dist.ProcessGroup | None = None,
        model: torch.nn.Module | None = None,
        **compressor_kwargs: Any,
    ):
        super().__init__(process_group)
        self.param_names: dict[int, str] | None = None
        if model is not None:
            self.bind(model)
        if isinstance(compressor, str):
            compressor = make_compressor(compressor, **compressor_kwargs)
        elif compressor_kwargs:
            raise ValueError("compressor_kwargs are only accepted with a compressor name")
        if not isinstance(compressor, Compressor):
            raise ValueError(f"compressor must be a Compressor or a registry name, got {type(compressor).__name__}")
        self.compressor = compressor
        self.error_feedback = bool(error_feedback)
        self.memory = ResidualMemory() if self.error_feedback else None
        self.start_iter = check_int("start_iter", start_iter, 0, None)
        self.selected_elements = 0
        self.compressed_elements = 0
        self.last_step: dict[str, Any] = {}
        self._cur: dict[str, Any] | None = None

    def bind(self, model: torch.nn.Module) -> "CompressedState":
        """Name the parameters of ``model`` (the module DDP wraps) so error-feedback residuals follow
        parameters when DDP's bucket layout changes (bucket rebuild, fresh DDP after resuming from a
        checkpoint). Without it a residual whose bucket layout changed is dropped with a warning.
        Call again after unpickling the state in another process. Returns ``self``."""
        self.param_names = parameter_names(model)
        return self

    # -- per-step bookkeeping -----------------------------------------------------------------
    def _step_record(self) -> dict[str, Any]:
        if self._cur is None:
            self._cur = {
                "iteration": self.iteration,
                "wire_bytes": 0.0,
                "payload_bytes": 0,
                "dense_wire_bytes": 0.0,
                "selected": 0,
                "numel": 0,
                "compress_seconds": 0.0,
                "compressed": self.iteration >= self.start_iter,
            }
        return self._cur

    def _finish_bucket(self, bucket: Any, rec: dict[str, Any]) -> None:
        if bucket.is_last():
            rec["density"] = rec["selected"] / rec["numel"] if rec["numel"] else 1.0
            self.last_step = rec
            self._cur = None
        rec["dense_wire_bytes"] += self.end_bucket(bucket)

    def _counter(self, rec: dict[str, Any]):
        def count(*tensors: torch.Tensor, kind: str = "allreduce") -> None:
            payload, wire = self.count_collective(*tensors, kind=kind)
            rec["payload_bytes"] += payload
            rec["wire_bytes"] += wire

        return count

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """The density (fraction of elements sent) of the step that just finished."""
        return {"density": self.last_step["density"]} if "density" in self.last_step else {}

    def _snapshot(self) -> Any:
        return self.memory.snapshot() if self.memory is not None else None

    def _restore(self, saved: Any) -> None:
        if self.memory is not None:
            self.memory.restore(saved)

    # -- reporting and checkpoints --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Cumulative counters of :meth:`HookState.stats` plus ``density`` (selected / compressed
        elements over compressed steps) and ``last_step`` (see class docstring)."""
        s = super().stats()
        s["density"] = self.selected_elements / self.compressed_elements if self.compressed_elements else 1.0
        s["last_step"] = dict(self.last_step)
        return s

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "compressor": self.compressor.config(),
            "error_feedback": self.error_feedback,
            "start_iter": self.start_iter,
        }

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["compressor"] = self.compressor.state_dict()
        d["memory"] = self.memory.state_dict() if self.memory is not None else None
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.compressor.load_state_dict(state["compressor"])
        if self.memory is not None and state.get("memory") is not None:
            self.memory.load_state_dict(state["memory"])


def compressed_hook(state: CompressedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compress the bucket (with error feedback if enabled), exchange, average.

    Dense all-reduce for the first ``state.start_iter`` iterations. All collectives are issued from
    this function, in bucket order; the returned future's callback only decompresses locally. On
    compressed iterations the last bucket also all-reduces one float32 (this rank's "every
    compensated input finite", :class:`~gradsync.feedback.finite.FiniteGuard`): a step whose inputs
    or result are not finite on some rank restores the residuals and returns NaN in the last bucket
    on every rank, so GradScaler skips it everywhere, as with DDP.

    Args:
        state: a :class:`CompressedState`.
        bucket: DDP's gradient bucket; its flat buffer (any floating dtype) is compressed as float32.

    Returns:
        Future of the bucket's flat tensor holding the averaged (decompressed) gradient.
    """
    group = state.process_group
    buf = bucket.buffer()
    rec = state._step_record()
    count = state._counter(rec)
    if state.iteration < state.start_iter:
        fut = dense_start(buf, rec, group, count)
        state._finish_bucket(bucket, rec)
        return fut
    key = bucket.index()
    rank = dist.get_rank(group)
    timer = lambda: _StepTimer(state, rec)  # noqa: E731
    guard = state.finite_guard
    guard.begin(state.iteration, state._snapshot)
    with timer():
        g = buf.detach().reshape(-1).to(torch.float32)
        if state.memory is not None:
            layout = bucket_layout(bucket, state.param_names)
            payload, ctx, _ = state.memory.compress(
                state.compressor, g, key, step=state.iteration, rank=rank, layout=layout
            )
            guard.check(g, state.memory.residuals[key])
        else:
            payload, ctx = state.compressor.compress(g, step=state.iteration, key=key, rank=rank)
            guard.check(g)
    rec["selected"] += ctx.selected
    rec["numel"] += ctx.numel
    state.selected_elements += ctx.selected
    state.compressed_elements += ctx.numel
    fut = communicate(state.compressor, payload, ctx, group, count, timer)
    verdict = guard.launch_verdict(group, buf.device, count) if bucket.is_last() else None
    state._finish_bucket(bucket, rec)
    return state.guarded(bucket, then(fut, copy_back(buf)), verdict)


def dense_start(buf: torch.Tensor, rec: dict[str, Any], group: Any, count: Any) -> torch.futures.Future:
    """A start-up iteration's bucket (shared by :func:`compressed_hook` and GraVAC's hook): dense
    all-reduce of ``buf``, every element counted as selected in the step record ``rec``."""
    rec["selected"] += buf.numel()
    rec["numel"] += buf.numel()
    return dense_allreduce(buf, group, count)


def copy_back(buf: torch.Tensor) -> Callable[[torch.futures.Future], torch.Tensor]:
    """The ``Future.then`` callback that copies the exchanged flat result into the bucket ``buf``
    (local only: no collective) and returns ``buf``."""
    def write_back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value().view_as(buf))
        return buf

    return write_back


@dataclass(frozen=True)
class FeedbackOptions(Options):
    """Options of a compressor-library algorithm without a size knob (``signsgd``, ``bf16``)."""

    error_feedback: bool = option(True, "error feedback: keep what compression dropped and add it to the "
                                  "next gradient (Karimireddy et al., ICML 2019, arXiv 1901.09847)")


@dataclass(frozen=True)
class SparsifierOptions(FeedbackOptions):
    """Options of ``topk``, ``randomk``, ``dgc``, ``redsync``."""

    density: float = option(0.01, "kept fraction of gradient elements for sparsifiers", low=0.0, high=1.0,
                            low_open=True)


@dataclass(frozen=True)
class QSGDOptions(FeedbackOptions):
    """Options of ``qsgd``."""

    levels: int = option(127, "QSGD quantisation levels per sign", low=1, high=32767)


def _compressed(name: str, summary: str, options: type) -> Any:
    def make_hook(opts: Any, ctx: Any) -> tuple:
        kwargs: dict[str, Any] = {}
        if isinstance(opts, SparsifierOptions):
            kwargs["density"] = opts.density
        if name == "dgc":
            kwargs["warmup_steps"] = ctx.steps_per_epoch
        if isinstance(opts, QSGDOptions):
            kwargs["levels"] = opts.levels
        state = CompressedState(name, error_feedback=opts.error_feedback, process_group=ctx.process_group,
                                model=ctx.model, **kwargs)
        return state, compressed_hook

    return hook_algorithm(name, summary, options, make_hook)


SPECS = (
    _compressed("topk", "top-k sparsification, sparse all-gather (Aji & Heafield, EMNLP 2017, arXiv 1704.05021)",
                SparsifierOptions),
    _compressed("randomk", "random-k with a seed shared by all ranks, all-reduce (Stich et al., NeurIPS 2018, "
                "arXiv 1809.07599)", SparsifierOptions),
    _compressed("dgc", "DGC sampled threshold with density warm-up (Lin et al., ICLR 2018, arXiv 1712.01887)",
                SparsifierOptions),
    _compressed("redsync", "RedSync threshold binary search (Fang et al., JPDC 2019, arXiv 1808.04357)",
                SparsifierOptions),
    _compressed("qsgd", "QSGD stochastic quantisation (Alistarh et al., NeurIPS 2017, arXiv 1610.02132)",
                QSGDOptions),
    _compressed("signsgd", "EF-SignSGD scaled sign (Karimireddy et al., ICML 2019, arXiv 1901.09847)",
                FeedbackOptions),
    _compressed("bf16", "cast to bfloat16, all-reduce", FeedbackOptions),
)
