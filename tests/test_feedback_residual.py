"""Standard error feedback: mass conservation, per-key residuals, checkpoints, arguments."""

import logging

import pytest
import torch

from gradsync.compressors import make_compressor
from gradsync.feedback.residual import ResidualMemory


@pytest.mark.parametrize("name,kw", [("topk", {"density": 0.05}), ("randomk", {"density": 0.05}),
                                      ("dgc", {"density": 0.05}), ("signsgd", {}), ("qsgd", {"levels": 64})])
def test_error_feedback_conserves_gradient_mass(name, kw):
    comp = make_compressor(name, **kw)
    mem = ResidualMemory()
    gen = torch.Generator().manual_seed(0)
    grads_sum = {0: torch.zeros(500, dtype=torch.float64), 1: torch.zeros(300, dtype=torch.float64)}
    applied_sum = {k: torch.zeros_like(v) for k, v in grads_sum.items()}
    for step in range(20):
        for key, n in ((0, 500), (1, 300)):
            g = torch.randn(n, generator=gen)
            payload, ctx, dec = mem.compress(comp, g, key, step=step)
            assert torch.equal(dec, comp.decompress(payload, ctx))
            grads_sum[key] += g.double()
            applied_sum[key] += dec.double()
    for key in grads_sum:
        assert torch.allclose(applied_sum[key] + mem.residuals[key].double(), grads_sum[key], rtol=1e-5, atol=1e-4)
    assert mem.residual_norm() > 0


def test_residual_is_added_and_keys_are_separate():
    mem = ResidualMemory()
    comp = make_compressor("topk", density=0.5)
    g = torch.tensor([4.0, 1.0, -3.0, 0.5])
    _, _, dec = mem.compress(comp, g, key=7)
    assert torch.equal(dec, torch.tensor([4.0, 0.0, -3.0, 0.0]))
    assert torch.equal(mem.residuals[7], torch.tensor([0.0, 1.0, 0.0, 0.5]))
    assert torch.equal(mem.compensate(torch.zeros(4), 7), torch.tensor([0.0, 1.0, 0.0, 0.5]))
    assert torch.equal(mem.compensate(torch.ones(4), 8), torch.ones(4))  # other key: no residual
    assert torch.equal(g, torch.tensor([4.0, 1.0, -3.0, 0.5]))  # input untouched
    mem.clear(7)
    assert 7 not in mem.residuals


def test_size_mismatch_drops_residual(caplog):
    mem = ResidualMemory()
    mem.update(0, torch.ones(4), torch.zeros(4))
    with caplog.at_level(logging.WARNING):
        x = mem.compensate(torch.ones(6), 0)
    assert torch.equal(x, torch.ones(6)) and 0 not in mem.residuals
    assert "dropped" in caplog.text


def test_beta_gamma_and_bad_arguments():
    mem = ResidualMemory(beta=0.5, gamma=2.0)
    mem.update(0, torch.full((3,), 2.0), torch.zeros(3))
    assert torch.equal(mem.compensate(torch.ones(3), 0), torch.full((3,), 3.0))
    for kw, match in (({"beta": 1.5}, "beta"), ({"beta": -0.1}, "beta"), ({"gamma": 0}, "gamma")):
        with pytest.raises(ValueError, match=match):
            ResidualMemory(**kw)


def test_state_dict_restores_same_next_step():
    comp = make_compressor("dgc", density=0.1)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(1000, generator=gen) for _ in range(6)]
    a = ResidualMemory()
    for step, g in enumerate(grads[:5]):
        a.compress(comp, g, 0, step=step)
    saved = a.state_dict()
    expected = a.compress(comp, grads[5], 0, step=5)
    b = ResidualMemory()
    b.load_state_dict(saved)
    got = b.compress(comp, grads[5], 0, step=5)
    for e, o in zip(expected[0], got[0]):
        assert torch.equal(e, o)
    assert torch.equal(a.residuals[0], b.residuals[0])
    # the checkpoint is a copy, unaffected by later steps
    assert not torch.equal(saved["residuals"][0], a.residuals[0])


