"""``torchft-diloco`` (issue 33): torchft 0.2.0's own DiLoCo as a peer of gradsync's ``diloco``, on real
2-rank Gloo groups on 127.0.0.1 (each rank its own torchft replica group, a lighthouse started by rank 0).

What is checked: when the ranks agree (right after each sync, bitwise, and only then), that the counted
wire bytes are those of the tensors torchft really hands to its all-reduce (one all-reduce of the
parameters per full sync), that its parameters equal gradsync's ``diloco`` with the same options from the
same start, bitwise at P = 2 (see :mod:`gradsync.algorithms.periodic.torchft_peer` for why), that a
checkpointed run resumes bitwise, that ``close`` leaves no lighthouse and no non-daemon thread; and,
without torchft, the error that names the extra. The distributed tests skip where torchft is not
importable.
"""

from __future__ import annotations

import socket
import sys
import threading
import urllib.parse

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from gradsync.algorithms import BuildContext, build, make_options
from gradsync.comm.collectives import wire_bytes

PERIOD, STEPS = 4, 8


def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="needs the torchft extra: pip install 'gradsync[torchft]'")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10))  # no buffers: torchft syncs none


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def _build(name: str, model: nn.Module | None = None, **options):
    ctx = BuildContext(model=_model() if model is None else model,
                       make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    return build(name, ctx, options)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _same_on_every_rank(t: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], other) for other in every[1:])


def _schedule(rank, world, steps):
    """torchft-diloco at period 4: per step, whether the ranks agree bitwise, the counted wire and
    payload bytes, and the bytes of the tensors torchft's Manager.allreduce was handed; after close,
    whether the lighthouse still accepts connections and the non-daemon threads left."""
    from torchft.manager import Manager

    sent = []
    allreduce = Manager.allreduce

    def recording(self, tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return allreduce(self, tensor, *args, **kwargs)

    Manager.allreduce = recording
    try:
        dp = _build("torchft-diloco", period=PERIOD)
        same, wire, payload, handed = [], [], [], []
        for s in range(steps):
            before = dp.stats()
            n = len(sent)
            dp.train_step(*_batch(rank, s), F.cross_entropy)
            after = dp.stats()
            same.append(_same_on_every_rank(_flat(dp.module), world))
            wire.append(after["wire_bytes"] - before["wire_bytes"])
            payload.append(after["payload_bytes"] - before["payload_bytes"])
            handed.append(sum(sent[n:]))
        stats = dp.stats()
        address = urllib.parse.urlparse(dp.algorithm.lighthouse_address)
        dp.close()
    finally:
        Manager.allreduce = allreduce
    dist.barrier()  # rank 0 shuts the lighthouse after close's own barrier
    try:
        socket.create_connection((address.hostname, address.port), timeout=2).close()
        lighthouse_up = True
    except OSError:
        lighthouse_up = False
    threads = [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()]
    return {"same": same, "wire": wire, "payload": payload, "handed": handed, "stats": stats,
            "lighthouse_up": lighthouse_up, "threads": threads}


def test_ranks_agree_right_after_each_sync_and_the_bytes_are_one_parameter_all_reduce_per_sync():
    _needs_torchft()
    results = run_ranks(_schedule, 2, STEPS, timeout=120)
    param_bytes = sum(p.numel() * p.element_size() for p in _model().parameters())
    syncs = [(s + 1) % PERIOD == 0 for s in range(STEPS)]
    for rank, r in enumerate(results):
        # bitwise identical parameters right after the syncs (steps 4, 8), different at every other step
        assert r["same"] == syncs, (rank, r["same"])
        # what is counted is what torchft hands to its all-reduce: every parameter, once per sync
        assert r["handed"] == [param_bytes if s else 0 for s in syncs], r["handed"]
        assert r["payload"] == r["handed"]
        per_sync = wire_bytes("allreduce", param_bytes, 2)  # 2 (P-1)/P x n
        assert r["wire"] == [pytest.approx(per_sync) if s else 0.0 for s in syncs], r["wire"]
        st = r["stats"]
        assert st["syncs"] == 2 and st["torchft_step"] == 2 and st["outer_steps_skipped"] == 0
        assert st["iteration"] == STEPS and st["collectives"] == 2 * 4  # one all-reduce per tensor (4)
        assert not r["lighthouse_up"] and r["threads"] == [], r


def _against_diloco(rank, world, steps, options):
    """diloco and torchft-diloco with the same options, from the same start (rank 0's model broadcast by
    both), on the same batches: whether their parameters are bitwise equal after every step."""
    runs = {}
    for name in ("diloco", "torchft-diloco"):
        torch.manual_seed(100 + rank)  # a different start on each rank: both must broadcast rank 0's
        model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10))
        dp = _build(name, model, **options)
        flats = []
        for s in range(steps):
            dp.train_step(*_batch(rank, s), F.cross_entropy)
            flats.append(_flat(dp.module))
        runs[name] = {"flats": flats, "wire": dp.stats()["wire_bytes"]}
        dp.close()
        dist.barrier()
    a, b = runs["diloco"], runs["torchft-diloco"]
    return {"equal": [torch.equal(x, y) for x, y in zip(a["flats"], b["flats"])],
            "max_diff": max((x - y).abs().max().item() for x, y in zip(a["flats"], b["flats"])),
            "wire": (a["wire"], b["wire"])}


