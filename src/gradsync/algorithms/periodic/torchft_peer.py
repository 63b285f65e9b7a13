"""``torchft-diloco``: torchft's own DiLoCo, run as a peer of gradsync's ``diloco`` in the same
``gradsync bench`` or ``train`` run (issue 33; an optional extra, ``pip install 'gradsync[torchft]'``).

Source: torchft 0.2.0 (PyTorch's fault-tolerance library, https://github.com/pytorch/torchft), file
``torchft/local_sgd.py``, class ``DiLoCo`` (with ``_StreamingDiLoCoFragment``), driven by
``torchft/manager.py``'s ``Manager``, the lighthouse of ``torchft/coordination.py``
(``LighthouseServer``) and ``torchft/process_group.py``'s ``ProcessGroupGloo``. The algorithm is DiLoCo
(Douillard et al., arXiv 2311.08105, Algorithm 1), optionally streamed by fragments (arXiv 2501.18512);
see :mod:`gradsync.algorithms.periodic.diloco` for gradsync's own implementation.

How it is run here: every gradsync rank is its own torchft *replica group* of one process (torchft's
DiLoCo averages across replica groups). At build time, on every rank of the gradsync group
(collective):

* rank 0's parameters and buffers are broadcast over the gradsync group (as ``diloco`` and DDP do), and
  torchft's ``init_sync`` (which would heal every replica from one of them at its first quorum) is off;
* group rank 0 starts a torchft ``LighthouseServer`` in-process, bound to its own address towards
  ``MASTER_ADDR`` at a free port, with ``min_replicas`` = the group's size, and broadcasts its address
  over the gradsync group;
* every rank starts a ``torch.distributed.TCPStore`` server at a free port on its own address towards
  ``MASTER_ADDR`` (the store of its replica group) and a torchft ``Manager`` (synchronous quorum, a
  manager server on a free port) over a torchft ``ProcessGroupGloo``, which torchft configures at each
  new quorum through the store of a replica torchft picks.

The options map onto torchft's ``DiLoCo`` as: ``period`` -> ``sync_every``; ``outer_lr``,
``outer_momentum`` -> the outer optimizers ``torch.optim.SGD(fragment, lr=outer_lr,
momentum=outer_momentum, nesterov=outer_momentum > 0)`` (one per fragment, torchft's list form);
``fragments`` -> ``model_fragments``: the trainable parameters cut into contiguous groups of whole
tensors by :func:`gradsync.comm.fragments.fragment_bounds` (the same cut as ``diloco``), each wrapped in an
``nn.Module`` that holds the model's own ``Parameter`` objects. torchft's other arguments keep their
defaults (backup copy on the CPU, one all-reduce per parameter tensor, no quantisation, no
``fragment_sync_delay``).

torchft's ``DiLoCo.__enter__`` registers two hooks on the inner optimizer: a pre-step hook (it locks
the state torchft would serve to a recovering replica) and a post-step hook that counts torchft's
local steps and syncs a fragment every ``period / fragments`` of them. Here the pre-step hook is
registered the same way, and the post-step hook (``DiLoCo._step_post_hook``, torchft's own function)
is called by :meth:`TorchftDiLoCo.after_inner_step` once per ``step()`` of the wrapper, also for a step
a GradScaler skipped, so that torchft's step counter stays that of every other rank (a skip is local to
a rank; torchft's own hook would not run, and the ranks would reach their quorums at different steps).

A sync (torchft's, unchanged): a quorum through the lighthouse, the pseudo-gradient ``backup -
parameter`` of every tensor of the fragment all-reduced (sum over the replicas, then divided by their
number, in torchft's Gloo group), torchft's ``should_commit`` round, then, if committed, the parameters
reset to the backup, the outer SGD step on them with the averaged pseudo-gradient as ``.grad``, and the
new backup copied from them. The fragment synced is ``manager step % fragments``: fragment 0 first,
``period / fragments`` steps apart, the last at the multiples of ``period`` (``diloco``'s order).

What differs from gradsync's ``diloco`` (same options, same start, same data):

* the arithmetic of the outer step is the same (torch's SGD with Nesterov on the mean of ``theta -
  theta_i``); torchft sums the pseudo-gradients and then divides by ``P``, ``diloco`` divides by ``P``
  and then sums: bitwise the same at ``P = 2`` (halving is exact in binary floating point, short of
  subnormals), up to float rounding otherwise;
* the module's floating-point buffers (BatchNorm running statistics) are **not** averaged: torchft's
  DiLoCo syncs parameters only, so each rank keeps its own;
* torchft adds a lighthouse quorum and a ``should_commit`` round trip to every sync (small RPCs, not
  counted as wire bytes) and sends one all-reduce per parameter tensor;
* no ``outer_dtype`` (16-bit outer gradients), ``overlap`` or ``overlap_mix`` (torchft's
  ``fragment_sync_delay`` / ``fragment_update_alpha`` are left at 0); ``fragments`` must divide
  ``period`` (torchft's own rule);
* a failed commit (a replica errored) leaves every parameter of the fragment at its backup, no outer
  step: counted in ``outer_steps_skipped``.

Bytes are counted by gradsync's rule (:func:`~gradsync.algorithms.base.count_bytes`): each parameter
tensor's all-reduce adds a ring all-reduce of its bytes, ``2 (P-1)/P x n``; a whole sync (``fragments =
1``) adds the same wire bytes as one all-reduce of all trainable parameters, which is what ``diloco``
counts for a model without floating buffers.

Checkpoints: :meth:`TorchftDiLoCo.state_dict` saves gradsync's step counters, torchft's manager state
(its committed step, which selects the next fragment), every fragment's backup copy (torchft's
``original_parameters``) and the outer optimizers' momentum, and loads them back, so a resumed run
repeats the uninterrupted one's steps bitwise (the lighthouse and the quorum are new; every replica
resumes at the same manager step, so none heals). Resume needs the same world size, options and model.

Not supported: torchft's fault tolerance itself (a replica group that dies is not restarted: the
gradsync launcher ends the job), CUDA/NCCL (torchft's ``ProcessGroupBabyNCCL`` is not used), a
process group other than a full one (every rank of ``process_group`` is a replica group).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import socket
import urllib.parse
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...comm.fragments import fragment_bounds
from ...options import option
from ..base import count_bytes
from ..spec import AlgorithmSpec
from ..synchroniser import BuildContext
from .base import PeriodicAlgorithm, PeriodicSynchroniser, _group_rank0, broadcast_module
from .diloco import OuterLoopOptions

#: the torchft release this module was written and tested against (it calls DiLoCo's post-step hook
#: and reads its fragments' backup copies, which are not public API)
TORCHFT_VERSION = "0.2.0"
#: what a missing torchft raises
MISSING = "torchft-diloco needs the torchft extra: pip install 'gradsync[torchft]'"


def import_torchft() -> SimpleNamespace:
    """torchft's classes this module uses: ``Manager``, ``ProcessGroupGloo``, ``DiLoCo``,
    ``LighthouseServer``.

    Raises:
        ImportError: :data:`MISSING` when torchft is not installed; a message naming both versions when
            the installed torchft is not :data:`TORCHFT_VERSION`; a dependency of torchft that is
            missing raises its own ``ModuleNotFoundError``.
    """
    try:
        manager = importlib.import_module("torchft.manager")
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torchft":
            raise  # torchft is there, one of its own dependencies is not
        raise ImportError(MISSING) from exc
    version = importlib.metadata.version("torchft")
    if version != TORCHFT_VERSION:
        raise ImportError(f"torchft-diloco was written for torchft=={TORCHFT_VERSION}, found {version}: "
                          f"pip install 'gradsync[torchft]'")
    return SimpleNamespace(Manager=manager.Manager,
                           ProcessGroupGloo=importlib.import_module("torchft.process_group").ProcessGroupGloo,
                           DiLoCo=importlib.import_module("torchft.local_sgd").DiLoCo,
                           LighthouseServer=importlib.import_module("torchft.coordination").LighthouseServer)


def local_address(master_addr: str) -> str:
    """This host's IP address on the route to ``master_addr`` (a host name or IP; no packet is sent:
    a UDP socket is connected, which only picks the route). ``127.0.0.1`` gives ``127.0.0.1``.

    Raises:
        OSError: if ``master_addr`` does not resolve or no route leads to it.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, 1, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class TorchftDiLoCoOptions(OuterLoopOptions):
    """Options of ``torchft-diloco`` (mapped onto torchft 0.2.0's ``DiLoCo``; see the module docstring)."""

    OWNER = "torchft-diloco"
    torchft_timeout: float = option(60.0, "torchft-diloco: timeout of torchft's quorum, collectives, RPCs and "
                                    "connections", low=0.0, high=86400.0, low_open=True, units="s")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.period % self.fragments:
            raise ValueError(f"torchft-diloco.fragments must divide period={self.period} (torchft's DiLoCo syncs "
                             f"one fragment every period / fragments steps), got {self.fragments}")


