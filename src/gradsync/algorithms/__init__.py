"""Registry of gradsync algorithms by name.

Every algorithm is an :class:`~gradsync.algorithms.spec.AlgorithmSpec`: a name, a summary, an options
dataclass and a builder returning a :class:`~gradsync.algorithms.synchroniser.Synchroniser`. Train,
bench, profile and the integrations use only :func:`build` / :func:`build_hook` and the protocol.
Unknown names and options raise ``ValueError`` listing what is allowed.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Mapping

from ..options import field_specs
from .allreduce import AllReduceState, FP16State, allreduce_hook, fp16_hook
from .base import HookState
from .compressed import CompressedState, compressed_hook
from .covap import CovapFilter, CovapPlan, CovapState, covap_hook
from .gravac import GravacState, gravac_hook
from .oscar import CountSketchState, OscarASCState, OscarSWState, countsketch_hook, oscar_hook
from .powersgd import PowerSGDHookState, powersgd_hook
from .spec import AlgorithmSpec
from .synchroniser import BuildContext, Precision, Synchroniser

REGISTRY: dict[str, AlgorithmSpec] = {}


def register(spec: AlgorithmSpec) -> None:
    """Add an algorithm (a later spec with the same name replaces the earlier one)."""
    REGISTRY[spec.name] = spec


#: Modules that register algorithms, in registration order; each exports ``SPECS``. Adding an
#: algorithm is its module plus its name here.
ALGORITHM_MODULES = ("allreduce", "covap", "powersgd", "powersgd_overlap", "compressed", "gravac", "oscar", "dear",
                     "ladder", "periodic")

for _module in ALGORITHM_MODULES:
    for _spec in importlib.import_module(f"{__name__}.{_module}").SPECS:
        register(_spec)


def get(name: str) -> AlgorithmSpec:
    """The spec registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the registered ones; for ``"auto"``, saying where
            the choice is made (:func:`gradsync.profiler.auto.resolve_auto`).
    """
    if name == "auto":
        raise ValueError("algorithm 'auto' measures the model and the network before it chooses: gradsync train "
                         "and bench do that; in a script call gradsync.profiler.auto.resolve_auto(...) on every "
                         "rank and pass the entry it returns (parse_entry splits it) here")
    if name not in REGISTRY:
        raise ValueError(f"algorithm must be one of {', '.join(sorted(REGISTRY))}; got {name!r}")
    return REGISTRY[name]


def make_options(name: str, values: Mapping[str, Any] | None = None) -> Any:
    """Algorithm ``name``'s options dataclass built strictly from ``values``.

    Raises:
        ValueError: for an unknown algorithm, an option it does not take (naming the algorithm and its
            allowed keys) or a value out of range.
    """
    spec = get(name)
    return spec.options.from_mapping(values, owner=f"algorithm {name!r}")


def build(name: str, ctx: BuildContext, options: Mapping[str, Any] | Any = None) -> Synchroniser:
    """Build algorithm ``name`` on ``ctx`` (collective for algorithms that create process groups).

    Args:
        options: the algorithm's options dataclass, or a mapping validated by :func:`make_options`.

    Raises:
        ValueError: for an unknown name or bad options.
    """
    spec = get(name)
    opts = options if isinstance(options, spec.options) else make_options(name, options)
    return spec.build(opts, ctx)


def build_hook(name: str, process_group: Any = None, model: Any = None, *, seed: int = 0, batch_size: int = 1,
               steps_per_epoch: int = 0, **options: Any) -> tuple[HookState, Any]:
    """``(state, hook)`` of communication-hook algorithm ``name`` for
    ``ddp.register_comm_hook(state, hook)``.

    Args:
        process_group: group of the hook's collectives (``None`` = default group).
        model: the module DDP wraps (lets residuals follow parameters across bucket rebuilds).
        seed, batch_size, steps_per_epoch: see :class:`BuildContext`.
        options: the algorithm's options (see ``REGISTRY[name].options``). COVAP's ``ratio="auto"``
            calibrates K from the hook's own first iterations (pass ``model`` so the backward time
            starts at the end of its forward) and adapts it every ``adapt_every`` (default 20) steps.

    Raises:
        ValueError: for an unknown name, an algorithm that is not a communication hook (``dear``,
            ``dear-covap``: use :func:`gradsync.wrap`), or bad options.
    """
    spec = get(name)
    if spec.make_hook is None:
        raise ValueError(f"algorithm {name!r} replaces DDP instead of plugging into it as a communication hook; "
                         f"use gradsync.wrap(model, optimizer, algorithm={name!r})")
    ctx = BuildContext(model=model, make_optimizer=None, process_group=process_group, seed=seed,
                       batch_size=batch_size, steps_per_epoch=steps_per_epoch)
    return spec.make_hook(make_options(name, options), ctx)


def parse_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """Split a ``--algorithms`` entry ``NAME[:KEY=VALUE[:KEY=VALUE...]]`` into the algorithm name and
    its options, each value converted to the option's type (``"auto"`` where the option takes it).

    Raises:
        ValueError: naming the entry, for an unknown algorithm (listing the registered ones), an item
            without ``=``, a key the algorithm does not take (listing those it takes), a repeated key
            or a value outside the option's allowed range.
    """
    name, *items = entry.split(":")
    if name not in REGISTRY:
        raise ValueError(f"algorithms must be among {', '.join(sorted(REGISTRY))}; got {name!r} in {entry!r}")
    specs = {f.name: f for f in field_specs(REGISTRY[name].options)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise ValueError(f"algorithms entry {entry!r}: {item!r} must be KEY=VALUE")
        if key not in specs:
            raise ValueError(f"algorithms entry {entry!r}: {name} takes "
                             f"{', '.join(sorted(specs)) or 'no options'}; got {key!r}")
        if key in out:
            raise ValueError(f"algorithms entry {entry!r} repeats {key!r}")
        out[key] = _parse_value(specs[key], text.strip(), entry)
    return name, out


def split_dense_tail(entry: str) -> tuple[str, int]:
    """``(entry without its dense_from item, dense_from)`` of a ``--algorithms`` entry, read from the text
    alone (any name): ``powersgd:matrix_approximation_rank=4:dense_from=700`` ->
    ``("powersgd:matrix_approximation_rank=4", 700)``; dense_from is 0 without a tail.

    Raises:
        ValueError: naming the entry, if its dense_from is not an integer.
    """
    name, *items = entry.split(":")
    kept, tail = [], 0
    for item in items:
        key, _, value = item.partition("=")
        if key.strip().replace("-", "_") != "dense_from":
            kept.append(item)
            continue
        try:
            tail = int(value)
        except ValueError:
            raise ValueError(f"algorithms entry {entry!r}: dense_from must be an integer; got {value!r}") from None
    return ":".join([name, *kept]), tail


def dense_tail_seconds(entry: str, steps: float, iteration_s: float, tail_iteration_s: float | None) -> float:
    """Seconds of ``steps`` iterations of ``entry``: with a dense tail from iteration D
    (:func:`split_dense_tail`), ``min(steps, D) x iteration_s + max(0, steps - D) x tail_iteration_s``;
    without one ``steps x iteration_s`` (``tail_iteration_s`` unused, may be None).

    Raises:
        ValueError: if the entry has a dense tail and ``tail_iteration_s`` is None, or its dense_from is not
            an integer.
    """
    tail = split_dense_tail(entry)[1]
    if not tail or steps <= tail:
        return steps * iteration_s
    if tail_iteration_s is None:
        raise ValueError(f"algorithms entry {entry!r} has a dense tail: tail_iteration_s must be given")
    return tail * iteration_s + (steps - tail) * tail_iteration_s


def _parse_value(spec: Any, text: str, entry: str) -> Any:
    if spec.base is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(f"algorithms entry {entry!r}: {spec.name} must be true or false, got {text!r}")
        return text.lower() == "true"
    try:
        return spec.parse(text)
    except argparse.ArgumentTypeError:
        raise ValueError(f"algorithms entry {entry!r}: {spec.name} must be {spec.allowed()}, got {text!r}") from None


__all__ = ["REGISTRY", "parse_entry", "AlgorithmSpec", "BuildContext", "Precision", "Synchroniser", "register", "get", "make_options", "build",
           "build_hook", "HookState", "AllReduceState", "FP16State", "CovapFilter", "CovapState", "CovapPlan",
           "CompressedState", "GravacState", "PowerSGDHookState", "CountSketchState", "OscarSWState",
           "OscarASCState", "allreduce_hook", "fp16_hook", "covap_hook", "compressed_hook", "gravac_hook",
           "powersgd_hook", "oscar_hook", "countsketch_hook"]
