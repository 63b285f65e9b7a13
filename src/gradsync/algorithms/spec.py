"""How an algorithm describes itself to the registry: its name, a one-line summary, its options
dataclass and a builder that returns a :class:`~gradsync.algorithms.synchroniser.Synchroniser`.

A new algorithm adds one module with its options dataclass (:mod:`gradsync.options`) and
``SPECS = (hook_algorithm(...),)`` (a DDP communication hook) or an :class:`AlgorithmSpec` whose
``build`` returns its own :class:`~gradsync.algorithms.synchroniser.Synchroniser` (an algorithm that
replaces DDP: :func:`gradsync.algorithms.dear.synchroniser.wrapper_algorithm`, the periodic
algorithms), and its module name in ``ALGORITHM_MODULES`` of :mod:`gradsync.algorithms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..options import Options
from .protocol import settling_hook
from .synchroniser import BuildContext, HookSynchroniser, Synchroniser

HookPair = tuple  # (state, hook) for ddp.register_comm_hook
MakeHook = Callable[[Any, BuildContext], HookPair]


@dataclass(frozen=True)
class AlgorithmSpec:
    """A registered algorithm.

    Attributes:
        name: registry name (``--algorithm``).
        summary: one line for ``--help`` and the README, citing the source.
        options: the options dataclass (a subclass of :class:`~gradsync.options.Options`).
        build: ``build(options, ctx) -> Synchroniser``.
        make_hook: ``make_hook(options, ctx) -> (state, hook)`` for DDP communication-hook algorithms
            (what ``build_hook`` and the framework integrations use), else ``None``.
        single_bucket: the hook needs DDP built with one bucket.
    """

    name: str
    summary: str
    options: type[Options]
    build: Callable[[Any, BuildContext], Synchroniser]
    make_hook: MakeHook | None = None
    single_bucket: bool = False


def hook_algorithm(name: str, summary: str, options: type[Options], make_hook: MakeHook,
                   single_bucket: bool = False) -> AlgorithmSpec:
    """Spec of a DDP communication-hook algorithm; ``single_bucket`` builds DDP with one bucket. The
    hook ``make_hook`` returns is registered through :func:`~gradsync.algorithms.protocol.settling_hook`
    (by ``gradsync train``, ``build_hook`` and the integrations alike)."""

    def make_settling_hook(opts: Any, ctx: BuildContext) -> HookPair:
        state, hook = make_hook(opts, ctx)
        return state, settling_hook(hook, ctx.model)

    def build(opts: Any, ctx: BuildContext) -> Synchroniser:
        state, hook = make_settling_hook(opts, ctx)
        return HookSynchroniser(name, ctx, state, hook, single_bucket=single_bucket)

    return AlgorithmSpec(name, summary, options, build, make_settling_hook, single_bucket)


@dataclass(frozen=True)
class NoOptions(Options):
    """Options of an algorithm that takes none."""
