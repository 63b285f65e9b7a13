"""gradsync's wrapper of torch's PowerSGD hook on real 2-rank Gloo groups: the dense tail
(``dense_from``) against torch's own fp16 hook.

Tolerances: after the tail starts, gradients equal torch's ``fp16_compress_hook`` run on the same
batches within rtol=1e-3/atol=1e-5 (both cast to float16; only the order of the division differs).
"""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_ranks
from small_mlp import backward_step, flat_grad, make_model
from gradsync.algorithms.powersgd import PowerSGDHookState, move_bucket_memories, powersgd_hook


def _grads(rank, world, hook, steps, dense_from=0, tail_chunk_mb=25.0):
    model = DDP(make_model(), bucket_cap_mb=25)  # one bucket, as gradsync gives PowerSGD on Gloo
    state = None
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        state = PowerSGDHookState(2, dense_from=dense_from, tail_chunk_mb=tail_chunk_mb)
        model.register_comm_hook(state, powersgd_hook)
    out, errors = [], []
    for step in range(steps):
        backward_step(model, rank, step)
        out.append(flat_grad(model.module).clone())
        errors.append(len(state.torch_state.error_dict) if state else 0)
    return out, errors, (state.stats() if state else None)


def test_dense_tail_flushes_the_residual_then_equals_torchs_fp16_hook():
    steps, dense_from = 9, 6
    fp16 = run_ranks(_grads, 2, "fp16", steps)
    tail = run_ranks(_grads, 2, "powersgd", steps, dense_from)
    plain = run_ranks(_grads, 2, "powersgd", dense_from)
    for r in range(2):
        grads, errors, _ = tail[r]
        for step in range(dense_from):  # PowerSGD until the tail, exactly as without it
            assert torch.equal(grads[step], plain[r][0][step])
        assert errors[dense_from - 1] == 1 and errors[dense_from] == 0, "the first dense step flushes the residual"
        assert not torch.allclose(grads[dense_from], fp16[r][0][dense_from], rtol=1e-3, atol=1e-5)
        for step in range(dense_from + 1, steps):
            torch.testing.assert_close(grads[step], fp16[r][0][step], rtol=1e-3, atol=1e-5)
    n = sum(p.numel() for p in make_model().parameters())
    stats = tail[0][2]
    compressed = plain[0][2]["payload_bytes"] - 2 * 4 * n  # the PowerSGD steps after the 2 dense start-up ones
    assert stats["payload_bytes"] == plain[0][2]["payload_bytes"] + (steps - dense_from) * 2 * n
    assert 0 < compressed < (dense_from - 2) * 4 * n


@pytest.mark.parametrize("dense_from", [1, -1])
def test_dense_from_before_the_start_up_is_refused(dense_from):
    with pytest.raises(ValueError, match="dense_from"):
        PowerSGDHookState(2, dense_from=dense_from)


def test_dense_tail_in_chunks_is_bitwise_torchs_fp16_hook_on_two_ranks():
    """The tail all-reduces PowerSGD's single bucket in chunks of the job's DDP bucket size; with two
    ranks each element's sum has two terms, so any chunking gives torch's hook bit for bit."""
    n = sum(p.numel() for p in make_model().parameters())
    chunk_mb = (n // 3 + 1) * 4 / 2 ** 20  # three chunks of float32 elements
    steps, dense_from = 5, 2
    fp16 = run_ranks(_grads, 2, "fp16", steps)
    tail = run_ranks(_grads, 2, "powersgd", steps, dense_from, chunk_mb)
    for r in range(2):
        for step in range(dense_from, steps):  # no residual yet to flush at iteration 2 (dense start-up)
            assert torch.equal(tail[r][0][step], fp16[r][0][step])
    stats = tail[0][2]
    assert stats["collectives"] == dense_from + 3 * (steps - dense_from)


def _several_buckets(rank, world, steps):
    import torch.nn.functional as F
    from every_algorithm import batches, small_model

    from gradsync.algorithms import build_hook

    model = small_model()
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets (a user's DDP with its own bucket size)
    state, hook = build_hook("powersgd", model=model, matrix_approximation_rank=2)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    try:
        for x, y in batches(rank, steps):
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, str(exc)
    return "trained", ""


def test_powersgd_through_build_hook_on_several_gloo_buckets_refuses_on_every_rank_instead_of_hanging():
    """torch's PowerSGD hook launches its second all-reduce from a ``.then`` callback, which Gloo
    runs in different orders on different ranks when several buckets are in flight: before the hook
    checked, this run aborted (size mismatch) or hung until the process-group timeout. Every rank
    must refuse at the first backward with a ValueError that says what to do."""
    import time

    t0 = time.monotonic()
    results = run_ranks(_several_buckets, 2, 6, timeout=60, pg_timeout=20)
    assert time.monotonic() - t0 < 20, "refused well within the process-group timeout"
    for kind, msg in results:
        assert kind == "ValueError", (kind, msg)
        assert "bucket_cap_mb" in msg and "powersgd-overlap" in msg, msg


class _MetaBucket:
    """A GradBucket stand-in on the ``meta`` device (a device other than the CPU, without a GPU)."""

    def buffer(self):
        return torch.empty(6, device="meta")

    def index(self):
        return 1


def test_a_state_loaded_on_the_cpu_moves_to_the_buckets_device_at_its_first_use():
    """What tests/test_cuda_nccl.py saw on an H200: torch's and gradsync's PowerSGD loaded directly
    from a CPU-read checkpoint added CPU residuals to CUDA buckets."""
    residual, q = torch.ones(6), [torch.ones(3, 2), torch.ones(2, 2)]
    errors, memories, other = {1: residual}, {1: q}, {0: torch.ones(2)}
    move_bucket_memories(_MetaBucket(), errors, memories, other)
    assert errors[1].device.type == "meta" and all(t.device.type == "meta" for t in memories[1])
    assert other[0].device.type == "cpu"  # another bucket's entry is left for that bucket
    assert residual.device.type == "cpu" and q[0].device.type == "cpu"  # replaced, not modified


def _joined_or_one_bucket(rank, world, bucket_cap_mb, steps):
    from gradsync.algorithms.joined import joined_hook

    model = DDP(make_model(), bucket_cap_mb=bucket_cap_mb)
    state = PowerSGDHookState(2)
    model.register_comm_hook(state, joined_hook(powersgd_hook))
    out = []
    for step in range(steps):
        backward_step(model, rank, step)
        out.append(flat_grad(model.module).clone())
    return out, len(model.reducer._get_zeros_like_grad_buckets()), state.stats()["wire_bytes"]


def test_joined_hook_on_several_buckets_gives_the_one_bucket_run_exactly():
    """torch's PowerSGD through :func:`joined_hook` on a DDP of several buckets (the online ``auto``'s race
    on a job's own DDP) computes what it computes on one bucket: the same gradients bit for bit on both
    ranks, dense start-up steps and compressed ones (error feedback, warm start), the same wire bytes."""
    steps = 6
    several = run_ranks(_joined_or_one_bucket, 2, 0.002, steps)
    one = run_ranks(_joined_or_one_bucket, 2, 25, steps)
    assert several[0][1] > 2 and one[0][1] == 1, (several[0][1], one[0][1])
    for r in range(2):
        for step in range(steps):
            assert torch.equal(several[r][0][step], one[r][0][step]), (r, step)
        assert several[r][2] == one[r][2]
    assert torch.equal(several[0][0][-1], several[1][0][-1])
