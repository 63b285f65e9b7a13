"""Every registered algorithm builds by name and trains a small model on a real 2-rank Gloo group,
with both ranks applying identical averaged gradients."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms import REGISTRY, build_hook


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


OPTIONS = {"ratio": 2, "density": 0.1}


def options_for(name):
    return {k: v for k, v in OPTIONS.items() if k in REGISTRY[name].options.keys()}


def train_all(rank, world, names, steps):
    out = {}
    for name in names:
        model = make_model()
        cap = 1e4 if REGISTRY[name].single_bucket else 0.01
        ddp = DDP(model, bucket_cap_mb=cap)
        state, hook = build_hook(name, model=model, steps_per_epoch=3, batch_size=8, **options_for(name))
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        out[name] = (params, state.stats())
    return out


def test_every_algorithm_trains_and_keeps_replicas_identical():
    names = sorted(n for n, spec in REGISTRY.items() if spec.make_hook is not None)
    r0, r1 = run_ranks(train_all, 2, names, 8, timeout=240)
    dense_wire = r0["allreduce"][1]["wire_bytes"]
    assert dense_wire == r0["allreduce"][1]["dense_wire_bytes"]
    for name in names:
        p0, stats = r0[name]
        p1, _ = r1[name]
        assert torch.isfinite(p0).all(), name
        assert torch.allclose(p0, p1, atol=1e-6), f"{name}: replicas diverged"
        assert stats["wire_bytes"] > 0 and stats["payload_bytes"] > 0, name
        assert stats["dense_wire_bytes"] == dense_wire, name
        if name not in ("allreduce",):
            assert stats["wire_bytes"] < dense_wire, f"{name} should send less than dense all-reduce"
            assert stats["compression_ratio"] > 1, name


def test_unknown_algorithm_is_a_value_error():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        build_hook("nope")


@pytest.mark.parametrize("name, options, match", [
    ("covap", {"ratoi": 4}, r"algorithm 'covap' does not take option\(s\) ratoi; allowed: ratio"),
    ("topk", {"densty": 0.1}, r"does not take option\(s\) densty; allowed: error_feedback, density"),
    ("covap", {"ratio": 1.5}, r"ratio must be an integer in \[1, 32\]"),
    ("covap", {"ratio": "4"}, r"ratio must be an integer in \[1, 32\] or 'auto', got '4'"),
    ("allreduce", {"ratio": 2}, r"algorithm 'allreduce' does not take option\(s\) ratio; allowed: none"),
    ("dear", {}, r"replaces DDP .* gradsync.wrap"),
])
def test_options_are_validated_strictly(name, options, match):
    with pytest.raises(ValueError, match=match):
        build_hook(name, **options)


def test_every_algorithm_declares_typed_options_with_help():
    from gradsync.options import field_specs

    for name, spec in REGISTRY.items():
        assert spec.summary, name
        for field in field_specs(spec.options):
            assert field.meta["help"], f"{name}.{field.name} has no help text"
            spec.options()  # defaults are valid


def wrap_both(rank, world):
    import gradsync
    from gradsync.algorithms.dear import DeAR
    from gradsync.algorithms.dear import CovapGradFilter

    model = make_model()
    ddp = gradsync.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm="covap", ratio=2)
    other = make_model()
    dear = gradsync.wrap(other, torch.optim.SGD(other.parameters(), lr=0.1), algorithm="dear-covap", ratio=2)
    try:
        gradsync.wrap(make_model(), None, algorithm="nope")
    except ValueError as exc:
        message = str(exc)
    try:
        gradsync.wrap(ddp, None, algorithm="covap")
    except ValueError as exc:
        double = str(exc)
    return (isinstance(ddp, DDP), ddp.gradsync_state.ratio, isinstance(dear, DeAR),
            isinstance(dear.grad_filter, CovapGradFilter), dear.grad_filter.ratio, message, double)


def test_wrap_builds_hooked_ddp_and_dear():
    for is_ddp, ratio, is_dear, has_filter, filter_ratio, message, double in run_ranks(wrap_both, 2, timeout=60):
        assert is_ddp and ratio == 2 and is_dear and has_filter and filter_ratio == 2
        assert "algorithm must be one of" in message and "dear-covap" in message
        assert "already a DistributedDataParallel" in double
