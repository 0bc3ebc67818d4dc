"""Ring attention (Liu et al. 2023): every rank keeps its queries and passes key/value blocks around a ring.

With P ranks, rank r holds the queries, keys and values of its shard of the sequence (a layout of
:mod:`~attention_core.distributed.layout`). At step s = 0 .. P-1 it holds the key/value block of rank
(r - s) mod P; it posts the send of that block to rank r+1 and the receive of the next one from rank r-1
(one ``dist.batch_isend_irecv``), computes its queries against the block it holds while they travel, and
merges the block's partial result into its running one by the log-sum-exp merge of the online softmax
(``attention_core.backends.chunked.merge_partials``). After P steps each query has seen every key once.

The backward pass runs the same ring: the key/value blocks travel again, and each block's gradient
accumulator (dK, dV) travels *with* it, collecting every rank's contribution, and makes one last hop home.
Per block, the work is the library's chunked kernel (``attention_core.backends.chunked.forward_with_lse``,
``backward_with_lse``); no softmax is written here.

Causal masks: the mask between a query shard and a key shard follows from their global positions. Each shard
is a few runs of positions with one stride (:func:`~attention_core.distributed.layout.segments`); between two
runs, query t sees key s iff ``t - s >= d`` for one integer d, so every pair of runs is skipped, computed whole,
or computed as the kernel's upper-left causal mask on a slice (:func:`block_plan`). Nothing fully masked is
computed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from attention_core._checks import (
    check_bool_flag,
    check_floating,
    check_int,
    check_positive_int,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    short_repr,
)
from attention_core.backends.chunked import BLOCK_K, BLOCK_Q, backward_with_lse, forward_with_lse, merge_partials
from attention_core.distributed.layout import (
    Segment,
    check_layout,
    check_length_and_world,
    gather_shapes,
    group_info,
    local_lengths,
    segments,
)

__all__ = ["CommStats", "block_plan", "kernel_tiles", "ring_attention", "ring_bytes", "ring_tiles"]

#: one piece of work: query rows [q0, q1) against keys [k0, k1) of the block, causal (upper-left) or whole
Call = Tuple[int, int, int, int, bool]


@dataclass
class CommStats:
    """What one rank did, filled when passed as ``stats=``: bytes it sent, score tiles it computed (per
    (batch, kv-head) pair, at the kernel's tile sizes), and timed events ``(kind, start, end)`` in seconds from
    ``t0``, kind one of ``"compute"``, ``"comm"`` (from posting a send/receive to its completion) and
    ``"wait"`` (time spent blocked on the network)."""

    bytes_sent: int = 0
    tiles: int = 0
    events: List[Tuple[str, float, float]] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def now(self) -> float:
        return time.perf_counter() - self.t0


# ------------------------------------------------------------------------------------------------ plans


def block_plan(q_segments: Sequence[Segment], k_segments: Sequence[Segment], is_causal: bool) -> List[Call]:
    """The kernel calls that compute a query shard against a key shard, from their global positions.

    Between a query run (global ``gq + t * st``) and a key run (``gk + s * st``), query t sees key s iff
    ``gq + t*st >= gk + s*st``, that is ``t - s >= d`` with ``d = ceil((gk - gq) / st)``. So the pair is
    skipped (``d > nq - 1``), whole (``d <= -(nk - 1)``), causal on rows ``[d, nq)`` (``d >= 0``), or whole on
    keys ``[0, -d)`` plus causal on keys ``[-d, nk)`` (``d < 0``).
    """
    nq_total = sum(n for _, _, n, _ in q_segments)
    nk_total = sum(n for _, _, n, _ in k_segments)
    if not is_causal:
        return [(0, nq_total, 0, nk_total, False)] if nq_total and nk_total else []
    calls: List[Call] = []
    for lq, gq, nq, st in q_segments:
        for lk, gk, nk, sk in k_segments:
            if nq == 0 or nk == 0:
                continue
            if st != sk:
                raise ValueError(f"runs of strides {st} and {sk} have no simple causal mask")
            d = -((gq - gk) // st)  # ceil((gk - gq) / st)
            if d > nq - 1:
                continue  # every key after every query
            if d <= -(nk - 1):
                calls.append((lq, lq + nq, lk, lk + nk, False))  # every key before every query
            elif d >= 0:
                calls.append((lq + d, lq + nq, lk, lk + nk, True))  # rows t >= d see keys s <= t - d
            else:
                calls.append((lq, lq + nq, lk, lk - d, False))  # keys s < -d: seen by every row
                calls.append((lq, lq + nq, lk - d, lk + nk, True))  # the rest: s + d <= t
    return calls


def kernel_tiles(n: int, m: int, causal: bool, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> int:
    """Score tiles the chunked kernel visits for n query rows and m keys (per (batch, kv-head) pair); causal
    stops each query tile at its last row's key, as the kernel does."""
    check_int(n, "n", low=0, note="(query rows)")
    check_int(m, "m", low=0, note="(keys)")
    check_bool_flag(causal, "causal")
    check_positive_int(block_q, "block_q")
    check_positive_int(block_k, "block_k")
    total = 0
    for r0 in range(0, n, block_q):
        r1 = min(r0 + block_q, n)
        stop = min(m, r1) if causal else m
        total += math.ceil(stop / block_k)
    return total


def check_byte_counts(lengths: object, **sizes: object) -> None:
    """The one check of the byte formulas (:func:`ring_bytes`, ``ulysses_bytes``): ``lengths`` a non-empty list
    or tuple of ints >= 0; each size an int >= 0, an ``itemsize`` (``acc_itemsize`` unless ``None``) an int >= 1."""
    if not isinstance(lengths, (list, tuple)):
        raise TypeError(f"lengths must be a list or tuple of ints >= 0 (rows per rank), got "
                        f"{type(lengths).__name__} {short_repr(lengths)}")
    if not lengths:
        raise ValueError("lengths must hold one int >= 0 per rank, got an empty sequence")
    for i, n in enumerate(lengths):
        check_int(n, f"lengths[{i}]", low=0, note=f"(the rows rank {i} holds)")
    for name, value in sizes.items():
        if name == "acc_itemsize" and value is None:
            continue
        check_int(value, name, low=1 if name.endswith("itemsize") else 0)


def ring_tiles(L: int, world_size: int, layout: str, is_causal: bool = True, block_q: int = BLOCK_Q,
               block_k: int = BLOCK_K) -> List[int]:
    """Score tiles each rank computes in one forward pass of ring attention over L positions (per (batch,
    kv-head) pair): counted from the plans, without processes."""
    check_layout(layout)
    check_length_and_world(L, world_size)
    counts = []
    for r in range(world_size):
        mine = segments(L, world_size, r, layout)
        counts.append(sum(kernel_tiles(q1 - q0, k1 - k0, c, block_q, block_k)
                          for src in range(world_size)
                          for q0, q1, k0, k1, c in block_plan(mine, segments(L, world_size, src, layout),
                                                              is_causal)))
    return counts


def ring_bytes(lengths: Sequence[int], batch: int, kv_heads: int, head_dim: int, value_dim: int,
               itemsize: int, backward: bool = False, acc_itemsize: Optional[int] = None) -> List[int]:
    """Bytes each rank sends in one ring attention layer, from the formula (no processes).

    Rank r's key/value block holds ``n_r * B * H_kv * (E + Ev)`` numbers. Forward: rank r sends the blocks of
    ranks r, r-1, ..., r-P+2 (P-1 sends). Backward: the same P-1 key/value sends, plus every block's dK/dV
    accumulator once (P sends, the last one home), in ``acc_itemsize`` bytes per number (the compute dtype).
    With equal lengths n: forward ``(P-1) * n * B * H_kv * (E + Ev) * itemsize``.

    ``lengths`` is a non-empty sequence of ints >= 0 (one per rank), the sizes are ints >= 0 and the item sizes
    ints >= 1; anything else raises ``TypeError`` or ``ValueError`` naming the argument.
    """
    check_byte_counts(lengths, batch=batch, kv_heads=kv_heads, head_dim=head_dim, value_dim=value_dim,
                      itemsize=itemsize, acc_itemsize=acc_itemsize)
    check_bool_flag(backward, "backward")
    P = len(lengths)
    per_row = batch * kv_heads * (head_dim + value_dim)
    acc = itemsize if acc_itemsize is None else acc_itemsize
    out = []
    for r in range(P):
        sent = sum(lengths[(r - s) % P] for s in range(P - 1)) * per_row * itemsize
        if backward:
            sent += sum(lengths[(r - s) % P] for s in range(P - 1)) * per_row * itemsize
            sent += sum(lengths) * per_row * acc if P > 1 else 0
        out.append(sent)
    return out


# ------------------------------------------------------------------------------------------------- ring


@dataclass
class _Ring:
    """Who is where: this rank, the world, the layout's runs and the peers' global ranks."""

    rank: int
    size: int
    layout: str
    Lq: int
    Lk: int
    group: Optional[dist.ProcessGroup]
    block_q: int
    block_k: int

    def peer(self, offset: int) -> int:
        r = (self.rank + offset) % self.size
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def q_segments(self) -> List[Segment]:
        return segments(self.Lq, self.size, self.rank, self.layout)

    def k_segments(self, src: int) -> List[Segment]:
        return segments(self.Lk, self.size, src, self.layout)

    def k_len(self, src: int) -> int:
        return local_lengths(self.Lk, self.size, self.layout)[src]


def _exchange(ring: _Ring, sends: list, recvs: list, stats: Optional[CommStats]) -> list:
    """Post sends of ``(tensor, tag)`` to rank r+1 and receives into ``(tensor, tag)`` from rank r-1 at once."""
    if not sends and not recvs:
        return []
    ops = [dist.P2POp(dist.isend, t, ring.peer(1), ring.group, tag) for t, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, ring.peer(-1), ring.group, tag) for t, tag in recvs]
    if stats is not None:
        stats.bytes_sent += sum(t.numel() * t.element_size() for t, _ in sends)
    return [dist.batch_isend_irecv(ops), stats.now() if stats is not None else 0.0]


