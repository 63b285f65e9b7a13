"""Every communication-hook algorithm with bfloat16 and float16 parameters (DDP buckets then have that
dtype), on a real 2-rank Gloo group: training stays finite, replicas stay identical, error-feedback
residuals are kept in float32 and the buckets are written back in their own dtype."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms import REGISTRY, build_hook
from gradsync.algorithms.covap import CovapFilter
from gradsync.feedback.residual import ResidualMemory
from gradsync.comm.buckets import ddp_bucket_numels

HOOKS = sorted(n for n, spec in REGISTRY.items() if spec.make_hook is not None)
OPTIONS = {"ratio": 2, "density": 0.1}
#: Algorithms that keep error-feedback residuals once compression starts (iteration 2).
WITH_RESIDUALS = {"bf16", "covap", "dgc", "gravac", "powersgd", "powersgd-overlap", "qsgd", "randomk", "redsync",
                  "signsgd", "topk", "oscar-sw", "oscar-asc"}
STEPS = 5  # 2 dense start-up iterations, then 3 compressed ones


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).to(dtype)


def residual_tensors(state) -> list[torch.Tensor]:
    """The error-feedback residuals an algorithm's state keeps, wherever it keeps them."""
    out = []
    for obj in (getattr(state, "memory", None), getattr(getattr(state, "filter", None), "memory", None)):
        if isinstance(obj, ResidualMemory):
            out += list(obj.residuals.values())
    torch_state = getattr(state, "torch_state", None)  # torch's PowerSGDState
    if torch_state is not None:
        out += list(torch_state.error_dict.values())
    for name in ("error", "accumulators", "error_dict"):  # OSCAR, count sketch, powersgd-overlap
        d = getattr(state, name, None)
        if isinstance(d, dict):
            out += [t for t in d.values() if isinstance(t, torch.Tensor)]
    return out


def train_low_precision(rank, world, dtypes):
    out = {}
    for dtype in dtypes:
        for name in HOOKS:
            model = make_model(dtype)
            ddp = DDP(model, bucket_cap_mb=1e4 if REGISTRY[name].single_bucket else 0.01)
            opts = {k: v for k, v in OPTIONS.items() if k in REGISTRY[name].options.keys()}
            state, hook = build_hook(name, model=model, steps_per_epoch=3, batch_size=8, **opts)
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(rank)
            grad_dtypes = set()
            for _ in range(STEPS):
                opt.zero_grad()
                x, y = torch.randn(8, 32, generator=g).to(dtype), torch.randint(0, 10, (8,), generator=g)
                nn.functional.cross_entropy(ddp(x).float(), y).backward()
                grad_dtypes |= {p.grad.dtype for p in model.parameters()}
                opt.step()
            params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            residuals = residual_tensors(state)
            out[(str(dtype), name)] = {
                "params": params,
                "grad_dtypes": sorted(str(d) for d in grad_dtypes),
                "residual_dtypes": sorted({str(r.dtype) for r in residuals}),
                "residuals": len(residuals),
                "stats": state.stats(),
                "bucket_numels": ddp_bucket_numels(ddp),
                "numel": sum(p.numel() for p in model.parameters()),
            }
    return out


