"""GraVAC: adaptive compression factor chosen from compression gain and throughput.

Source: Tyagi & Swany, "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL
Training", IEEE CLOUD 2023 (arXiv 2305.12201), restated from the paper and the
reference code (sahiltyagi4/GraVAC), with its three bugs fixed:

1. the candidate kept fraction ``theta_c`` is scaled repeatedly (``theta_c *= step_factor`` at each
   search boundary), so the search really goes from 10x past 20x up to 10,000x;
2. the candidate's gain is computed from the *candidate* compressor's output;
3. the per-step statistics (gradient norms, throughput) are all-reduced, so every rank takes the
   same branch.

Definitions (per step t, sums over DDP buckets b, averaged over ranks):

* ``Ng = sum_b ||g_b||_2``, ``N(theta) = sum_b ||C_theta(g_b + e_b)||_2`` (with the residual e);
* ``gain(theta) = EWMA(N(theta)) / EWMA(Ng)`` (can exceed 1 because of the residual);
* compression throughput at kept fraction cf: ``samples/s x gain(cf)``; the table ``CT[cf]`` holds
  the mean over the steps sent at cf (dense steps enter as cf = 1 with gain 1).

Each step: warm-up (``step < window``) sends ``C_theta_min``; afterwards the candidate is sent if
``gain_c >= epsilon``, else ``C_theta_min`` if ``gain_min >= epsilon``, else the dense gradient.
At each search boundary (every ``search_interval`` steps) the candidate is compressed further while
searching, and the search stops when the two best ``CT`` values are within ``omega`` (relative); the
candidate is then the more compressed of those two.

DDP-hook integration and the one-step lag
-----------------------------------------
The hook sees one bucket at a time, but the branch must be the same for all buckets of a step and on
all ranks. So the branch used in step t is decided from statistics all-reduced at the **end of step
t-1**: the hook body of step t-1's last bucket issues one small blocking all-reduce (9 floats: the
statistics and the finite vote of :class:`~gradsync.feedback.finite.FiniteGuard`) after that bucket's
own collectives, updates the controller identically on every rank (not at all when a rank saw a
non-finite input: the step is then rolled back) and fixes the branch for step t. No collective is
ever launched from a ``Future.then`` callback. Consequences: a change of candidate takes effect one
step after the boundary that caused it, and the candidate's gain is first known one step after the
candidate is first computed (that step sends ``theta_min`` or dense).

Composition: the hook goes through compressor -> memory -> communicator
(:func:`~gradsync.compressors.make_compressor`, :class:`~gradsync.feedback.residual.ResidualMemory`,
:func:`gradsync.comm.sparse.communicate`) and shares the start-up and write-back of
:func:`~gradsync.algorithms.compressed.compressed_hook`; it keeps its own body because it compresses
twice per bucket (``theta_min`` and the candidate, to measure both gains) and takes its branch from
the previous step's all-reduced statistics.

Deviation from the reference: the reference keeps two independent error-feedback memories (one per
compressor, both updated each step). Here one residual memory is shared: both compressors compress
the same ``x = g + e`` and ``e`` is updated from the payload actually sent (``e = 0`` after a dense
step, which sends ``x``). This keeps the invariant "applied updates + residual = sum of gradients".
"""

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from gradsync.algorithms.base import HookState
from gradsync.algorithms.compressed import copy_back, dense_start
from gradsync.algorithms.gravac_controller import GravacController
from gradsync.algorithms.spec import hook_algorithm
from gradsync.comm.collectives import dense_allreduce
from gradsync.comm.futures import then
from gradsync.comm.sparse import communicate
from gradsync.compressors import SparseCompressor, make_compressor
from gradsync.feedback.residual import ResidualMemory, bucket_layout, parameter_names
from gradsync.options import Options, option
from gradsync.validation import check_choice, check_float, check_int

GRAVAC_COMPRESSORS = ("topk", "dgc", "redsync", "randomk")


