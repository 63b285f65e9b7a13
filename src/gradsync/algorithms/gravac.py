"""GraVAC: adaptive compression factor chosen from compression gain and throughput.

Source: Tyagi & Swany, "GraVAC: Adaptive Compression for Communication-Efficient Distributed DL
Training", IEEE CLOUD 2023 (arXiv 2305.12201), restated in specs/algorithms.md §2 from the reference
code (sahiltyagi4/GraVAC), with its three bugs fixed:

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
t-1**: the hook body of step t-1's last bucket issues one small blocking all-reduce (8 floats) after
that bucket's own collectives, updates the controller identically on every rank and fixes the branch
for step t. No collective is ever launched from a ``Future.then`` callback. Consequences: a change of
candidate takes effect one step after the boundary that caused it, and the candidate's gain is first
known one step after the candidate is first computed (that step sends ``theta_min`` or dense).

Deviation from the reference: the reference keeps two independent error-feedback memories (one per
compressor, both updated each step). Here one residual memory is shared: both compressors compress
the same ``x = g + e`` and ``e`` is updated from the payload actually sent (``e = 0`` after a dense
step, which sends ``x``). This keeps the invariant "applied updates + residual = sum of gradients".
"""

import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync.algorithms.base import HookState
from gradsync.comm.sparse import communicate, dense_allreduce
from gradsync.compressors import SparseCompressor, make_compressor
from gradsync.feedback.residual import ResidualMemory, bucket_layout, parameter_names
from gradsync.validation import check_choice, check_float, check_int

GRAVAC_COMPRESSORS = ("topk", "dgc", "redsync", "randomk")
BRANCHES = ("min", "candidate", "dense")


class EWMA:
    """Exponentially weighted moving average with a mean-of-first-``window`` start.

    The first ``window`` samples are averaged arithmetically (no bias towards the initial value);
    after that ``value = (1 - alpha) * value + alpha * sample``.
    """

    def __init__(self, alpha: float, window: int):
        self.alpha = alpha
        self.window = window
        self.value: float | None = None
        self.count = 0

    def update(self, sample: float) -> float:
        self.count += 1
        if self.value is None:
            self.value = float(sample)
        elif self.count <= self.window:
            self.value += (float(sample) - self.value) / self.count
        else:
            self.value = (1.0 - self.alpha) * self.value + self.alpha * float(sample)
        return self.value

    def reset(self) -> None:
        self.value, self.count = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "count": self.count}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.value, self.count = s["value"], int(s["count"])


