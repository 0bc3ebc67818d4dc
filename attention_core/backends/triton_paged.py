"""Paged attention in Triton: one program per (sequence, query head, query token) follows the block table.

The program loads its query row, then walks the sequence's blocks in order: it reads the block id from
``block_table[b, j]``, loads that block's ``block_size`` keys and values from the shared pool, and updates an
online softmax (running max ``m``, running sum ``l``, unnormalised output ``acc``), in base 2 as the flash kernel
does. Keys past the query's position (causal, the queries aligned to the end of the sequence) or past its length
are masked. Nothing contiguous is ever built: this is the read pattern of vLLM's PagedAttention kernel, written
for clarity (one query row per program, products as broadcasts and sums, no ``tl.dot``), not for speed.

Layout (as the Triton tutorial): jit kernel -> launcher (validate, allocate, grid) -> public function. It is an
inference kernel: no backward. ``TRITON_INTERPRET=1`` must be set before import to run it on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_fwd(Q, KC, VC, BT, SL, Out,
               stride_qb, stride_qh, stride_ql,
               stride_kn, stride_kh, stride_ks,
               stride_vn, stride_vh, stride_vs,
               stride_bt, stride_ob, stride_oh, stride_ol,
               qk_scale, L, E, EV, GROUP,
               BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    i = tl.program_id(2)
    h = hq // GROUP
    seq_len = tl.load(SL + b)
    qpos = seq_len - L + i  # the query's position in its sequence
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    offs_s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + hq * stride_qh + i * stride_ql + offs_e, mask=offs_e < E,
                other=0.0).to(tl.float32)
    m = -float("inf")
    l_sum = 0.0
    acc = tl.zeros([BLOCK_EV], dtype=tl.float32)
    n_blocks = (qpos + BLOCK_SIZE) // BLOCK_SIZE  # blocks holding positions 0 .. qpos
    for j in range(0, n_blocks):
        block = tl.load(BT + b.to(tl.int64) * stride_bt + j).to(tl.int64)
        kpos = j * BLOCK_SIZE + offs_s
        visible = kpos <= qpos
        k = tl.load(KC + block * stride_kn + h * stride_kh + offs_s[:, None] * stride_ks + offs_e[None, :],
                    mask=visible[:, None] & (offs_e[None, :] < E), other=0.0).to(tl.float32)  # (bs, E)
        s = tl.sum(k * q[None, :], axis=1) * qk_scale  # (bs,) in base 2
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        corr = tl.exp2(m - m_new)
        v = tl.load(VC + block * stride_vn + h * stride_vh + offs_s[:, None] * stride_vs + offs_ev[None, :],
                    mask=visible[:, None] & (offs_ev[None, :] < EV), other=0.0).to(tl.float32)  # (bs, Ev)
        l_sum = l_sum * corr + tl.sum(p, axis=0)
        acc = acc * corr + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / l_sum
    tl.store(Out + b.to(tl.int64) * stride_ob + hq * stride_oh + i * stride_ol + offs_ev,
             out.to(Out.dtype.element_ty), mask=offs_ev < EV)


def triton_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The launcher of :func:`attention_core.paged_attention.paged_attention`'s ``"triton"`` path.

    Inputs as there (already validated); the block size must be a power of two. Returns (B, Hq, L, Ev).
    """
    B, Hq, L, E = query.shape
    _, H, bs, Ev = value_cache.shape
    if bs & (bs - 1):
        raise ValueError(f"the triton path needs a power-of-two block_size, got {bs}")
    query, key_cache, value_cache = query.contiguous(), key_cache.contiguous(), value_cache.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = query.new_empty(B, Hq, L, Ev)
    if out.numel() == 0:
        return out
    grid = (B, Hq, L)
    _paged_fwd[grid](query, key_cache, value_cache, block_table, seq_lens, out,
                     query.stride(0), query.stride(1), query.stride(2),
                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                     block_table.stride(0), out.stride(0), out.stride(1), out.stride(2),
                     scale * _LOG2E, L, E, Ev, Hq // H,
                     BLOCK_SIZE=bs, BLOCK_E=max(triton.next_power_of_2(E), 16),
                     BLOCK_EV=max(triton.next_power_of_2(Ev), 16))
    return out