class GravacState(HookState):
    """State of :func:`gravac_hook` (GraVAC on a DDP comm hook).

    Args:
        compressor: sparsifier name, one of ``topk``, ``dgc``, ``redsync``, ``randomk``.
        batch_size: samples per step on this rank, used when no throughput is recorded (then the
            throughput is batch_size / seconds between the last buckets of consecutive steps); default
            1 (throughput in steps/s, enough for the relative comparisons GraVAC makes).
        start_iter: first iterations synchronised by dense all-reduce while DDP rebuilds buckets (>= 0).
        process_group: group the collectives run on (``None`` = default group).
        seed: compressor seed (identical on every rank).
        model: the module DDP wraps (optional; see :meth:`CompressedState.bind
            <gradsync.algorithms.compressed.CompressedState.bind>`, same meaning).
        theta_min, theta_max, step_factor, window, alpha, epsilon, omega, search_interval: see
            :class:`GravacController`.
        **compressor_kwargs: extra constructor arguments of the compressor (e.g. DGC's ``warmup_steps``).

    Throughput: call :meth:`record_step` with this rank's samples/s after each optimizer step; it is
    summed over ranks (system throughput) and attributed to that step. Without it the hook times the
    interval between the last buckets of consecutive steps.

    Attributes:
        controller: the :class:`GravacController` (identical on every rank).
        last_step: statistics of the latest step (complete after ``backward()``): ``iteration``,
            ``branch``, ``kept_fraction``, ``compression_factor`` (1 / kept fraction, 1.0 dense),
            ``theta_candidate``, ``gain_min``, ``gain_candidate``, ``searching``,
            ``wire_bytes``, ``payload_bytes``, ``dense_wire_bytes`` (bytes, as in
            :meth:`HookState.stats`), ``density``, ``compress_seconds`` (s).
        cf_history: list of ``(iteration, compression_factor)`` for every step seen.

    Raises:
        ValueError: on an unsupported compressor or out-of-range arguments.
    """

    def __init__(
        self,
        compressor: str = "topk",
        batch_size: int = 1,
        start_iter: int = 2,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        theta_min: float = 0.1,
        theta_max: float = 1e-4,
        step_factor: float = 0.5,
        window: int = 25,
        alpha: float = 0.05,
        epsilon: float = 0.75,
        omega: float = 0.05,
        search_interval: int = 200,
        model: torch.nn.Module | None = None,
        **compressor_kwargs: Any,
    ):
        super().__init__(process_group)
        self.param_names: dict[int, str] | None = parameter_names(model) if model is not None else None
        self.compressor_name = check_choice("compressor", compressor, GRAVAC_COMPRESSORS)
        self.batch_size = check_int("batch_size", batch_size, 1, None)
        self.start_iter = check_int("start_iter", start_iter, 0, None)
        self.seed = check_int("seed", seed, 0, None)
        self.compressor_kwargs = dict(compressor_kwargs)
        self.controller = GravacController(
            theta_min, theta_max, step_factor, window, alpha, epsilon, omega, search_interval
        )
        self.memory = ResidualMemory()
        self._compressors: dict[float, SparseCompressor] = {}
        self._compressor(self.controller.theta_min)  # validates compressor_kwargs now
        self.last_step: dict[str, Any] = {}
        self.cf_history: list[tuple[int, float]] = []
        self._cur: dict[str, Any] | None = None
        self._recorded: float | None = None
        self._last_time: float | None = None

    def _compressor(self, theta: float) -> SparseCompressor:
        c = self._compressors.get(theta)
        if c is None:
            c = make_compressor(self.compressor_name, density=theta, seed=self.seed, **self.compressor_kwargs)
            self._compressors[theta] = c
        return c

    def bind(self, model: torch.nn.Module) -> "GravacState":
        """Name ``model``'s parameters so residuals follow parameters across bucket-layout changes
        (see ``CompressedState.bind``). Returns ``self``."""
        self.param_names = parameter_names(model)
        return self

    @property
    def compression_factor(self) -> float:
        """Compression factor (1 / kept fraction) the next step will use; 1.0 for dense."""
        if self.iteration < self.start_iter:
            return 1.0
        return 1.0 / self.controller.kept_fraction()

    def observe_step(self, seconds: float, samples: int) -> dict[str, float]:
        """Record this rank's throughput ``samples / seconds`` for the step that just finished (see
        :meth:`record_step`); returns the step's ``compression_factor`` and ``density``."""
        self.record_step(samples / seconds)
        return {k: self.last_step[k] for k in ("compression_factor", "density") if k in self.last_step}

    def record_step(self, samples_per_s: float) -> None:
        """Report this rank's throughput (samples/s, > 0) of the step that just finished.

        Call it on every rank after each step, or on none (then the hook's own timing is used).

        Raises:
            ValueError: if ``samples_per_s`` is not a positive finite number.
        """
        self._recorded = check_float("samples_per_s", samples_per_s, 0.0, None, low_inclusive=False)

    def _record(self) -> dict[str, Any]:
        if self._cur is None:
            dense = self.iteration < self.start_iter
            branch = "dense" if dense else self.controller.branch
            kept = 1.0 if dense else self.controller.kept_fraction()
            self._cur = {
                "iteration": self.iteration,
                "branch": branch,
                "kept_fraction": kept,
                "compression_factor": 1.0 / kept,
                "theta_candidate": self.controller.theta_c,
                "wire_bytes": 0.0,
                "payload_bytes": 0,
                "dense_wire_bytes": 0.0,
                "selected": 0,
                "numel": 0,
                "compress_seconds": 0.0,
                "ng": 0.0,
                "nmin": 0.0,
                "nc": 0.0,
                "has_c": False,
            }
        return self._cur

    def _counter(self, rec: dict[str, Any]):
        def count(*tensors: torch.Tensor, kind: str = "allreduce") -> None:
            payload, wire = self.count_collective(*tensors, kind=kind)
            rec["payload_bytes"] += payload
            rec["wire_bytes"] += wire

        return count

    def _end_of_step(self, rec: dict[str, Any], device: torch.device) -> None:
        """Last bucket: all-reduce this step's statistics (float64 ``[9]`` on ``device``, the
        bucket's device: norms, throughputs and the :class:`~gradsync.feedback.finite.FiniteGuard`
        vote) and update the controller unless the vote says a rank saw a non-finite input (hook
        body only). ``rec``'s norms become the means over ranks."""
        now = time.perf_counter()
        timed = self.batch_size / (now - self._last_time) if self._last_time is not None else 0.0
        timed_flag = 1.0 if self._last_time is not None else 0.0
        self._last_time = now
        rec["density"] = rec["selected"] / rec["numel"] if rec["numel"] else 1.0
        if self.iteration >= self.start_iter:
            rec_flag = 1.0 if self._recorded is not None else 0.0
            local = [rec["ng"], rec["nmin"], rec["nc"], float(rec["has_c"]), self._recorded or 0.0, rec_flag, timed,
                     timed_flag]
            # the 9th element is the step's finite vote (FiniteGuard): 0, or NaN if an input was not finite
            vec = torch.cat([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(1) for v in local]
                            + [self.finite_guard.local_element(torch.float64, device)])
            self._counter(rec)(vec, kind="allreduce")
            dist.all_reduce(vec, group=self.process_group)
            p = self.world_size
            ng, nmin, nc, has_c, rec_sum, rec_n, timed_sum, timed_n, vote = vec.tolist()  # the step's one sync
            rec["ng"], rec["nmin"], rec["nc"] = ng / p, nmin / p, nc / p
            if math.isfinite(vote):  # a non-finite step leaves the controller as it was
                self.controller.update(
                    self.iteration,
                    ng / p,
                    nmin / p,
                    nc / p if has_c == p else None,
                    tput_prev=rec_sum if rec_n == p else None,
                    tput_cur=timed_sum if rec_n != p and timed_n == p else None,
                )
            rec["verdict"] = vec[8:]
        self._recorded = None
        rec["gain_min"] = self.controller.gain_min
        rec["gain_candidate"] = self.controller.gain_c
        rec["searching"] = self.controller.searching
        rec["next_theta_candidate"] = self.controller.theta_c
        rec["next_branch"] = self.controller.branch
        self.last_step = rec
        self.cf_history.append((rec["iteration"], rec["compression_factor"]))
        self._cur = None

    def _snapshot(self) -> Any:
        return self.memory.snapshot(), self.controller.state_dict()

    def _restore(self, saved: Any) -> None:
        self.memory.restore(saved[0])
        self.controller.load_state_dict(saved[1])

    # -- reporting and checkpoints --------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["compression_factor"] = self.last_step.get("compression_factor", 1.0)
        s["theta_candidate"] = self.controller.theta_c
        s["searching"] = self.controller.searching
        s["compression_throughput"] = self.controller.compression_throughput()
        s["last_step"] = dict(self.last_step)
        return s

    def config(self) -> dict[str, Any]:
        c = self.controller
        return {
            **super().config(),
            "compressor": self.compressor_name,
            "compressor_kwargs": dict(self.compressor_kwargs),
            "seed": self.seed,
            "start_iter": self.start_iter,
            "theta_min": c.theta_min,
            "theta_max": c.theta_max,
            "step_factor": c.step_factor,
            "window": c.window,
            "alpha": c.alpha,
            "epsilon": c.epsilon,
            "omega": c.omega,
            "search_interval": c.search_interval,
        }

    def state_dict(self) -> dict[str, Any]:
        d = super().state_dict()
        d["config"] = self.config()
        d["controller"] = self.controller.state_dict()
        d["memory"] = self.memory.state_dict()
        d["recorded"] = self._recorded
        d["cf_history"] = list(self.cf_history)
        return d

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint from an identically configured state.

        Raises:
            ValueError: if the saved configuration differs.
        """
        if state["config"] != self.config():
            raise ValueError(f"GraVAC checkpoint config {state['config']} does not match {self.config()}")
        super().load_state_dict(state)
        self.controller.load_state_dict(state["controller"])
        self.memory.load_state_dict(state["memory"])
        self._recorded = state["recorded"]
        self.cf_history = [tuple(x) for x in state["cf_history"]]
        self._last_time = None
        self._cur = None


def _norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of ``t`` as a float64 scalar on its device (no host sync)."""
    return torch.linalg.vector_norm(t, dtype=torch.float64)


