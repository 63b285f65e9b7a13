"""``local-sgd``: local SGD with periodic model averaging.

Source: Tao Lin, Sebastian U. Stich, Kumar Kshitij Patel, Martin Jaggi, "Don't Use Large Mini-Batches,
Use Local SGD", ICLR 2020 (arXiv 1808.07217), Sec. 2 (local SGD: every worker takes ``H`` local
steps, then the models are averaged); torch ships it as ``PeriodicModelAverager`` and
``post_localSGD_hook`` (:mod:`torch.distributed.algorithms.model_averaging`).

Every rank applies the job's optimizer to its own gradients for ``period`` steps; after every
``period``-th step the trainable parameters and the floating-point buffers are averaged with one
all-reduce by torch's own ``model_averaging.utils.average_parameters`` (flatten, divide by ``P``,
all-reduce, unflatten; the parameters become views of its flat tensor, their ``Parameter`` objects and
the optimizer's references unchanged). torch's ``PeriodicModelAverager`` is not used for the
schedule: it averages at its step 0 (after the first optimizer step), and its ``get_params_to_average``
drops parameters whose ``.grad`` is ``None`` on this rank (a local fact: a parameter unused on one
rank would give all-reduces of different sizes), and it has no ``state_dict``. Here whether a step
syncs is ``step % period == 0`` of a counter that is in the checkpoint.

The inner optimizer's state (momentum, Adam's moments) stays local and is not averaged, as in
torch's post-local SGD. With ``period=1`` and plain SGD the averaged parameters equal DDP's (the
average of ``p - lr g_i`` is ``p - lr mean(g_i)``), up to float rounding.

Not done yet: the post-local warm-up (DDP for the first steps, Lin et al. Sec. 3), hierarchical
(intra-node) averaging.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from ...options import Options, option
from ..base import count_bytes
from ..spec import AlgorithmSpec
from .base import PeriodicAlgorithm, PeriodicSynchroniser, broadcast_module

#: largest ``period`` accepted (steps)
MAX_PERIOD = 1_000_000


@dataclass(frozen=True)
class LocalSGDOptions(Options):
    """Options of ``local-sgd``."""

    OWNER = "local-sgd"
    period: int = option(16, "H: local optimizer steps between synchronisations (local-sgd: parameter "
                         "averages; diloco: outer steps)", low=1, high=MAX_PERIOD, units="steps")


class LocalSGD(PeriodicAlgorithm):
    """Periodic model averaging (see the module docstring). Built on every rank (collective: it
    broadcasts rank 0's parameters and buffers, as DDP does).

    Args:
        module: the model on its device (any floating dtype; mixed dtypes are averaged in their
            promoted dtype and cast back).
        period: ``H >= 1``.
        process_group: the data-parallel group (``None`` = default group).

    Raises:
        ValueError: if ``period`` is not an integer >= 1.
    """

    def __init__(self, module: nn.Module, period: int, process_group: Any = None):
        super().__init__(module, period, process_group)
        broadcast_module(module, process_group)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in (*self.params, *self.buffers)], torch.float32)
        self._flat_bytes = self.numel() * torch.empty((), dtype=dtype).element_size()

    def sync(self) -> None:
        """Average the trainable parameters and floating buffers over the group (one all-reduce of
        ``numel()`` elements in their promoted dtype)."""
        average_parameters(iter([*self.params, *self.buffers]), self.process_group)
        count_bytes(self, self._flat_bytes, "allreduce", self.world_size)

    def config(self) -> dict[str, Any]:
        return {"algorithm": "local-sgd", **super().config()}


def _build(opts: LocalSGDOptions, ctx: Any) -> PeriodicSynchroniser:
    return PeriodicSynchroniser("local-sgd", ctx, LocalSGD(ctx.model, opts.period, ctx.process_group))


SPEC = AlgorithmSpec("local-sgd", "local SGD: H local optimizer steps, then one all-reduce averages the parameters "
                     "and buffers (Lin et al., ICLR 2020; torch's model averaging)", LocalSGDOptions, _build)
