"""Ring reduce-scatter / all-gather with arbitrary chunk boundaries, dense or variable-length coded.

Built on ``torch.distributed.batch_isend_irecv`` (point-to-point), so it runs on Gloo and does not
need the chunks to have equal sizes: ``bounds`` is a list of ``P + 1`` non-decreasing ints with
``bounds[0] == 0`` and ``bounds[P] == numel``; chunk ``c`` is ``tensor[bounds[c]:bounds[c+1]]`` and may be
empty. Every rank must pass the same ``bounds`` (derive them from the step counter or from statistics
all ranks share). Zero-sized chunks are skipped on both ends of a link (both sides know the size).

Schedule (P = world size, rank r sends to ``(r + 1) % P`` and receives from ``(r - 1) % P``):

* reduce-scatter, step ``s = 0 .. P-2``: send chunk ``(r - s) % P``, receive chunk ``(r - s - 1) % P``
  and add it to the local copy. Afterwards rank r holds the fully reduced chunk
  ``owned_chunk(r, P) == (r + 1) % P``.
* all-gather, step ``s = 0 .. P-2``: send chunk ``(r + 1 - s) % P``, receive chunk ``(r - s) % P``.

The coded variants carry a uint8 payload per hop. Each hop sends an 8-byte int64 length header first,
then the payload (two exchanges per step; the header bytes are counted in the statistics). Encoding
and decoding are callbacks, so entropy coding (``gradsync.coding.asc``) is applied per hop.

All calls are blocking and must be made in the same order on every rank (never from a Future
callback: see ``specs/platform.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gradsync.validation import check_int

HEADER_BYTES = 8


# -- chunk boundaries ---------------------------------------------------------------------------
def equal_bounds(numel: int, world_size: int) -> list[int]:
    """Boundaries of ``world_size`` chunks with equal element counts (the first ``numel % P`` chunks get
    one extra element).

    Returns:
        list of ``world_size + 1`` ints, ``0 = b[0] <= ... <= b[P] = numel``.

    Raises:
        ValueError: if ``numel < 0`` or ``world_size < 1``.
    """
    numel = check_int("numel", numel, 0, None)
    p = check_int("world_size", world_size, 1, None)
    base, extra = divmod(numel, p)
    bounds = [0]
    for c in range(p):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def balanced_bounds(costs: torch.Tensor, world_size: int) -> list[int]:
    """Cut ``costs`` into ``world_size`` contiguous chunks of about equal total cost.

    Boundary ``c`` is the first position where the cumulative cost reaches ``c / P`` of the total
    (quantiles of the cumulative sum), so each chunk carries about the same estimated *compressed*
    bytes when ``costs[i]`` estimates the coded size of element ``i``. With all-zero costs this falls
    back to :func:`equal_bounds`. The result is a deterministic function of ``costs``: ranks that pass
    the same tensor (e.g. computed from the previous step's all-reduced result) get the same bounds.

    Args:
        costs: ``(n,)`` non-negative finite real tensor (bits, bytes or any unit).
        world_size: number of chunks P >= 1.

    Returns:
        list of ``P + 1`` ints, ``0 = b[0] <= ... <= b[P] = n``.

    Raises:
        ValueError: if ``costs`` is not 1-D, has negative or non-finite entries, or ``world_size < 1``.
    """
    p = check_int("world_size", world_size, 1, None)
    if costs.dim() != 1:
        raise ValueError(f"costs must be a 1-D tensor, got shape {tuple(costs.shape)}")
    n = costs.numel()
    c = costs.to(torch.float64)
    if n and (not bool(torch.isfinite(c).all()) or float(c.min()) < 0):
        raise ValueError("costs must be finite and non-negative")
    total = float(c.sum()) if n else 0.0
    if total <= 0.0:
        return equal_bounds(n, p)
    cum = torch.cumsum(c, 0)
    targets = torch.tensor([total * j / p for j in range(1, p)], dtype=torch.float64)
    # first index whose cumsum >= target -> boundary just after it
    cuts = (torch.searchsorted(cum, targets, right=False) + 1).clamp_(0, n).tolist()
    bounds = [0] + [int(x) for x in cuts] + [n]
    for i in range(1, len(bounds)):  # enforce monotonicity (searchsorted already is)
        bounds[i] = max(bounds[i], bounds[i - 1])
    return bounds


def chunk_imbalance(sizes: Sequence[float]) -> float:
    """Load-balance figure ``max / mean`` of ``sizes`` (1.0 = perfectly balanced; 1.0 for all-zero)."""
    if len(sizes) == 0:
        return 1.0
    mean = sum(sizes) / len(sizes)
    return (max(sizes) / mean) if mean > 0 else 1.0


def owned_chunk(rank: int, world_size: int) -> int:
    """Index of the chunk that ``rank`` holds fully reduced after :func:`ring_reduce_scatter`."""
    return (rank + 1) % world_size


def _check_bounds(bounds: Sequence[int], numel: int, p: int) -> list[int]:
    b = [int(x) for x in bounds]
    if len(b) != p + 1 or b[0] != 0 or b[-1] != numel or any(b[i] > b[i + 1] for i in range(p)):
        raise ValueError(
            f"bounds must be {p + 1} non-decreasing ints from 0 to {numel}, got {list(bounds)[:8]}..."
        )
    return b


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    p = dist.get_world_size(group)
    r = dist.get_rank(group)
    nxt = (r + 1) % p
    prv = (r - 1) % p
    if group is not None:  # batch_isend_irecv takes global ranks
        nxt = dist.get_global_rank(group, nxt)
        prv = dist.get_global_rank(group, prv)
    return p, r, nxt, prv


def _exchange(send: torch.Tensor | None, recv: torch.Tensor | None, nxt: int, prv: int, group) -> None:
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, nxt, group))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, prv, group))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


# -- dense ring ---------------------------------------------------------------------------------
def ring_reduce_scatter(
    tensor: torch.Tensor, bounds: Sequence[int], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """In-place ring reduce-scatter (sum) of a 1-D ``tensor`` over chunks ``bounds``.

    Args:
        tensor: ``(n,)`` contiguous tensor of any dtype that supports ``+`` (int or float).
        bounds: ``P + 1`` chunk boundaries, identical on every rank.
        group: process group (``None`` = default).

    Returns:
        ``tensor``; on rank r, chunk ``owned_chunk(r, P)`` holds the sum over ranks, the other chunks
        hold partial sums.

    Raises:
        ValueError: if ``tensor`` is not 1-D contiguous or ``bounds`` is malformed.
    """
    p, r, nxt, prv = _group_info(group)
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("tensor must be a 1-D contiguous tensor")
    b = _check_bounds(bounds, tensor.numel(), p)
    for s in range(p - 1):
        sc = (r - s) % p
        rc = (r - s - 1) % p
        recv = torch.empty(b[rc + 1] - b[rc], dtype=tensor.dtype)
        _exchange(tensor[b[sc]:b[sc + 1]], recv, nxt, prv, group)
        tensor[b[rc]:b[rc + 1]] += recv
    return tensor


def ring_all_gather(
    tensor: torch.Tensor, bounds: Sequence[int], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """In-place ring all-gather: rank r contributes chunk ``owned_chunk(r, P)``; afterwards every rank
    holds every rank's owned chunk. Shapes, dtypes and errors as :func:`ring_reduce_scatter`."""
    p, r, nxt, prv = _group_info(group)
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("tensor must be a 1-D contiguous tensor")
    b = _check_bounds(bounds, tensor.numel(), p)
    for s in range(p - 1):
        sc = (r + 1 - s) % p
        rc = (r - s) % p
        _exchange(tensor[b[sc]:b[sc + 1]], tensor[b[rc]:b[rc + 1]], nxt, prv, group)
    return tensor


def ring_all_reduce(
    tensor: torch.Tensor, bounds: Sequence[int] | None = None, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """In-place ring all-reduce (sum) = :func:`ring_reduce_scatter` + :func:`ring_all_gather`.
    ``bounds=None`` uses :func:`equal_bounds`."""
    p = dist.get_world_size(group)
    if bounds is None:
        bounds = equal_bounds(tensor.numel(), p)
    ring_reduce_scatter(tensor, bounds, group)
    return ring_all_gather(tensor, bounds, group)


# -- coded ring (variable-length uint8 payloads) --------------------------------------------------
Encoder = Callable[[str, int, int, torch.Tensor], torch.Tensor]
Decoder = Callable[[str, int, int, torch.Tensor, int], torch.Tensor]


class RingStats:
    """Per-call statistics of a coded ring pass.

    Attributes:
        rs_bytes: bytes this rank sent at each reduce-scatter step (payload + 8-byte header), list of
            P-1 ints.
        ag_bytes: same for the all-gather steps.
        encode_seconds / decode_seconds: wall-clock seconds spent in the callbacks on this rank.
        rs_numel / ag_numel: elements this rank sent at each step (0 for an empty chunk, which is not
            sent), lists of P-1 ints.
        encoded_numel / decoded_numel: elements passed to ``encode`` / returned by ``decode`` on
            this rank.
    """

    def __init__(self) -> None:
        self.rs_bytes: list[int] = []
        self.ag_bytes: list[int] = []
        self.rs_numel: list[int] = []
        self.ag_numel: list[int] = []
        self.encode_seconds = 0.0
        self.decode_seconds = 0.0
        self.encoded_numel = 0
        self.decoded_numel = 0

    @property
    def hops(self) -> int:
        """Non-empty messages this rank sent (reduce-scatter and all-gather)."""
        return sum(1 for m in self.rs_numel + self.ag_numel if m)

    @property
    def total_bytes(self) -> int:
        return sum(self.rs_bytes) + sum(self.ag_bytes)


def _coded_hop(
    payload: torch.Tensor, nxt: int, prv: int, group, send: bool, recv: bool
) -> torch.Tensor | None:
    """Send ``payload`` (uint8) to ``nxt`` and receive one from ``prv``: length header, then bytes."""
    hdr_out = torch.tensor([payload.numel()], dtype=torch.int64)
    hdr_in = torch.zeros(1, dtype=torch.int64)
    _exchange(hdr_out if send else None, hdr_in if recv else None, nxt, prv, group)
    data_in = torch.empty(int(hdr_in[0]), dtype=torch.uint8) if recv else None
    _exchange(payload if send else None, data_in, nxt, prv, group)
    return data_in


def ring_all_reduce_coded(
    tensor: torch.Tensor,
    bounds: Sequence[int],
    encode: Encoder,
    decode: Decoder,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, RingStats]:
    """In-place ring all-reduce (sum) of an integer ``tensor`` whose hops carry coded bytes.

    Reduce-scatter step ``s``: ``encode("rs", s, chunk, values)`` produces the uint8 payload sent to
    the next rank; the receiver calls ``decode("rs", s, chunk, payload, numel)`` and adds the result.
    All-gather: the owner encodes its reduced chunk once with ``encode("ag", 0, chunk, values)``; each
    receiver decodes it with ``decode("ag", 0, chunk, payload, numel)`` and forwards the *same bytes*
    (no re-encoding). Empty chunks are not sent (neither header nor payload).

    Args:
        tensor: ``(n,)`` contiguous integer tensor (int8..int64).
        bounds: ``P + 1`` chunk boundaries, identical on every rank.
        encode: ``(phase, step, chunk, values) -> (m,) uint8 tensor``.
        decode: ``(phase, step, chunk, payload, numel) -> (numel,) integer tensor``; must invert
            ``encode`` exactly (the callbacks of the two ends of a link must keep identical models).
        group: process group.

    Returns:
        ``(tensor, stats)``: the summed tensor and a :class:`RingStats`.

    Raises:
        ValueError: for a non-integer or non-1-D tensor, malformed bounds, or a decode callback that
            returns the wrong number of elements.
    """
    p, r, nxt, prv = _group_info(group)
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError("tensor must be a 1-D contiguous tensor")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"tensor must have an integer dtype, got {tensor.dtype}")
    b = _check_bounds(bounds, tensor.numel(), p)
    stats = RingStats()
    size = [b[c + 1] - b[c] for c in range(p)]

    def _decode(phase: str, step: int, chunk: int, payload: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        vals = decode(phase, step, chunk, payload, size[chunk])
        stats.decode_seconds += time.perf_counter() - t0
        stats.decoded_numel += size[chunk]
        if vals.numel() != size[chunk]:
            raise ValueError(f"decode returned {vals.numel()} values for a chunk of {size[chunk]}")
        return vals

    def _encode(phase: str, step: int, chunk: int) -> torch.Tensor:
        t0 = time.perf_counter()
        out = encode(phase, step, chunk, tensor[b[chunk]:b[chunk + 1]])
        stats.encode_seconds += time.perf_counter() - t0
        stats.encoded_numel += size[chunk]
        if out.dtype != torch.uint8:
            raise ValueError("encode must return a uint8 tensor")
        return out.contiguous()

    for s in range(p - 1):
        sc = (r - s) % p
        rc = (r - s - 1) % p
        payload = _encode("rs", s, sc) if size[sc] else torch.empty(0, dtype=torch.uint8)
        data = _coded_hop(payload, nxt, prv, group, size[sc] > 0, size[rc] > 0)
        stats.rs_bytes.append(payload.numel() + HEADER_BYTES if size[sc] else 0)
        stats.rs_numel.append(size[sc])
        if size[rc]:
            tensor[b[rc]:b[rc + 1]] += _decode("rs", s, rc, data).to(tensor.dtype)

    own = owned_chunk(r, p)
    fwd = _encode("ag", 0, own) if size[own] else torch.empty(0, dtype=torch.uint8)
    for s in range(p - 1):
        sc = (r + 1 - s) % p
        rc = (r - s) % p
        data = _coded_hop(fwd, nxt, prv, group, size[sc] > 0, size[rc] > 0)
        stats.ag_bytes.append(fwd.numel() + HEADER_BYTES if size[sc] else 0)
        stats.ag_numel.append(size[sc])
        if size[rc]:
            tensor[b[rc]:b[rc + 1]] = _decode("ag", 0, rc, data).to(tensor.dtype)
            fwd = data
        else:
            fwd = torch.empty(0, dtype=torch.uint8)
    return tensor, stats


# -- reduce_scatter_tensor layout on the ring -------------------------------------------------------
def ring_reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Bandwidth-optimal ring reduce-scatter (sum) with ``dist.reduce_scatter_tensor``'s layout.

    Rank ``r`` receives in ``output`` the sum over ranks of ``input[r * n:(r + 1) * n]`` (``n =
    output.numel()``). Each rank sends ``(P - 1) / P`` of ``input`` in ``P - 1`` point-to-point steps
    (step ``s``: send chunk ``(r - s - 1) % P`` to rank ``r + 1``, receive chunk ``(r - s - 2) % P`` from
    rank ``r - 1`` and add it), the reduce-scatter half of the ring all-reduce of Patarasuk & Yuan,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 69(2), 2009. On Gloo,
    whose ``reduce_scatter_tensor`` reduces the whole tensor on every rank, this moves ``1/2`` of an
    all-reduce's bytes. Blocking; every rank must call it in the same order (never from a Future
    callback); it may run on a worker thread if no other thread uses ``group`` meanwhile.

    Args:
        output: ``(n,)`` contiguous tensor, same dtype and device as ``input``.
        input: ``(P * n,)`` contiguous tensor; overwritten with partial sums.
        group: process group (``None`` = default).

    Returns:
        ``output``.

    Raises:
        ValueError: for non-1-D / non-contiguous tensors, mismatched dtypes or devices, or
            ``input.numel() != P * output.numel()``.
    """
    p, r, nxt, prv = _group_info(group)
    for name, t in (("output", output), ("input", input)):
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(t.shape)}")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(f"output and input must share dtype and device, got {output.dtype}/{output.device} "
                         f"and {input.dtype}/{input.device}")
    n = output.numel()
    if input.numel() != p * n:
        raise ValueError(f"input must have world_size * output.numel() = {p * n} elements, got {input.numel()}")
    if p > 1 and n > 0:
        recv = torch.empty(n, dtype=input.dtype, device=input.device)
        for s in range(p - 1):
            sc = (r - s - 1) % p
            rc = (r - s - 2) % p
            _exchange(input[sc * n:(sc + 1) * n], recv, nxt, prv, group)
            input[rc * n:(rc + 1) * n] += recv
    output.copy_(input[r * n:(r + 1) * n])
    return output
