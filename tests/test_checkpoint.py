"""Checkpoints: atomic durable rank files, a manifest written last, newest-complete selection,
weights_only loading of every algorithm's state, and the resume position of the data iterator."""

import hashlib
import io
import json
import math
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from every_algorithm import batches, build_small
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from gradsync.train import checkpoint as C
from gradsync.train.config import TrainConfig


def _payload(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(5, 3, generator=g), "step": 7, "cfg": {"a": 1.5, "b": None, "t": (1, "x")}}


# ---------------------------------------------------------------------------------------- atomic


def test_rank_file_is_written_atomically_and_fsynced(tmp_path, monkeypatch):
    synced, replaced = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((str(a), str(b))), real_replace(a, b))[1])
    entry = C.save_rank_file(tmp_path / "ck", 3, _payload())
    path = tmp_path / "ck" / "rank3.pt"
    assert entry == {"name": "rank3.pt", "bytes": path.stat().st_size,
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    # the temporary file is fsynced before the rename, the directory after it
    (tmp, dst), = replaced
    assert dst == str(path) and tmp != dst and os.path.dirname(tmp) == str(path.parent)
    assert synced == [tmp, str(path.parent)]
    assert os.listdir(path.parent) == ["rank3.pt"], "no temporary file left behind"
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["w"], _payload()["w"]) and back["cfg"] == _payload()["cfg"]


def test_crash_before_rename_keeps_the_old_file(tmp_path, monkeypatch):
    C.save_rank_file(tmp_path, 0, _payload(0))
    before = (tmp_path / "rank0.pt").read_bytes()

    def crash(a, b):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        C.save_rank_file(tmp_path, 0, _payload(1))
    assert (tmp_path / "rank0.pt").read_bytes() == before


# -------------------------------------------------------------------------------------- manifest


def _save_two_ranks(rank, world, directory):
    if rank == 1:
        time.sleep(1.0)  # rank 0 must wait for this file before writing the manifest
    C.save_checkpoint(directory, {"rank": rank, "x": torch.full((4,), float(rank))}, step=12, epoch=1,
                      algorithm="covap")
    return rank


def test_manifest_lists_every_rank_file_and_is_written_last(tmp_path):
    run_ranks(_save_two_ranks, 2, str(tmp_path / "step12"), timeout=90, pg_timeout=30)
    d = tmp_path / "step12"
    info = C.read_checkpoint_info(d)
    assert (info.step, info.epoch, info.world_size, info.algorithm) == (12, 1, 2, "covap")
    for r in range(2):
        data = (d / f"rank{r}.pt").read_bytes()
        assert info.files[r] == {"name": f"rank{r}.pt", "bytes": len(data),
                                 "sha256": hashlib.sha256(data).hexdigest()}
        assert (d / C.MANIFEST).stat().st_mtime_ns >= (d / f"rank{r}.pt").stat().st_mtime_ns
    assert C.load_checkpoint(d, 1, 2)["x"].tolist() == [1.0] * 4


def _write(root, name, step, ranks=2, manifest=True, created=None):
    d = root / name
    entries = [C.save_rank_file(d, r, {"r": r, "step": step}) for r in range(ranks)]
    if manifest:
        C.write_manifest(d, entries, step=step, epoch=0, algorithm="allreduce")
        if created is not None:
            doc = json.loads((d / C.MANIFEST).read_text())
            doc["created"] = created
            (d / C.MANIFEST).write_text(json.dumps(doc))
    return d


def test_latest_picks_newest_complete_and_skips_incomplete_with_warning(tmp_path, capsys):
    root = tmp_path / "ck"
    _write(root, "step4", 4)
    _write(root, "epoch1", 5)
    _write(root, "step8", 8, manifest=False)                  # a rank died before the manifest
    gone = _write(root, "step9", 9)
    (gone / "rank1.pt").unlink()                              # a file went missing
    short = _write(root, "step10", 10)
    (short / "rank0.pt").write_bytes((short / "rank0.pt").read_bytes()[:-5])  # truncated
    (root / "notes").mkdir()                                  # not a checkpoint: ignored
    info = C.latest_checkpoint(root)
    assert info.path == root / "epoch1" and info.step == 5
    err = capsys.readouterr().err
    assert "skipping incomplete checkpoint" in err
    assert "step8: no manifest.json" in err and "rank1.pt of rank 1 is missing" in err
    assert "has 1" in err and "manifest says" in err
    assert "notes" not in err
    assert C.latest_checkpoint(tmp_path / "absent") is None