class GravacController:
    """GraVAC's decision logic, free of communication: feed it rank-averaged statistics once per step.

    Args:
        theta_min: least compression as a kept fraction, in (0, 1] (0.1 = 10x).
        theta_max: most compression as a kept fraction, in (0, theta_min] (1e-4 = 10,000x).
        step_factor: multiplier of the candidate kept fraction at each search boundary, in (0, 1)
            (0.5 doubles the compression factor: exponential search).
        window: warm-up steps at ``theta_min`` and EWMA start window (reference 25).
        alpha: EWMA smoothing factor, in (0, 1] (reference 0.05).
        epsilon: gain floor, in (0, inf) (reference 0.75).
        omega: plateau tolerance of the two best compression throughputs, relative, in [0, inf)
            (reference 0.05).
        search_interval: steps between search boundaries (>= 1; reference: one epoch).

    Raises:
        ValueError: on arguments outside the ranges above.
    """

    def __init__(
        self,
        theta_min: float = 0.1,
        theta_max: float = 1e-4,
        step_factor: float = 0.5,
        window: int = 25,
        alpha: float = 0.05,
        epsilon: float = 0.75,
        omega: float = 0.05,
        search_interval: int = 200,
    ):
        self.theta_min = check_float("theta_min", theta_min, 0.0, 1.0, low_inclusive=False)
        self.theta_max = check_float("theta_max", theta_max, 0.0, self.theta_min, low_inclusive=False)
        self.step_factor = check_float("step_factor", step_factor, 0.0, 1.0, False, False)
        self.window = check_int("window", window, 0, None)
        self.alpha = check_float("alpha", alpha, 0.0, 1.0, low_inclusive=False)
        self.epsilon = check_float("epsilon", epsilon, 0.0, None, low_inclusive=False)
        self.omega = check_float("omega", omega, 0.0, None)
        self.search_interval = check_int("search_interval", search_interval, 1, None)
        self.ng = EWMA(self.alpha, self.window)
        self.nmin = EWMA(self.alpha, self.window)
        self.ng_c = EWMA(self.alpha, self.window)
        self.nc = EWMA(self.alpha, self.window)
        self.theta_c = self.theta_min
        self.searching = True
        self.ct: dict[float, list[float]] = {}  # kept fraction -> [sum of tput*gain, count]
        self.branch = "min"  # branch for the next step
        self.gain_min: float | None = None
        self.gain_c: float | None = None
        self._used: dict[int, tuple[float, float]] = {}  # step -> (kept fraction, gain) sent

    # -- queries --------------------------------------------------------------------------------
    @property
    def candidate_active(self) -> bool:
        """Whether the candidate compressor differs from ``theta_min`` (then it is evaluated each step)."""
        return self.theta_c != self.theta_min

    def kept_fraction(self, branch: str | None = None) -> float:
        """Kept fraction of ``branch`` (default: the branch of the next step); 1.0 for dense."""
        b = self.branch if branch is None else branch
        return {"min": self.theta_min, "candidate": self.theta_c, "dense": 1.0}[b]

    def compression_throughput(self) -> dict[float, float]:
        """``CT``: kept fraction -> mean of samples/s x gain over the steps sent at it."""
        return {cf: s / n for cf, (s, n) in self.ct.items() if n}

    # -- update ---------------------------------------------------------------------------------
    def update(
        self,
        step: int,
        ng: float,
        nmin: float,
        nc: float | None = None,
        tput_prev: float | None = None,
        tput_cur: float | None = None,
    ) -> str:
        """Account step ``step`` and decide the branch of step ``step + 1``.

        Args:
            step: the step just finished (its branch was ``self.branch``).
            ng: rank-averaged ``sum_b ||g_b||`` of the step.
            nmin: rank-averaged ``sum_b ||C_theta_min(g_b + e_b)||``.
            nc: same for the candidate (``None`` if it was not evaluated).
            tput_prev: system throughput (samples/s, all ranks) of step ``step - 1``, if measured.
            tput_cur: system throughput of step ``step``, if measured.

        Returns:
            The branch for step ``step + 1``: ``"min"``, ``"candidate"`` or ``"dense"``.
        """
        ng_v = self.ng.update(ng)
        nmin_v = self.nmin.update(nmin)
        self.gain_min = nmin_v / ng_v if ng_v > 0 else 1.0
        if nc is not None:
            ngc_v = self.ng_c.update(ng)
            nc_v = self.nc.update(nc)
            self.gain_c = nc_v / ngc_v if ngc_v > 0 else 1.0
        gain_used = {"min": self.gain_min, "candidate": self.gain_c, "dense": 1.0}[self.branch]
        self._used[step] = (self.kept_fraction(), 1.0 if gain_used is None else gain_used)
        for s in list(self._used):
            if s < step - 1:
                del self._used[s]
        if tput_prev is not None and (step - 1) in self._used:
            self._record(*self._used[step - 1], tput_prev)
        if tput_cur is not None:
            self._record(*self._used[step], tput_cur)
        nxt = step + 1
        if nxt >= self.window and nxt % self.search_interval == 0:
            self._search_boundary()
        self.branch = self._decide(nxt)
        return self.branch

    def _record(self, cf: float, gain: float, tput: float) -> None:
        entry = self.ct.setdefault(cf, [0.0, 0])
        entry[0] += tput * gain
        entry[1] += 1

    def _set_candidate(self, theta: float) -> None:
        if theta != self.theta_c:
            self.theta_c = theta
            self.ng_c.reset()
            self.nc.reset()
            self.gain_c = None

    def _search_boundary(self) -> None:
        if self.searching:
            self._set_candidate(max(self.theta_c * self.step_factor, self.theta_max))
        ct = self.compression_throughput()
        if len(ct) >= 2:
            (cf1, v1), (cf2, v2) = sorted(ct.items(), key=lambda kv: kv[1], reverse=True)[:2]
            if v2 > 0 and abs(v1 - v2) / v2 < self.omega:
                self.searching = False
                self._set_candidate(min(cf1, cf2))

    def _decide(self, step: int) -> str:
        if step < self.window:
            return "min"
        if self.candidate_active and self.gain_c is not None and self.gain_c >= self.epsilon:
            return "candidate"
        if self.gain_min is not None and self.gain_min >= self.epsilon:
            return "min"
        return "dense"

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "ng": self.ng.state_dict(),
            "nmin": self.nmin.state_dict(),
            "ng_c": self.ng_c.state_dict(),
            "nc": self.nc.state_dict(),
            "theta_c": self.theta_c,
            "searching": self.searching,
            "ct": {cf: list(v) for cf, v in self.ct.items()},
            "branch": self.branch,
            "gain_min": self.gain_min,
            "gain_c": self.gain_c,
            "used": dict(self._used),
        }

    def load_state_dict(self, s: dict[str, Any]) -> None:
        for name in ("ng", "nmin", "ng_c", "nc"):
            getattr(self, name).load_state_dict(s[name])
        self.theta_c = float(s["theta_c"])
        self.searching = bool(s["searching"])
        self.ct = {float(cf): list(v) for cf, v in s["ct"].items()}
        self.branch = check_choice("branch", s["branch"], BRANCHES)
        self.gain_min, self.gain_c = s["gain_min"], s["gain_c"]
        self._used = {int(k): tuple(v) for k, v in s["used"].items()}


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
            ``theta_candidate``, ``gain_min``, ``gain_candidate``, ``searching``, ``bytes_sent``,
            ``dense_bytes`` (bytes), ``density``, ``compress_seconds`` (s).
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
                "bytes_sent": 0,
                "dense_bytes": 0,
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
        def count(*tensors: torch.Tensor) -> None:
            self.count_collective(*tensors)
            rec["bytes_sent"] += sum(t.numel() * t.element_size() for t in tensors)

        return count

    def _end_of_step(self, rec: dict[str, Any]) -> None:
        """Last bucket: all-reduce this step's statistics and update the controller (hook body only)."""
        now = time.perf_counter()
        timed = self.batch_size / (now - self._last_time) if self._last_time is not None else 0.0
        timed_flag = 1.0 if self._last_time is not None else 0.0
        self._last_time = now
        rec["density"] = rec["selected"] / rec["numel"] if rec["numel"] else 1.0
        if self.iteration >= self.start_iter:
            rec_flag = 1.0 if self._recorded is not None else 0.0
            vec = torch.tensor(
                [rec["ng"], rec["nmin"], rec["nc"], float(rec["has_c"]),
                 self._recorded or 0.0, rec_flag, timed, timed_flag],
                dtype=torch.float64,
            )
            self.count_collective(vec)
            rec["bytes_sent"] += vec.numel() * vec.element_size()
            dist.all_reduce(vec, group=self.process_group)
            p = self.world_size
            ng, nmin, nc, has_c, rec_sum, rec_n, timed_sum, timed_n = vec.tolist()
            self.controller.update(
                self.iteration,
                ng / p,
                nmin / p,
                nc / p if has_c == p else None,
                tput_prev=rec_sum if rec_n == p else None,
                tput_cur=timed_sum if rec_n != p and timed_n == p else None,
            )
        self._recorded = None
        rec["gain_min"] = self.controller.gain_min
        rec["gain_candidate"] = self.controller.gain_c
        rec["searching"] = self.controller.searching
        rec["next_theta_candidate"] = self.controller.theta_c
        rec["next_branch"] = self.controller.branch
        self.last_step = rec
        self.cf_history.append((rec["iteration"], rec["compression_factor"]))
        self._cur = None

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


def _norm(t: torch.Tensor) -> float:
    return float(t.norm()) if t.numel() else 0.0


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
    rec["dense_bytes"] += buf.numel() * buf.element_size()
    if state.iteration < state.start_iter:
        rec["selected"] += buf.numel()
        rec["numel"] += buf.numel()
        fut = dense_allreduce(buf, group, count)
        if bucket.is_last():
            state._end_of_step(rec)
        state.end_bucket(bucket)
        return fut

    ctrl = state.controller
    key = bucket.index()
    rank = dist.get_rank(group)
    step = state.iteration
    t0 = time.perf_counter()
    g = buf.detach().reshape(-1).to(torch.float32)
    x = state.memory.compensate(g, key, bucket_layout(bucket, state.param_names))
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
        state._end_of_step(rec)
    state.end_bucket(bucket)

    def write_back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value().view_as(buf))
        return buf

    return fut.then(write_back)
