"""A killed rank ends ``gradsync train`` with one message; a run resumed from a mid-epoch
``--checkpoint-every`` checkpoint (found by ``--resume latest``) continues the uninterrupted run."""

import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync.workloads import fashion_mnist
from cli_runner import run_cli

pytestmark = pytest.mark.skipif(
    not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists(),
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)

CLI = [sys.executable, "-m", "gradsync", "train", "--no-progress"]


@pytest.mark.timeout(600)
def test_sigkill_of_one_rank_gives_one_message_and_the_resume_command(tmp_path):
    timeout = 60
    ck, tmp = tmp_path / "ck", tmp_path / "tmp"
    tmp.mkdir()
    args = ["--algorithm", "allreduce", "--train-samples", "1280", "--max-steps", "500",
            "--checkpoint", str(ck), "--checkpoint-every", "3", "--timeout", str(timeout)]
    proc = subprocess.Popen(CLI + args, env=dict(os.environ, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (ck / "step6" / "manifest.json").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 6 within 240 s"
            time.sleep(0.1)
        # the launcher's progress file of rank 1: last step, then the rank's pid
        slot, = glob.glob(str(tmp / "gradsync-ranks-*" / "rank1"))
        _, pid = struct.unpack("<qq", Path(slot).read_bytes()[:16])
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=timeout + 30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert elapsed < timeout, f"took {elapsed:.1f} s, more than --timeout {timeout}"
    assert "Traceback" not in err and "Exception" not in err, err
    lines = err.strip().splitlines()
    assert lines[0] == "gradsync train: rank 1 was killed by SIGKILL; stopped the other 1 rank(s)", err
    step = int(lines[1].split("last completed step:")[1])
    assert step >= 6
    m = re.fullmatch(r"  newest checkpoint: (\S+) \(step (\d+), epoch 0\)", lines[2])
    assert m, err
    newest, ck_step = Path(m.group(1)), int(m.group(2))
    # the newest with a manifest; a checkpoint of the last step may have been cut off by the kill
    assert newest == ck / f"step{ck_step}" and ck_step % 3 == 0 and step - 3 <= ck_step <= step
    assert (newest / "manifest.json").is_file()
    assert not (ck / f"step{ck_step + 3}" / "manifest.json").exists()
    assert lines[3].strip() == ("resume with: gradsync train --no-progress " + " ".join(args)
                                + f" --resume {newest}"), err
    assert len(lines) == 4, err
    assert not glob.glob(str(tmp / "gradsync-ranks-*")), "the launcher removes its temporary directory"


#: batch 16 (not the recipe's 64) and 200 test samples: a quarter of the compute per step and a fifth of the
#: evaluation; what is compared (losses, rates, evaluations, bitwise) and said does not depend on either
SMALL = ["--batch-size", "16", "--eval-samples", "200"]


def _train(tmp_path, name, algorithm, *extra):
    out = tmp_path / name
    proc = run_cli(["train", "--no-progress", "--algorithm", algorithm, *(["--ratio", "2"] if algorithm == "covap" else []),
                    "--train-samples", "1280", "--max-steps", "6", *SMALL, "--out", str(out), *extra],
                    timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), proc


@pytest.mark.timeout(900)
@pytest.mark.parametrize("algorithm", ["covap"])  # error-feedback state on top of model/optimizer/RNG
def test_resume_latest_mid_epoch_continues_the_uninterrupted_losses(tmp_path, algorithm):
    # 1280 samples, 2 ranks, batch 16: 40 steps per epoch, cut at 6: checkpoints at steps 2 and 4
    # (mid-epoch) and at the end, step 6 (mid-epoch too: a longer run continues the epoch); one
    # evaluation per run keeps the test short
    ck = tmp_path / "ck"
    full, _ = _train(tmp_path, "full", algorithm, "--checkpoint", str(ck), "--checkpoint-every", "2")
    assert {p.name for p in ck.iterdir()} == {"step2", "step4", "step6"}
    # step 4 is the newest complete checkpoint; step 6 lost its manifest (as if a rank died)
    resume = tmp_path / "resume"
    resume.mkdir()
    for name in ("step2", "step4", "step6"):
        shutil.copytree(ck / name, resume / name)
    os.unlink(resume / "step6" / "manifest.json")
    part, proc = _train(tmp_path, "part", algorithm, "--checkpoint", str(resume), "--resume", "latest")
    assert "skipping incomplete checkpoint" in proc.stderr and "step6: no manifest.json" in proc.stderr
    assert f"resuming from {resume / 'step4'} (step 4, epoch 0)" in proc.stdout
    a = [i["loss"] for i in full["iterations"]]
    b = [i["loss"] for i in part["iterations"]]
    assert len(a) == len(b) == 6
    assert b[4:] == a[4:], "steps 5 and 6, trained after the resume, repeat the uninterrupted run exactly"
    assert [(e["test_loss"], e["test_acc"]) for e in part["epochs"]] == \
        [(e["test_loss"], e["test_acc"]) for e in full["epochs"]]


@pytest.mark.timeout(900)
def test_a_longer_run_continues_a_finished_one_with_the_schedule_over_the_new_length(tmp_path):
    """A 4-step run, then --max-steps 8 --resume latest: steps 5-8 are trained (the old code trained
    none and said nothing: the end checkpoint claimed a finished epoch), with the learning rates
    of an 8-step one-cycle schedule (the old code's restored 4-step schedule raised at step 5); a
    resume at the end is an error that says so."""
    import torch

    ck = tmp_path / "ck"
    first, _ = _train(tmp_path, "first", "covap", "--checkpoint", str(ck), "--checkpoint-every", "2",
                      "--max-steps", "4")
    assert {p.name for p in ck.iterdir()} == {"step2", "step4"}
    longer, proc = _train(tmp_path, "longer", "covap", "--checkpoint", str(ck), "--resume", "latest",
                          "--max-steps", "8")
    assert f"resuming from {ck / 'step4'} (step 4, epoch 0)" in proc.stdout
    assert "resume: the run now has 8 steps (it had 4): training steps 5 to 8" in proc.stdout
    assert [i["step"] for i in longer["iterations"]] == list(range(1, 9))
    assert longer["iterations"][:4] == first["iterations"]
    lr = longer["config"]["lr"]
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=8, pct_start=0.15, anneal_strategy="cos")
    want = []  # the loop logs the rate after each step's scheduler step
    for _ in range(8):
        opt.step()
        sched.step()
        want.append(sched.get_last_lr()[0])
    assert [i["lr"] for i in longer["iterations"][4:]] == pytest.approx(want[4:], rel=1e-12)
    assert longer["summary"]["steps"] == 8
    at_end = run_cli(["train", "--no-progress", "--algorithm", "covap", "--ratio", "2", "--train-samples", "1280",
                      "--max-steps", "4", *SMALL, "--resume", str(ck / "step4")], timeout=400)
    assert at_end.returncode == 1
    assert ("the checkpoint is at step 4, and this run ends at step 4 (--max-steps/--epochs): nothing left "
            "to train") in at_end.stderr, at_end.stderr


def test_continue_schedule_redefines_the_one_cycle_over_the_new_length():
    """--epochs 2 -> 3 (or any new length): the rates from the resumed step on are the new length's."""
    import torch

    from gradsync.train.loop import continue_schedule

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)

    def make(total):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total, pct_start=0.15,
                                                   anneal_strategy="cos")

    def rates(sched, n):
        out = []
        for _ in range(n):
            opt.step()
            sched.step()
            out.append((sched.get_last_lr()[0], opt.param_groups[0]["momentum"]))
        return out

    want = rates(make(30), 29)[20:]  # after steps 21-29 of an uninterrupted 30-step schedule
    assert continue_schedule(make, 20, 20, 10) is None, "same length: the restored scheduler goes on"
    got = rates(continue_schedule(make, 20, 30, 20), 9)
    assert got == want
    with pytest.raises(ValueError, match="checkpoint is at step 20, and this run ends at step 20"):
        continue_schedule(make, 20, 20, 20)
    with pytest.raises(ValueError, match="nothing left to train"):
        continue_schedule(make, 30, 10, 20)
