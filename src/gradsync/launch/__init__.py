"""Start the ranks of a job on this machine and watch them: one code path for ``gradsync train``,
``gradsync bench`` and the test suite.

:class:`LocalRanks` starts ``world`` ranks, either as Python callables (``fork`` for fast test start,
``spawn`` for training and CUDA) or as commands (``python -m ...``), optionally wrapped per rank
(``ip netns exec NS`` for the hosts of an emulated cluster). Every rank gets the torch.distributed
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME``) and a progress slot (:func:`rank_progress`). :meth:`LocalRanks.join` waits;
when a rank dies (signal, non-zero exit, or an exception it reports) the others are stopped and
:class:`RankFailure` says which rank failed, how it ended and the last step every rank completed.

``torch.distributed.elastic.multiprocessing.start_processes`` was considered: it reports the failed
rank and its exit code or signal too, but its function path prints every rank's traceback (the
secondary "connection closed by peer" errors of the survivors included) and installs SIGTERM/SIGINT
handlers in the caller, its command path needs a log directory per run, and it returns only the
first failure; the small supervisor here keeps fork start, per-rank command wrappers and quiet,
structured failures.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

from ..comm.rendezvous import free_port
from .status import PROGRESS_ENV, RankExit, RankFailure, RankProgress, _read_step, rank_progress  # noqa: F401


@contextlib.contextmanager
def imports_without_collection() -> Iterator[None]:
    """Pause the cyclic garbage collector while a process imports torch and gradsync; in a process
    that has frozen nothing yet (its start-up), then move everything imported into the permanent
    generation (``gc.freeze``), so that a long-lived caller's later garbage is never pinned.

    Importing torch makes ~170k long-lived objects; the collections the allocations trigger meanwhile
    free nothing and took 20-25 % of the import's CPU time here (torch and gradsync's CLI: 2.7-4.0 s
    against 2.1-3.0 s without them); later collections no longer walk the imported objects either."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
        if enabled:
            gc.enable()


def _function_rank(rank: int, world: int, env: dict[str, str], fn: Callable[..., Any],
                   args: tuple, results: Any) -> None:
    """Body of a function rank: set the environment, run ``fn`` and report its result or error.

    A forked rank first moves the objects it inherited (torch's import alone makes ~170k) into the
    garbage collector's permanent generation (``gc.freeze``, O(1)): its collections no longer walk
    them, and their pages stay shared with the parent (Python's ``gc`` documentation, on fork)."""
    gc.freeze()
    os.environ.update(env)
    try:
        value = fn(rank, world, *args)
        # plain pickle: torch's shared-memory tensor pickling breaks once this process exits
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher instead of printed
        tb = traceback.extract_tb(exc.__traceback__)
        where = f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else None
        message = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {message[0] if message else ''}".rstrip(": ")
        results.put((rank, False, (text, where, traceback.format_exc())))
        results.close()
        results.join_thread()
        sys.exit(1)


