"""Flat-tensor all-gather and reduce-scatter under the name each torch version prefers.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; older releases (>= 2.2) have only the former.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_flat(output [P*n], input [n], group=None, async_op=False)``."""

reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_flat(output [n], input [P*n], op=SUM, group=None, async_op=False)``."""
