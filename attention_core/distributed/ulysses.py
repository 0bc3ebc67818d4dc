"""DeepSpeed-Ulysses (Jacobs et al. 2023): trade the sequence split for a head split, attend, trade back.

Each rank starts with its shard of the sequence for all H heads. An all-to-all gives every rank H/P heads
for the *whole* sequence; it runs ordinary attention on them (the library's ``scaled_dot_product_attention``,
with the kernel ``backend=`` names); a last all-to-all on the output gives every rank its shard of the sequence
back, all heads. The paper counts two all-to-alls per layer, q, k and v together in the first; this code makes
four all-to-alls in the forward pass, one each for q, k, v and the output (the same bytes as the paper's two),
and their mirror images in the backward; each is a batch of point-to-point messages, one to and one from every
other rank whose share is not empty (the way NCCL's point-to-point guide writes an all-to-all; with gloo, a
rank's memory then does not depend on when a worker thread lets go of a collective's buffers). P cannot exceed
the number of key/value heads: every rank needs whole heads.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from attention_core._checks import check_bool_flag
from attention_core.backends import get_backend
from attention_core.distributed.layout import exchange, local_lengths, positions
from attention_core.distributed.ring import CommStats, check_byte_counts, check_options, check_shards
from attention_core.functional import scaled_dot_product_attention

__all__ = ["ulysses_attention", "ulysses_bytes"]


def _all_to_all(send: torch.Tensor, send_sizes: List[int], recv_sizes: List[int], group, stats) -> torch.Tensor:
    """``all_to_all_single`` as one batch of point-to-point messages, one to and one from each other rank
    (:func:`~attention_core.distributed.layout.exchange`: the calling thread lets go of the buffers)."""
    rank = dist.get_rank(group)
    recv = send.new_empty(sum(recv_sizes))
    start = stats.now() if stats is not None else 0.0
    sends, recvs = send.split(send_sizes), recv.split(recv_sizes)
    recvs[rank].copy_(sends[rank])  # the share this rank keeps
    exchange(list(sends), list(recvs), group)
    if stats is not None:
        stats.bytes_sent += (sum(send_sizes) - send_sizes[rank]) * send.element_size()
        stats.events.append(("comm", start, stats.now()))
    return recv


def _seq_to_heads(x: torch.Tensor, lengths: Sequence[int], group, stats) -> torch.Tensor:
    """(B, H, n_r, E) on each rank -> (B, H/P, sum(lengths), E): its heads, every rank's rows in rank order."""
    B, H, n, E = x.shape
    P = len(lengths)
    h = H // P
    send = x.reshape(B, P, h, n, E).transpose(0, 1).reshape(-1)  # (B, H, n, E) -> (P, B, h, n, E), flat
    recv = _all_to_all(send, [B * h * n * E] * P, [B * h * m * E for m in lengths], group, stats)
    pieces = recv.split([B * h * m * E for m in lengths])
    return torch.cat([p.view(B, h, m, E) for p, m in zip(pieces, lengths)], dim=2)  # (B, h, L, E)


def _heads_to_seq(x: torch.Tensor, lengths: Sequence[int], group, stats) -> torch.Tensor:
    """The inverse: (B, H/P, sum(lengths), E) -> (B, H, n_r, E)."""
    B, h, L, E = x.shape
    P, r = len(lengths), dist.get_rank(group)
    send = torch.cat([p.reshape(-1) for p in x.split(list(lengths), dim=2)])  # rank j's rows, for rank j
    recv = _all_to_all(send, [B * h * m * E for m in lengths], [B * h * lengths[r] * E] * P, group, stats)
    n = lengths[r]
    return recv.view(P, B, h, n, E).transpose(0, 1).reshape(B, P * h, n, E)  # (P, B, h, n, E) -> (B, H, n, E)


class _AllToAll(torch.autograd.Function):
    """One of the pair, differentiable: ``to_heads`` turns sequence shards into head shards
    (:func:`_seq_to_heads`), otherwise back (:func:`_heads_to_seq`); the gradient takes the other one."""

    @staticmethod
    def forward(ctx, x, lengths, group, stats, to_heads):
        ctx.config = (lengths, group, stats)
        ctx.to_heads = to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, lengths, group, stats)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), *ctx.config), None, None, None, None