def test_latest_breaks_step_ties_by_manifest_time(tmp_path):
    _write(tmp_path, "epoch2", 10, created=100.0)
    _write(tmp_path, "step10", 10, created=200.0)
    assert C.latest_checkpoint(tmp_path).path.name == "step10"


def test_resolve_resume(tmp_path, capsys):
    assert C.resolve_resume(None, None) is None
    assert C.resolve_resume("/some/dir", None) == "/some/dir"
    with pytest.raises(ValueError, match="checkpoint"):
        C.resolve_resume("latest", None)
    assert C.resolve_resume("latest", str(tmp_path)) is None
    assert "no complete checkpoint" in capsys.readouterr().err
    _write(tmp_path, "step3", 3)
    assert C.resolve_resume("latest", str(tmp_path)) == str(tmp_path / "step3")


def test_load_checks_digest_world_size_and_warns_without_manifest(tmp_path, capsys):
    d = _write(tmp_path, "step4", 4)
    assert C.load_checkpoint(d, 1, 2) == {"r": 1, "step": 4}
    with pytest.raises(ValueError, match="written by 2 ranks, this run has 4"):
        C.load_checkpoint(d, 1, 4)
    data = bytearray((d / "rank1.pt").read_bytes())
    data[-30] ^= 0xFF  # same size, other content
    (d / "rank1.pt").write_bytes(bytes(data))
    with pytest.raises(C.IncompleteCheckpoint, match="SHA-256"):
        C.load_checkpoint(d, 1, 2)
    with pytest.raises(FileNotFoundError, match="rank5.pt not found"):
        C.load_checkpoint(d, 5)
    old = _write(tmp_path, "epoch1", 3, manifest=False)  # as written by an older gradsync
    assert C.load_checkpoint(old, 0) == {"r": 0, "step": 3}
    assert "has no manifest.json" in capsys.readouterr().err


def test_config_checkpoint_fields():
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainConfig(checkpoint_every=5)
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainConfig(checkpoint="/tmp/x", checkpoint_every=0)
    with pytest.raises(ValueError, match="resume 'latest' needs checkpoint"):
        TrainConfig(resume="latest")
    assert TrainConfig(checkpoint="/tmp/x", checkpoint_every=5, resume="latest").checkpoint_every == 5


# ---------------------------------------------------------------------------------- weights_only


class _Opaque:
    pass


def test_numpy_state_is_stored_loadable_and_restored(tmp_path):
    rs = np.random.RandomState(3)
    rs.rand(5)
    payload = {"counts": np.arange(6, dtype=np.float64).reshape(2, 3), "n": np.int32(4),
               "rng": rs, "nested": [(np.ones(2, dtype=np.uint8), 1)]}
    raw = io.BytesIO()
    torch.save(payload, raw)
    raw.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(raw, weights_only=True)  # why the conversion exists
    C.save_rank_file(tmp_path, 0, payload)
    back = C.load_checkpoint(tmp_path, 0)
    assert back["counts"].dtype == np.float64 and np.array_equal(back["counts"], payload["counts"])
    assert type(back["n"]) is np.int32 and back["n"] == 4
    assert back["rng"].rand() == rs.rand()
    assert isinstance(back["nested"][0], tuple) and back["nested"][0][0].dtype == np.uint8


def test_unloadable_type_is_named_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"payload\.algorithm\.x is a .*_Opaque"):
        C.save_rank_file(tmp_path, 0, {"algorithm": {"x": _Opaque()}})
    assert not (tmp_path / "rank0.pt").exists()


