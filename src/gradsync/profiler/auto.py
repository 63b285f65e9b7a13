"""``--algorithm auto``: the setting with the least predicted time to quality on the measured network.

At start-up every rank measures a compute profile (:func:`~gradsync.profiler.profile.record_profile`:
forward, backward and optimizer times, DDP's buckets and when each is ready) and the dense
all-reduce time of those buckets on the real network (:func:`~gradsync.profiler.ccr.measure_ccr`).
The times are all-reduced with MAX, so every rank holds the same numbers and takes the same
decision. The network is then summarised as the link rate at which the ring all-reduce model gives
the measured time (:func:`effective_bandwidth_mbit`), and :func:`gradsync.profiler.advise.advise`
ranks the candidates by predicted iteration time (trace-driven simulator) x (1 + extra steps to the
quality target), counting only accuracy costs *measured* for the job's optimizer family
(:mod:`gradsync.profiler.accuracy_costs`): a setting without a measurement for that family is not
chosen. Given the job's budget (its schedule's iterations), the measured settings with a dense tail
are candidates too, the tail starting at the measured fraction of the budget. Below a CCR of 0.5, or when nothing measured is predicted at least 10 % faster to quality,
auto keeps dense all-reduce.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.collectives import collective_device
from ..options import AUTO
from ..sim.profile import Profile
from .accuracy_costs import MEASURED_COSTS, AccuracyCost
from .advise import Advice, advise
from .ccr import measure_ccr
from .probe import QUALITY_STEPS
from .profile import ccr_at, record_profile

__all__ = ["AUTO", "agreed_profile", "effective_bandwidth_mbit", "choose", "resolve_auto"]

_REFERENCE_MBIT = 1000.0


def probe_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int, seed: int,
                  count: int = QUALITY_STEPS, augment: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's first ``count`` training batches of ``batch_size`` samples in the order
    ``DistributedSampler(shuffle=True, seed=seed)`` gives them (different on every rank, as in
    training), ``augment`` applied to the inputs: what the probe measures on (:mod:`.probe`). Draws
    nothing from torch's global random generator but ``augment``'s.

    Raises:
        ValueError: if ``x`` holds fewer than ``batch_size x world_size`` samples.
    """
    from torch.utils.data import DistributedSampler, TensorDataset

    if x.shape[0] < batch_size * world_size:
        raise ValueError(f"batch_size {batch_size} x world size {world_size} exceeds the {x.shape[0]} samples")
    order = list(DistributedSampler(TensorDataset(x), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                    drop_last=True))
    batches = []
    for i in range(count):
        idx = torch.tensor([order[(i * batch_size + j) % len(order)] for j in range(batch_size)])
        batches.append((augment(x[idx]), y[idx]))
    return batches


def agreed_profile(prof: Profile, allreduce_s: float, group: Any = None) -> tuple[Profile, float]:
    """Collective: ``prof`` with its times (forward, backward, optimizer, every bucket's ready time;
    seconds) and ``allreduce_s`` (this rank's dense all-reduce time, seconds) replaced by their MAX
    over the ranks of ``group`` (one all-reduce), so every rank holds the same numbers."""
    times = [allreduce_s, prof.forward_s, prof.backward_s, prof.optimizer_s, *(b.ready_s for b in prof.buckets)]
    t = torch.tensor(times, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    v = [float(x) for x in t.cpu()]
    buckets = tuple(dataclasses.replace(b, ready_s=r) for b, r in zip(prof.buckets, v[4:]))
    return dataclasses.replace(prof, forward_s=v[1], backward_s=v[2], optimizer_s=v[3], buckets=buckets), v[0]


def effective_bandwidth_mbit(prof: Profile, world_size: int, allreduce_s: float) -> float:
    """The link rate (Mbit/s) at which the ring all-reduce model (no latency) moves ``prof``'s buckets
    in ``allreduce_s`` seconds: the measured network as one number.

    Raises:
        ValueError: if ``allreduce_s`` <= 0.
    """
    if not allreduce_s > 0:
        raise ValueError(f"allreduce_s must be > 0 seconds; got {allreduce_s}")
    modelled = ccr_at(prof, world_size, _REFERENCE_MBIT) * prof.backward_s
    return _REFERENCE_MBIT * modelled / allreduce_s


def choose(prof: Profile, world_size: int, allreduce_s: float, optimizer: str,
           costs: Sequence[AccuracyCost] = MEASURED_COSTS, allowed: Callable[[str], bool] = lambda entry: True,
           budget_steps: int | None = None, model_key: str | None = None) -> Advice:
    """The auto choice (pure: no collectives) for profile ``prof`` (seconds) on ``world_size`` ranks whose
    dense all-reduce of the buckets took ``allreduce_s`` seconds, for optimizer family ``optimizer``
    (``"sgd"`` or ``"adamw"``); ``allowed(entry)`` restricts the candidates (e.g. hooks only);
    ``budget_steps`` (the job's iterations; None: unknown) admits the settings with a dense tail;
    ``model_key`` (``workload:model``) prefers the accuracy costs measured on that model.

    Raises:
        ValueError: for ``world_size`` < 2, ``allreduce_s`` <= 0 or ``budget_steps`` < 1.
    """
    bandwidth = effective_bandwidth_mbit(prof, world_size, allreduce_s)
    return advise(prof, world_size, bandwidth, costs=costs, assume_casts=False, allowed=allowed,
                  budget_steps=budget_steps, optimizer=optimizer, model_key=model_key)


def resolve_auto(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 make_optimizer: Callable[[Any], torch.optim.Optimizer], optimizer: str, workload: str,
                 batch_size: int, bucket_cap_mb: float, allowed: Callable[[str], bool] = lambda entry: True,
                 group: Any = None, budget_steps: int | None = None,
                 model_key: str | None = None) -> tuple[str, Advice]:
    """Collective (every rank, same arguments but its own batches): measure and choose.

    Args:
        model: the model to train (a copy is profiled; ``model`` is not changed).
        batches: at least one ``(inputs, targets)`` batch, cycled through the profile's steps.
        loss_fn, make_optimizer: as in training.
        optimizer: the optimizer family, ``"sgd"`` or ``"adamw"``.
        workload, batch_size, bucket_cap_mb: the profile's labels and DDP's bucket size (MB).
        allowed: which ``--algorithms`` entries may be chosen.
        budget_steps: the job's iterations (its schedule's length), which admits the settings with a
            dense tail; None: unknown.
        model_key: the job as ``workload:model`` (``fashion-mnist:resnet8-w32``): that model's measured
            accuracy costs replace the others where it has any.

    Returns:
        ``(entry, advice)``: the chosen ``gradsync bench --algorithms`` entry (e.g.
        ``powersgd:matrix_approximation_rank=2``) and the :class:`~gradsync.profiler.advise.Advice`
        with every prediction and the reason.

    Raises:
        ValueError: for an empty ``batches`` or a world size < 2.
    """
    if not batches:
        raise ValueError("batches must hold at least one (inputs, targets) batch")
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"world size must be >= 2 for algorithm 'auto' (nothing to synchronise); got {world}")
    it = iter(batches * 8)
    prof = record_profile(copy.deepcopy(model), lambda: next(it), loss_fn, make_optimizer, workload, batch_size,
                          bucket_cap_mb, iterations=3)
    ccr = measure_ccr([b.numel for b in prof.buckets], prof.backward_s, group=group)
    prof, allreduce_s = agreed_profile(prof, ccr.allreduce_s, group)
    advice = choose(prof, world, allreduce_s, optimizer, allowed=allowed, budget_steps=budget_steps,
                    model_key=model_key)
    return advice.choice.entry, advice
