"""Which positions of a sequence each rank holds: the three layouts, ``shard`` and ``unshard``.

A sequence of ``L`` positions is split among ``P`` ranks. Every layout gives rank ``r`` a sorted set of global
positions; everything else (the causal mask between two ranks' blocks, the work and the bytes) is derived from
those positions.

- ``contiguous``: rank r holds the r-th of ``torch.tensor_split(arange(L), P)``.
- ``zigzag``: the sequence is cut into 2P chunks (``tensor_split(arange(L), 2P)``); rank r holds chunks r and
  2P-1-r, one early and one late, so that every rank has the same share of a causal mask's work.
- ``striped``: rank r holds positions r, r+P, r+2P, ... (Brandon et al. 2023).

When ``P`` does not divide ``L``, parts differ by at most one row, as with ``torch.tensor_split``, and no
padding is ever visible to the caller.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from attention_core._checks import check_int, check_tensor, fmt_shape, short_repr

__all__ = ["LAYOUTS", "check_layout", "local_lengths", "positions", "segments", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag", "striped")

#: one run of a rank's positions: (first local index, first global position, length, stride)
Segment = Tuple[int, int, int, int]


def check_layout(layout: object) -> str:
    """``layout`` if it names a layout, else a ValueError that lists them."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}; got {layout!r}")
    return layout  # type: ignore[return-value]


def _bounds(L: int, parts: int) -> List[int]:
    """Boundaries of ``torch.tensor_split`` of L rows into ``parts``: the first L % parts parts hold one more."""
    base, extra = divmod(L, parts)
    edges = [0]
    for i in range(parts):
        edges.append(edges[-1] + base + (1 if i < extra else 0))
    return edges


def check_length_and_world(L: object, world_size: object) -> None:
    """Raise ``TypeError`` (not an int) or ``ValueError`` (out of range), naming the argument, unless ``L`` is an
    int >= 0 and ``world_size`` an int >= 1 (the one check of every function here that takes them)."""
    check_int(L, "L", low=0)
    check_int(world_size, "world_size", low=1)


def segments(L: int, world_size: int, rank: int, layout: str) -> List[Segment]:
    """Rank ``rank``'s positions as runs ``(local start, global start, length, stride)``, in local order."""
    check_layout(layout)
    check_length_and_world(L, world_size)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int in [0, world_size) = [0, {world_size}), got {type(rank).__name__} "
                        f"{short_repr(rank)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size) = [0, {world_size}), got {rank!r}")
    P, r = world_size, rank
    if layout == "contiguous":
        e = _bounds(L, P)
        return [(0, e[r], e[r + 1] - e[r], 1)]
    if layout == "zigzag":
        e = _bounds(L, 2 * P)
        first = (0, e[r], e[r + 1] - e[r], 1)
        j = 2 * P - 1 - r
        return [first, (first[2], e[j], e[j + 1] - e[j], 1)]
    n = len(range(r, L, P))  # striped
    return [(0, r, n, P)]


def positions(L: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """The global positions rank ``rank`` holds, in its local order: a 1-D int64 tensor."""
    parts = [torch.arange(g, g + n * s, s) if n else torch.zeros(0, dtype=torch.long)
             for _, g, n, s in segments(L, world_size, rank, layout)]
    return torch.cat(parts)


def local_lengths(L: int, world_size: int, layout: str) -> List[int]:
    """Rows each rank holds, rank by rank (``world_size`` ints)."""
    check_layout(layout)
    check_length_and_world(L, world_size)
    return [sum(n for _, _, n, _ in segments(L, world_size, r, layout)) for r in range(world_size)]


def group_info(group: Optional[dist.ProcessGroup] = None) -> Tuple[int, int]:
    """(rank, world size) in ``group``; a clear error when no process group is initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attention_core.distributed needs an initialised torch.distributed process group "
            "(dist.init_process_group, or run under torchrun / attention_core.distributed.launch.run); none is"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def exchange(sends: List[torch.Tensor], recvs: List[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> None:
    """Send ``sends[j]`` to rank ``j`` of ``group`` and receive ``recvs[j]`` from it, for every other rank ``j``, as
    one batch of point-to-point messages (empty tensors travel as no message; this rank's own entries are left
    alone). Gloo's collectives (``all_gather``, ``all_to_all_single``) keep their buffers on a worker thread after
    ``wait()`` returns and let go of them there a moment later, so the memory a rank holds at a given step would
    depend on thread timing; here the calling thread lets go of every buffer when the function returns."""
    rank, P = group_info(group)
    peer = (lambda j: j) if group is None else (lambda j: dist.get_global_rank(group, j))
    others = [j for j in range(P) if j != rank]
    ops = [dist.P2POp(dist.isend, sends[j], peer(j), group) for j in others if sends[j].numel()]
    ops += [dist.P2POp(dist.irecv, recvs[j], peer(j), group) for j in others if recvs[j].numel()]
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    """``dim`` as a non-negative index of one of ``x``'s dims (a 0-d tensor has none to split: ValueError)."""
    check_tensor(x, name)
    check_int(dim, "dim")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least 1 dim to split along dim={dim}, got a 0-d tensor (shape ())")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must index a dim of {name} (shape {fmt_shape(x.shape)}), in [{-x.dim()}, "
                         f"{x.dim() - 1}], got {short_repr(dim)}")
    return dim % x.dim()


