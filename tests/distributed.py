"""Run a function on a real multi-process Gloo group on 127.0.0.1 (test helper).

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes, each joins a Gloo process group
with a short timeout, runs ``fn(rank, world_size, *args)`` and sends back its return value (which
must be picklable) or its exception. Raises ``RankFailed`` naming the failing ranks; a rank that
does not finish within ``timeout`` seconds is killed and reported.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import traceback
from typing import Any, Callable

import torch._dynamo  # noqa: F401  DDP imports it lazily (~6 s per forked rank); import once before fork

from gradsync.comm.rendezvous import free_port


class RankFailed(RuntimeError):
    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        lines = [f"rank {r}: {msg}" for r, msg in sorted(failures.items())]
        super().__init__("distributed test failed:\n" + "\n".join(lines))


def _worker(rank, world_size, port, pg_timeout, fn, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        # plain pickle: torch's shared-memory tensor pickling breaks once this process exits
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
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
    pairs instead of raising.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, pg_timeout, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = queue.get(timeout=min(remaining, 1.0))
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        except queue_mod.Empty:
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for r in range(world_size):
        if r not in outcomes:
            outcomes[r] = (False, f"no result within {timeout:.0f} s (exit code {procs[r].exitcode})")
    if expect_failure:
        return [outcomes[r] for r in range(world_size)]
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        raise RankFailed(failures)
    return [outcomes[r][1] for r in range(world_size)]