@pytest.mark.parametrize("fragments", [1, 2])
def test_matches_gradsync_diloco_bitwise_at_two_ranks(fragments):
    _needs_torchft()
    options = {"period": PERIOD, "outer_lr": 0.7, "outer_momentum": 0.9, "fragments": fragments}
    for r in run_ranks(_against_diloco, 2, STEPS, options, timeout=120):
        # the same outer Nesterov step on the same averaged deltas: torchft sums then halves, diloco halves
        # then sums, exact either way at P = 2; so bitwise at every step, through 2 outer steps per fragment
        assert r["equal"] == [True] * STEPS, r
        assert r["wire"][0] == r["wire"][1] > 0  # no buffers: the same bytes on the wire


def _resume(rank, world, steps, cut, options):
    """Parameters after ``steps`` uninterrupted steps and after ``cut`` steps, a checkpoint (model, inner
    optimizer, algorithm), a fresh build that loads it, and ``steps - cut`` more steps."""
    dp = _build("torchft-diloco", **options)
    for s in range(steps):
        dp.train_step(*_batch(rank, s), F.cross_entropy)
    full = _flat(dp.module)
    dp.close()
    dp = _build("torchft-diloco", **options)
    for s in range(cut):
        dp.train_step(*_batch(rank, s), F.cross_entropy)
    saved = {"model": dp.module.state_dict(), "optimizer": dp.optimizer.state_dict(), "algorithm": dp.state_dict()}
    dp.close()
    torch.manual_seed(7)  # not the start model: everything must come from the checkpoint
    dp = _build("torchft-diloco", nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 10)), **options)
    dp.module.load_state_dict(saved["model"])
    dp.optimizer.load_state_dict(saved["optimizer"])
    dp.load_state_dict(saved["algorithm"])
    for s in range(cut, steps):
        dp.train_step(*_batch(rank, s), F.cross_entropy)
    resumed = _flat(dp.module)
    stats = dp.stats()
    dp.close()
    return {"equal": torch.equal(full, resumed), "torchft_step": stats["torchft_step"], "syncs": stats["syncs"]}


def test_a_run_checkpointed_mid_period_resumes_bitwise():
    _needs_torchft()
    # period 4, 2 fragments: cut after step 3 (fragment 0 synced at 2); the resumed run must sync fragment
    # 1 at step 4 (torchft's manager step, restored, picks it), then 0 at 6
    for r in run_ranks(_resume, 2, 6, 3, {"period": PERIOD, "fragments": 2}, timeout=120):
        assert r == {"equal": True, "torchft_step": 3, "syncs": 3}, r


def test_options_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"torchft-diloco\.fragments must divide period=4 .*got 3"):
        make_options("torchft-diloco", {"period": 4, "fragments": 3})
    with pytest.raises(ValueError, match=r"torchft-diloco\.outer_momentum must be in \[0\.0, 1\.0\), got 1\.0"):
        make_options("torchft-diloco", {"outer_momentum": 1.0})
    with pytest.raises(ValueError, match=r"torchft-diloco\.torchft_timeout must be in \(0\.0, 86400\.0\]"):
        make_options("torchft-diloco", {"torchft_timeout": 0})
    opts = make_options("torchft-diloco", {"period": 16})
    assert (opts.period, opts.outer_lr, opts.outer_momentum, opts.fragments) == (16, 0.7, 0.9, 1)


def test_without_torchft_the_build_names_the_extra(monkeypatch):
    # None in sys.modules makes `import torchft.manager` fail as an uninstalled package does; no group is
    # needed: the import comes before any collective
    monkeypatch.setitem(sys.modules, "torchft.manager", None)
    with pytest.raises(ImportError, match=r"^torchft-diloco needs the torchft extra: "
                                          r"pip install 'gradsync\[torchft\]'$"):
        _build("torchft-diloco", period=4)
