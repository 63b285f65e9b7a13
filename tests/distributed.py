"""Run a function on a real multi-process Gloo group on 127.0.0.1 (test helper).

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes through the same launcher as
``gradsync train`` and ``gradsync bench`` (:class:`gradsync.launch.LocalRanks`); each joins a Gloo
process group with a short timeout, runs ``fn(rank, world_size, *args)`` and sends back its return
value (which must be picklable) or its exception. Raises ``RankFailed`` naming the failing ranks; a
rank that does not finish within ``timeout`` seconds is killed and reported.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
from collections.abc import Callable
from typing import Any


from gradsync.launch import LocalRanks, RankFailure


class RankFailed(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        lines = [f"rank {r}: {msg}" for r, msg in sorted(failures.items())]
        super().__init__("distributed test failed:\n" + "\n".join(lines))


def _in_group(rank, world_size, pg_timeout, fn, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        result = fn(rank, world_size, *args)
        # fn's DDP models, hook states and futures die here, on this thread, and every rank is past its
        # collectives: otherwise the last reference to the process group (torch's hooks capture it in
        # their callbacks) can drop in a Gloo worker thread, whose destructor then joins itself and
        # aborts the rank ("terminate called ... Resource deadlock avoided")
        gc.collect()
        dist.barrier()
        return result
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    expect_failure: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on every rank; return the results ordered by rank.

    With ``expect_failure=True`` the per-rank outcomes are returned as ``(ok, value_or_error)``
    pairs instead of raising (ranks are not stopped when one fails).
    """
    with LocalRanks(world_size) as ranks:
        ranks.start_function(_in_group, (pg_timeout, fn, args), start_method="fork")
        try:
            results = ranks.join(timeout=timeout, stop_on_failure=not expect_failure)
        except RankFailure as exc:
            outcomes = {}
            for r, e in exc.exits.items():
                if e.failed or e.stopped or exc.timed_out:
                    if e.traceback:
                        msg = f"{e.error}\n{e.traceback}"
                    elif e.stopped and exc.timed_out:
                        msg = f"no result within {timeout:.0f} s"
                    else:
                        msg = e.describe()
                    outcomes[r] = msg
            if not expect_failure:
                raise RankFailed(outcomes) from None
            return [(False, outcomes[r]) if r in outcomes else (True, exc.results.get(r))
                    for r in range(world_size)]
    if expect_failure:
        return [(True, v) for v in results]
    return results


def _job_rank(rank, world, fn, args, cwd, log):
    import sys

    os.chdir(cwd)
    sys.stdout.flush()
    fd = os.open(f"{log}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # (not pytest's capture, which the fork inherited)
    # a rank stopped at the timeout writes every thread's stack into its log (a hang shows where)
    faulthandler.register(signal.SIGTERM, file=sys.stdout, all_threads=True, chain=True)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # a singleton a fresh torchrun rank would not have (the parent's, non-distributed)
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    try:
        return fn(*args)
    finally:
        sys.stdout.flush()


def end_job(settle_s: float = 0.25) -> None:
    """End a framework job's process group (Lightning, Accelerate and the HF Trainer keep theirs; a Gloo
    group left to interpreter teardown once aborted a rank after every fit had finished): a barrier,
    ``settle_s`` seconds with the GIL free, then :func:`gradsync.comm.futures.shutdown_process_group`.
    Gloo's worker frees a finished collective's work (the Trainer's last all-gather holds Python tensors,
    whose release needs the GIL) after the caller saw it complete; dropping the group joins that worker
    on a thread holding the GIL, a deadlock (torch issue #56297) that once kept both HF Trainer ranks from
    exiting after their job had finished. ``examples/transformers_covap.py`` ends the same way."""
    import time

    import torch.distributed as dist

    from gradsync.comm.futures import shutdown_process_group

    if dist.is_initialized():
        dist.barrier()
        time.sleep(settle_s)
        shutdown_process_group()


def run_script_ranks(fn: Callable[..., Any], world_size: int, *args: Any, cwd: Any, log: Any,
                     timeout: float = 240.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks forked from this process with the environment
    ``torchrun`` gives a rank script (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``; no process group: ``fn`` or its framework creates one), in ``cwd``; each rank's
    stdout goes to ``{log}.rank{r}``, then all of it to ``log``. Returns the results ordered by rank.
    Whatever the parent imported (a framework: Lightning ~5 s of CPU) the ranks need not import again."""
    from pathlib import Path

    try:
        with LocalRanks(world_size) as ranks:
            ranks.start_function(_job_rank, (fn, args, str(cwd), str(log)), start_method="fork")
            return ranks.join(timeout=timeout)
    finally:
        parts = [Path(f"{log}.rank{r}") for r in range(world_size)]
        Path(log).write_text("".join(p.read_text() for p in parts if p.exists()))


def cluster_skip_reason(needs_fashion_mnist: bool = False) -> str | None:
    """Why the emulated-cluster tests cannot run here (:func:`gradsync.cluster.commands.why_unshaped`:
    not root, no iproute2; with ``needs_fashion_mnist`` also a missing dataset), or ``None``."""
    from gradsync.cluster.commands import why_unshaped
    from gradsync.workloads import fashion_mnist

    why = why_unshaped()
    if why is None and needs_fashion_mnist and not (fashion_mnist.DEFAULT_DIR / "train-images-idx3-ubyte.gz").exists():
        why = "Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
    return why
