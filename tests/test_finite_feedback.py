"""One inf in one gradient element on one rank costs exactly one skipped step for every algorithm
with error feedback (gradsync issue 18, items 1 and 11): real 2-rank Gloo, DDP with several
buckets, ``torch.amp.GradScaler("cpu")`` at its default initial scale 2**16, the inf injected by a
parameter hook on rank 0 only at a compressed step. Afterwards: the scale halved exactly once (DDP
behaviour), every later update is finite, the residuals (and GraVAC's controller, PowerSGD's P/Q
memories, OSCAR's state) after the skipped step equal those before it bitwise, both ranks hold the
same parameters. COVAP at K=2 is run with the inf at two consecutive steps, so one run has it in an
element that step sends and the other in one it does not (asserted from the plan)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms import REGISTRY, build_hook
from test_mixed_precision import WITH_RESIDUALS, residual_tensors

STEPS = 12
INIT_SCALE = 2.0 ** 16
#: (case id, algorithm, options, step of the inf). Every registry hook with error feedback.
CASES = [
    ("covap-fp16-t5", "covap", {"ratio": 2, "cast": "fp16"}, 5),
    ("covap-fp16-t6", "covap", {"ratio": 2, "cast": "fp16"}, 6),
    ("covap-t5", "covap", {"ratio": 2}, 5),
    *[(n, n, {"density": 0.1}, 5) for n in ("topk", "randomk", "dgc", "redsync")],
    ("qsgd", "qsgd", {}, 5),
    ("signsgd", "signsgd", {}, 5),
    ("bf16", "bf16", {}, 5),
    ("gravac", "gravac", {"search_interval": 2}, 5),
    ("powersgd", "powersgd", {}, 5),
    ("powersgd-tail-flush", "powersgd", {"dense_from": 5}, 5),  # the inf hits the step that flushes the residual
    ("powersgd-overlap", "powersgd-overlap", {}, 5),
    ("powersgd-overlap-tail-flush", "powersgd-overlap", {"dense_from": 5}, 5),
    ("covap-tail-flush", "covap", {"ratio": 2, "cast": "fp16", "dense_from": 5}, 5),
    ("oscar-sw", "oscar-sw", {}, 5),
    ("oscar-asc", "oscar-asc", {}, 5),
    ("countsketch", "countsketch", {}, 5),
    # the inf on a quality-check step (iteration 5, check_every 5): the rung's guard rolls back, no switch
    ("ladder", "ladder", {"start": "powersgd-overlap/matrix_approximation_rank=2", "check_every": 5}, 5),
]
PARAM, ELEMENT = "2.weight", 7  # the element of the second Linear's weight that gets the inf


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def saved_state(state) -> list:
    """Everything the guard must roll back, as comparable copies."""
    if hasattr(state, "rungs"):  # ladder: the rung in use and its state
        return [state.index, *saved_state(state.meter.hooks[0][0])]
    out = [t.clone() for t in residual_tensors(state)]
    ts = getattr(state, "torch_state", None)
    if ts is not None:  # PowerSGD's warm-start memories
        out += [t.clone() for d in (ts.p_memory_dict, ts.q_memory_dict) for t in d.values()]
    for qs in getattr(state, "q_memory_dict", {}).values():  # powersgd-overlap's warm-start memories
        out += [q.clone() for q in qs]
    if hasattr(state, "controller"):
        out.append(copy.deepcopy(state.controller.state_dict()))
    for name in ("prev_agg", "zero_mask"):  # OSCAR
        d = getattr(state, name, None)
        if isinstance(d, dict):
            out += [t.clone() for t in d.values()]
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def sent_at(state, step: int):
    """Whether COVAP's plan sends the injected element at ``step`` (None for other algorithms)."""
    if not hasattr(state, "filter"):
        return None
    b, off, _ = state.filter.memory.index()[PARAM]
    plan = state.filter.plan
    return plan.selected_shard(b, step) == (off + ELEMENT) % plan.shards[b]


