"""Checkpoint files: durable per-rank writes, manifests, the cross-rank agreement on a save and on
which checkpoint to resume from, verified loads. What a training checkpoint holds is
:mod:`gradsync.train.checkpoint`'s.

A checkpoint is a directory ``ROOT/epoch{E}`` (end of an epoch) or ``ROOT/step{S}`` (every
``--checkpoint-every S`` steps) holding ``rank{r}.pt`` for every rank (residuals differ between
ranks) and a manifest per node (``manifest.json`` on one node) listing its ranks' files with their
sizes and SHA-256 digests. Saving (:func:`save_checkpoint`) removes the old manifests, waits for
every rank (barrier), writes each rank file atomically and durably (temporary file, ``fsync``,
rename, ``fsync`` of the directory and of every new directory's parent), gathers the digests and
then writes the manifests, so an old manifest never vouches for a file being replaced. ``--resume
latest`` (:func:`agree_latest`) verifies each rank's own file against its manifest and resumes from
the newest checkpoint that verifies on every rank, warning about each one it skips; each node reads
only its own files, so no shared filesystem is needed. Files load with
``torch.load(weights_only=True)`` and are checked against the manifest's digest first; numpy
arrays, numpy scalars and ``numpy.random.RandomState`` objects in a payload (some algorithm states
hold them) are stored as tagged tensors and turned back into numpy on load (:func:`to_safe`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# the one safe (weights-only loadable) form of a payload, also that of every algorithm's state_dict()
from ..algorithms.state_io import from_safe, to_safe  # noqa: F401  (re-exported)

MANIFEST = "manifest.json"
FORMAT = 1
_NAME = re.compile(r"^(epoch|step)(\d+)$")
_MANIFEST = re.compile(r"^manifest(\.node\d+)?\.json$")


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint directory lacks its manifest or a rank file, or a file does not match it."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that verified: its directory and what its manifests say (``step`` optimizer
    steps done; ``epoch`` the epoch the run continues in; ``files`` by rank: name, bytes, sha256,
    for the ranks whose manifests were read)."""

    path: Path
    step: int
    epoch: int
    world_size: int
    algorithm: str
    files: dict[int, dict[str, Any]]
    created: float


def checkpoint_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.pt"


