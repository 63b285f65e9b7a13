"""Record a compute profile of one DDP training iteration: forward time, per-bucket backward ready
times and sizes, optimizer time, as a :class:`gradsync.sim.profile.Profile` (JSON schema
``gradsync-profile/1``, read by :mod:`gradsync.sim`).

The profile runs on a one-rank process group (or on the caller's group, where every rank computes at
once, so CPU contention matches a real run on the same machine): DDP still cuts the gradients into its buckets and calls
the communication hook of each bucket as it becomes ready, so a hook that records the time and
returns the gradient unchanged measures when each bucket could start its all-reduce (DDP calls the
hooks in bucket order, so a bucket's time is also bounded by its predecessor's, as on a real run).
"""

# No "from __future__ import annotations": DDP checks the hook annotations at runtime.

import datetime
import inspect
import statistics
import time
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm.futures import completed
from ..comm.rendezvous import free_port
from ..sim.profile import SCHEMA, Profile, load_profile
from ..validation import check_float, check_int
from .compute import device_clock


class _ReadyRecorder:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.events: list[tuple[int, int, float, list[list[int]]]] = []


def _recording_hook(state: _ReadyRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.events.append((bucket.index(), bucket.buffer().numel(), state.clock(),
                         [list(g.shape) for g in bucket.gradients()]))
    return completed(bucket.buffer())


def _single_rank_group() -> bool:
    if dist.is_initialized():
        return False
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


def record_profile(
    model: nn.Module,
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    name: str,
    batch_size: int,
    bucket_cap_mb: float = 25.0,
    iterations: int = 3,
) -> Profile:
    """Measure ``iterations`` training steps (after two warm-up steps, the second on DDP's rebuilt
    buckets) and return the profile, with medians in seconds.

    Returns:
        a validated :class:`~gradsync.sim.profile.Profile`: ``forward_s``, ``backward_s``,
        ``optimizer_s`` (s), ``dtype_bytes``, buckets in DDP reduction order (``numel``, ``ready_s``
        seconds after backward starts, parameter ``shapes``); ``meta`` holds ``bucket_cap_mb``,
        ``threads`` and ``device`` (the model's: ``cpu``, ``cuda:0``). ``profile.save(path)``
        writes the JSON that ``gradsync simulate`` reads; ``profile.to_dict()`` is the plain dict.
        Every clock read synchronises the model's CUDA devices first
        (:func:`~gradsync.profiler.compute.device_clock`, the clock of every gradsync profile).

    Raises:
        ValueError: for ``iterations`` < 1 or ``bucket_cap_mb`` <= 0.
    """
    iterations = check_int("iterations", iterations, 1, 1000)
    check_float("bucket_cap_mb", bucket_cap_mb, 0.0, 1e5, low_inclusive=False)
    own_group = _single_rank_group()
    try:
        # No broadcast: the profile must contain compute only, no collective, and its copy's values
        # need not agree across ranks. Neither the model's at construction (init_sync: on 2 hosts at
        # 5 Mbit/s that broadcast was 1 s of auto's 1.3 s profile of the GRU) nor the buffers at every
        # forward (forward_sync_buffers, which replaced broadcast_buffers in torch 2.13).
        device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel.__init__).parameters else {"broadcast_buffers": False})
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, init_sync=False, **no_sync,
                                      device_ids=[device.index] if device.type == "cuda" else None)
        # on CUDA the device is synchronised before every clock read (also a bucket's ready time:
        # its gradients are computed when the device gets there, not when the host launched them)
        clock = device_clock(model)
        rec = _ReadyRecorder(clock)
        ddp.register_comm_hook(rec, _recording_hook)
        opt = make_optimizer(ddp.parameters())
        fwd, bwd, upd, ready = [], [], [], {}
        layout: dict[int, tuple[int, list[list[int]]]] = {}
        for it in range(iterations + 2):
            x, y = make_batch()
            opt.zero_grad(set_to_none=True)
            rec.events.clear()
            t0 = clock()
            loss = loss_fn(ddp(x), y)
            t1 = clock()
            loss.backward()
            t2 = clock()
            opt.step()
            t3 = clock()
            if it < 2:
                continue
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            upd.append(t3 - t2)
            for index, numel, t, shapes in rec.events:
                ready.setdefault(index, []).append(t - t1)
                layout[index] = (numel, shapes)
        buckets = [{"index": i, "numel": layout[i][0], "ready_s": statistics.median(ready[i]),
                    "shapes": layout[i][1]} for i in sorted(layout)]
        dtype_bytes = next(p for p in model.parameters() if p.requires_grad).element_size()
        return load_profile({
            "schema": SCHEMA, "model": name, "batch_size": batch_size, "dtype_bytes": dtype_bytes,
            "forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd),
            "optimizer_s": statistics.median(upd), "bucket_cap_mb": bucket_cap_mb,
            "threads": torch.get_num_threads(), "device": str(device), "buckets": buckets})
    finally:
        if own_group:
            dist.destroy_process_group()


