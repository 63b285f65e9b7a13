"""The local launcher (gradsync.launch.LocalRanks): results, environment, progress, and which rank
is named when one dies."""

import gc
import os
import signal
import sys
import time

import pytest

from gradsync.launch import LocalRanks, RankExit, RankFailure, imports_without_collection, rank_progress
from gradsync.train.launcher import TrainingFailed, resume_command


def _env_and_steps(rank, world, keys):
    progress = rank_progress()
    for step in range(1, 4 + rank):
        progress.report(step)
    return {k: os.environ.get(k) for k in keys}


KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "EXTRA")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_function_ranks_return_results_with_the_distributed_environment(start_method):
    with LocalRanks(3, socket_ifname=lambda r: f"if{r}", env={"EXTRA": "x"}) as ranks:
        ranks.start_function(_env_and_steps, (KEYS,), start_method=start_method)
        results = ranks.join(timeout=120)
        assert ranks.steps() == {0: 3, 1: 4, 2: 5}
    for r, env in enumerate(results):
        assert env == {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(ranks.port), "GLOO_SOCKET_IFNAME": f"if{r}", "EXTRA": "x"}


def _frozen(rank, world):
    return gc.get_freeze_count()


def test_forked_ranks_freeze_what_they_inherit_and_the_launcher_does_not():
    young = [[i] for i in range(1000)]  # tracked, not frozen in this process
    before = gc.get_freeze_count()
    counts = run_ranks_of(_frozen)
    assert gc.get_freeze_count() == before, "the launcher's own collections are unchanged"
    assert all(c >= before + len(young) for c in counts), (counts, before)


def _start_up(rank, world):
    gc.unfreeze()  # as a fresh interpreter: nothing frozen yet
    with imports_without_collection():
        paused = not gc.isenabled()
        imported = [[i] for i in range(1000)]
    return paused, gc.isenabled(), gc.get_freeze_count() >= len(imported)


def test_imports_pause_the_collector_and_freeze_only_at_start_up():
    assert run_ranks_of(_start_up) == [(True, True, True)] * 2
    before = gc.get_freeze_count()  # this worker froze at start-up (conftest): a later call pins nothing
    with imports_without_collection():
        assert not gc.isenabled()
        [[i] for i in range(1000)]
    assert gc.isenabled() and gc.get_freeze_count() == before


def run_ranks_of(fn):
    with LocalRanks(2) as ranks:
        ranks.start_function(fn, start_method="fork")
        return ranks.join(timeout=120)


def _die(rank, world, how):
    rank_progress().report(7 if rank == 0 else 5)
    if rank == 1 and how != "sleep":
        if how == "kill-late":  # the peer's error is seen first, the death within the grace period
            time.sleep(0.2)
        if how.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        raise ValueError("bad value\nsecond line")
    if how.startswith("kill") and rank == 0:
        time.sleep(0.1 if how == "kill" else 0.0)  # a peer noticing the dead rank raises afterwards: not the one to blame
        raise RuntimeError("Connection closed by peer")
    time.sleep(60)


@pytest.mark.parametrize("how, phrase", [
    ("kill", "rank 1 was killed by SIGKILL"),
    ("kill-late", "rank 1 was killed by SIGKILL"),
    ("exit", "rank 1 exited with code 3"),
    ("raise", "rank 1 raised ValueError: bad value (at test_launch.py:"),
])
def test_the_failed_rank_is_named_and_the_others_stopped(how, phrase):
    t0 = time.monotonic()
    with LocalRanks(3) as ranks:
        ranks.start_function(_die, (how,))
        with pytest.raises(RankFailure) as info:
            ranks.join(timeout=60)
    assert time.monotonic() - t0 < 20, "the sleeping rank was stopped, not waited for"
    exc = info.value
    assert exc.failed.rank == 1 and exc.failed.describe().startswith(phrase)
    assert str(exc).startswith(phrase) and "last step completed by every rank: 5" in str(exc)
    assert exc.last_step == 5
    assert exc.exits[2].stopped and exc.exits[2].signal == "SIGTERM" and not exc.exits[2].failed
    if how == "raise":
        assert "Traceback" in exc.failed.traceback and exc.failed.exitcode == 1


def test_timeout_is_reported():
    with LocalRanks(2) as ranks:
        ranks.start_function(_die, ("sleep",))
        with pytest.raises(RankFailure, match="ranks did not finish within 2 s") as info:
            ranks.join(timeout=2)
    assert info.value.timed_out


