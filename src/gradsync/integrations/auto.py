"""``algorithm="auto"`` in the framework integrations: :func:`choose_auto` measures on the job
(:func:`gradsync.profiler.auto.resolve_auto`, a collective) and every rank registers the chosen hook
(:func:`build_auto`); the choice (:class:`AutoChoice`) is saved in the hook-state payload
(``"algorithm": "auto"``, ``"auto_entry"``: the chosen entry) so a resumed run takes it without
measuring again (:func:`agree_auto_entry` checks on every rank that all ranks recorded the same one).
Framework batches (dicts, lists) reach the probe through :class:`BatchLoss`, a module whose forward
returns the loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..options import AUTO, AUTO_ONLINE
from . import PAYLOAD_FORMAT, _world, build_state_and_hook

@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``algorithm="auto"`` chose in an integration; the same on every rank.

    Attributes:
        entry: the chosen ``gradsync bench --algorithms`` entry, whose hook was registered (``"fp16"``,
            ``"powersgd-overlap:matrix_approximation_rank=8"``, ``"allreduce"``: gradsync's dense hook, ...).
        decision: the :class:`~gradsync.profiler.auto.AutoDecision` measured (``advice.reason``,
            ``errors``, ``iterations`` in seconds, ``probe_seconds``: what measuring cost this rank, in
            seconds); ``None`` when the choice was read from a checkpoint (nothing was measured).
        source: ``"measured"``, or the checkpoint the recorded choice was read from.
    """

    entry: str
    decision: Any = None
    source: str = "measured"

    def line(self) -> str:
        """The one line the integrations print on rank 0: the choice, why, and what measuring cost."""
        if self.decision is not None:
            return (f"gradsync auto: {self.entry}: {self.decision.advice.reason} "
                    f"(measuring took {self.decision.probe_seconds:.1f} s)")
        return f"gradsync auto: {self.entry}: the choice recorded in {self.source} (nothing measured: 0.0 s)"

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures: :meth:`AutoDecision.summary` where measured, else ``auto_choice``,
        ``auto_reason`` and ``auto_probe_seconds`` (0.0) of the resumed choice."""
        if self.decision is not None:
            return self.decision.summary()
        return {"auto_choice": self.entry, "auto_reason": f"resumed from {self.source}", "auto_probe_seconds": 0.0}


def entry_of(choice: AutoChoice | None) -> str | None:
    """``choice.entry``, or ``None`` without a choice (a fixed algorithm): the ``auto_entry`` that
    :func:`~gradsync.integrations.gather_hook_state` and :func:`~gradsync.integrations.load_hook_state`
    take."""
    return None if choice is None else choice.entry


def known_steps(steps: Any) -> int | None:
    """A framework's count of the fit's optimizer steps as ``job_steps`` for :func:`choose_auto`: the
    integer for a finite count >= 1, None for anything else (Lightning's ``inf`` for an unbounded fit,
    the HF Trainer's ``-1`` or 0 before it knows)."""
    try:
        value = float(steps)
    except (TypeError, ValueError):
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None


def online_options(options: dict[str, Any]) -> tuple[bool, int]:
    """Pop ``online`` and ``recheck_every`` from a framework's ``"auto"`` options: ``(online, recheck_every)``
    (:attr:`gradsync.profiler.online.OnlinePlan.recheck_every`; 0: never).

    Raises:
        ValueError: for ``recheck_every`` outside [0, 1000000], or above 0 without ``online``.
    """
    from ..validation import check_int

    online = bool(options.pop("online", False))
    recheck_every = check_int("recheck_every", options.pop("recheck_every", 0), 0, 1_000_000)
    if recheck_every and not online:
        raise ValueError(f"recheck_every needs online=True (the choice made on the job's own steps); got "
                         f"recheck_every={recheck_every}")
    return online, recheck_every


def check_auto_options(options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if algorithm options were given with ``algorithm="auto"`` (auto chooses them)."""
    if options:
        raise ValueError(f"options {', '.join(sorted(options))} cannot be given with algorithm 'auto', "
                         "which chooses the algorithm and its options")


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch`` (a tensor, or nested mappings, lists and
    tuples of them); 1 where there is none (no tensor, or a 0-d one)."""
    tensor = _first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def to_device(batch: Any, device: torch.device | str) -> Any:
    """``batch`` with every tensor (in nested mappings, lists and tuples) moved to ``device``; mappings
    come back as ``dict``, tuples as ``tuple`` (namedtuples as their type)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class ProbeInputs:
    """A framework batch (any structure) as the ``inputs`` of an ``(inputs, targets)`` probe batch:
    ``shape[0]`` is its batch size (the probes read it), ``batch`` the batch, ``index`` its position."""

    __slots__ = ("batch", "index", "shape")

    def __init__(self, batch: Any, index: int, size: int):
        self.batch, self.index, self.shape = batch, index, (size,)


class BatchLoss(torch.nn.Module):
    """``module`` as :func:`~gradsync.profiler.auto.resolve_auto` trains it: ``forward(inputs)`` with
    ``inputs`` a :class:`ProbeInputs` returns ``loss(module, inputs.batch, inputs.index)``, a 0-d tensor
    (e.g. Lightning's ``training_step`` loss, a Hugging Face model's ``model(**batch).loss``); pair it
    with ``loss_fn = lambda output, _: output``. ``loss`` gets the module it is called on (a probe's
    copy), so it must not hold the original module itself."""

    def __init__(self, module: torch.nn.Module, loss: Callable[[torch.nn.Module, Any, int], torch.Tensor]):
        super().__init__()
        self.module = module
        self._batch_loss = loss

    def forward(self, inputs: ProbeInputs) -> torch.Tensor:
        return self._batch_loss(self.module, inputs.batch, inputs.index)

    @staticmethod
    def batches(batches: Sequence[Any]) -> list[tuple[ProbeInputs, None]]:
        """``batches`` as the probe's ``(inputs, targets)`` pairs (targets ``None``)."""
        return [(ProbeInputs(b, i, batch_size_of(b)), None) for i, b in enumerate(batches)]


def _output_loss(output: Any, _targets: Any) -> Any:
    return output


class preserved_rng:
    """Context manager: torch's CPU random generator (and that of ``device`` where it is a CUDA device)
    is restored on exit, so what ``algorithm="auto"`` draws while measuring (probe forwards, a data
    loader's seed) leaves the training that follows as it would have been with the chosen setting."""

    def __init__(self, device: torch.device | str | None = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        self._fork = torch.random.fork_rng(devices=devices)

    def __enter__(self) -> None:
        self._fork.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._fork.__exit__(*exc)


def choose_auto(model: torch.nn.Module, batches: Sequence[tuple[Any, Any]], loss_fn: Callable[[Any, Any], torch.Tensor],
                optimizer: Any, bucket_cap_mb: float, process_group: dist.ProcessGroup | None = None,
                batch_size: int | None = None, workload: str = "integration", seed: int = 0,
                job_steps: int | None = None) -> AutoChoice:
    """Collective (every rank, its own batches): measure on the job and choose
    (:func:`gradsync.profiler.auto.resolve_auto`), among the hooks that work on any DDP bucket layout
    (``allowed=lambda e: is_hook(e, any_buckets=True)``, as :func:`gradsync.register_auto`: the
    framework's DDP keeps its own buckets). ``model`` is copied, not changed; torch's random generators
    are as before (:class:`preserved_rng`).

    Args:
        model: the module DDP wraps (or a :class:`BatchLoss` around it).
        batches: this rank's first training batches as ``(inputs, targets)``
            (:data:`gradsync.profiler.probe.QUALITY_STEPS` = 8 are measured; fewer are cycled), on the
            model's device; ``inputs`` must have a ``shape`` (a tensor, or :class:`ProbeInputs`).
        loss_fn: ``loss_fn(model(inputs), targets) -> 0-d tensor``.
        optimizer: the job's optimizer (:func:`~gradsync.profiler.auto.optimizer_factory`).
        bucket_cap_mb: the framework DDP's bucket size (MB).
        process_group: the hook's group (``None`` = the default group).
        batch_size: the profile's batch-size label (default: ``inputs``' leading dimension).
        workload: the profile's workload label.
        seed: PowerSGD's initial factors in the probes.
        job_steps: the fit's optimizer steps where the framework knows them: measuring then spends at
            most :data:`gradsync.profiler.auto.PROBE_SHARE` of the job's predicted time; None: no budget.

    Returns:
        :class:`AutoChoice` with ``decision`` set.

    Raises:
        ValueError: for empty ``batches``, a world size < 2 or a non-optimizer.
    """
    from ..profiler.advise import is_hook
    from ..profiler.auto import optimizer_factory, resolve_auto

    batches = list(batches)
    if not batches:
        raise ValueError("algorithm 'auto' needs at least one training batch of this rank to measure on")
    make_optimizer = optimizer_factory(optimizer)
    if batch_size is None:
        batch_size = int(batches[0][0].shape[0]) if getattr(batches[0][0], "shape", ()) else 1
    device = next((p.device for p in model.parameters()), None)
    with preserved_rng(device):
        decision = resolve_auto(model, batches, loss_fn, make_optimizer, workload, batch_size, bucket_cap_mb,
                                allowed=lambda e: is_hook(e, any_buckets=True), group=process_group, seed=seed,
                                job_steps=job_steps)
    return AutoChoice(decision.entry, decision)


def choose_auto_on_batches(module: torch.nn.Module, batches: Sequence[Any],
                           loss: Callable[[torch.nn.Module, Any, int], torch.Tensor], optimizer: Any,
                           bucket_cap_mb: float, process_group: dist.ProcessGroup | None = None,
                           workload: str = "integration", job_steps: int | None = None) -> AutoChoice:
    """:func:`choose_auto` on a framework's own batches (dicts, lists, ...): ``module`` is measured as a
    :class:`BatchLoss` with ``loss(module_copy, batch, index) -> 0-d tensor``; the batch-size label is
    the first batch's leading dimension (:func:`batch_size_of`)."""
    if not batches:
        raise ValueError("algorithm 'auto' needs at least one training batch of this rank to measure on")
    return choose_auto(BatchLoss(module, loss), BatchLoss.batches(batches), _output_loss, optimizer, bucket_cap_mb,
                       process_group=process_group, batch_size=batch_size_of(batches[0]), workload=workload,
                       job_steps=job_steps)


def plan_online_on_batches(module: torch.nn.Module, batches: Sequence[Any],
                           loss: Callable[[torch.nn.Module, Any, int], torch.Tensor], optimizer: Any,
                           bucket_cap_mb: float, process_group: dist.ProcessGroup | None = None,
                           workload: str = "integration", job_steps: int | None = None, recheck_every: int = 0) -> Any:
    """Collective: :func:`~gradsync.profiler.online.plan_online` (the online probe's start-up measurements) on a
    framework's own batches, ``module`` measured as a :class:`BatchLoss` as :func:`choose_auto_on_batches` does;
    copies of ``optimizer``'s class with its defaults train the copies; ``recheck_every`` as
    :attr:`~gradsync.profiler.online.OnlinePlan.recheck_every`.

    Raises:
        ValueError: for empty ``batches`` (and as :func:`~gradsync.profiler.online.plan_online`).
    """
    from ..profiler.auto import optimizer_factory
    from ..profiler.online import plan_online

    if not batches:
        raise ValueError("algorithm 'auto' needs at least one training batch of this rank to measure on")
    return plan_online(BatchLoss(module, loss), BatchLoss.batches(batches), _output_loss, optimizer_factory(optimizer),
                       workload, batch_size_of(batches[0]), bucket_cap_mb, group=process_group, job_steps=job_steps,
                       recheck_every=recheck_every)


def online_auto_state(module: torch.nn.Module, batches: Sequence[Any],
                      loss: Callable[[torch.nn.Module, Any, int], torch.Tensor], optimizer: Any, bucket_cap_mb: float,
                      pending: dict[str, Any] | None, owner: str, process_group: dist.ProcessGroup | None = None,
                      workload: str = "integration", job_steps: int | None = None, recheck_every: int = 0) -> Any:
    """Collective: a framework's ``"auto"`` with ``online=True``: :func:`plan_online_on_batches` (torch's random
    generators as before) and the :class:`~gradsync.profiler.online.OnlineAutoState` that decides on the job's
    own steps, for the hook to register; ``pending`` (the payload the run resumes from, or None) must be an
    online decision's. Every rank reads the same checkpoint, so every rank refuses alike.

    Raises:
        ValueError: for a ``pending`` payload of another algorithm (``owner`` names the caller, e.g.
            ``"GradsyncHook('auto', online=True)"``), and as :func:`plan_online_on_batches`.
    """
    from ..profiler.online import OnlineAutoState

    if pending is not None and pending.get("algorithm") != AUTO_ONLINE:
        raise ValueError(f"{owner} resumes only from its own checkpoints; this one holds gradsync hook state of "
                         f"algorithm {pending.get('algorithm')!r}")
    with preserved_rng(next((p.device for p in module.parameters()), None)):
        plan = plan_online_on_batches(module, batches, loss, optimizer, bucket_cap_mb, process_group=process_group,
                                      workload=workload, job_steps=job_steps, recheck_every=recheck_every)
    return OnlineAutoState(plan, module, process_group=process_group)


def recorded_auto_entry(payload: Any) -> tuple[str | None, str | None]:
    """``(entry, problem)`` of a hook-state payload a resumed ``algorithm="auto"`` run read: ``(None,
    None)`` for no payload (``None`` or ``{}``: nothing recorded), ``(entry, None)`` for an auto
    payload, ``(None, message)`` for one that an auto run cannot resume from (another format, or a
    fixed algorithm's state, whose options the payload does not hold)."""
    if payload is None or (isinstance(payload, Mapping) and not payload):
        return None, None
    if not isinstance(payload, Mapping) or payload.get("format") != PAYLOAD_FORMAT:
        return None, (f"the checkpoint's gradsync hook state is no payload of format {PAYLOAD_FORMAT} "
                      f"({type(payload).__name__})")
    if payload.get("algorithm") != AUTO:
        return None, (f"the checkpoint holds gradsync hook state of algorithm {payload.get('algorithm')!r}, not "
                      "an 'auto' choice: resume with the algorithm and options that run used")
    entry = payload.get("auto_entry")
    if not isinstance(entry, str):
        return None, "the checkpoint's 'auto' hook state records no chosen entry"
    return entry, None


def agree_auto_entry(recorded: str | None, problem: str | None = None,
                     group: dist.ProcessGroup | None = None) -> str | None:
    """Collective (every rank of ``group``, one ``all_gather_object``): the auto choice every rank's
    checkpoint recorded (:func:`recorded_auto_entry`), so that all ranks take it, or all measure, or all
    fail, and none waits for the others in a collective they do not send.

    Returns:
        The entry all ranks recorded; ``None`` where no rank recorded one (the run measures).

    Raises:
        ValueError: on every rank, naming each rank's record, where a rank reported a ``problem`` or
            the ranks' recorded choices differ (a rank without one counts as different).
    """
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (recorded, problem), group=group)
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(seen) if p]
    if problems:
        raise ValueError("algorithm 'auto' cannot resume: " + "; ".join(problems))
    entries = [e for e, _ in seen]
    if len(set(entries)) > 1:
        raise ValueError("algorithm 'auto': the ranks' checkpoints recorded different choices ("
                         + ", ".join(f"rank {r}: {e!r}" for r, e in enumerate(entries))
                         + "; None = no recorded choice); every rank must resume from the same checkpoint")
    return entries[0]


def build_auto(choice: AutoChoice, process_group: dist.ProcessGroup | None = None,
               model: torch.nn.Module | None = None) -> tuple[Any, Callable]:
    """``(state, hook)`` of ``choice.entry`` (:func:`build_state_and_hook` with the entry's options)."""
    from ..algorithms import parse_entry

    name, options = parse_entry(choice.entry)
    return build_state_and_hook(name, process_group=process_group, model=model, **options)


def announce_auto(choice: AutoChoice) -> None:
    """Print :meth:`AutoChoice.line` on rank 0 (one write, flushed)."""
    if _world()[0] == 0:
        import sys

        sys.stdout.write(choice.line() + "\n")
        sys.stdout.flush()


__all__ = ["AutoChoice", "BatchLoss", "ProbeInputs", "agree_auto_entry", "announce_auto", "batch_size_of", "build_auto",
           "check_auto_options", "choose_auto", "choose_auto_on_batches", "entry_of", "online_auto_state",
           "online_options", "plan_online_on_batches", "preserved_rng", "recorded_auto_entry", "to_device"]