def test_module_state_dict_metadata_survives(tmp_path):
    m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    C.save_rank_file(tmp_path, 0, {"model": m.state_dict()})
    back = C.load_checkpoint(tmp_path, 0)["model"]
    assert back._metadata == m.state_dict()._metadata


def _same(a, b, path=""):
    """Differences between ``a`` and ``b`` (tensors and numpy arrays compared exactly, with dtype)."""
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b) else [path]
    if isinstance(a, np.random.RandomState):
        sa, sb = a.get_state(), b.get_state()
        return [] if sa[0] == sb[0] and np.array_equal(sa[1], sb[1]) and sa[2:] == sb[2:] else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [path + " (keys)"]
        return [d for k in a for d in _same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [path + " (container)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{path}[{i}]")]
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return [] if a == b or both_nan else [f"{path}: {a!r} != {b!r}"]


def _every_algorithm(rank, world, names, root):
    out = {}
    for name in names:
        dp = build_small(name)
        sched = torch.optim.lr_scheduler.OneCycleLR(dp.optimizer, max_lr=0.05, total_steps=20)
        data = batches(rank, 8)
        dp.warm_up(data[:2], F.cross_entropy)
        for x, y in data:
            dp.train_step(x, y, F.cross_entropy)
            sched.step()
            dp.observe_step(0.08, 8)
        dp.flush()
        payload = {"algorithm": dp.state_dict(), "optimizer": dp.optimizer.state_dict(),
                   "scheduler": sched.state_dict(), "rng": C.rng_state(), "model": dp.module.state_dict(),
                   "config": TrainConfig(algorithm=name).to_dict()}
        try:
            C.save_checkpoint(f"{root}/{name}", payload, step=8, epoch=2, algorithm=name)
            back = C.load_checkpoint(f"{root}/{name}", rank, world)
            diffs = _same(payload, back)
            dp.load_state_dict(back["algorithm"])  # the restored types are accepted
            out[name] = diffs
        except Exception as exc:  # noqa: BLE001 - reported per algorithm
            out[name] = [f"{type(exc).__name__}: {str(exc)[-300:]}"]
        dp.close()
        dist.barrier()
    return out


def test_every_algorithm_state_round_trips_with_weights_only(tmp_path):
    from gradsync.algorithms import REGISTRY

    names = sorted(REGISTRY)
    results = run_ranks(_every_algorithm, 2, names, str(tmp_path), timeout=240, pg_timeout=60)
    for rank, res in enumerate(results):
        bad = {n: d for n, d in res.items() if d}
        assert not bad, f"rank {rank}: {bad}"
    assert set(results[0]) == set(names)


# -------------------------------------------------------------------------------- resume position


def test_resume_batches_continues_the_data_and_rng_of_the_uninterrupted_epoch():
    ds = TensorDataset(torch.arange(40).float().reshape(20, 2), torch.arange(20))
    order = torch.randperm(20, generator=torch.Generator().manual_seed(1)).tolist()  # as DistributedSampler
    loader = DataLoader(ds, sampler=BatchSampler(order, 4, drop_last=True), batch_size=None)

    def train(it, steps, ckpt_at=None):
        seen, ckpt = [], None
        for i, (x, y) in enumerate(it):
            if i == steps:
                break
            seen.append((y.tolist(), torch.rand(1).item()))  # the step draws from the global RNG
            if ckpt_at == i + 1:
                ckpt = {"epoch_step": i + 1, "rng": C.rng_state()}
        return seen, ckpt

    torch.manual_seed(5)
    full, ckpt = train(C.resume_batches(loader, None), 5, ckpt_at=2)
    torch.manual_seed(99)  # a resumed process starts with other RNG state
    rest, _ = train(C.resume_batches(loader, ckpt), 5)
    assert rest == full[2:]
    # an end-of-epoch checkpoint restores the RNG before the next epoch's iterator is made
    torch.manual_seed(5)
    train(iter(loader), 5)
    end = {"epoch_step": 0, "rng": C.rng_state()}
    nxt, _ = train(iter(loader), 5)
    torch.manual_seed(99)
    assert train(C.resume_batches(loader, end), 5)[0] == nxt
