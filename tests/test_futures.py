"""Callbacks on collective futures cannot abort a rank at interpreter exit (gradsync.comm.futures).

The race, made deterministic on a one-rank Gloo group (the all-reduce completes on Gloo's worker
thread, which runs the callback and then releases it, both under the GIL):

* ``release``: the callback holds an object that takes 50 ms to be released; the script waits for the
  callback's result and ends while the worker thread is still releasing the callback;
* ``running``: the callback takes 300 ms and the script ends without waiting for it (or for the
  all-reduce, which may still be in flight when the script ends).

With torch's ``Future.then`` the worker thread meets the finalizing interpreter and the rank dies
(SIGABRT, "terminate called without an active exception", or "Fatal Python error"), as ``examples/torchrun_covap.py`` did in
about 1 run in 20 (the last step's bucket callbacks). With gradsync's ``then`` the script exits
cleanly and the callback finished.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradsync.comm.rendezvous import free_port

SRC = Path(__file__).resolve().parents[1] / "src"

SCRIPT = textwrap.dedent("""
    import datetime, sys, time
    import torch, torch.distributed as dist
    from gradsync.comm.futures import then

    mode, port, scenario = sys.argv[1:4]

    class SlowRelease:
        def __del__(self):
            time.sleep(0.05)

    def slow_callback(f):
        time.sleep(0.3)
        print("CALLBACK DONE", flush=True)
        return f.value()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    if scenario == "release":
        slow = SlowRelease()
        callback = lambda f, slow=slow: f.value()
        del slow
    else:
        callback = slow_callback
    child = then(fut, callback) if mode == "gradsync" else fut.then(callback)
    del callback
    if scenario == "release":
        assert child.wait()[0].tolist() == [1.0] * 4
    print("END OF SCRIPT", flush=True)
""")


def _run(tmp_path: Path, mode: str, scenario: str) -> subprocess.CompletedProcess:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.run([sys.executable, str(script), mode, str(free_port()), scenario], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("scenario", ["release", "running"])
def test_a_callback_the_worker_thread_still_holds_at_exit_does_not_abort_the_rank(tmp_path, scenario):
    if scenario == "running":
        # the scenario is real: with torch's own then() the rank is lost after the script's last line (the
        # "release" one lost it in 14 of 15 runs, so it is not asserted: a fast exit can outrun the worker).
        # It needs the script to end while the callback runs: on a loaded machine the main thread can take
        # longer than the callback's 300 ms to get there (seen with a benchmark beside the suite), which
        # voids that run; up to 3 runs are made for one where the callback outlives the script
        for _ in range(3):
            plain = _run(tmp_path, "torch", scenario)
            assert "END OF SCRIPT" in plain.stdout, plain.stderr
            if plain.stdout.startswith("END OF SCRIPT"):
                assert plain.returncode != 0, "torch's Future.then no longer aborts here: the race is gone upstream"
                break
    ours = _run(tmp_path, "gradsync", scenario)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert "END OF SCRIPT" in ours.stdout
    if scenario == "running":
        assert "CALLBACK DONE" in ours.stdout  # drain waited for the callback, then for its release