def _finish(pending: list, stats: Optional[CommStats]) -> None:
    if not pending:
        return
    reqs, posted = pending
    start = stats.now() if stats is not None else 0.0
    for req in reqs:
        req.wait()
    if stats is not None:
        end = stats.now()
        stats.events.append(("comm", posted, end))
        stats.events.append(("wait", start, end))


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])  # one contiguous buffer: one message per step


def _unpack(buf: torch.Tensor, *shapes: tuple) -> List[torch.Tensor]:
    out, i = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[i:i + n].view(shape))
        i += n
    return out


def _ring_forward(ring, q, k, v, is_causal, scale, stats):
    B, Hq, n, E = q.shape
    H, Ev = k.shape[1], v.shape[-1]
    dt = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    out = q.new_zeros((B * H, Hq // H, n, Ev), dtype=dt)  # (B*H, G, n, Ev): the kernel's layout
    lse = q.new_full((B * H, Hq // H, n, 1), float("-inf"), dtype=dt)
    kv = _pack(k, v)
    mine = ring.q_segments()
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        pending = []
        if s < ring.size - 1:  # the previous block is no longer referenced here: two blocks alive, not three
            m_next = ring.k_len((src - 1) % ring.size)
            nxt = kv.new_empty(B * H * m_next * (E + Ev))
            pending = _exchange(ring, [(kv, 0)], [(nxt, 0)], stats)
        m = ring.k_len(src)
        kb, vb = _unpack(kv, (B, H, m, E), (B, H, m, Ev))  # views of the block held now
        start = stats.now() if stats is not None else 0.0
        for q0, q1, k0, k1, causal in block_plan(mine, ring.k_segments(src), is_causal):
            o_b, l_b = forward_with_lse(q[:, :, q0:q1], kb[:, :, k0:k1], vb[:, :, k0:k1], causal, scale,
                                        ring.block_q, ring.block_k)
            o, lo = merge_partials(out[:, :, q0:q1], lse[:, :, q0:q1], o_b, l_b)
            out[:, :, q0:q1], lse[:, :, q0:q1] = o, lo
            if stats is not None:
                stats.tiles += kernel_tiles(q1 - q0, k1 - k0, causal, ring.block_q, ring.block_k)
        if stats is not None:
            stats.events.append(("compute", start, stats.now()))
        _finish(pending, stats)
        del kb, vb  # the views would keep this block alive while the next step's receive buffer is made
        if pending:
            kv = nxt
    return out, lse


def _ring_backward(ring, q, k, v, out, lse, grad_out, is_causal, scale, stats):
    B, Hq, n, E = q.shape
    H, Ev = k.shape[1], v.shape[-1]
    do = grad_out.to(out.dtype).reshape(out.shape)  # (B, Hq, n, Ev) -> (B*H, G, n, Ev)
    dq = out.new_zeros((*out.shape[:-1], E))  # (B*H, G, n, E)
    kv = _pack(k, v)
    mine = ring.q_segments()
    acc_out: Optional[torch.Tensor] = None  # the dK/dV accumulator of the block held at the previous step
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        m = ring.k_len(src)
        sends, recvs, nxt, acc_in = [], [], None, None
        if s < ring.size - 1:
            nxt = kv.new_empty(B * H * ring.k_len((src - 1) % ring.size) * (E + Ev))
            sends.append((kv, 0))
            recvs.append((nxt, 0))
        if s >= 1:
            acc_in = out.new_empty(B * H * m * (E + Ev))  # this block's dK/dV, as far as rank r-1 summed them
            sends.append((acc_out, 1))
            recvs.append((acc_in, 1))
        pending = _exchange(ring, sends, recvs, stats)
        kb, vb = _unpack(kv, (B, H, m, E), (B, H, m, Ev))
        dk = out.new_zeros((B * H, m, E))
        dv = out.new_zeros((B * H, m, Ev))
        start = stats.now() if stats is not None else 0.0
        for q0, q1, k0, k1, causal in block_plan(mine, ring.k_segments(src), is_causal):
            dq_b, dk_b, dv_b = backward_with_lse(q[:, :, q0:q1], kb[:, :, k0:k1], vb[:, :, k0:k1],
                                                 do[:, :, q0:q1], out[:, :, q0:q1], lse[:, :, q0:q1], causal,
                                                 scale, ring.block_q, ring.block_k)
            dq[:, :, q0:q1] += dq_b
            dk[:, k0:k1] += dk_b
            dv[:, k0:k1] += dv_b
        if stats is not None:
            stats.events.append(("compute", start, stats.now()))
        _finish(pending, stats)
        acc_out = _pack(dk, dv) if acc_in is None else acc_in.add_(_pack(dk, dv))
        if nxt is not None:
            kv = nxt
    if ring.size > 1:  # the last hop: every accumulator goes home
        home = out.new_empty(B * H * ring.k_len(ring.rank) * (E + Ev))
        _finish(_exchange(ring, [(acc_out, 1)], [(home, 1)], stats), stats)
        acc_out = home
    m = ring.k_len(ring.rank)
    dk, dv = _unpack(acc_out, (B, H, m, E), (B, H, m, Ev))
    return dq.reshape(q.shape), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, is_causal, scale, stats):
        out, lse = _ring_forward(ring, q, k, v, is_causal, scale, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (ring, is_causal, scale, stats)
        return out.to(q.dtype).view(q.shape[:-1] + v.shape[-1:])  # (B*H, G, n, Ev) -> (B, Hq, n, Ev)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, is_causal, scale, stats = ctx.config
        dq, dk, dv = _ring_backward(ring, q, k, v, out, lse, grad_out, is_causal, scale, stats)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ------------------------------------------------------------------------------------------------ public


def check_options(is_causal: object, scale: object, who: str) -> Tuple[bool, Optional[float]]:
    """``is_causal`` a bool and ``scale`` a finite float or None, as ``scaled_dot_product_attention`` takes them;
    checked on each rank before any message is sent."""
    return (check_bool_flag(is_causal, f"{who}: is_causal"),
            check_scale(scale, f"{who}: scale", positive=False))


def check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, group, who: str,
                 ) -> Tuple[int, int, int, int]:
    """Validate one rank's shards and, with one small all-gather of shapes, every rank's against the others.

    Returns (rank, world size, total query length, total key length)."""
    check_layout(layout)
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(t, name)
            check_rank(t, name, (4,), "4-D (B, H, L_local, E)")
            check_floating(t, name)
        check_same_dtype(q=q, k=k, v=v)
        check_same_device(q=q, k=k, v=v)  # ValueError: the right kind of tensor, in the wrong place
    except (TypeError, ValueError) as err:
        raise type(err)(f"{who}: {err}") from None
    B, Hq, _, E = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[-1] != E or k.shape[1] != v.shape[1] \
            or k.shape[2] != v.shape[2] or k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"{who}: expected q (B, Hq, L, E), k (B, H, S, E), v (B, H, S, Ev) with Hq a multiple of "
                         f"H; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    rank, P = group_info(group)
    shapes = gather_shapes([q, k, v], group)
    for r, (qs, ks, vs) in enumerate(shapes):
        same = (qs[:2] + qs[3:], ks[:2] + ks[3:], vs[:2] + vs[3:])
        if same != (list(q.shape[:2]) + [E], list(k.shape[:2]) + [E], list(v.shape[:2]) + [v.shape[-1]]):
            raise ValueError(f"{who}: the shards' shapes differ across ranks outside the sequence dim: rank "
                             f"{rank} has q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; rank {r} "
                             f"has q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}")
    Lq, Lk = sum(s[0][2] for s in shapes), sum(s[1][2] for s in shapes)
    for name, L, idx in (("q", Lq, 0), ("k", Lk, 1)):
        seen = [s[idx][2] for s in shapes]
        if seen != local_lengths(L, P, layout):
            raise ValueError(f"{who}: the ranks' {name} lengths {seen} are not the {layout!r} split of {L} "
                             f"positions over {P} ranks (expected {local_lengths(L, P, layout)}): were the "
                             "shards made by shard(..., layout=...) with the same layout?")
    return rank, P, Lq, Lk


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                   scale: Optional[float] = None, layout: str = "zigzag", group: Optional[dist.ProcessGroup] = None,
                   stats: Optional[CommStats] = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                   ) -> torch.Tensor:
    """This rank's shard of ``scaled_dot_product_attention(Q, K, V, is_causal=is_causal, scale=scale)`` on the
    whole sequence, with key/value blocks passed around a ring of the group's ranks; differentiable.

    Args:
        q: (B, Hq, L_local, E), this rank's queries, sharded with ``shard(..., layout=layout)``.
        k: (B, H, S_local, E), ``Hq`` a multiple of ``H`` (GQA).
        v: (B, H, S_local, Ev).
        is_causal: upper-left causal mask on global positions.
        scale: score scale, default ``1/sqrt(E)``.
        layout: ``"contiguous"``, ``"zigzag"`` or ``"striped"``, the layout the shards were made with.
        group: the process group (``None``: the default one).
        stats: a :class:`CommStats` to fill with bytes sent, tiles computed and timed events.
        block_q, block_k: the chunked kernel's tile sizes.

    Returns:
        (B, Hq, L_local, Ev), in the query's dtype.
    """
    is_causal, scale = check_options(is_causal, scale, "ring_attention")
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        check_int(b, f"ring_attention: {name}", low=1, note="(the chunked kernel's tile size)")
    rank, P, Lq, Lk = check_shards(q, k, v, layout, group, "ring_attention")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ring = _Ring(rank, P, layout, Lq, Lk, group, block_q, block_k)
    return _RingAttention.apply(q, k, v, ring, is_causal, scale, stats)