def ulysses_bytes(lengths: Sequence[int], batch: int, heads: int, kv_heads: int, head_dim: int, value_dim: int,
                  itemsize: int, backward: bool = False) -> List[int]:
    """Bytes each rank sends in one Ulysses layer, from the formula (no processes).

    Forward, rank r (n_r rows, L in all): q, k, v minus the heads it keeps,
    ``n_r * B * (Hq*E + H*E + H*Ev) * (P-1)/P``, then the output rows of its Hq/P heads that belong to the
    others, ``(L - n_r) * B * (Hq/P) * Ev``. The backward sends the mirror images: the output's gradient as the
    q, k, v went forward and the q, k, v gradients as the output came back.

    The arguments are checked as :func:`~attention_core.distributed.ring.ring_bytes` checks them.
    """
    check_byte_counts(lengths, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      value_dim=value_dim, itemsize=itemsize)
    check_bool_flag(backward, "backward")
    P, L = len(lengths), sum(lengths)
    out = []
    for n in lengths:
        go = n * batch * (heads * head_dim + kv_heads * (head_dim + value_dim)) * (P - 1) // P
        back = (L - n) * batch * (heads // P) * value_dim
        sent = go + back
        if backward:
            sent += n * batch * heads * value_dim * (P - 1) // P  # dO, split like q
            sent += (L - n) * batch * (heads * head_dim + kv_heads * (head_dim + value_dim)) // P  # dq, dk, dv
        out.append(sent * itemsize)
    return out


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                      scale: Optional[float] = None, layout: str = "contiguous",
                      group: Optional[dist.ProcessGroup] = None, stats: Optional[CommStats] = None,
                      backend: Optional[str] = None) -> torch.Tensor:
    """This rank's shard of ``scaled_dot_product_attention`` on the whole sequence, by all-to-alls (four in the
    forward pass: q, k, v, then the output).

    Args:
        q: (B, Hq, L_local, E); k: (B, H, S_local, E); v: (B, H, S_local, Ev); ``Hq`` a multiple of ``H``,
            and both divisible by the world size.
        is_causal, scale: as in ``scaled_dot_product_attention``, on global positions.
        layout: the layout the shards were made with.
        group: the process group (``None``: the default one).
        stats: a :class:`~attention_core.distributed.ring.CommStats` to fill with bytes sent and events.
        backend: the kernel of the local attention call, as ``scaled_dot_product_attention``'s ``backend``
            (``None``: its automatic choice; ``"chunked"``: the kernel ring attention uses).

    Returns:
        (B, Hq, L_local, Ev).
    """
    if backend is not None:  # refused before any message is sent (a wrong name raises on every rank alike)
        if not isinstance(backend, str):
            raise TypeError(f"ulysses_attention: backend must be a str or None, got {type(backend).__name__}")
        get_backend(backend)
    is_causal, scale = check_options(is_causal, scale, "ulysses_attention")
    rank, P, Lq, Lk = check_shards(q, k, v, layout, group, "ulysses_attention")
    Hq, H = q.shape[1], k.shape[1]
    if Hq % P or H % P:
        raise ValueError(f"ulysses_attention splits heads among the {P} ranks: the query heads ({Hq}) and the "
                         f"key/value heads ({H}) must both be divisible by the world size {P}")
    lq, lk = local_lengths(Lq, P, layout), local_lengths(Lk, P, layout)
    qh = _AllToAll.apply(q, lq, group, stats, True)  # (B, Hq/P, Lq, E), rows in rank order
    kh = _AllToAll.apply(k, lk, group, stats, True)  # (B, H/P, Lk, E)
    vh = _AllToAll.apply(v, lk, group, stats, True)  # (B, H/P, Lk, Ev)
    if layout != "contiguous":  # rows in rank order -> global order, so that the causal mask is the plain one
        pq = torch.cat([positions(Lq, P, r, layout) for r in range(P)]).to(q.device)
        pk = torch.cat([positions(Lk, P, r, layout) for r in range(P)]).to(q.device)
        qh, kh, vh = qh[:, :, pq.argsort()], kh[:, :, pk.argsort()], vh[:, :, pk.argsort()]
    start = stats.now() if stats is not None else 0.0
    oh = scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale, enable_gqa=Hq != H,
                                      backend=backend)
    if stats is not None:
        stats.events.append(("compute", start, stats.now()))
    if layout != "contiguous":
        oh = oh[:, :, pq]  # global order -> rank order
    return _AllToAll.apply(oh.contiguous(), lq, group, stats, False)