def shard(x: torch.Tensor, dim: int, layout: str = "zigzag", group: Optional[dist.ProcessGroup] = None
          ) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the whole sequence, the same on every rank), in ``layout``.

    Parts differ by at most one row when the world size does not divide ``x.shape[dim]``.
    """
    check_layout(layout)
    dim = _check_dim(x, dim, "x")
    rank, P = group_info(group)
    return x.index_select(dim, positions(x.shape[dim], P, rank, layout).to(x.device))


def unshard(x_local: torch.Tensor, dim: int, layout: str = "zigzag", group: Optional[dist.ProcessGroup] = None
            ) -> torch.Tensor:
    """The whole tensor, exactly the original length, on every rank: the inverse of :func:`shard`.

    Every rank's shape must agree except along ``dim`` (checked first, with a small all-gather of shapes).
    """
    check_layout(layout)
    dim = _check_dim(x_local, dim, "x_local")
    rank, P = group_info(group)
    shapes = gather_shapes([x_local], group)  # (P, 1, ndim)
    rest = [s[0][:dim] + s[0][dim + 1:] for s in shapes]
    if any(r != rest[0] for r in rest):
        raise ValueError(f"unshard: every rank's x_local must have the same shape outside dim {dim}; got "
                         f"{[tuple(s[0]) for s in shapes]} on ranks 0..{P - 1}")
    lengths = [s[0][dim] for s in shapes]
    L = sum(lengths)
    if lengths != local_lengths(L, P, layout):
        raise ValueError(f"unshard: the ranks' lengths {lengths} along dim {dim} are not a {layout!r} split of "
                         f"{L} rows (expected {local_lengths(L, P, layout)})")
    longest = max(lengths)
    pad = list(x_local.shape)
    pad[dim] = longest
    buf = x_local.new_zeros(pad)
    buf.narrow(dim, 0, lengths[rank]).copy_(x_local)
    pieces = [buf if r == rank else torch.empty_like(buf) for r in range(P)]
    exchange([buf] * P, pieces, group)
    shape = list(x_local.shape)
    shape[dim] = L
    out = x_local.new_empty(shape)
    for r, piece in enumerate(pieces):
        out.index_copy_(dim, positions(L, P, r, layout).to(x_local.device), piece.narrow(dim, 0, lengths[r]))
    return out


#: The most dims a shape may have to travel through :func:`gather_shapes` (one fixed-size message per rank).
MAX_DIMS = 16


def gather_shapes(tensors: List[torch.Tensor], group: Optional[dist.ProcessGroup] = None) -> List[list]:
    """Every rank's shapes of ``tensors`` (the same number of tensors on each rank), in one all-gather of a
    fixed-size message (point-to-point messages, :func:`exchange`): per tensor, its number of dims, then its
    sizes, padded with -1.

    Raises ``ValueError`` on every rank alike (each sees every rank's message) when any rank's tensor has more
    than :data:`MAX_DIMS` dims.
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"tensors must be a non-empty list of torch.Tensor, got {type(tensors).__name__} "
                        f"{short_repr(tensors)}")
    for i, t in enumerate(tensors):
        check_tensor(t, f"tensors[{i}]")
    width = 1 + MAX_DIMS
    flat = []
    for t in tensors:
        sizes = list(t.shape) if t.dim() <= MAX_DIMS else []
        flat += [t.dim(), *sizes] + [-1] * (MAX_DIMS - len(sizes))
    dev = tensors[0].device  # NCCL gathers GPU tensors, gloo CPU ones: the shapes travel with the data
    mine = torch.tensor(flat, dtype=torch.long, device=dev).view(len(tensors), width)
    rank, P = group_info(group)
    everyone = [mine if r == rank else torch.empty_like(mine) for r in range(P)]
    exchange([mine] * P, everyone, group)
    rows = [e.tolist() for e in everyone]  # (P, len(tensors), width)
    too_many = [(r, row[0]) for r, e in enumerate(rows) for row in e if row[0] > MAX_DIMS]
    if too_many:
        raise ValueError(f"gather_shapes: shapes of at most {MAX_DIMS} dims travel between ranks; got "
                         f"{too_many[0][1]} dims on rank {too_many[0][0]}")
    return [[row[1:1 + row[0]] for row in e] for e in rows]
