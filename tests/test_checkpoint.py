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
from distributed import RankFailed, run_ranks
from every_algorithm import batches, build_small
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, TensorDataset

from gradsync.train import checkpoint as C
from gradsync.train import checkpoint_files
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
    # the new directory is fsynced in its parent; the temporary file before the rename, the directory after it
    (tmp, dst), = replaced
    assert dst == str(path) and tmp != dst and os.path.dirname(tmp) == str(path.parent)
    assert synced == [str(tmp_path), tmp, str(path.parent)]
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


def _logged(log, rank):
    """Append every rename and unlink this process does (``rank name``) to the file ``log``:
    one shared, append-only record of the order in which the ranks changed the checkpoint."""
    real_replace, real_unlink = os.replace, os.unlink

    def note(what, path):
        with open(log, "a") as f:
            f.write(f"{rank} {what} {os.path.basename(path)}\n")

    def replace(a, b):
        real_replace(a, b)
        note("wrote", b)

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        note("removed", path)

    os.replace, os.unlink = replace, unlink


def _save_twice(rank, world, directory, log):
    _logged(log, rank)
    for attempt in range(2):
        if rank == 1 - attempt:
            time.sleep(1.0)  # the first save: rank 1 is late; the re-save: rank 0 (which removes the manifest)
        C.save_checkpoint(directory, {"rank": rank, "x": torch.full((4,), float(rank + attempt))}, step=12,
                          epoch=1, algorithm="covap")
        with open(log, "a") as f:
            f.write(f"{rank} returned\n")
    return rank


def test_manifest_lists_every_rank_file_and_is_written_after_them_and_removed_before_a_resave(tmp_path):
    log = tmp_path / "log"
    run_ranks(_save_twice, 2, str(tmp_path / "step12"), str(log), timeout=90, pg_timeout=30)
    d = tmp_path / "step12"
    info = C.read_checkpoint_info(d)
    assert (info.step, info.epoch, info.world_size, info.algorithm) == (12, 1, 2, "covap")
    for r in range(2):
        data = (d / f"rank{r}.pt").read_bytes()
        assert info.files[r] == {"name": f"rank{r}.pt", "bytes": len(data),
                                 "sha256": hashlib.sha256(data).hexdigest()}
    assert C.load_checkpoint(d, 1, 2)["x"].tolist() == [2.0] * 4, "the re-saved file"
    events = log.read_text().splitlines()
    first, second = events[:events.index("0 returned")], events[events.index("0 returned"):]
    assert sorted(first[:2]) == ["0 wrote rank0.pt", "1 wrote rank1.pt"] and first[2] == "0 wrote manifest.json"
    # the re-save: the old manifest goes before any rank replaces its file, the new one comes after both
    resave = [e for e in second if "returned" not in e]
    assert resave[0] == "0 removed manifest.json", events
    assert sorted(resave[1:3]) == ["0 wrote rank0.pt", "1 wrote rank1.pt"], events
    assert resave[3] == "0 wrote manifest.json", events
    # every rank returns only once the manifest is written
    assert events.index("1 returned") > events.index("0 wrote manifest.json")


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
    assert "step10: rank0.pt does not match its manifest" in err
    assert "notes" not in err
    assert C.latest_checkpoint(tmp_path / "absent") is None


def test_an_old_manifest_does_not_vouch_for_a_replaced_file_of_the_same_size(tmp_path, capsys):
    root = tmp_path / "ck"
    _write(root, "step2", 2)
    d = _write(root, "step4", 4)
    size = (d / "rank1.pt").stat().st_size
    C.save_rank_file(d, 1, {"r": 1, "step": 5})  # a crash during a re-save: new file, old manifest
    assert (d / "rank1.pt").stat().st_size == size
    info = C.latest_checkpoint(root)
    assert info.path == root / "step2"
    assert "skipping incomplete checkpoint" in capsys.readouterr().err
    data = bytearray((root / "step2" / "rank0.pt").read_bytes())
    data[-30] ^= 0x01  # one flipped bit, same size
    (root / "step2" / "rank0.pt").write_bytes(bytes(data))
    assert C.latest_checkpoint(root) is None
    assert "step2: rank0.pt does not match its manifest" in capsys.readouterr().err


def _kill_self_after(point, rank, when):
    """SIGKILL this process right after the real ``point`` (``"replace"``: a rename; ``"manifest"``:
    :func:`C.write_manifest` is entered, before it writes) once ``when(arg)`` holds."""
    import signal

    if point == "replace":
        real = os.replace

        def replace(a, b):
            real(a, b)
            if when(b):
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace
    else:
        real_manifest = checkpoint_files.write_manifest

        def write_manifest(directory, *args, **kwargs):
            if when(directory):
                os.kill(os.getpid(), signal.SIGKILL)
            return real_manifest(directory, *args, **kwargs)

        checkpoint_files.write_manifest = write_manifest  # where save_checkpoint looks it up


def _save_steps(rank, world, roots, steps, crash=None):
    """Save ``steps`` (checkpoint ``root/step{s}``, payload step s and this process's pid, so a
    re-save differs from the first save but has its size) on every rank; ``crash``: ``(rank,
    point, step)``: that rank kills itself at ``point`` of that step's checkpoint while the others
    are still 5 s behind, and the launcher stops them (as if the machine went down)."""
    if crash is not None and crash[0] == rank:
        _kill_self_after(crash[1], rank, lambda p: f"step{crash[2]}" in str(p))
    for s in steps:
        if crash is not None and rank != crash[0] and s == crash[2]:
            time.sleep(5.0)
        C.save_checkpoint(C.step_dir(roots[rank], s), {"rank": rank, "step": s, "pid": os.getpid(),
                                                       "w": torch.full((64,), s + 0.5)},
                          step=s, epoch=0, algorithm="covap")
    return rank


