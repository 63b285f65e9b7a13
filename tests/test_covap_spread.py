"""COVAP's ``unsent="spread"`` delivery (for Adam-family optimizers) on real Gloo groups.

With lr=0 the gradients depend only on the data, so a ``"zero"`` run and a ``"spread"`` run see
the same gradients and keep the same residuals; the spread run must deliver, at every position, the
zero run's last sent value divided by K (bitwise: both divide the same float32 all-reduce result),
identically on every rank, and nothing before a shard's first send.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from gradsync.algorithms import CovapState, covap_hook
from gradsync.algorithms.covap import CovapFilter
from test_covap import batch, make_model

K = 4


def bucket_outputs(rank, world, unsent, steps):
    """Per step and bucket: (iteration, bucket index, delivered buffer, (shard, c) or None)."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = CovapState(ratio=K, unsent=unsent)
    log = []

    def recording_hook(state, bucket):
        t, index = state.iteration, bucket.index()
        fut = covap_hook(state, bucket)

        def record(f):
            out = f.value()
            shard = state.filter.plan.selected_shard(index, t) if t >= state.start_iter else None
            sel = None if shard is None else (shard, state.filter.plan.shards[index])
            log.append((t, index, out.clone(), sel))
            return out
        return fut.then(record)

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    log.sort(key=lambda r: (r[0], r[1]))  # futures complete in any order
    held = {k: v.clone() for k, v in state.filter.held.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, held)
    return log, state.start_iter, gathered


def test_spread_delivers_the_last_sent_value_over_k_on_every_rank():
    zero = run_ranks(bucket_outputs, 2, "zero", 12)
    spread = run_ranks(bucket_outputs, 2, "spread", 12)
    for rank in range(2):
        zlog, start, _ = zero[rank]
        slog, _, gathered = spread[rank]
        assert [(t, i) for t, i, _, _ in zlog] == [(t, i) for t, i, _, _ in slog]
        held: dict[int, torch.Tensor] = {}
        sent_steps = 0
        for (t, index, z, sel), (_, _, s, _) in zip(zlog, slog):
            if t < start:
                assert torch.equal(s, z), "dense warm-up iterations are the same in both modes"
                continue
            h = held.setdefault(index, torch.zeros_like(z))
            if sel is not None:
                shard, c = sel
                h[shard::c] = z[shard::c] / K
                sent_steps += 1
            assert torch.equal(s, h), f"step {t} bucket {index}: max diff {(s - h).abs().max()}"
        assert sent_steps > 0
        # every position has been sent by now, so nothing delivered is a stale zero
        assert all(bool((h != 0).any()) for h in held.values())
        for k in gathered[0]:
            assert torch.equal(gathered[0][k], gathered[1][k]), "held values identical on every rank"


def test_spread_with_k1_is_dense():
    f = CovapFilter(1, unsent="spread")
    out = torch.zeros(6)
    reduced = torch.arange(6.0)
    assert torch.equal(f.deliver(0, out, (0, 1), reduced), reduced)


def test_unsent_is_validated_and_saved():
    with pytest.raises(ValueError, match="unsent must be one of zero, spread"):
        CovapState(ratio=4, unsent="hold")
    f = CovapFilter(4, unsent="spread")
    f.deliver(3, torch.zeros(8), (1, 2), torch.ones(4))
    g = CovapFilter(4, unsent="spread")
    g.load_state_dict(f.state_dict())
    assert torch.equal(g.held[3], torch.tensor([0, 0.25] * 4))
    assert f.config()["unsent"] == "spread"