class LocalRanks:
    """``world`` ranks on this machine.

    Args:
        world: number of ranks, >= 1.
        master_addr: rendezvous address (``MASTER_ADDR``); ``127.0.0.1`` for loopback.
        port: rendezvous port (``MASTER_PORT``); None picks a free one.
        socket_ifname: ``GLOO_SOCKET_IFNAME`` for every rank, or a function of the rank (the
            interface inside an emulated host's namespace); None leaves the variable alone.
        env: extra environment variables for every rank (they win over the ones above, e.g.
            ``LOCAL_RANK=0`` when every rank stands for a host of its own).

    Use: ``ranks.start_function(fn, args)`` or ``ranks.start_command(argv_of)``, then
    ``results = ranks.join()``; as a context manager the ranks are stopped and the temporary
    progress directory removed on exit.

    Raises:
        ValueError: if ``world`` < 1.
    """

    def __init__(self, world: int, *, master_addr: str = "127.0.0.1", port: int | None = None,
                 socket_ifname: str | Callable[[int], str] | None = "lo",
                 env: Mapping[str, str] | None = None):
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an integer >= 1, got {world!r}")
        self.world = world
        self.master_addr = master_addr
        self.port = port if port is not None else free_port()
        self._ifname = socket_ifname
        self._extra_env = dict(env or {})
        self._dir = tempfile.mkdtemp(prefix="gradsync-ranks-")
        self._procs: list[Any] = []
        self._kind: str | None = None
        self._results: Any = None
        self._logs: dict[int, IO] = {}

    def env(self, rank: int) -> dict[str, str]:
        """The environment variables set for ``rank`` (on top of the inherited ones)."""
        env = dict(RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(self.world), MASTER_ADDR=self.master_addr,
                   MASTER_PORT=str(self.port), **{PROGRESS_ENV: self._dir})
        if self._ifname is not None:
            env["GLOO_SOCKET_IFNAME"] = self._ifname(rank) if callable(self._ifname) else self._ifname
        env.update(self._extra_env)
        return env

    def start_function(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                       start_method: str = "fork") -> None:
        """Run ``fn(rank, world, *args)`` in one new process per rank; its return value (picklable)
        comes back from :meth:`join`. ``fork`` starts in ~0.05 s after torch is imported; use
        ``spawn`` when the parent holds CUDA or OpenMP state (``fn`` and ``args`` must then pickle).

        Raises:
            ValueError: for an unknown ``start_method``.
        """
        if start_method not in ("fork", "spawn", "forkserver"):
            raise ValueError(f"start_method must be fork, spawn or forkserver, got {start_method!r}")
        self._claim("function")
        if start_method == "fork":  # torch imports it at each rank's first optimizer (1-3 s there); once here
            import torch._dynamo  # noqa: F401
        ctx = mp.get_context(start_method)
        self._results = ctx.Queue()
        for r in range(self.world):
            p = ctx.Process(target=_function_rank, args=(r, self.world, self.env(r), fn, tuple(args),
                                                         self._results), daemon=False)
            p.start()
            self._procs.append(p)

    def start_command(self, argv: Callable[[int], Sequence[str]], *,
                      popen: Callable[..., subprocess.Popen] | None = None,
                      output: Callable[[int], tuple[Any, Any]] | None = None) -> None:
        """Run the command ``argv(rank)`` per rank with the inherited environment plus :meth:`env`.

        Args:
            argv: the command of each rank, e.g. ``[sys.executable, "-m", "pkg.worker", cfg]``.
            popen: starts one rank: ``popen(rank, argv, env=..., stdout=..., stderr=...)``; default
                ``subprocess.Popen`` (an emulated cluster passes its ``popen``, which runs the
                command inside the rank's network namespace).
            output: ``(stdout, stderr)`` for a rank (``None`` inherits); by default stdout is
                inherited and stderr goes to a log whose tail is reported if the rank fails.
        """
        self._claim("command")
        for r in range(self.world):
            env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env(r))
            if output is not None:
                out, err = output(r)
            else:
                out, err = None, self._log(r)
            cmd = list(argv(r))
            if popen is None:
                p = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
            else:
                p = popen(r, cmd, env=env, stdout=out, stderr=err)
            self._procs.append(p)

    def log(self, rank: int) -> IO:
        """A writable log file for ``rank`` (its tail is reported when the rank fails)."""
        return self._log(rank)

    def _log(self, rank: int) -> IO:
        if rank not in self._logs:
            self._logs[rank] = open(os.path.join(self._dir, f"rank{rank}.log"), "w+b")
        return self._logs[rank]

    def _claim(self, kind: str) -> None:
        if self._kind is not None:
            raise RuntimeError("ranks were already started")
        self._kind = kind

    def steps(self) -> dict[int, int]:
        """The last step each rank reported through :class:`RankProgress`."""
        out = {}
        for r in range(self.world):
            s = _read_step(os.path.join(self._dir, f"rank{r}"))
            if s is not None:
                out[r] = s
        return out

    def _exitcode(self, r: int) -> int | None:
        p = self._procs[r]
        return p.exitcode if self._kind == "function" else p.poll()

    def _drain(self, outcomes: dict[int, tuple[bool, Any]], wait_s: float = 0.0) -> None:
        if self._results is None:
            if wait_s:
                time.sleep(wait_s)
            return
        try:
            rank, ok, value = self._results.get(timeout=wait_s) if wait_s else self._results.get_nowait()
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            while True:
                rank, ok, value = self._results.get_nowait()
                outcomes[rank] = (ok, pickle.loads(value) if ok else value)
        except queue_mod.Empty:
            pass

    def join(self, timeout: float | None = None, stop_on_failure: bool = True,
             grace_s: float = 0.5) -> list[Any]:
        """Wait for every rank; return the function ranks' return values by rank (``None`` for
        command ranks).

        Args:
            timeout: seconds for the whole job; None waits as long as ranks run.
            stop_on_failure: stop the other ranks as soon as one fails (else wait for all).
            grace_s: after the first failure, how long to collect the others' outcomes before
                stopping them (so the rank that died first is named, not a peer that raised
                "connection closed" right after).

        Raises:
            RankFailure: when a rank fails or the job runs past ``timeout``.
        """
        if self._kind is None:
            raise RuntimeError("no ranks were started")
        outcomes: dict[int, tuple[bool, Any]] = {}
        order: list[int] = []  # ranks in the order their failure was seen
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at = None
        timed_out = False
        try:
            while True:
                self._drain(outcomes, wait_s=0.05)
                codes = [self._exitcode(r) for r in range(self.world)]
                if self._kind == "function" and all(c is not None for c in codes):
                    self._drain(outcomes)
                for r in range(self.world):
                    bad = (r in outcomes and not outcomes[r][0]) or codes[r] not in (None, 0)
                    if bad and r not in order:
                        order.append(r)
                if order and failed_at is None:
                    failed_at = time.monotonic()
                if all(c is not None for c in codes):
                    break
                if stop_on_failure and failed_at is not None and time.monotonic() - failed_at >= grace_s:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    timed_out = True
                    break
        finally:
            stopped = self._stop()
            self._drain(outcomes)
        exits = {}
        for r in range(self.world):
            e = RankExit(r, self._exitcode(r), stopped=r in stopped)
            if r in outcomes and not outcomes[r][0]:
                e.error, e.where, e.traceback = outcomes[r][1]
                e.stopped = False
            elif self._kind == "function" and r not in outcomes and e.exitcode == 0:
                e.error = "no result (the process exited without reporting one)"
            if e.failed and r in self._logs:
                e.log_tail = self._tail(r)
            exits[r] = e
        failures = [r for r in range(self.world) if exits[r].failed]
        if failures or timed_out:
            # A rank that died without reporting (signal, exit code) is the likely cause; the
            # others typically raised because their peer went away.
            hard = [r for r in order if exits[r].failed and exits[r].error is None]
            first = (hard or [r for r in order if exits[r].failed] or failures or [0])[0]
            raise RankFailure(exits[first], exits, self.steps(), timed_out=timed_out, timeout=timeout,
                              results={r: v for r, (ok, v) in outcomes.items() if ok})
        return [outcomes[r][1] if r in outcomes else None for r in range(self.world)]

    def _tail(self, rank: int, chars: int = 3000) -> str:
        log = self._logs[rank]
        log.flush()
        log.seek(0)
        return log.read().decode(errors="replace")[-chars:].strip()

    def _stop(self, wait_s: float = 5.0) -> set[int]:
        """SIGTERM every running rank, SIGKILL those still running after ``wait_s``; return them."""
        running = {r for r in range(len(self._procs)) if self._exitcode(r) is None}
        for r in running:
            try:
                self._procs[r].terminate()
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait_s
        for r in running:
            p = self._procs[r]
            left = max(0.0, end - time.monotonic())
            if self._kind == "function":
                p.join(left)
                if p.exitcode is None:
                    p.kill()
                    p.join()
            else:
                try:
                    p.wait(left)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return running

    def close(self) -> None:
        """Stop any running rank, close the logs and remove the temporary directory."""
        if self._procs:
            self._stop()
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self._results is not None:
            self._results.close()
            self._results = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def local_start_method() -> str:
    """How ranks on this machine start when they may be forked: ``fork`` (4-5 s faster per run than
    ``spawn`` or a new interpreter here: the ranks neither re-import torch nor re-run the launcher's
    imports) where CUDA is absent; ``spawn`` where it is available, since a CUDA runtime initialised in
    the launcher does not survive a fork."""
    import torch

    return "spawn" if torch.cuda.is_available() else "fork"


