"""One ``gradsync train`` rank as a command: ``python -m gradsync.train.worker CONFIG.json RESULT.json``.

How ``gradsync train --hosts N --bandwidth R`` starts its ranks: each rank is this command run inside
its emulated host's network namespace (``ip netns exec``) by
:func:`gradsync.train.launcher.launch_on_cluster`, with the torch.distributed environment set
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` = host 0's bridge address,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` = the host's interface). ``CONFIG.json`` is a
:class:`~gradsync.train.config.TrainConfig` as a JSON object; rank 0 writes the run's results (the
dict :func:`gradsync.train.loop.run` returns) to ``RESULT.json`` (atomically, via a ``.tmp`` file).
An exception ends the rank with its traceback on stderr and exit code 1; the launcher reports it.
"""

from __future__ import annotations

import json
import os
import sys

from ..launch import imports_without_collection


def main(argv: list[str] | None = None) -> int:
    """Run one rank; return the exit code.

    Raises:
        ValueError: if ``argv`` is not ``[CONFIG, RESULT]`` or the configuration is invalid.
    """
    with imports_without_collection():
        from ..launch import write_result
        from .config import TrainConfig
        from .launcher import _run_rank

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise ValueError(f"argv must be CONFIG.json RESULT.json, got {argv!r}")
    with open(argv[0]) as f:
        cfg = TrainConfig(**json.load(f))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = _run_rank(rank, world, int(os.environ.get("LOCAL_RANK", "0")), cfg, "emulated")
    if result is not None:
        write_result(argv[1], result, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