def _resume_latest(rank, world, roots):
    path = C.resolve_resume("latest", roots[rank], rank)
    return None if path is None else (os.path.basename(path), C.load_checkpoint(path, rank, world)["step"])


@pytest.mark.parametrize("crash, resumed", [((0, "manifest", 6), 4), ((1, "replace", 4), 2)],
                         ids=["between-files-and-manifest", "during-a-resave"])
def test_a_crash_while_saving_resumes_from_a_checkpoint_that_verifies(tmp_path, capfd, crash, resumed):
    """A new checkpoint (step 6) cut off after its files, before its manifest, is skipped with a
    warning; so is a re-save of step 4 (as a resumed run does) cut off after rank 1 replaced its file:
    no rank replaces a file before the old manifest is gone, so it never vouches for a new file (the
    old code let rank 1 replace first: step 4 was picked, then failed its checksum on load)."""
    roots = [str(tmp_path / "ck")] * 2
    run_ranks(_save_steps, 2, roots, [2, 4], timeout=90, pg_timeout=30)
    with pytest.raises(RankFailed, match="SIGKILL"):
        run_ranks(_save_steps, 2, roots, [crash[2]], crash, timeout=90, pg_timeout=10)
    capfd.readouterr()
    assert run_ranks(_resume_latest, 2, roots, timeout=90, pg_timeout=30) == [(f"step{resumed}", resumed)] * 2
    err = capfd.readouterr().err
    assert f"skipping incomplete checkpoint {tmp_path / 'ck' / f'step{crash[2]}'}: no manifest.json" in err, err


def _per_rank_dirs(rank, world, roots):
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # every rank a node of its own, with a directory of its own
    _save_steps(rank, world, roots, [2, 4, 6])
    return sorted(os.listdir(C.step_dir(roots[rank], 6)))


def test_without_a_shared_filesystem_the_ranks_agree_on_the_newest_step_verified_everywhere(tmp_path, capfd):
    roots = [str(tmp_path / f"node{r}") for r in range(2)]
    assert run_ranks(_per_rank_dirs, 2, roots, timeout=90, pg_timeout=30) == [
        ["manifest.node0.json", "rank0.pt"], ["manifest.node1.json", "rank1.pt"]]
    assert run_ranks(_resume_latest, 2, roots, timeout=90, pg_timeout=30) == [("step6", 6)] * 2
    # node 1's step 6 is corrupted (same size), node 0's step 4 lost its manifest: step 2 is the
    # newest checkpoint that verifies on both
    f = tmp_path / "node1" / "step6" / "rank1.pt"
    data = bytearray(f.read_bytes())
    data[-40] ^= 0x01
    f.write_bytes(bytes(data))
    os.unlink(tmp_path / "node0" / "step4" / "manifest.node0.json")
    capfd.readouterr()
    assert run_ranks(_resume_latest, 2, roots, timeout=90, pg_timeout=30) == [("step2", 2)] * 2
    err = capfd.readouterr().err
    assert f"{tmp_path / 'node1' / 'step6'}: rank1.pt does not match its manifest" in err, err
    assert f"{tmp_path / 'node0' / 'step4'}: no manifest.json" in err, err
    assert "skipping checkpoint step4: it verifies on rank(s) [1] only, not on all 2" in err, err


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
            # algorithms' state_dict() is already in the safe form, which the load undoes
            diffs = _same(C.from_safe(payload), back)
            dp.load_state_dict(back["algorithm"])  # the restored types are accepted
            out[name] = diffs
        except Exception as exc:  # noqa: BLE001 - reported per algorithm
            out[name] = [f"{type(exc).__name__}: {str(exc)[-300:]}"]
        dp.close()
        dist.barrier()
    return out


def test_every_algorithm_state_round_trips_with_weights_only(tmp_path):
    from every_algorithm import installed_algorithms

    names = installed_algorithms()
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


# ------------------------------------------------------------------------------- failed saves


def _save_with_a_full_disk(rank, world, root, failing):
    import errno

    if rank == failing:
        def full(path, data):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        checkpoint_files._atomic_write = full  # this forked rank only
    t0 = time.monotonic()
    try:
        C.save_checkpoint(f"{root}/step3", {"rank": rank, "w": torch.ones(4)}, step=3, epoch=0, algorithm="covap")
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, str(exc), isinstance(exc, OSError), time.monotonic() - t0
    return "saved", "", False, time.monotonic() - t0


def test_a_write_failing_on_one_rank_raises_on_every_rank_promptly(tmp_path):
    """Rank 1's disk is full: before the ranks agreed on each step's outcome, rank 1 raised and rank
    0 waited in the digest gather until the process-group timeout (20 s here); now both raise
    CheckpointSaveError (an OSError) naming rank 1's error, and no manifest vouches for the step."""
    results = run_ranks(_save_with_a_full_disk, 2, str(tmp_path), 1, timeout=60, pg_timeout=20)
    for kind, msg, is_os_error, seconds in results:
        assert kind == "CheckpointSaveError" and is_os_error, (kind, msg)
        assert "rank 1: OSError" in msg and "No space left on device" in msg, msg
        assert seconds < 5.0, f"raised after {seconds:.1f} s"
    assert not list((tmp_path / "step3").glob("manifest*.json"))
