"""The profile type (gradsync.sim.profile.Profile): JSON save/load, mapping access, derived profiles,
and the profiler returning it (gradsync.profiler.profile.record_profile)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gradsync.profiler.profile import ccr_at, record_profile
from gradsync.sim import Network, Profile, allreduce_time, load_profile, simulate, synthetic_profile

GOOD = {
    "schema": "gradsync-profile/1", "model": "m", "batch_size": 8, "dtype_bytes": 4,
    "forward_s": 0.01, "backward_s": 0.03, "optimizer_s": 0.002,
    "buckets": [{"index": 0, "numel": 600, "ready_s": 0.012, "shapes": [[20, 30]]},
                {"index": 1, "numel": 50, "ready_s": 0.03}],
    "device": "cpu",
}


def test_save_load_and_mapping_access(tmp_path):
    prof = Profile.load(GOOD)
    path = prof.save(tmp_path / "p.json")
    again = Profile.load(path)
    assert again == prof and isinstance(again, Profile)
    assert json.loads((tmp_path / "p.json").read_text()) == prof.to_dict()
    # dict-style access over the JSON form, as the profile dict had
    assert prof["forward_s"] == 0.01 and prof["dtype_bytes"] == 4 and prof["device"] == "cpu"
    assert prof["buckets"][0] == {"index": 0, "numel": 600, "ready_s": 0.012, "shapes": [[20, 30]]}
    assert dict(prof) == prof.to_dict() and set(prof) == set(GOOD) and "buckets" in prof
    assert load_profile(dict(prof)) == prof
    with pytest.raises(KeyError):
        prof["nope"]
    with pytest.raises(TypeError):
        prof["forward_s"] = 1.0  # read-only


def test_with_meta_and_scale_compute():
    prof = load_profile(GOOD)
    tagged = prof.with_meta(ccr={"world_size": 4})
    assert tagged["ccr"] == {"world_size": 4} and tagged.meta["device"] == "cpu" and "ccr" not in prof
    with pytest.raises(ValueError, match="forward_s"):
        prof.with_meta(forward_s=1.0)
    half = prof.scale_compute(0.5)
    assert half.forward_s == 0.005 and half.backward_s == 0.015 and half.optimizer_s == 0.001
    assert [b.ready_s for b in half.buckets] == [0.006, 0.015]
    assert [b.numel for b in half.buckets] == [600, 50] and half.buckets[0].shapes == ((20, 30),)
    net = Network.from_mbit(100)
    # halving compute at the same network: compute halves, communication does not
    assert simulate(half, "dense", 4, net).compute_s == pytest.approx(prof.compute_s / 2)
    with pytest.raises(ValueError, match="factor"):
        prof.scale_compute(0.0)


def test_ccr_at_takes_profile_or_dict():
    prof = synthetic_profile([1000, 3000], 0.01, 0.02)
    net = Network.from_mbit(10)
    want = (allreduce_time(4000, 4, net) + allreduce_time(12000, 4, net)) / 0.02
    assert ccr_at(prof, 4, 10) == pytest.approx(want)
    assert ccr_at(prof.to_dict(), 4, 10) == pytest.approx(want)


def test_record_profile_returns_a_profile(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)

    def batch():
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    prof = record_profile(model, batch, nn.functional.cross_entropy,
                          lambda p: torch.optim.SGD(p, lr=0.1), "tiny", 8, bucket_cap_mb=0.001, iterations=2)
    assert isinstance(prof, Profile)
    assert prof.model == "tiny" and prof.batch_size == 8 and prof.dtype_bytes == 4
    assert prof.total_numel == sum(p.numel() for p in model.parameters())
    assert all(0 <= b.ready_s <= prof.backward_s for b in prof.buckets)
    assert prof.meta["bucket_cap_mb"] == 0.001 and prof["device"] == "cpu"
    # parameter shapes of each bucket add up to its size
    assert sorted(s for b in prof.buckets for s in b.shapes) == sorted(tuple(p.shape) for p in model.parameters())
    assert Profile.load(prof.save(tmp_path / "p.json")) == prof


def test_record_profile_reads_the_one_synchronising_clock_of_the_models_devices(monkeypatch):
    """Before, record_profile read ``time.perf_counter`` directly (on CUDA: kernel launches, not the
    compute, which inflated auto's CCR) and labelled every profile ``cpu``. It must time with
    :func:`~gradsync.profiler.compute.device_clock` built for the model (which synchronises its CUDA
    devices; ``test_cuda_nccl.py`` checks the times on a GPU) and label the model's device."""
    from gradsync.profiler import compute, profile

    built, reads = [], []
    real = compute.device_clock

    def counting(*sources):
        built.append(sources)
        clock = real(*sources)
        return lambda: (reads.append(1), clock())[1]

    monkeypatch.setattr(compute, "device_clock", counting)
    monkeypatch.setattr(profile, "device_clock", counting, raising=False)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    prof = record_profile(model, lambda: (torch.randn(8, 16), torch.randint(0, 4, (8,))), nn.functional.cross_entropy,
                          lambda p: torch.optim.SGD(p, lr=0.1), "tiny", 8, bucket_cap_mb=0.001, iterations=2)
    assert any(model in s for s in built), built
    buckets = len(prof.buckets)
    assert len(reads) >= 4 * (2 + 2) + buckets * 2, "forward, backward, optimizer and every bucket's ready time"
    assert prof["device"] == str(next(model.parameters()).device)


def test_device_clock_synchronises_each_cuda_device_of_its_sources(monkeypatch):
    from gradsync.profiler.compute import device_clock

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    device_clock(nn.Linear(2, 2), None, torch.device("cpu"))()
    assert synced == []
    device_clock(torch.device("cuda", 1), "cuda:1", None)()
    assert synced == [torch.device("cuda", 1)]


def _profile_on_two_ranks(rank, world):
    torch.manual_seed(rank)  # a different model on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    record_profile(model, lambda: (x, y), nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.0),
                   "mlp", 8, iterations=1)
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_record_profile_in_a_job_sends_no_model_over_the_network():
    """auto profiles a copy of the job's model on the job's group: DDP's broadcast of the model at
    construction was most of that phase on a slow link (1 s of 1.3 s, the GRU at 5 Mbit/s)."""
    from distributed import run_ranks

    assert run_ranks(_profile_on_two_ranks, 2, timeout=120) == [True, True], "rank 1 received rank 0's model"
