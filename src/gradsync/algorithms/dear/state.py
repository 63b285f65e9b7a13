"""What DeAR's collaborators share: the fusion layout and cursors of one iteration
(:class:`IterationState`) and this rank's cumulative counters (:class:`Counters`).

Everything else a collaborator keeps is its own (e.g. the loss scale's found-inf flag in
:class:`~gradsync.algorithms.dear.amp.LossScaling`, the staged buffers in
:class:`~gradsync.algorithms.dear.buffers.BufferSync`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import init_counters
from .groups import FusionGroup, FusionLayout


@dataclass
class IterationState:
    """The fusion groups (buckets) of a DeAR wrapper and where its pipeline stands in the iteration.

    Who writes (W) and who reads (R) each field; "RS" is
    :class:`~gradsync.algorithms.dear.backward.ReduceScatterStage`, "AG"
    :class:`~gradsync.algorithms.dear.forward.AllGatherStage`, "AMP"
    :class:`~gradsync.algorithms.dear.amp.LossScaling`, "Parts" :class:`~gradsync.algorithms.dear.parts.Parts`
    (which finishes the reduction and ends the iteration) and "DeAR" the wrapper:

    * ``groups``, ``module_group`` (``id(module) ->`` group index), ``param_loc`` (``id(param) ->
      (group index, slot)``): the fusion layout. W: :meth:`set_layout` (DeAR, between iterations);
      R: RS, AG, AMP, DeAR (clipping, sizes). Each :class:`~gradsync.algorithms.dear.groups.FusionGroup`
      also holds its own per-iteration state: ``ready``/``n_ready``/``launched``/``all_used``/
      ``skipped``/``rs_work`` and the compact ``sel``/``c_*`` buffers (W: RS; ``sel``/``c_*`` cleared
      by AG once applied or by RS on a skipped step), ``unscaled`` (W: RS, AMP) and ``ag_work`` (W: AG).
    * ``next_launch``: highest group index whose reduce-scatter is not launched yet in this backward
      (-1: all launched). W: RS, :meth:`set_layout`; R: RS.
    * ``reduced``: this iteration's reduce-scatters are done and the shards averaged. W: RS (set),
      Parts (cleared at the end of the iteration); R: RS, Parts, DeAR (:meth:`mid_iteration`).
    * ``pending``: an update of the last ``step()`` is not fully applied yet. W, R: AG.
    * ``next_apply``: the first group whose update is not applied yet. W, R: AG.
    * ``next_ag``: the next group whose all-gather is to be launched. W, R: AG.
    * ``ag_inflight``: all-gathers launched and not waited for yet. W, R: AG.
    """

    groups: list[FusionGroup] = field(default_factory=list)
    module_group: dict[int, int] = field(default_factory=dict)
    param_loc: dict[int, tuple[int, int]] = field(default_factory=dict)
    next_launch: int = -1
    reduced: bool = False
    pending: bool = False
    next_apply: int = 0
    next_ag: int = 0
    ag_inflight: int = 0

    def set_layout(self, layout: FusionLayout) -> None:
        """Use ``layout``'s groups from now on (no update may be pending, no reduce-scatter in flight)."""
        self.groups = layout.groups
        self.module_group = layout.module_group
        self.param_loc = layout.param_loc
        self.next_launch = len(self.groups) - 1

    def mid_iteration(self) -> bool:
        """Whether a backward pass has started filling the groups and ``step()`` has not ended it."""
        return self.reduced or any(g.launched or g.n_ready for g in self.groups)


class Counters:
    """This rank's cumulative counters of a DeAR wrapper, what :meth:`DeAR.stats
    <gradsync.algorithms.dear.DeAR.stats>` reports: the common ones of
    :func:`~gradsync.algorithms.base.init_counters` (``iteration``, ``payload_bytes``, ``wire_bytes``,
    ``dense_payload_bytes``, ``dense_wire_bytes``, ``collectives``, ``buckets_skipped``,
    ``compress_seconds``), ``rs_wait_seconds``, ``ag_wait_seconds`` and ``buffer_seconds`` (s, added
    by :class:`~gradsync.algorithms.dear.timing.WaitTimers`) and ``steps_skipped`` (updates skipped by
    the GradScaler). W: RS and AG (collectives, bytes), the timers, Parts (``iteration``,
    ``steps_skipped``), DeAR's ``load_state_dict`` (``iteration``); R: :meth:`DeAR.stats`, RS
    (``iteration``: the ``grad_filter``'s step).
    """

    def __init__(self) -> None:
        init_counters(self)
        self.rs_wait_seconds = 0.0
        self.ag_wait_seconds = 0.0
        self.buffer_seconds = 0.0
        self.steps_skipped = 0


def counter_property(name: str) -> property:
    """A property reading and writing the counter ``name`` of the owner's ``_parts.counters``, so
    DeAR's counters stay attributes of the wrapper (``dear.iteration``, ``dear.steps_skipped``, ...)."""
    return property(lambda self: getattr(self._parts.counters, name),
                    lambda self, value: setattr(self._parts.counters, name, value),
                    doc=f"The counter ``{name}`` (see :meth:`DeAR.stats <gradsync.algorithms.dear.DeAR.stats>`).")