def test_named_layouts_move_residuals_between_buckets():
    mem = ResidualMemory()
    comp = make_compressor("topk", density=0.25)
    gen = torch.Generator().manual_seed(2)
    ga, gb = torch.randn(8, generator=gen), torch.randn(4, generator=gen)
    # two buckets: key 0 holds "a" (8), key 1 holds "b" (4)
    mem.compress(comp, ga, 0, layout=(("a", 8),))
    mem.compress(comp, gb, 1, layout=(("b", 4),))
    ea, eb = mem.residuals[0].clone(), mem.residuals[1].clone()
    saved = mem.state_dict()
    fresh = ResidualMemory()
    fresh.load_state_dict(saved)
    # after resuming, one bucket holding "b" then "a"
    x = fresh.compensate(torch.zeros(12), 0, layout=(("b", 4), ("a", 8)))
    assert torch.equal(x, torch.cat([eb, ea]))
    assert fresh.residuals == {} and fresh.stale == ({}, {})
    # unnamed layouts cannot be re-sliced: dropped
    mem2 = ResidualMemory()
    mem2.update(0, torch.ones(4), torch.zeros(4))
    mem2.layouts[0] = ((2,), (2,))
    assert torch.equal(mem2.compensate(torch.zeros(4), 0, layout=((4,),)), torch.zeros(4))


def test_stale_buckets_split_between_new_buckets_and_old_pool_checkpoints_load():
    gen = torch.Generator().manual_seed(3)
    ea, eb, ec = (torch.randn(n, generator=gen) for n in (3, 5, 2))
    mem = ResidualMemory()
    mem.store(0, torch.cat([ea, eb]))
    mem.layouts[0] = (("a", 3), ("b", 5))
    mem.store(1, ec)
    mem.layouts[1] = (("c", 2),)
    total = float(mem.total())
    # the new layout splits bucket 0 over two buckets: each takes its parameters, the rest waits
    x = mem.compensate(torch.zeros(7), 0, layout=(("c", 2), ("b", 5)))
    assert torch.equal(x, torch.cat([ec, eb]))
    assert list(mem.stale[1].values()) == [(("a", 3),)]
    mem.store(0, x)  # what was taken is in the new bucket only: no residual counted twice or lost
    assert abs(float(mem.total()) - total) < 1e-5
    assert torch.equal(mem.compensate(torch.zeros(3), 1, layout=(("a", 3),)), ea)
    assert mem.stale == ({}, {})
    # a checkpoint from before the one store keeps per-parameter residuals in "pool"
    old = {"beta": 1.0, "gamma": 1.0, "residuals": {}, "layouts": {}, "pool": {"a": ea, "c": ec}}
    fresh = ResidualMemory()
    fresh.load_state_dict(old)
    assert torch.equal(fresh.compensate(torch.zeros(5), 0, layout=(("a", 3), ("c", 2))), torch.cat([ea, ec]))


def test_read_and_write_by_name_keep_the_recorded_buckets_and_the_snapshot():
    mem = ResidualMemory()
    mem.layouts.update({0: (("a", 2), ("b", 3)), 1: (("c", 4),)})
    mem.store(0, torch.arange(5.0))
    saved = mem.snapshot()
    e = mem.read((("c", 4), ("b", 3)))
    assert e[0] is None and torch.equal(e[1], torch.tensor([2.0, 3.0, 4.0]))
    mem.write((("c", 4), ("b", 3)), -torch.arange(1.0, 8.0))
    assert torch.equal(mem.residuals[0], torch.tensor([0.0, 1.0, -5.0, -6.0, -7.0]))
    assert torch.equal(mem.residuals[1], -torch.arange(1.0, 5.0))
    assert mem.index() == {"a": (0, 0, 2), "b": (0, 2, 3), "c": (1, 0, 4)}
    mem.restore(saved)  # a rolled-back step sees none of the writes
    assert torch.equal(mem.residuals[0], torch.arange(5.0)) and 1 not in mem.residuals


def test_memory_pickled_with_a_pool_loads():
    import pickle

    mem = ResidualMemory()
    legacy = dict(mem.__dict__)
    del legacy["stale"]
    legacy["_pool"] = {"a": torch.ones(2)}
    old = ResidualMemory.__new__(ResidualMemory)
    old.__setstate__(pickle.loads(pickle.dumps(legacy)))
    assert torch.equal(old.compensate(torch.zeros(2), 0, layout=(("a", 2),)), torch.ones(2))
