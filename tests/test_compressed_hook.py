"""The generic compressed DDP comm hook on real 2-rank Gloo DDP."""

import pickle

import pytest
import torch

from distributed import run_ranks
from gradsync.algorithms.compressed import CompressedState, compressed_hook
from gradsync.compressors import make_compressor

STEPS = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 40), torch.nn.ReLU(), torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 10)
    )


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def _ddp(model, bucket_cap_mb=0.002):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # ~2 KB buckets: several buckets per step (after DDP's rebuild at iteration 1)
    return DDP(model, bucket_cap_mb=bucket_cap_mb)


def _step(ddp, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _train(rank, world_size, spec):
    ddp = _ddp(_model())
    state = None
    if spec is not None:
        name, kw, ef = spec
        state = CompressedState(make_compressor(name, **kw), error_feedback=ef)
        ddp.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    steps = []
    for step in range(STEPS):
        _step(ddp, opt, rank, step)
        if state is not None:
            steps.append(dict(state.last_step))
    params = [p.detach().clone() for p in ddp.module.parameters()]
    return params, steps, state.stats() if state else None


SPECS = {
    "none": (("none", {}, False), 1e-6),
    "topk1": (("topk", {"density": 1.0}, True), 1e-6),
    "randomk1": (("randomk", {"density": 1.0}, True), 1e-6),
    "fp16": (("fp16", {}, False), 1e-2),
    "topk": (("topk", {"density": 0.1}, True), None),
}


def _train_all(rank, world_size):
    out = {"dense": _train(rank, world_size, None)}
    for key, (spec, _) in SPECS.items():
        out[key] = _train(rank, world_size, spec)
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_train_all, 2, timeout=90)


@pytest.mark.parametrize("key", ["none", "topk1", "randomk1", "fp16"])
def test_hook_without_compression_matches_dense_allreduce(trained, key):
    atol = SPECS[key][1]
    for r in range(2):
        for a, b in zip(trained[r]["dense"][0], trained[r][key][0]):
            torch.testing.assert_close(b, a, atol=atol, rtol=0)
    for a, b in zip(trained[0][key][0], trained[1][key][0]):  # ranks stay identical
        assert torch.equal(a, b)


def test_topk_hook_reports_per_step_stats(trained):
    res = [trained[r]["topk"] for r in range(2)]
    params, steps, stats = res[0]
    assert [s["compressed"] for s in steps] == [False, False, True, True, True]
    assert steps[0]["density"] == 1.0
    assert steps[0]["wire_bytes"] == steps[0]["dense_wire_bytes"] > 0
    assert steps[0]["payload_bytes"] == steps[0]["dense_wire_bytes"]  # 2 ranks: ring all-reduce sends n
    for s in steps[2:]:
        assert 0.1 <= s["density"] < 0.13  # ceil(0.1 n) per bucket
        # all-gather of (float32 value, int32 index) pairs: (P-1) m = m at P = 2
        assert s["wire_bytes"] == s["payload_bytes"]
        assert 0 < s["wire_bytes"] < 0.5 * s["dense_wire_bytes"]
        assert s["compress_seconds"] > 0
    assert stats["iteration"] == STEPS and stats["compression_ratio"] > 1
    assert 0.1 <= stats["density"] < 0.13
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)


def _checkpoint_resume(rank, world_size, name, kw):
    # One bucket holding every parameter: a fresh DDP's first-iteration bucket has the parameters in
    # registration order, the rebuilt one in gradient-ready order; with parameter names bound, the
    # residual follows the parameters, and top-k's selection does not depend on the order.
    def build():
        ddp = _ddp(_model(), bucket_cap_mb=25)
        state = CompressedState(make_compressor(name, **kw), error_feedback=True, model=ddp.module)
        ddp.register_comm_hook(state, compressed_hook)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9), state

    ddp, opt, state = build()
    for step in range(4):
        _step(ddp, opt, rank, step)
    ckpt = pickle.loads(pickle.dumps(
        {"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    ))
    _step(ddp, opt, rank, 4)
    expected = [p.detach().clone() for p in ddp.module.parameters()]
    ddp2, opt2, state2 = build()
    ddp2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["hook"])
    _step(ddp2, opt2, rank, 4)
    got = [p.detach().clone() for p in ddp2.module.parameters()]
    return expected, got, state2.iteration


@pytest.mark.parametrize("name,kw", [("topk", {"density": 0.05}), ("signsgd", {})])
def test_checkpoint_restores_same_next_step(name, kw):
    for expected, got, it in run_ranks(_checkpoint_resume, 2, name, kw, timeout=60):
        assert it == 5
        for a, b in zip(expected, got):
            # the permuted bucket can change float summation order (sign's mean |x|): tiny tolerance
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)


def test_state_arguments_and_pickling():
    with pytest.raises(ValueError, match="start_iter"):
        CompressedState("topk", start_iter=-1, density=0.1)
    with pytest.raises(ValueError, match="density"):
        CompressedState("topk", density=0)
    with pytest.raises(ValueError, match="compressor must be"):
        CompressedState(42)
    s = CompressedState("randomk", error_feedback=True, density=0.2)
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.config() == s.config() and s2.memory is not None