def limit_launcher_threads() -> None:
    """The launching process runs its own torch code (a data check, a model build) on one thread, so
    no OpenMP thread pool exists when :func:`local_start_method` forks the ranks."""
    import torch

    torch.set_num_threads(1)


def _module_rank(rank: int, world: int, module: str, argv: list[str], log_path: str) -> int:
    """Body of a forked module rank: stderr (and stdout, except rank 0's) to the rank's log, as for a
    command rank, then ``module.main(argv)``."""
    import importlib

    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 2)
    if rank != 0:
        os.dup2(fd, 1)
    os.close(fd)
    code = importlib.import_module(module).main(argv)
    sys.stdout.flush()
    if code:
        raise SystemExit(code)
    return 0


def run_module_ranks(module: str, config_json: str, world: int, *, master_addr: str = "127.0.0.1",
                     socket_ifname: str | Callable[[int], str] | None = "lo",
                     env: Mapping[str, str] | None = None,
                     popen: Callable[..., subprocess.Popen] | None = None,
                     deadline_s: float | None = None) -> Any:
    """Run ``<module>.main([CONFIG, RESULT])`` on ``world`` ranks (:class:`LocalRanks`) with
    ``config_json`` in the file CONFIG, and return the JSON rank 0 wrote to RESULT (with
    :func:`write_result`). Without ``popen`` the ranks are forked from this process where
    :func:`local_start_method` allows it (no CUDA; call :func:`limit_launcher_threads` first), else
    they are commands ``python -m <module> CONFIG RESULT``; ``popen`` (an emulated cluster's hosts)
    always runs commands. Rank 0's stdout is shown; the other ranks' stdout and every rank's stderr
    go to logs whose tail is reported when a rank fails. ``master_addr``, ``socket_ifname``, ``env``
    and ``popen`` are passed to :class:`LocalRanks` and :meth:`LocalRanks.start_command`.

    Raises:
        RankFailure: when a rank fails (the others are stopped) or the run exceeds ``deadline_s``.
    """
    import json
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="gradsync-run-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "result.json"
        cfg_path.write_text(config_json)
        argv = [str(cfg_path), str(out_path)]
        with LocalRanks(world, master_addr=master_addr, socket_ifname=socket_ifname, env=env) as ranks:
            if popen is None and local_start_method() == "fork":
                logs = [ranks.log(r).name for r in range(world)]
                ranks.start_function(lambda r, w: _module_rank(r, w, module, argv, logs[r]),
                                     start_method="fork")
            else:
                ranks.start_command(lambda r: [sys.executable, "-m", module, *argv], popen=popen,
                                    output=lambda r: (None if r == 0 else ranks.log(r), ranks.log(r)))
            ranks.join(timeout=deadline_s)
        return json.loads(out_path.read_text())


def write_result(path: str, result: Any, default: Callable[[Any], Any] | None = None) -> None:
    """Write ``result`` as JSON to ``path`` atomically (a ``.tmp`` file, then ``os.replace``), so
    :func:`run_module_ranks` never reads a half-written file; ``default`` as in ``json.dump``."""
    import json

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=default)
    os.replace(tmp, path)