@pytest.fixture(scope="module")
def low_precision_runs():
    return run_ranks(train_low_precision, 2, [torch.bfloat16, torch.float16], timeout=420, pg_timeout=120)


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
@pytest.mark.parametrize("name", HOOKS)
def test_hook_trains_with_low_precision_parameters(low_precision_runs, name, dtype):
    r0, r1 = (r[(dtype, name)] for r in low_precision_runs)
    p0, p1 = r0["params"], r1["params"]
    assert str(p0.dtype) == dtype, "parameters changed dtype"
    assert r0["grad_dtypes"] == [dtype], "gradients were written back in another dtype"
    assert torch.isfinite(p0.float()).all(), f"{name} {dtype}: non-finite parameters"
    assert torch.equal(p0, p1), f"{name} {dtype}: replicas diverged"
    init = torch.cat([p.detach().reshape(-1) for p in make_model(getattr(torch, dtype.split(".")[1])).parameters()])
    assert not torch.equal(p0, init), f"{name} {dtype}: parameters did not move"
    assert r0["stats"]["wire_bytes"] > 0 and r0["stats"]["payload_bytes"] > 0, name
    if name in WITH_RESIDUALS:
        assert r0["residuals"] > 0, f"{name} {dtype}: no error-feedback residual was kept"
    assert set(r0["residual_dtypes"]) <= {"torch.float32"}, f"{name} {dtype}: residuals {r0['residual_dtypes']}"


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_covap_sends_the_bucket_dtype(low_precision_runs, dtype):
    """At K=2 COVAP sends about half the dense bytes of the same (16-bit) buckets, not a float32 copy
    (which would make the ratio about 1)."""
    stats = low_precision_runs[0][(dtype, "covap")]["stats"]
    dense = low_precision_runs[0][(dtype, "allreduce")]["stats"]
    assert dense["payload_bytes"] == dense["dense_payload_bytes"]
    assert dense["wire_bytes"] == dense["dense_wire_bytes"]  # 2 ranks: a ring all-reduce sends n
    # 2 dense iterations + 3 at K=2: bytes ~ (2 + 3/2) / 5 of dense, plus at most 4 bytes per compressed
    # iteration for the finite vote (FiniteGuard) its last bucket all-reduces (2 ranks: wire = payload)
    vote = 3 * 4
    assert stats["payload_bytes"] - vote <= 0.8 * stats["dense_payload_bytes"], stats
    assert stats["wire_bytes"] - vote <= 0.8 * stats["dense_wire_bytes"], stats


def test_covap_filter_keeps_the_rounding_error_of_a_narrow_send():
    """The values sent in bf16 plus the float32 residual equal the compensated gradient exactly."""
    f = CovapFilter(ratio=1)
    f.plan_for([5])
    g = torch.tensor([1.0, 1.0 + 2**-10, -3.0, 0.1, 7.0], dtype=torch.float32)
    shard, c, values = f.split(0, g, 0, 0, send_dtype=torch.bfloat16)
    assert (shard, c) == (0, 1) and values.dtype == torch.bfloat16
    residual = f.memory.residuals[0]
    assert residual.dtype == torch.float32
    assert torch.equal(values.float() + residual, g)
    assert residual.abs().max() > 0  # 1 + 2**-10 and 0.1 are not bf16 numbers


def test_residual_memory_is_float32_for_low_precision_gradients():
    mem = ResidualMemory()
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.linspace(-1, 1, 11).to(dtype)
        x = mem.compensate(g, key=0)
        assert x.dtype == torch.float32
        mem.update(0, x, x.to(dtype).to(torch.float32) * 0.5)
        assert mem.residuals[0].dtype == torch.float32
        mem.store(1, g)
        assert mem.residuals[1].dtype == torch.float32
        mem.clear()


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_bucket_numels_of_16_bit_buckets(low_precision_runs, dtype):
    run = low_precision_runs[0][(dtype, "allreduce")]
    assert sum(run["bucket_numels"]) == run["numel"]


class _FakeDDP:
    """What ``ddp_bucket_numels`` reads of a DDP object: its module and logging data."""

    def __init__(self, module, bucket_bytes):
        self.module, self._sizes = module, ", ".join(str(b) for b in bucket_bytes)

    def _get_ddp_logging_data(self):
        return {"bucket_sizes": self._sizes}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bucket_numels_divide_bytes_by_the_parameter_size(dtype):
    """DDP reports bucket sizes in bytes; 2-byte parameters give twice as many elements per byte."""
    module = nn.Sequential(nn.Linear(10, 100), nn.Linear(100, 10)).to(dtype)  # 1100 + 1010 elements
    size = torch.empty(0, dtype=dtype).element_size()
    assert ddp_bucket_numels(_FakeDDP(module, [1010 * size, 1100 * size])) == [1010, 1100]
    mixed = nn.Sequential(nn.Linear(10, 100), nn.Linear(100, 10).to(torch.bfloat16))
    assert ddp_bucket_numels(_FakeDDP(mixed, [1010 * 2, 1100 * 4])) == [2110]  # mixed dtypes: one total