def test_command_ranks_get_their_argv_environment_and_report_the_log_tail(tmp_path):
    script = ("import os, sys\n"
              "r = int(os.environ['RANK'])\n"
              "open(sys.argv[1] + f'/out{r}', 'w').write(os.environ['GLOO_SOCKET_IFNAME'] + ' ' + sys.argv[2])\n"
              "print('rank', r, 'failing', file=sys.stderr)\n"
              "sys.exit(4 if r == 1 else 0)\n")
    with LocalRanks(2, socket_ifname=lambda r: f"eth{r}") as ranks:
        ranks.start_command(lambda r: [sys.executable, "-c", script, str(tmp_path), f"arg{r}"])
        with pytest.raises(RankFailure) as info:
            ranks.join(timeout=60)
    assert info.value.failed.describe() == "rank 1 exited with code 4"
    assert str(info.value).endswith("rank 1 failing")
    assert [(tmp_path / f"out{r}").read_text() for r in range(2)] == ["eth0 arg0", "eth1 arg1"]


def test_progress_outside_a_launcher_does_nothing(monkeypatch):
    monkeypatch.delenv("GRADSYNC_PROGRESS_DIR", raising=False)
    rank_progress().report(3)  # no error, no file


def test_training_report_and_resume_command(tmp_path):
    from gradsync.train import checkpoint as C

    d = tmp_path / "step6"
    C.write_manifest(d, [C.save_rank_file(d, 0, {"x": 1})], step=6, epoch=0, algorithm="covap")
    failure = RankFailure(RankExit(1, -9), {0: RankExit(0, -15, stopped=True), 1: RankExit(1, -9)}, {0: 7, 1: 7})
    report = TrainingFailed(failure, str(tmp_path)).report(
        ["train", "--algorithm", "covap", "--resume", "old", "--checkpoint", str(tmp_path), "--resume=x"])
    assert report.splitlines() == [
        "gradsync train: rank 1 was killed by SIGKILL; stopped the other 1 rank(s)",
        "  last completed step: 7",
        f"  newest checkpoint: {d} (step 6, epoch 0)",
        f"  resume with: gradsync train --algorithm covap --checkpoint {tmp_path} --resume {d}",
    ]
    assert resume_command(["train", "--out", "a b"], "/c") == "gradsync train --out 'a b' --resume /c"


def test_progress_slot_holds_step_and_pid(tmp_path, monkeypatch):
    import struct

    monkeypatch.setenv("GRADSYNC_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "2")
    p = rank_progress(5)  # a resumed run starts at its checkpoint's step
    assert struct.unpack("<qq", (tmp_path / "rank2").read_bytes()) == (5, os.getpid())
    p.report(6)
    p.close()
    assert struct.unpack("<qq", (tmp_path / "rank2").read_bytes()) == (6, os.getpid())


@pytest.mark.parametrize("launcher, world, local_rank, cuda, gpus, want", [
    ("local", 2, 0, False, 0, "gloo"),     # no CUDA
    ("local", 2, 1, True, 1, "gloo"),      # one GPU, two ranks: set_device(1) would fail
    ("local", 2, 1, True, 2, "nccl"),      # one GPU per rank on one host
    ("local", 1, 0, True, 1, "nccl"),
    ("emulated", 2, 0, True, 2, "gloo"),   # shaped links: NCCL would bypass them
    ("emulated", 1, 0, True, 8, "gloo"),
    ("torchrun", 8, 3, True, 4, "nccl"),   # LOCAL_RANK 3 < 4 devices
    ("torchrun", 8, 4, True, 4, "gloo"),   # LOCAL_RANK 4 has no device
    ("torchrun", 2, 0, False, 0, "gloo"),
])
def test_auto_backend_choice(monkeypatch, launcher, world, local_rank, cuda, gpus, want):
    import torch
    import torch.distributed as dist

    from gradsync.train.launcher import choose_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    backend, reason = choose_backend("auto", launcher, world, local_rank)
    assert backend == want, reason
    assert reason.startswith("auto: ") and (f"{gpus} CUDA device" in reason or launcher == "emulated")
    assert choose_backend("gloo", launcher, world, local_rank) == ("gloo", "--backend gloo")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)  # a build without NCCL
    assert choose_backend("auto", launcher, world, local_rank)[0] == "gloo"


def test_auto_backend_rejects_an_unknown_launcher():
    from gradsync.train.launcher import choose_backend

    with pytest.raises(ValueError, match="launcher must be one of torchrun, local, emulated, got 'slurm'"):
        choose_backend("auto", "slurm", 2, 0)
