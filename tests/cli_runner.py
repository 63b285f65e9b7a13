"""Run the ``gradsync`` command line in a fresh process without paying for a new interpreter.

``run_cli(args)`` behaves like ``subprocess.run([sys.executable, "-m", "gradsync", *args],
capture_output=True, text=True)``: the command runs in its own process (forked from a multiprocessing
forkserver that imported torch, gradsync's CLI and matplotlib and decoded Fashion-MNIST once), with its
own environment and working directory, file descriptors 1 and 2 captured, and its exit status from
``gradsync.cli.main`` (``SystemExit`` from argparse included). Each run saves the ~3-4 s an interpreter spends importing
torch, torch._dynamo and matplotlib; the command's own ranks are started exactly as from the console
script. The console script itself is still run by a few tests (``CONSOLE``).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence

#: The real console entry point, for the tests that check it.
CONSOLE = [sys.executable, "-m", "gradsync"]

_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.optim", "gradsync.cli", "gradsync.train.loop",
            "gradsync.bench.worker", "matplotlib.pyplot", "preload_data"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _main(argv: list[str], env: dict[str, str], cwd: str | None, out_path: str, err_path: str) -> None:
    gc.freeze()  # as a forked rank does (gradsync.launch): collections skip what the forkserver preloaded
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["gradsync", *argv]
    code = 1
    try:
        from gradsync.cli import main

        code = main(argv) or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as a command's traceback would be
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def run_cli(args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``gradsync ARGS`` in a new process; returns its exit code, stdout and stderr (text).

    Raises:
        subprocess.TimeoutExpired: after ``timeout`` seconds (the process and its ranks are killed).
    """
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="gradsync-cli-") as tmp:
        out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        for p in (out_path, err_path):
            open(p, "w").close()
        full_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        proc = _context().Process(target=_main, args=(argv, full_env, cwd, out_path, err_path))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            _kill_tree(proc.pid)
            proc.join()
            raise subprocess.TimeoutExpired(["gradsync", *argv], timeout)
        with open(out_path, errors="replace") as f:
            out = f.read()
        with open(err_path, errors="replace") as f:
            err = f.read()
    return subprocess.CompletedProcess(["gradsync", *argv], proc.exitcode, out, err)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (the command's ranks)."""
    import signal

    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in children:
        _kill_tree(int(child))
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tree(cmd: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, except that on
    the timeout the command's whole process tree is killed (``torchrun``'s ranks included: killing only
    the launcher left a hung rank running for the rest of the session) before ``TimeoutExpired`` is
    raised."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