class _Fragment(nn.Module):
    """One of torchft's ``model_fragments``: an ``nn.Module`` holding the model's own trainable
    ``Parameter`` objects of one fragment (no copy)."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)


class TorchftDiLoCo(PeriodicAlgorithm):
    """torchft 0.2.0's ``DiLoCo`` on a lighthouse and one torchft replica group per rank (see the
    module docstring). Built on every rank of ``process_group`` (collective); :meth:`attach` then gives
    it the inner optimizer (what :class:`TorchftSynchroniser` does).

    Args:
        module: the model, on the CPU (torchft's Gloo group); its trainable parameters are synced, its
            buffers are not.
        period: ``H >= 1`` inner steps per full sync (torchft's ``sync_every``).
        outer_lr: outer learning rate, > 0 (paper: 0.7).
        outer_momentum: outer Nesterov momentum in [0, 1) (0: plain outer SGD).
        process_group: the gradsync data-parallel group (``None`` = default group): used to broadcast
            the start model and the lighthouse address and for the barrier at :meth:`close`; its
            ``P`` ranks are torchft's ``P`` replica groups.
        fragments: ``F``, an integer in ``[1, min(period, trainable parameter tensors)]`` that divides
            ``period``.
        timeout: seconds, > 0: torchft's quorum, collective, RPC and connection timeouts.
        master_addr: host name or IP the ranks reach group rank 0 at (default: the ``MASTER_ADDR``
            environment variable, which ``gradsync train``/``bench`` and ``torchrun`` set).

    Attributes:
        manager: this rank's torchft ``Manager``.
        diloco: torchft's ``DiLoCo`` (after :meth:`attach`).
        outer_optimizers: one ``torch.optim.SGD`` per fragment, over the model's own parameters.
        bounds: ``F`` half-open ranges ``(lo, hi)`` of trainable-parameter indices.
        lighthouse_address: the lighthouse's URL (``http://HOST:PORT``), the same on every rank.
        outer_steps_skipped: syncs torchft did not commit (parameters reset to the backup copy).

    Raises:
        ImportError: without torchft 0.2.0 (:func:`import_torchft`).
        ValueError: if ``period``, ``fragments``, ``outer_lr``, ``outer_momentum`` or ``timeout`` is out
            of its range above, a trainable parameter is not on the CPU, or ``master_addr`` is not
            given and ``MASTER_ADDR`` is not set.
    """

    def __init__(self, module: nn.Module, period: int, outer_lr: float, outer_momentum: float,
                 process_group: Any = None, fragments: int = 1, timeout: float = 60.0,
                 master_addr: Optional[str] = None):
        super().__init__(module, period, process_group)
        fragments = self.check_fragments("torchft-diloco", fragments)
        if self.period % fragments:
            raise ValueError(f"torchft-diloco.fragments must divide period={self.period}, got {fragments!r}")
        devices = sorted({str(p.device) for p in self.params})
        if devices != ["cpu"]:
            raise ValueError(f"torchft-diloco runs CPU models only (torchft's Gloo process group; CUDA is not "
                             f"supported here); the module's trainable parameters are on {', '.join(devices)}")
        if not outer_lr > 0:
            raise ValueError(f"torchft-diloco.outer_lr must be > 0, got {outer_lr!r}")
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"torchft-diloco.outer_momentum must be in [0.0, 1.0), got {outer_momentum!r}")
        if not timeout > 0:
            raise ValueError(f"torchft-diloco.torchft_timeout must be > 0 seconds, got {timeout!r}")
        tft = import_torchft()
        master_addr = master_addr or os.environ.get("MASTER_ADDR")
        if not master_addr:
            raise ValueError("torchft-diloco needs master_addr (or the MASTER_ADDR environment variable): the host "
                             "of group rank 0, where the torchft lighthouse runs")
        self.outer_lr, self.outer_momentum, self.fragments = float(outer_lr), float(outer_momentum), fragments
        self.timeout = float(timeout)
        self.outer_steps_skipped = 0
        self.diloco: Any = None
        self._lighthouse: Any = None
        self._store: Any = None
        self._pg: Any = None
        self.manager: Any = None
        self._pre_hook: Any = None
        self._closed = False
        broadcast_module(module, process_group)
        self.bounds = fragment_bounds([p.numel() for p in self.params], self.fragments)
        self.fragment_modules = [_Fragment(self.params[lo:hi]) for lo, hi in self.bounds]
        self.outer_optimizers = [torch.optim.SGD(f.parameters(), lr=self.outer_lr, momentum=self.outer_momentum,
                                                 nesterov=self.outer_momentum > 0) for f in self.fragment_modules]
        self._tft = tft
        try:
            self._start(tft, master_addr)
        except BaseException:
            self._stop()
            raise

    def _start(self, tft: SimpleNamespace, master_addr: str) -> None:
        """The lighthouse (group rank 0), this rank's store and manager (collective: one broadcast)."""
        td = datetime.timedelta(seconds=self.timeout)
        host = local_address(master_addr)
        rank = dist.get_rank(self.process_group)
        box: list[Any] = [None]
        if rank == 0:
            try:
                self._lighthouse = tft.LighthouseServer(bind=_hostport(host, 0), min_replicas=self.world_size)
                port = urllib.parse.urlparse(self._lighthouse.address()).port
                box[0] = f"http://{_hostport(host, port)}"
            except Exception as exc:  # noqa: BLE001 - sent to the other ranks, raised below on every rank
                box[0] = exc
        dist.broadcast_object_list(box, src=_group_rank0(self.process_group), group=self.process_group)
        if isinstance(box[0], BaseException):
            raise RuntimeError(f"torchft-diloco: rank 0 could not start the torchft lighthouse: {box[0]}")
        self.lighthouse_address = box[0]
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=td)
        self._pg = tft.ProcessGroupGloo(timeout=td)
        self.manager = tft.Manager(
            pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=self.world_size,
            use_async_quorum=False, timeout=td, quorum_timeout=td, connect_timeout=td, rank=0, world_size=1,
            store_addr=host, store_port=self._store.port, lighthouse_addr=self.lighthouse_address,
            replica_id=f"gradsync_rank_{rank}", port=0, hostname=host, init_sync=False)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Build torchft's ``DiLoCo`` over the fragments with the inner ``optimizer`` (over the module's
        parameters), register torchft's pre-step hook on it and the model and optimizer as the state a
        recovering replica would fetch (torchft's ``register_state_dict_fn``).

        Raises:
            RuntimeError: if already attached.
        """
        if self.diloco is not None:
            raise RuntimeError("torchft-diloco: attach() was called already")
        self.optimizer = optimizer
        self.diloco = self._tft.DiLoCo(self.manager, self.fragment_modules, optimizer, self.outer_optimizers,
                                       sync_every=self.period)
        self._pre_hook = optimizer.register_step_pre_hook(self.diloco._step_pre_hook)

        def load(state: dict[str, Any]) -> None:
            self.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])

        self.manager.register_state_dict_fn(
            "gradsync", load, lambda: {"model": self.module.state_dict(), "optimizer": optimizer.state_dict()})

    def numel(self) -> int:
        """Elements all-reduced per full period (the trainable parameters; buffers are not synced)."""
        return sum(p.numel() for p in self.params)

    def due(self, step: int) -> bool:
        """Whether a fragment syncs after inner step ``step`` (from 1): ``step % (period / fragments) ==
        0``, torchft's schedule."""
        return step % (self.period // self.fragments) == 0

    def after_inner_step(self) -> bool:
        """torchft's post-step hook (``DiLoCo._step_post_hook``: its step counter, and at its sync steps
        the quorum, the fragment's all-reduce, ``should_commit`` and the outer step), then
        :meth:`PeriodicAlgorithm.after_inner_step` (gradsync's counter; :meth:`sync` counts the sync
        torchft just ran). Returns whether this step synced.

        Raises:
            RuntimeError: before :meth:`attach`, or if torchft's schedule and gradsync's disagree.
        """
        if self.diloco is None:
            raise RuntimeError("torchft-diloco: attach(optimizer) before training")
        self._fragment = self.manager.current_step() % self.fragments
        self._committed = self.manager.current_step()
        self.diloco._step_post_hook(self.optimizer, (), {})
        torchft_synced = self.diloco._local_step == 0
        if torchft_synced != self.due(self.step + 1):
            raise RuntimeError(f"torchft-diloco: torchft {'synced' if torchft_synced else 'did not sync'} after "
                               f"inner step {self.step + 1}, gradsync's schedule says otherwise")
        return super().after_inner_step()

    def sync(self) -> None:
        """Count the sync torchft's hook just ran: one all-reduce per parameter tensor of the fragment
        (in its dtype), and an outer step torchft did not commit in :attr:`outer_steps_skipped`."""
        lo, hi = self.bounds[self._fragment]
        for p in self.params[lo:hi]:
            count_bytes(self, p.numel() * p.element_size(), "allreduce", self.world_size)
        if self.manager.current_step() == self._committed:
            self.outer_steps_skipped += 1

    def stats(self) -> dict[str, Any]:
        """The base statistics plus ``outer_steps_skipped`` and ``torchft_step`` (torchft's committed
        syncs)."""
        return {**super().stats(), "outer_steps_skipped": self.outer_steps_skipped,
                "torchft_step": self.manager.current_step()}

    def config(self) -> dict[str, Any]:
        return {"algorithm": "torchft-diloco", **super().config(), "outer_lr": self.outer_lr,
                "outer_momentum": self.outer_momentum, "fragments": self.fragments, "torchft": TORCHFT_VERSION}

    def state_dict(self) -> dict[str, Any]:
        """``{"step", "syncs", "outer_steps_skipped", "manager": torchft's Manager.state_dict() (ints:
        "step", "batches_committed"), "anchor": [torchft's backup copy per trainable parameter, module
        order], "outer_optimizers": [torch SGD state_dict per fragment]}`` (weights-only loadable)."""
        anchor = [t.detach().clone() for frag in self.diloco._fragments for t in frag.original_parameters.values()]
        return {**super().state_dict(), "outer_steps_skipped": self.outer_steps_skipped,
                "manager": dict(self.manager.state_dict()), "anchor": anchor,
                "outer_optimizers": [o.state_dict() for o in self.outer_optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, model and options (load the model and the
        inner optimizer first).

        Raises:
            ValueError: if the backup copy or the outer optimizers do not match this model's trainable
                parameters and fragments.
        """
        backups = [t for frag in self.diloco._fragments for t in frag.original_parameters.values()]
        anchor = state["anchor"]
        if len(anchor) != len(backups) or any(a.shape != b.shape for a, b in zip(anchor, backups)):
            raise ValueError("torchft-diloco: the checkpoint's backup copy does not match the model's trainable "
                             f"parameters ({len(anchor)} tensors, the model has {len(backups)})")
        if len(state["outer_optimizers"]) != self.fragments:
            raise ValueError(f"torchft-diloco: the checkpoint has {len(state['outer_optimizers'])} outer optimizers, "
                             f"fragments is {self.fragments}")
        super().load_state_dict(state)
        self.outer_steps_skipped = int(state["outer_steps_skipped"])
        self.manager.load_state_dict({k: int(v) for k, v in state["manager"].items()})
        with torch.no_grad():
            for b, saved in zip(backups, anchor):
                b.copy_(saved)
        for opt, saved in zip(self.outer_optimizers, state["outer_optimizers"]):
            opt.load_state_dict(saved)
        self.diloco._local_step = self.step % (self.period // self.fragments)

    def _stop(self) -> None:
        """Stop what :meth:`_start` started on this rank (each part once, whatever failed)."""
        if self._pre_hook is not None:
            self._pre_hook.remove()
            self._pre_hook = None
        if self.manager is not None:
            self.manager.shutdown(wait=True)
            self.manager = None
        if self._pg is not None:
            self._pg.shutdown()
            self._pg = None
        self._store = None

    def close(self) -> None:
        """Shut down this rank's manager (its server, checkpoint server and quorum thread), its torchft
        process group and store; then, after a barrier on the gradsync group (every manager is down),
        rank 0's lighthouse. Collective; idempotent. torchft's process-wide timeout thread (daemon,
        ``torchft.futures``) stays, as with any torchft use; it does not keep the process alive."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        dist.barrier(group=self.process_group)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None


class TorchftSynchroniser(PeriodicSynchroniser):
    """:class:`~gradsync.algorithms.periodic.base.PeriodicSynchroniser` of ``torchft-diloco``: the
    inner optimizer ``ctx.make_optimizer(ctx.model.parameters())`` is attached to torchft's DiLoCo
    (:meth:`TorchftDiLoCo.attach`)."""

    def __init__(self, name: str, ctx: BuildContext, algorithm: TorchftDiLoCo):
        super().__init__(name, ctx, algorithm)
        try:
            algorithm.attach(self.optimizer)
        except BaseException:
            algorithm.close()
            raise


def _build(opts: TorchftDiLoCoOptions, ctx: Any) -> TorchftSynchroniser:
    algorithm = TorchftDiLoCo(ctx.model, opts.period, opts.outer_lr, opts.outer_momentum, ctx.process_group,
                              opts.fragments, opts.torchft_timeout)
    return TorchftSynchroniser("torchft-diloco", ctx, algorithm)


SPEC = AlgorithmSpec("torchft-diloco", "torchft 0.2.0's DiLoCo (torchft.local_sgd.DiLoCo, Manager and lighthouse; one "
                     "replica group per rank) as a measured peer of diloco; needs pip install 'gradsync[torchft]'",
                     TorchftDiLoCoOptions, _build)
