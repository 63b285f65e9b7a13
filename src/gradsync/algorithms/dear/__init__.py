"""DeAR: reduce-scatter in backward, all-gather in the next forward, with tensor fusion.

Source: Lin Zhang, Shaohuai Shi, Xiaowen Chu, Wei Wang, Bo Li, Chengjian Liu, "DeAR: Accelerating
Distributed Deep Learning with Fine-Grained All-Reduce Pipelining", arXiv 2302.12445 (Sec. 3:
decoupling all-reduce into reduce-scatter + all-gather and pipelining them with back-propagation and
the next feed-forward; Sec. 4: tensor fusion and its Bayesian-optimisation tuning). The code is
written from the paper's description, not copied.

The package: :mod:`.pipeline` (:class:`DeAR`: construction, ``step()``, public API) holds collaborators,
each built with only what it uses (:mod:`.parts` wires them): :mod:`.communicator` (process groups, ring
or native reduce-scatter, ``max_allgathers``), :mod:`.backward` (gradient hooks, reduce-scatter,
``grad_filter``), :mod:`.forward` (all-gather, lazy optimizer application), :mod:`.amp` (GradScaler,
clipping), :mod:`.buffers` (module buffers), :mod:`.guard` (placeholder gradient, optimizer guard) and
:mod:`.timing` (wait timers); they share one :mod:`.state` (fusion layout, cursors and flags of the
iteration; counters). :mod:`.groups` decides which parameters are fused into which group;
:mod:`.covap` is dear-covap's filter; :mod:`.registration` registers both names.

How one iteration runs (world size ``P``):

* **Tensor fusion.** Modules owning trainable parameters are cut into fusion groups (buckets) of
  consecutive modules by a byte threshold (:func:`~gradsync.algorithms.dear.groups.cut_modules`).
  Group ``k`` owns a flat gradient buffer of the parameters' dtype: gradients, one "used" flag per
  parameter, zero padding up to a multiple of ``P`` elements.
* **Backward (wait-free back-propagation).** A post-accumulate-grad hook copies each gradient into its
  group's buffer and replaces ``p.grad`` by a placeholder (see "Misuse" below). When every parameter
  of a group is ready, an asynchronous reduce-scatter (sum) of the buffer is launched on the
  reduce-scatter process group: ``dist.reduce_scatter_tensor`` where the backend has a real one
  (NCCL), a bandwidth-optimal point-to-point ring on Gloo (whose ``reduce_scatter_tensor`` costs a
  whole all-reduce), run by one worker thread in launch order. Groups are launched in descending group
  order (the order gradients normally become ready), the same on every rank; a ready group waits until
  all later groups were launched.
* **step()** launches the groups not launched yet (parameters that got no gradient on this rank
  contribute zeros), waits for all reduce-scatters, divides the shards by ``P`` (average, as DDP),
  optionally unscales / clips them (:meth:`DeAR.clip_grad_norm_`, ``step(scaler)``) and launches the
  all-gather of group 0 on a separate all-gather process group, so reduce-scatters and all-gathers
  can run concurrently. It does no optimizer math.
* **Next forward.** A forward-pre hook on each module of group ``k`` waits for the all-gather of every
  group up to ``k`` not applied yet, launches the next group's all-gather, and applies the update of
  the group: the averaged gradient becomes ``p.grad``, the user's optimizer runs on that group's
  parameters only, and ``p.grad`` is cleared. So the update of iteration ``t`` is applied lazily, layer
  group by layer group, just before the layers are used in forward ``t + 1``. Whether updates are
  applied in a forward depends on the *root* module's mode (``model.training``) and on grad mode, never
  on a submodule's own ``training`` flag (a frozen BatchNorm in eval mode is still updated in order).

Differences from the reference code, all needed for "DeAR reproduces DDP + the same optimizer":

* Any per-parameter optimizer works (SGD, Adam, AdamW, RMSprop, ...; not LBFGS): the user's optimizer
  object is stepped once per group with its ``param_groups`` temporarily narrowed to the group's
  parameters and with the hyper-parameters it had at ``step()``, so learning-rate schedulers that
  change ``optimizer.param_groups[i]["lr"]`` (or momentum, betas) after ``step()`` take effect
  exactly as under DDP, and ``optimizer.state_dict()`` keeps DDP's format.
* A parameter that got no gradient on *any* rank is left with ``p.grad = None`` (so the optimizer
  skips it), as DDP does: the used flags travel with the gradients. A parameter used on some ranks
  only gets the average with zeros from the others, as in DDP. A group whose modules are never
  called in the next forward is applied at the latest in the following ``step()`` or :meth:`DeAR.flush`.
* Gradient clipping (:meth:`DeAR.clip_grad_norm_`) and loss scaling (``step(scaler)``) work on the
  reduced shards: each rank holds ``1/P`` of every averaged gradient after the reduce-scatter, so the
  global norm is one all-reduce of a scalar, and the clipped / unscaled shards are what is
  all-gathered (the "all-reduce = reduce-scatter + all-gather" decomposition of Sec. 3).
* Gradient accumulation: :meth:`DeAR.no_sync` (as ``DistributedDataParallel.no_sync``).
* Module buffers (BatchNorm statistics) take rank 0's values at the start of the training forward,
  as DDP's ``broadcast_buffers=True``, with one broadcast per iteration issued in ``step()``, before
  the all-gathers (buffers do not change between the end of backward and the next forward, and a
  broadcast issued at the next forward would queue behind the all-gathers on the link). A forward never issues a collective for the
  buffers, so forwards that only some ranks run between ``step()`` and the next training forward
  (logging, sampling, evaluation on rank 0) cannot desynchronise the ranks. The semantics: every
  training forward (grad enabled, root module in training mode) from ``step()`` until the next
  backward starts from rank 0's buffers as of ``step()`` (the first one from those broadcast when
  the wrapper was built); buffer changes made by other forwards in between (a training-mode forward
  under ``no_grad`` updates BatchNorm statistics) are therefore replaced there, on every rank
  (under DDP a forward through ``ddp.module`` on rank 0 would be broadcast instead; call
  :meth:`DeAR.sync_buffers` on every rank after such forwards to keep rank 0's). A state dict
  loaded into the model between iterations keeps the loaded buffers (load the same one on every
  rank, or call :meth:`DeAR.sync_buffers`; :meth:`DeAR.load_state_dict` does). Training
  forwards after a backward and before ``step()`` (:meth:`DeAR.no_sync` micro-batches) keep the
  local buffers, as DDP, which does not broadcast after a ``no_sync`` forward. A forward run on
  some ranks only should be under ``torch.no_grad()`` or in eval mode: a grad-enabled
  training-mode forward applies the pending update, and with ``max_allgathers`` below the number of
  groups (NCCL's default 1) that waits for all-gathers the other ranks launch in their next forward.
  Parameters and buffers are broadcast from rank 0 when the wrapper is built.
* All collectives are launched from hook bodies or ``step()`` on the Python thread (never from
  ``Future`` callbacks), in an order identical on every rank.

Misuse that raises instead of being silently ignored: from a parameter's backward hook until DeAR
applies the averaged gradient, ``p.grad`` is a storage-less placeholder tensor of the right shape,
dtype and device; any computation on it (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``,
``GradScaler.unscale_`` / ``GradScaler.step``, reading its values, a second backward pass that would
accumulate into it) raises ``RuntimeError`` naming the DeAR method to use. ``optimizer.step()`` on the
wrapped optimizer raises ``RuntimeError`` too. Not detectable: reading only metadata (``p.grad is
None``, ``.shape``, ``.dtype``); clipping *after* the next forward applied the update (``p.grad`` is
``None`` then, so torch's clip returns a zero norm and does nothing); clipping the local, accumulated
gradients inside :meth:`DeAR.no_sync` (they are real local tensors there, as under DDP).

Limitations: a parameter used in a forward through a module other than its owner (e.g.
``F.linear(x, self.child.weight)`` in the parent) before its owner runs sees the not-yet-updated value;
``optimizer.add_param_group`` after wrapping is not seen; trainable parameters that the optimizer does
not hold, or that have ``requires_grad=False`` when the wrapper is built, are not synchronised.
"""

from .backward import GradFilter, StridedShard
from .covap import CovapGradFilter
from .groups import MAX_FUSION_MB, MB, FusionGroup
from .pipeline import DeAR
from .registration import COVAP_SPEC, SPEC, SPECS, DearCovapOptions, DearOptions

__all__ = ["COVAP_SPEC", "MAX_FUSION_MB", "MB", "SPEC", "SPECS", "CovapGradFilter", "DeAR", "DearCovapOptions",
           "DearOptions", "FusionGroup", "GradFilter", "StridedShard"]