def epoch_dir(root: str | os.PathLike, epoch: int) -> Path:
    """``ROOT/epoch{epoch}``: the checkpoint written after ``epoch`` epochs."""
    return Path(root) / f"epoch{epoch}"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``ROOT/step{step}``: the checkpoint written after optimizer step ``step`` (mid-epoch)."""
    return Path(root) / f"step{step}"


def manifest_name(node: int, nodes: int) -> str:
    """``manifest.json`` for a one-node run; ``manifest.node{node}.json`` when ``nodes`` > 1 (each
    node writes its own, so nodes with or without a shared filesystem never write the same file)."""
    return MANIFEST if nodes == 1 else f"manifest.node{node}.json"


def node_of(rank: int) -> int:
    """The node (machine) ``rank`` runs on: torchrun's ``GROUP_RANK`` when set, else ``rank //
    LOCAL_WORLD_SIZE`` (torchrun, the local and emulated-cluster launchers set it; unset: node 0).
    Only this rank's own value is read; :func:`save_checkpoint` gathers every rank's."""
    if "GROUP_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    return rank // local if local > 0 else 0


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dir(directory: Path) -> None:
    """``mkdir -p directory``, durably: each directory created is fsynced in its parent."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        _fsync_dir(d.parent)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_rank_file(directory: str | os.PathLike, rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Write ``payload`` as ``directory/rank{rank}.pt`` atomically and durably.

    Returns ``{"name", "bytes", "sha256"}`` of the file (the manifest's entry).

    Raises:
        TypeError: from :func:`to_safe`, for an entry ``weights_only`` loading could not read.
    """
    path = checkpoint_file(directory, rank)
    _make_dir(path.parent)
    buf = io.BytesIO()
    torch.save(to_safe(payload), buf)
    data = buf.getvalue()
    _atomic_write(path, data)
    return {"name": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_manifest(directory: str | os.PathLike, files: list[dict[str, Any]] | dict[int, dict[str, Any]], *,
                   step: int, epoch: int, algorithm: str, world_size: int | None = None,
                   name: str = MANIFEST) -> Path:
    """Write ``directory/name`` atomically, listing ``files``: one entry per rank in rank order, or a
    dict rank -> entry (a node's ranks of a ``world_size``-rank run). Call it only once every listed
    file is durable."""
    files = dict(enumerate(files)) if isinstance(files, list) else dict(files)
    path = Path(directory) / name
    doc = {"format": FORMAT, "step": int(step), "epoch": int(epoch),
           "world_size": int(len(files) if world_size is None else world_size),
           "algorithm": algorithm, "created": time.time(), "files": {str(r): f for r, f in files.items()}}
    _atomic_write(path, json.dumps(doc, indent=1).encode())
    return path


def _manifests(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("manifest*.json") if _MANIFEST.match(p.name))


def save_checkpoint(directory: str | os.PathLike, payload: dict[str, Any], *, step: int, epoch: int,
                    algorithm: str) -> Path:
    """Save this rank's ``payload`` into ``directory`` and, once every rank's file is durable, its
    node's manifest (see :func:`manifest_name`; written by the node's lowest rank). Collective:
    every rank of the default group must call it (without a process group it saves a one-rank
    checkpoint). Returns ``directory``.

    Order: the node leaders remove the manifests a re-save invalidates; the ranks agree on the
    outcome; every rank writes its file (fsync of file and directory; new directories are fsynced
    in their parent); an ``all_gather_object`` of the files' sizes and SHA-256 digests or of the
    error; the leaders write the manifests; the ranks agree on the outcome. A crash anywhere leaves
    a directory without a manifest or with one that verifies. Each node needs to see only its own
    ranks' files (no shared filesystem). An error on any rank in any step (disk full) raises
    :class:`CheckpointSaveError` on every rank at the next agreement, never a wait for the
    process-group timeout.

    Args:
        payload: what :func:`load_checkpoint` returns: tensors, numbers, strings, None, numpy
            arrays and ``RandomState`` objects, in lists, tuples and dicts (see :func:`to_safe`).
        step: optimizer steps completed; epoch: the epoch the run continues in.

    Raises:
        CheckpointSaveError: on every rank, when a step failed on any rank (an ``OSError``).
    """
    directory = Path(directory)
    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    nodes: list[Any] = [None] * world
    if group:
        dist.all_gather_object(nodes, node_of(rank))
    else:
        nodes = [0]
    node = nodes[rank]
    leader = rank == nodes.index(node)

    def clear() -> None:
        _make_dir(directory)
        if leader:  # an older manifest must not vouch for files being replaced now
            for old in _manifests(directory):
                old.unlink(missing_ok=True)
            _fsync_dir(directory)

    _agree(directory, "removing the old manifests", clear)  # a barrier: no file is replaced before
    entries = _agree(directory, "writing the rank file", lambda: save_rank_file(directory, rank, payload))

    def manifest() -> None:
        if leader:
            mine = {r: e for r, e in enumerate(entries) if nodes[r] == node}
            write_manifest(directory, mine, step=step, epoch=epoch, algorithm=algorithm, world_size=world,
                           name=manifest_name(sorted(set(nodes)).index(node), len(set(nodes))))
            _fsync_dir(directory.parent)

    _agree(directory, "writing the manifest", manifest)
    return directory


class CheckpointSaveError(OSError):
    """A checkpoint could not be saved on some rank (disk full, permissions, an unloadable payload
    entry): raised on every rank, naming the failing ranks and their errors."""


def _agree(directory: Path, what: str, fn: Any) -> list[Any]:
    """Run ``fn()`` on this rank, then agree on the outcome with every rank (one
    ``all_gather_object``, also a barrier): the list of every rank's result, or
    :class:`CheckpointSaveError` on every rank when ``fn`` raised on any (chained to the exception on
    the ranks where it did), so no rank goes on to a collective the others never reach."""
    group = dist.is_available() and dist.is_initialized()
    error: BaseException | None = None
    try:
        mine: Any = ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - reported on every rank below
        error, mine = exc, ("error", f"{type(exc).__name__}: {exc}")
    outcomes: list[Any] = [None] * (dist.get_world_size() if group else 1)
    if group:
        dist.all_gather_object(outcomes, mine)
    else:
        outcomes = [mine]
    failed = {r: o[1] for r, o in enumerate(outcomes) if o[0] == "error"}
    if failed:
        detail = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointSaveError(f"checkpoint {directory} not saved: {what} failed on {detail}") from error
    return [o[1] for o in outcomes]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_checkpoint_info(directory: str | os.PathLike, ranks: Any = None) -> CheckpointInfo:
    """Read ``directory``'s manifests and verify the files of ``ranks`` (default: every rank of the
    run, which the manifests together must list): each exists and its SHA-256 is the listed one.

    Raises:
        IncompleteCheckpoint: naming what is missing or wrong.
    """
    directory = Path(directory)
    paths = _manifests(directory)
    if not paths:
        raise IncompleteCheckpoint(f"{directory}: no {MANIFEST} (a rank stopped before every file was written)")
    docs, files = [], {}
    for mpath in paths:
        try:
            doc = json.loads(mpath.read_text())
            files.update({int(r): f for r, f in doc["files"].items()})
            docs.append((int(doc["step"]), int(doc["epoch"]), int(doc["world_size"]), str(doc["algorithm"]),
                         float(doc.get("created", 0.0))))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise IncompleteCheckpoint(f"{mpath}: unreadable manifest ({exc})") from None
    if len({d[:4] for d in docs}) > 1:
        raise IncompleteCheckpoint(f"{directory}: its manifests disagree (steps, epochs, world sizes)")
    step, epoch, world, algorithm, _ = docs[0]
    info = CheckpointInfo(directory, step, epoch, world, algorithm, files, min(d[4] for d in docs))
    wanted = range(world) if ranks is None else ranks
    for r in wanted:
        if r not in files:
            raise IncompleteCheckpoint(f"{directory}: no manifest lists rank {r}")
        f = files[r]
        p = directory / f["name"]
        if not p.is_file():
            raise IncompleteCheckpoint(f"{directory}: {f['name']} of rank {r} is missing")
        if p.stat().st_size != int(f["bytes"]) or _sha256(p) != f["sha256"]:
            raise IncompleteCheckpoint(f"{directory}: {f['name']} does not match its manifest "
                                       f"({p.stat().st_size} bytes, the manifest says {f['bytes']}; SHA-256 "
                                       "checked)")
    return info


def _warn(msg: str) -> None:
    print(f"gradsync: warning: {msg}", file=sys.stderr, flush=True)


def verified_checkpoints(root: str | os.PathLike,
                         ranks: Any = None) -> tuple[dict[str, CheckpointInfo], list[str]]:
    """The checkpoints under ``root`` whose files of ``ranks`` (default: all) verify, by directory
    name, and one message per ``epoch*``/``step*`` directory that does not (other entries are ignored)."""
    root = Path(root)
    found: dict[str, CheckpointInfo] = {}
    skipped: list[str] = []
    if not root.is_dir():
        return found, skipped
    for d in sorted(root.iterdir()):
        if not d.is_dir() or not _NAME.match(d.name):
            continue
        try:
            found[d.name] = read_checkpoint_info(d, ranks)
        except IncompleteCheckpoint as exc:
            skipped.append(str(exc))
    return found, skipped


def _newest(infos: list[CheckpointInfo]) -> CheckpointInfo:
    return max(infos, key=lambda i: (i.step, i.created))


def latest_checkpoint(root: str | os.PathLike, warn: bool = True) -> CheckpointInfo | None:
    """The newest checkpoint under ``root`` whose every file verifies (most steps; then the oldest
    manifest's time), or None. Others are skipped, with a warning on stderr when ``warn``. Reads
    only this machine's files: across nodes use :func:`agree_latest`."""
    found, skipped = verified_checkpoints(root)
    if warn:
        for msg in skipped:
            _warn(f"skipping incomplete checkpoint {msg}")
    return _newest(list(found.values())) if found else None


def agree_latest(root: str | os.PathLike, rank: int = 0, world: int | None = None) -> str | None:
    """The newest checkpoint under ``root`` that verifies on every rank; ``root/NAME`` or None.

    Each rank verifies only its own file against its node's manifest (``root`` may be a directory of
    its own: no shared filesystem needed); an ``all_gather_object`` of the names that verified (and of
    the reasons others did not) lets every rank pick the same one: the most steps among the names
    verified everywhere. Rank 0 warns once per checkpoint skipped, naming why, and says where it
    resumes, or that it starts from scratch. Collective when a process group is initialised.
    Checkpoints of another world size than ``world`` (default: the group's; None without one: any)
    are skipped.
    """
    group = dist.is_available() and dist.is_initialized()
    if group:
        rank, world = dist.get_rank(), dist.get_world_size()
    found, skipped = verified_checkpoints(root, [rank])
    for name, info in list(found.items()):
        if world is not None and info.world_size != world:
            skipped.append(f"{info.path}: written by {info.world_size} ranks, this run has {world}")
            del found[name]
    mine = ({n: (i.step, i.created) for n, i in found.items()}, skipped)
    views: list[Any] = [mine]
    if group:
        views = [None] * world
        dist.all_gather_object(views, mine)
    common = set(views[0][0]).intersection(*(v[0] for v in views[1:]))
    choice = max(common, key=lambda n: views[0][0][n]) if common else None
    if rank == 0:
        for msg in dict.fromkeys(m for v in views for m in v[1]):
            _warn(f"skipping incomplete checkpoint {msg}")
        for name in sorted(set().union(*(v[0] for v in views)) - common):
            ok = [r for r, v in enumerate(views) if name in v[0]]
            _warn(f"skipping checkpoint {name}: it verifies on rank(s) {ok} only, not on all {len(views)}")
        if choice is None:
            _warn(f"--resume latest: no complete checkpoint in {root} (none verifies on every rank); "
                  "starting from scratch")
        else:
            step = views[0][0][choice][0]
            print(f"resuming from {Path(root) / choice} (step {step}, epoch {found[choice].epoch})", flush=True)
    return None if choice is None else str(Path(root) / choice)


def resolve_resume(resume: str | None, checkpoint_root: str | None, rank: int = 0,
                   world: int | None = None) -> str | None:
    """The checkpoint directory ``--resume`` names: ``"latest"`` is the newest one under
    ``checkpoint_root`` that verifies on every rank (:func:`agree_latest`; None, with a warning, when
    there is none: the run starts from scratch); any other value is returned as given.

    Raises:
        ValueError: for ``"latest"`` without ``checkpoint_root``.
    """
    if resume != "latest":
        return resume
    if not checkpoint_root:
        raise ValueError("resume: 'latest' needs checkpoint (--checkpoint DIR) to say where to look")
    return agree_latest(checkpoint_root, rank, world)


def load_checkpoint(directory: str | os.PathLike, rank: int, world_size: int | None = None) -> dict[str, Any]:
    """Read ``rank``'s checkpoint with ``torch.load(weights_only=True)``.

    With a manifest the file is checked against it (SHA-256; world size when ``world_size`` is
    given); a directory without one (an older gradsync) is read with a warning.

    Raises:
        FileNotFoundError: naming the missing file (a checkpoint needs one file per rank).
        IncompleteCheckpoint: if the file does not match the manifest.
        ValueError: if the checkpoint was written by a different number of ranks.
    """
    directory = Path(directory)
    path = checkpoint_file(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found (resume needs one rank*.pt per rank, "
                                "written by --checkpoint with the same world size)")
    data = path.read_bytes()
    if _manifests(directory):
        info = read_checkpoint_info(directory, ranks=[])
        if world_size is not None and info.world_size != world_size:
            raise ValueError(f"resume: {directory} was written by {info.world_size} ranks, this run has "
                             f"{world_size}")
        if rank not in info.files:
            raise IncompleteCheckpoint(f"{directory}: no manifest lists rank {rank}")
        if hashlib.sha256(data).hexdigest() != info.files[rank]["sha256"]:
            raise IncompleteCheckpoint(f"{path}: SHA-256 does not match its manifest in {directory}")
    elif rank == 0:
        _warn(f"{directory} has no {MANIFEST}; it may be incomplete")
    return from_safe(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