def attach(name, opts, model):
    """DDP over ``model`` with ``name``'s hook (small buckets, or one for single-bucket algorithms)."""
    ddp = DDP(model, bucket_cap_mb=1e4 if REGISTRY[name].single_bucket else 0.01)
    state, hook = build_hook(name, model=model, steps_per_epoch=4, batch_size=8, **opts)
    ddp.register_comm_hook(state, hook)
    return ddp, state


def run_with_one_inf(rank, model, forward, zero_grad, step_fn, steps, inf_step, scaler, gen, saved, out):
    """Train ``steps`` (a range) through ``forward`` with one inf injected into ``PARAM``'s gradient
    element ``ELEMENT`` on rank 0 at ``inf_step``; ``step_fn()`` is the optimizer step. Appends each
    step's scale, ``saved()`` state and parameters to ``out``."""
    step = {"t": -1}

    def inject(g):
        if rank == 0 and step["t"] == inf_step:
            g = g.clone()
            g.view(-1)[ELEMENT] = float("inf")
        return g

    handle = dict(model.named_parameters())[PARAM].register_hook(inject)
    for t in steps:
        step["t"] = t
        zero_grad()
        x, y = torch.randn(8, 20, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        scaler.scale(nn.functional.cross_entropy(forward(x), y)).backward()
        step_fn()
        out["scales"].append(scaler.get_scale())
        out["states"].append(saved())
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    handle.remove()
    return out


def train(rank, model, ddp, state, steps, inf_step, scaler, gen, out=None):
    """:func:`run_with_one_inf` on DDP with ``state``'s hook and GradScaler's step."""
    out = out if out is not None else {"scales": [], "states": [], "params": []}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def step_fn():
        scaler.step(opt)
        scaler.update()

    return run_with_one_inf(rank, model, ddp, opt.zero_grad, step_fn, steps, inf_step, scaler, gen,
                            lambda: saved_state(state), out)


def train_with_one_inf(rank, world, cases):
    out = {}
    for case, name, opts, inf_step in cases:
        model = make_model()
        ddp, state = attach(name, opts, model)
        scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        out[case] = train(rank, model, ddp, state, range(STEPS), inf_step, scaler, torch.Generator().manual_seed(rank))
        out[case].update(inf_step=inf_step, sent=sent_at(state, inf_step))
    return out


def restored_with_one_inf(rank, world):
    """COVAP restored into a fresh DDP (buckets not rebuilt: the first step runs as the recorded buckets,
    :mod:`gradsync.algorithms.recorded_layout`), the inf at the first step after the restore."""
    model = make_model()
    ddp, state = attach("covap", {"ratio": 2, "cast": "fp16"}, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    gen = torch.Generator().manual_seed(rank)
    out = train(rank, model, ddp, state, range(5), None, scaler, gen)
    saved = state.state_dict()
    ddp, state = attach("covap", {"ratio": 2, "cast": "fp16"}, model)
    state.load_state_dict(saved)
    out = train(rank, model, ddp, state, range(5, STEPS), 5, scaler, gen, out)
    out.update(inf_step=5, remapped=state.remapped_buckets)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(train_with_one_inf, 2, CASES, timeout=600, pg_timeout=60)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_one_inf_costs_exactly_one_step(runs, case):
    check_one_skip(runs[0][case], runs[1][case], case)


def test_one_inf_after_a_restore_into_a_fresh_ddp():
    r0, r1 = run_ranks(restored_with_one_inf, 2, timeout=300, pg_timeout=60)
    # the inf step ran as the recorded buckets (the hook wrapper's), so COVAP's own remapping had nothing to do
    assert r0["remapped"] == 0
    check_one_skip(r0, r1, "covap restored")


def check_one_skip(r0, r1, case):
    t = r0["inf_step"]
    for r in (r0, r1):
        halvings = [i for i in range(STEPS) if r["scales"][i] < (r["scales"][i - 1] if i else INIT_SCALE)]
        assert halvings == [t], f"{case}: scale per step {r['scales']}"
        assert r["scales"][-1] == INIT_SCALE / 2, r["scales"]
        assert same(r["states"][t], r["states"][t - 1]), f"{case}: state changed by the skipped step"
        assert torch.equal(r["params"][t], r["params"][t - 1]), f"{case}: the skipped step updated parameters"
        for i in range(t + 1, STEPS):
            assert torch.isfinite(r["params"][i]).all(), f"{case}: non-finite parameters at step {i}"
            assert not torch.equal(r["params"][i], r["params"][i - 1]), f"{case}: step {i} did not update"
            assert all(torch.isfinite(x).all() for x in r["states"][i] if isinstance(x, torch.Tensor)), case
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b), f"{case}: replicas diverged"


def test_cases_cover_every_hook_with_state():
    """Every registry hook algorithm is here except the dense ones (no state to protect)."""
    hooks = {n for n, spec in REGISTRY.items() if spec.make_hook is not None}
    covered = {c[1] for c in CASES}
    assert WITH_RESIDUALS <= covered
    assert hooks - covered == {"allreduce", "fp16"}


def test_covap_cases_cover_a_sent_and_an_unsent_element(runs):
    assert {runs[0]["covap-fp16-t5"]["sent"], runs[0]["covap-fp16-t6"]["sent"]} == {True, False}


def cast_overflow_run(rank, world):
    """COVAP K=1 with ``cast="fp16"``: every gradient element is 40,000 on both ranks (fp16 max is
    65,504): summed before dividing it overflows, divided first (torch's fp16_compress_hook) it is
    the exact average."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    ddp = DDP(model)
    state, hook = build_hook("covap", model=model, ratio=1, cast="fp16")
    ddp.register_comm_hook(state, hook)
    grads = []
    for _ in range(4):  # 2 dense start-up steps (float32), then 2 cast steps
        model.zero_grad()
        (ddp(torch.ones(1, 8)).sum() * 40000.0).backward()
        grads.append(model.weight.grad.clone())
    return grads, [r.clone() for r in state.filter.memory.residuals.values()]


def test_fp16_cast_divides_before_the_sum():
    for grads, residuals in run_ranks(cast_overflow_run, 2, timeout=120):
        for t, g in enumerate(grads):
            assert torch.equal(g, torch.full((4, 8), 40000.0)), f"step {t}: {g.flatten()[:4]}"
        assert residuals and all(torch.equal(r, torch.zeros_like(r)) for r in residuals)  # 20,000 is exact


def dear_covap_with_one_inf(rank, world):
    """dear-covap (COVAP's filter in DeAR's pipeline, fp16 cast) with the scaler known from
    construction: DeAR's all-reduced found-inf skips the step, and the filter's residuals roll back."""
    from gradsync.algorithms.dear import DeAR
    from gradsync.algorithms.dear import CovapGradFilter

    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    filt = CovapGradFilter(2, cast="fp16")
    dear = DeAR(model, torch.optim.SGD(model.parameters(), lr=0.05), fusion_mb=0.01, grad_filter=filt,
                grad_scaler=scaler)
    filt.bind(dear)
    gen = torch.Generator().manual_seed(rank)

    def step_fn():
        dear.step(scaler)
        dear.flush()

    return run_with_one_inf(rank, model, dear, dear.zero_grad, step_fn, range(STEPS), 5, scaler, gen,
                            lambda: [e.clone() for e in filt.filter.memory.residuals.values()],
                            {"scales": [], "states": [], "params": [], "inf_step": 5})


def test_dear_covap_one_inf_costs_exactly_one_step():
    r0, r1 = run_ranks(dear_covap_with_one_inf, 2, timeout=300, pg_timeout=60)
    assert r0["states"][r0["inf_step"]], "the filter kept residuals"
    check_one_skip(r0, r1, "dear-covap")


# ------------------------------------------------------------------ no host read of the flag in the hook
class _CountingReads(torch.Tensor):
    """A tensor that counts the host reads of its value (``bool``, ``item``): a host
    synchronisation where it lives on a GPU."""

    reads = 0

    def __bool__(self):
        _CountingReads.reads += 1
        return bool(self.as_subclass(torch.Tensor))

    def item(self):
        _CountingReads.reads += 1
        return self.as_subclass(torch.Tensor).item()


@pytest.mark.parametrize("finite", [True, False])
def test_a_deferred_decision_reads_no_flag_in_the_hook_and_rolls_back_at_settle(finite):
    """Before, ``conclude`` read the agreed flag with ``bool`` on every compressed step: on NCCL a host
    synchronisation inside the last bucket's hook. Where the flag lives on an accelerator (forced here
    with ``lazy``) the step reads nothing: the last bucket gets its NaN on the device and the snapshot
    is restored when the state is next read (``settle``, the next ``begin``)."""
    from gradsync.feedback.finite import FiniteGuard

    guard = FiniteGuard()
    guard.lazy = True
    state = {"residual": torch.ones(3)}
    guard.begin(7, lambda: dict(state))
    state["residual"] = torch.full((3,), 2.0)          # the step replaced its residual
    value = torch.tensor([1.0, 2.0]) if finite else torch.tensor([1.0, float("inf")])
    guard.agree(value.as_subclass(_CountingReads))
    last = torch.zeros(4)
    _CountingReads.reads = 0
    assert guard.conclude(lambda saved: state.update(saved), last) is None
    assert _CountingReads.reads == 0, "the hook read the flag on the host"
    assert torch.isnan(last).all() != finite           # GradScaler sees the NaN without a host read
    assert torch.equal(state["residual"], torch.full((3,), 2.0))   # not yet decided
    guard.begin(8, lambda: dict(state))               # the next iteration (or any reader) settles first
    assert torch.equal(state["residual"], torch.full((3,), 2.0) if finite else torch.ones(3))
    assert guard.rollbacks == (0 if finite else 1)


def test_on_the_cpu_the_flag_is_read_at_once_as_before():
    from gradsync.feedback.finite import FiniteGuard

    guard = FiniteGuard()
    state = {"residual": torch.ones(3)}
    guard.begin(1, lambda: dict(state))
    state["residual"] = torch.zeros(3)
    guard.agree(torch.tensor([float("nan")]))
    last = torch.zeros(2)
    assert guard.conclude(lambda saved: state.update(saved), last) is False
    assert torch.equal(state["residual"], torch.ones(3)) and torch.isnan(last).all() and guard.rollbacks == 1


LAZY_CASES = [c for c in CASES if c[0] in ("covap-fp16-t5", "covap-fp16-t6", "topk", "gravac", "powersgd",
                                           "powersgd-tail-flush", "powersgd-overlap-tail-flush", "oscar-asc")]


def _eager_and_deferred(rank, world, cases):
    from gradsync.feedback.finite import FiniteGuard

    out = {}
    for lazy in (False, True):
        FiniteGuard.lazy = lazy  # every guard of this forked rank
        runs = train_with_one_inf(rank, world, cases)
        out[lazy] = {case: {"scales": r["scales"], "params": r["params"]} for case, r in runs.items()}
    return out


def test_deferred_decisions_train_exactly_as_immediate_ones():
    """The same one-inf runs with every guard deferring its decision (as on CUDA) and deciding at
    once (as on the CPU): the same scales and bitwise the same parameters after every step, so the
    deferred rollbacks land before anything reads the state (also the dense tail that flushes the
    residual right after the skipped step, and GraVAC's controller)."""
    for res in run_ranks(_eager_and_deferred, 2, LAZY_CASES, timeout=300, pg_timeout=60):
        for case, _, _, _ in LAZY_CASES:
            eager, lazy = res[False][case], res[True][case]
            assert eager["scales"] == lazy["scales"], case
            assert all(torch.equal(a, b) for a, b in zip(eager["params"], lazy["params"])), case