def gravac_hook(state: GravacState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook running GraVAC (see the module docstring for the one-step decision lag).

    Args:
        state: a :class:`GravacState`.
        bucket: DDP gradient bucket (flat buffer of any floating dtype, processed as float32).

    Returns:
        Future of the bucket's flat buffer holding the averaged gradient.
    """
    group = state.process_group
    buf = bucket.buffer()
    rec = state._record()
    count = state._counter(rec)
    if state.iteration < state.start_iter:
        fut = dense_start(buf, rec, group, count)
        if bucket.is_last():
            state._end_of_step(rec, buf.device)
        rec["dense_wire_bytes"] += state.end_bucket(bucket)  # rec is last_step's dict after the last bucket
        return fut

    ctrl = state.controller
    key = bucket.index()
    rank = dist.get_rank(group)
    step = state.iteration
    guard = state.finite_guard
    guard.begin(step, state._snapshot)
    t0 = time.perf_counter()
    g = buf.detach().reshape(-1).to(torch.float32)
    x = state.memory.compensate(g, key, bucket_layout(bucket, state.param_names))
    guard.check(x)
    rec["ng"] += _norm(g)
    cmin = state._compressor(ctrl.theta_min)
    p_min, ctx_min = cmin.compress(x, step=step, key=key, rank=rank)
    d_min = cmin.decompress(p_min, ctx_min)
    rec["nmin"] += _norm(d_min)
    sent = (cmin, p_min, ctx_min, d_min)
    if ctrl.candidate_active:
        cc = state._compressor(ctrl.theta_c)
        p_c, ctx_c = cc.compress(x, step=step, key=key, rank=rank)
        d_c = cc.decompress(p_c, ctx_c)
        rec["nc"] += _norm(d_c)
        rec["has_c"] = True
        if rec["branch"] == "candidate":
            sent = (cc, p_c, ctx_c, d_c)
    dt = time.perf_counter() - t0
    state.compress_seconds += dt
    rec["compress_seconds"] += dt

    if rec["branch"] == "dense":
        state.memory.clear(key)
        rec["selected"] += x.numel()
        rec["numel"] += x.numel()
        fut = dense_allreduce(x, group, count)
    else:
        comp, payload, ctx, dec = sent
        state.memory.update(key, x, dec)
        rec["selected"] += ctx.selected
        rec["numel"] += ctx.numel
        fut = communicate(comp, payload, ctx, group, count, state.compression_timer)
    if bucket.is_last():
        state._end_of_step(rec, buf.device)
    rec["dense_wire_bytes"] += state.end_bucket(bucket)
    return state.guarded(bucket, then(fut, copy_back(buf)), rec.pop("verdict", None))


@dataclass(frozen=True)
class GravacOptions(Options):
    """Options of ``gravac``."""

    OWNER = "gravac"
    compressor: str = option("topk", "GraVAC's sparsifier", choices=GRAVAC_COMPRESSORS)
    search_interval: Optional[int] = option(None, "steps between compression-factor search boundaries; "
                                            "None: a quarter epoch", low=1, units="steps")
    gain_floor: float = option(0.75, "epsilon: least compression gain a compressor may have", low=0.0,
                               low_open=True)
    plateau_tolerance: float = option(0.05, "omega: stop searching when the two best compression throughputs "
                                      "are this close (relative)", low=0.0)


def _make_hook(opts: GravacOptions, ctx: Any) -> tuple:
    # The reference code searches once per epoch; a quarter epoch lets short runs explore 10x..10,000x.
    interval = opts.search_interval or max(1, (ctx.steps_per_epoch or 200) // 4)
    state = GravacState(compressor=opts.compressor, batch_size=ctx.batch_size, process_group=ctx.process_group,
                        search_interval=interval, epsilon=opts.gain_floor, omega=opts.plateau_tolerance,
                        model=ctx.model)
    return state, gravac_hook


SPEC = hook_algorithm("gravac", "GraVAC: compression factor adapted from the all-reduced compression gain and "
                      "throughput (Tyagi & Swany, IEEE CLOUD 2023, arXiv 2305.12201)", GravacOptions, _make_hook)

#: the algorithms this module registers
SPECS = (SPEC,)