def workload_key(name: str) -> str | None:
    """The ``workload:model`` key (:attr:`gradsync.workloads.Workload.key`) of profile target ``name``
    (see :func:`model_for_profile`): ``fashion-mnist`` -> ``fashion-mnist:resnet8``; None for a
    target that is not a training workload.

    Raises:
        ValueError: for a workload with a model it does not offer.
    """
    from ..workloads import WORKLOADS, get_workload

    workload, _, model = name.partition(":")
    return get_workload(workload, model or None).key if workload in WORKLOADS else None


def model_for_profile(name: str, batch_size: int, data_dir: str | None = None):
    """``(model, make_batch, loss_fn)`` for a profile target; ``make_batch()`` returns one batch
    ``(inputs, targets)`` of ``batch_size`` samples. ``name`` is one of:

    * a training workload, optionally with a model (``fashion-mnist``, ``fashion-mnist:resnet18``):
      its model on real batches, ``F.cross_entropy``;
    * ``module:function`` (``module`` not a workload name): ``function()`` from the importable
      ``module`` (the current directory is searched too) returns the ``nn.Module``; the module
      defines ``make_batch(batch_size) -> (inputs, targets)`` and optionally
      ``loss_fn(output, targets) -> scalar tensor`` (default ``F.cross_entropy``);
    * a torchvision classification model (``resnet18``, ``resnet50``, ...): random 3x224x224
      images, 1000 classes (:func:`gradsync.workloads.vision.imagenet_profile_target`).

    Raises:
        ValueError: for an unknown name, a ``module:function`` that cannot be imported or found, a
            function that returns no ``nn.Module``, or a module without ``make_batch``.
        ImportError: for a torchvision model without the ``vision`` extra.
    """
    import torch.nn.functional as F

    from ..workloads import WORKLOADS, get_workload

    workload, colon, model = name.partition(":")
    if workload not in WORKLOADS:
        if colon:
            return _user_model(workload, model, batch_size)
        from ..workloads.vision import imagenet_profile_target

        return imagenet_profile_target(name, batch_size)
    w = get_workload(workload, model or None)
    x, y, _, _ = w.load(data_dir)
    g = torch.Generator().manual_seed(0)

    def make_batch():
        idx = torch.randint(0, x.shape[0], (batch_size,), generator=g)
        return x[idx], y[idx]

    torch.manual_seed(0)
    return w.make_model(), make_batch, F.cross_entropy


def _user_model(module_name: str, function: str, batch_size: int):
    """``(model, make_batch, loss_fn)`` of a ``module:function`` spec (see :func:`model_for_profile`)."""
    import importlib
    import os
    import sys

    import torch.nn.functional as F

    spec = f"{module_name}:{function}"
    if os.getcwd() not in sys.path and "" not in sys.path:  # as "python -m" does: local modules import
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model {spec!r}: cannot import {module_name!r} ({exc}); give a workload "
                         f"(fashion-mnist[:MODEL], kjv-lstm, ...), a torchvision model or module:function") from None
    build = getattr(module, function, None)
    make = getattr(module, "make_batch", None)
    if not callable(build) or not callable(make):
        raise ValueError(f"model {spec!r}: {module_name} must define {function}() -> nn.Module and "
                         f"make_batch(batch_size) -> (inputs, targets)")
    torch.manual_seed(0)
    model = build()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {spec!r}: {function}() must return an nn.Module, got {type(model).__name__}")
    return model, lambda: make(batch_size), getattr(module, "loss_fn", F.cross_entropy)


def ccr_at(profile: Profile | Mapping[str, Any], world_size: int, bandwidth_mbit: float,
           latency_s: float = 0.0) -> float:
    """Dense all-reduce time of every bucket without overlap (ring alpha-beta model) divided by the
    backward time, for ``world_size`` ranks at ``bandwidth_mbit`` Mbit/s and ``latency_s`` seconds
    per message.

    Args:
        profile: a :class:`~gradsync.sim.profile.Profile` or anything
            :func:`~gradsync.sim.profile.load_profile` takes.

    Raises:
        ValueError: for an invalid profile, a profile with ``backward_s == 0``, or bad network values.
    """
    from ..sim.costmodel import Network, allreduce_time

    prof = load_profile(profile)
    if prof.backward_s <= 0:
        raise ValueError("profile backward_s must be > 0 to compute a CCR")
    net = Network.from_mbit(bandwidth_mbit, latency_s)
    comm = sum(allreduce_time(b.numel * prof.dtype_bytes, world_size, net) for b in prof.buckets)
    return comm / prof.backward_s


